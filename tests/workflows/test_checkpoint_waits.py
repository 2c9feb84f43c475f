"""A stop that waits for a checkpoint, judged again when a more important job comes to wait
for its GPUs (issue 10): the next plan cuts the wait short, the preemption workflow's next
check stops the victim, and the request it had no time to answer is not held against it.
Executed on moto through the real state machines."""

from __future__ import annotations

from emulation import emulation, when_a_step_returns
from notice_queues import received, subscribe

from preemptor.core.model import JobState


def while_the_sweep_waits(env, **job):
    """Submit `job` once the sweep's preemption workflow has asked for its checkpoint, and
    let that submission's workflows finish before the preemption workflow goes on to wait."""
    return when_a_step_returns(env, "sweep", "Ask for a checkpoint", lambda: env.submit_nowait(**job))


def _sweep_and_tuning(env) -> None:
    """A low sweep on the whole pool (64 GPUs) that writes a checkpoint only every 2 hours and
    cannot answer a request (no training helper); after 30 minutes, a medium job preempts it:
    64 GPUs x 1800 s at risk outweigh 32 GPUs x 600 s (the longest wait) x 200/50, so its
    workflow asks for a checkpoint and waits."""
    env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=14400, checkpoint_every=7200)
    env.advance(1800)


def _metric(documents: list[dict], name: str) -> float:
    """The sum of a metric over the EMF documents the functions printed."""
    values = [d[name] for d in documents if name in d]
    return sum(sum(v) if isinstance(v, list) else v for v in values)


def test_a_critical_job_cuts_short_the_checkpoint_wait_of_the_stop_it_waits_on():
    emitted: list[dict] = []
    with emulation(metrics=emitted) as env:
        _sweep_and_tuning(env)
        # When, while the sweep's stop waits, a critical job arrives that needs the other 32
        # of its GPUs: waiting ~600 s more would cost 32 GPUs x 600 s x 1000/50, more than
        # the 64 x 1800 GPU-s at risk
        incident = dict(name="incident", team="production", priority="critical", pool="p5", instances=4, duration=1200, checkpoint_every=300)
        with while_the_sweep_waits(env, **incident) as arrived:
            env.submit(name="tuning", team="ml", priority="medium", pool="p5", instances=4, duration=1800, checkpoint_every=300)
        env.advance(300)
        history = env.store.history("sweep")
        kinds = [e["kind"] for e in history]
        # Then the preemption asked for a checkpoint, and the critical job's plan cut the wait
        # short, naming the job it did so for and the figures
        [cut] = [e for e in history if e["kind"] == "checkpoint-wait-cut"]
        assert cut["extra"]["preemptor"] == "incident" and "no longer waits for a checkpoint" in cut["detail"]
        assert kinds.index("checkpoint-requested") < kinds.index("checkpoint-wait-cut")
        # And the workflow's next check stopped the sweep without the checkpoint, a poll
        # later, before the checkpoint it was asked for (written a minute after the request)
        [stop] = [e for e in history if e["kind"] == "stop-requested"]
        assert kinds.index("checkpoint-wait-cut") < kinds.index("stop-requested")
        assert stop["reason"] == "stop-at-once" and stop["at"] - arrived[0] <= 60
        # And the critical job runs, within a poll, the grace and its launch of arriving
        assert env.job("incident").status is JobState.RUNNING
        assert env.job("incident").started_at - arrived[0] <= 300
        # And the request the sweep had no time to answer is not held against it
        assert env.job("sweep").ignored_checkpoint_request is False
        # And the medium job it was stopped for runs too; the sweep was stopped once
        assert env.job("tuning").status is JobState.RUNNING
        assert kinds.count("stop-requested") == 1
        # And the operators' metric counted the cut, once
        assert _metric(emitted, "CheckpointWaitsCut") == 1


