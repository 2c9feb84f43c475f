"""A stop that waits for a checkpoint, judged again when a more important job comes to wait
for its GPUs (issue 10): the next plan cuts the wait short, the preemption workflow's next
check stops the victim, and the request it had no time to answer is not held against it.
Executed on moto through the real state machines."""

from __future__ import annotations

from emulation import emulation, when_a_step_returns

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