def test_a_wait_that_still_pays_is_kept_and_the_sweep_stops_with_its_checkpoint():
    with emulation() as env:
        _sweep_and_tuning(env)
        # When, while the sweep's stop waits, a second medium job of one instance comes for
        # its GPUs: 8 GPUs x ~600 s x 200/50 is less than the 64 x 1800 GPU-s at risk
        probe = dict(name="probe", team="ml", priority="medium", pool="p5", instances=1, duration=600, checkpoint_every=300)
        with while_the_sweep_waits(env, **probe) as arrived:
            env.submit(name="tuning", team="ml", priority="medium", pool="p5", instances=4, duration=1800, checkpoint_every=300)
        history = env.store.history("sweep")
        # Then nothing was cut: the workflow waited for the checkpoint the sweep wrote on
        # request (a minute later), then stopped it with it
        assert "checkpoint-wait-cut" not in [e["kind"] for e in history]
        [stop] = [e for e in history if e["kind"] == "stop-requested"]
        assert stop["reason"] == "fresh-checkpoint" and stop["at"] - arrived[0] >= 60
        assert env.job("sweep").ignored_checkpoint_request is False
        # And both medium jobs run in the GPUs it freed
        assert env.job("tuning").status is JobState.RUNNING and env.job("probe").status is JobState.RUNNING


def test_a_stop_waiting_for_a_checkpoint_is_called_off_when_its_preemptor_runs_in_gpus_a_runs_end_freed():
    emitted: list[dict] = []
    with emulation(metrics=emitted) as env:
        research = subscribe(env, "research-notices", {"team": ["research"]})
        # Given a low sweep on half the pool with no checkpoint for 50 minutes, and a medium
        # job on the other half that ends at 3,020 s
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=4, duration=14400, checkpoint_every=7200)
        env.submit(name="short", team="ml", priority="medium", pool="p5", instances=4, duration=2897, checkpoint_every=300)
        env.advance(3000)
        # When a medium job of half the pool comes at 3,000 s: it preempts the sweep, whose
        # 32 GPUs x 3,000 s at risk outweigh 32 GPUs x 600 s x 200/50, so its workflow asks
        # for a checkpoint and waits; and the other run ends while it waits
        env.submit(name="tuning", team="ml", priority="medium", pool="p5", instances=4, duration=1800, checkpoint_every=300)
        env.advance(600)
        history = env.store.history("sweep")
        kinds = [e["kind"] for e in history]
        # Then the run's end was delivered at its time, during the wait, and the medium job
        # ran in the GPUs it freed
        [ended] = [e for e in env.store.history("short") if e["kind"] == "completed"]
        [asked] = [e for e in history if e["kind"] == "checkpoint-requested"]
        assert asked["at"] < ended["at"] < asked["at"] + 60
        assert env.job("tuning").status is JobState.RUNNING and env.job("tuning").started_at - ended["at"] <= 5
        # And the sweep's preemption was called off, nobody waiting for its GPUs: never
        # stopped, never relaunched, out of the preemption budget
        [called_off] = [e for e in history if e["kind"] == "preemption-cancelled"]
        assert called_off["reason"] == "preemption-no-longer-needed" and called_off["extra"]["preemptor"] == "tuning"
        assert "stop-requested" not in kinds and "requeued" not in kinds
        swept = env.job("sweep")
        assert (swept.status, swept.incarnation, swept.preemptions) == (JobState.RUNNING, 1, 0)
        assert [s for s in env.fleet.stops if s.run.startswith("sweep")] == []
        assert env.store.preemptions_since("p5", 0) == []
        # And research, told the preemption was planned, is told it is called off, at once;
        # the operators' metric counted it
        assert [n["attributes"]["kind"] for n in received(env, research)] == ["preemption-planned", "preemption-called-off"]
        assert _metric(emitted, "PreemptionsCalledOff") == 1
        # And every call the stack made for it, the plan step's call-off and notice among
        # them, is one its role's policy allows
        from iam_policy import StackPolicies

        assert any(c.principal == "PlanFunction" and (c.service, c.operation) == ("sns", "Publish") for c in env.stack.calls.calls)
        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []
