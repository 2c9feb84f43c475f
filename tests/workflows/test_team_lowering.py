"""A team lowers one of its own jobs' priority ("Job Priority Lowered"), on the emulated stack.

The platform decides priority: a team submits within its ceiling, and only the operator
raises a job afterwards (`preemptor priority`). Lowering is the team's own: a sweep that is
no longer urgent makes way for the team's other work, as Slurm's `nice` lets an owner do.
The intake takes the team from the event's source and refuses a raise, another team's job,
and a malformed detail; whatever it refuses, it writes nothing.
"""

from __future__ import annotations

import json
import uuid

import pytest

from emulation import emulation, when_a_step_returns
from iam_policy import StackPolicies
from notice_queues import received, subscribe

from preemptor.adapters.store import LogLine
from preemptor.core.model import JobState
from preemptor_tools import ops


def _lowering(env, team: str, detail: dict, deliver=None) -> dict:
    """The team's event, put on the submission bus as its principals put it; the intake's
    answer. `deliver`: how it is put (by default `env.put`, which waits for the workflows;
    from inside a workflow's step, the stack's `put_event`, which does not)."""
    event = {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "Job Priority Lowered",
        "source": f"preemptor.{team}",
        "account": "123456789012",
        "time": "2026-12-06T12:00:00Z",
        "region": env.stack.region,
        "resources": [],
        "detail": detail,
    }
    [result] = (deliver or env.put)(json.loads(json.dumps(event))).results
    return result


def test_a_team_lowers_its_running_sweep_and_its_own_waiting_job_preempts_it():
    with emulation() as env:
        research = subscribe(env, "research-notices", {"team": ["research"]})
        # Given research's high sweep holding the pool, and research's medium eval waiting
        # behind it (a job never preempts a higher priority)
        env.submit(name="sweep", team="research", priority="high", pool="p5", instances=8, duration=14400, checkpoint_every=300)
        env.advance(600)
        env.submit(name="eval", team="research", priority="medium", pool="p5", instances=8, duration=1200)
        env.advance(300)
        assert env.job("eval").status is JobState.PENDING and env.job("sweep").status is JobState.RUNNING
        # When research lowers the sweep to low, saying why
        result = _lowering(env, "research", {"name": "sweep", "priority": "low", "note": "the paper deadline moved"})
        assert (result["outcome"], result["reason"]) == ("accepted", "priority 500 -> 50") and result["workflow"]
        # Then the sweep is low at once, and its decision log says who lowered it and why
        assert env.job("sweep").priority == 50
        [line] = [e for e in env.store.history("sweep") if e["kind"] == "priority-changed"]
        assert line["reason"] == "team" and "500 -> 50 (low), lowered by team research" in line["detail"]
        assert "the paper deadline moved" in line["detail"] and line["extra"] == {"from": 500, "to": 50}
        # And a cycle of the pool planned it: eval preempts the sweep and runs
        env.advance(900)
        assert "launched" in env.kinds("eval") and env.job("sweep").preemptions == 1
        # And research was told at once, not at reconcile's next run
        [notice] = [n for n in received(env, research) if n["attributes"]["kind"] == "priority-changed"]
        assert (notice["message"]["from"], notice["message"]["to"], notice["message"]["by"]) == (500, 50, "team")
        # And every call the stack made for it was one its functions' roles may make
        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []


def test_what_a_team_may_not_change_is_refused_with_a_reason_and_nothing_is_written():
    with emulation() as env:
        # Given research's medium job running
        env.submit(name="sweep", team="research", priority="medium", pool="p5", instances=4, duration=14400)
        env.advance(300)
        before, cycles = env.job("sweep"), len(env.executions("ScheduleStateMachine"))
        # When research asks for a higher priority, then vision lowers research's job
        raised = _lowering(env, "research", {"name": "sweep", "priority": "critical"})
        foreign = _lowering(env, "vision", {"name": "sweep", "priority": "low"})
        # Then both are refused, each with its stable code and the why
        assert raised["outcome"] == "rejected" and raised["reason"].startswith("not-a-lowering: ")
        assert "raising it is the platform's" in raised["reason"]
        assert foreign["outcome"] == "rejected" and foreign["reason"] == "not-your-job: job sweep belongs to team 'research', not 'vision'"
        # And a malformed detail is refused by the parser: the team is the source's, not the detail's
        spoofed = _lowering(env, "vision", {"name": "sweep", "priority": "low", "team": "research"})
        assert spoofed["outcome"] == "rejected" and spoofed["reason"].startswith("team-mismatch")
        # And a lowering to the priority it has, or of a job that does not exist, changes nothing
        assert _lowering(env, "research", {"name": "sweep", "priority": 200})["outcome"] == "ignored"
        assert _lowering(env, "research", {"name": "nobody", "priority": 0})["outcome"] == "ignored"
        # And nothing was written, and no cycle started
        assert env.job("sweep") == before and "priority-changed" not in env.kinds("sweep")
        assert len(env.executions("ScheduleStateMachine")) == cycles


def test_the_cli_says_what_it_will_not_send_in_one_line_before_any_event():
    with emulation() as env:
        env.submit(name="sweep", team="research", priority="medium", pool="p5", instances=4, duration=14400)
        target = env.operator()
        for priority, code in (("high", "not-a-lowering"), ("lowest", "bad-priority")):
            with pytest.raises(ops.BadInput, match=f"^{code}: "):
                ops.lower(target, "sweep", priority)
        assert ops.lower(target, "sweep", "medium") == {
            "job": "sweep", "from": 200, "to": 200, "state": "RUNNING", "note": None, "event_id": None,
        }
        assert "priority-changed" not in env.kinds("sweep")


def test_a_lowered_job_loses_the_escalation_it_was_given_at_its_former_priority():
    with emulation() as env:
        # Given production's critical job waiting behind an equal one, escalated by the wait alarm
        env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=14400)
        env.submit(name="backfill", team="production", priority="critical", pool="p5", instances=8, duration=600)
        env.advance(900)
        line = LogLine("backfill", env.clock.now(), "escalated", "wait-alarm", "waited 15 min (over 10)")
        assert env.store.escalate("backfill", env.clock.now(), line) and env.job("backfill").escalated_at is not None
        # When production lowers it to low: it is no longer urgent
        result = _lowering(env, "production", {"name": "backfill", "priority": "low"})
        assert result["outcome"] == "accepted"
        # Then its escalation is withdrawn with it (granted for the wait at critical), and said so
        backfill = env.job("backfill")
        assert (backfill.priority, backfill.escalated_at, backfill.status) == (50, None, JobState.PENDING)
        [change] = [e for e in env.store.history("backfill") if e["kind"] == "priority-changed"]
        assert change["detail"].endswith("; its escalation is withdrawn")


def _prod_lowered_while_its_victim_checkpoints(env, team: str, sweep: str, lowered_to: str) -> dict:
    """Research's sweep (64 GPUs, an hour in, no checkpoint yet) holding the pool, then
    `team`'s high job preempting it; the team lowers that job to `lowered_to` as the
    preemption asks the sweep for a checkpoint. The intake's answer."""
    env.submit(name="sweep", team="research", priority=sweep, pool="p5", instances=8, duration=14400, checkpoint_every=7200)
    env.advance(3600)
    answers = []
    lower = lambda: answers.append(_lowering(env, team, {"name": "prod", "priority": lowered_to}, env.stack.put_event))  # noqa: E731
    with when_a_step_returns(env, "preempt", "Ask for a checkpoint", lower) as done:
        env.submit(name="prod", team=team, priority="high", pool="p5", instances=8, duration=1200)
    assert done
    env.advance(1800)
    return answers[0]


def test_a_team_lowering_its_waiting_job_below_its_victim_calls_the_stop_off():
    with emulation() as env:
        research = subscribe(env, "research-notices", {"team": ["research"]})
        # When production lowers its job below the sweep it is preempting, before the stop
        result = _prod_lowered_while_its_victim_checkpoints(env, "production", "medium", "low")
        # Then the change is accepted with the call-off, and the sweep's run goes on, whole
        assert (result["outcome"], result["reason"]) == ("accepted", "priority 500 -> 50; preemptions of sweep called off")
        swept = env.job("sweep")
        assert (swept.status, swept.incarnation, swept.preemptions) == (JobState.RUNNING, 1, 0)
        assert "stop-requested" not in env.kinds("sweep") and env.store.preemptions_since("p5", 0) == []
        [cancelled] = [e for e in env.store.history("sweep") if e["kind"] == "preemption-cancelled"]
        assert "lowered by team production" in cancelled["detail"]
        assert env.job("prod").status is JobState.PENDING
        # And research, told the preemption was planned, is told it is called off, at once
        kinds = [n["attributes"]["kind"] for n in received(env, research)]
        assert kinds == ["preemption-planned", "preemption-called-off"]
        assert [sent for n, sent in env.store.notices("p5") if n.kind == "preemption-called-off"] == [True]


def test_a_victim_reclaimed_from_borrowed_quota_is_still_stopped_whatever_its_reclaimer_is_lowered_to():
    # Given quotas: production's nominal share is the pool, research runs on borrowed quota,
    # and a team within its nominal quota reclaims borrowed work whatever its priority
    quotas = {"quotas": [{"team": "production", "nominal_gpus": 64}, {"team": "research", "nominal_gpus": 0, "borrowing_limit": 64}]}
    with emulation(policy=quotas) as env:
        # When production lowers its job, reclaiming the sweep's GPUs, below the sweep
        result = _prod_lowered_while_its_victim_checkpoints(env, "production", "medium", "low")
        # Then the reclaim goes on: the rule that chose the sweep does not look at priority
        assert (result["outcome"], result["reason"]) == ("accepted", "priority 500 -> 50")
        [started] = [e for e in env.store.history("sweep") if e["kind"] == "preemption-started"]
        assert started["extra"]["rule"] == "reclaim-borrowed"
        swept = env.job("sweep")
        assert (swept.incarnation, swept.preemptions) == (2, 1) and "stop-requested" in env.kinds("sweep")
        assert "preemption-cancelled" not in env.kinds("sweep")


@pytest.mark.parametrize("died_first", [False, True], ids=["cancelled", "handled again after dying"])
def test_a_team_cancelling_its_waiting_job_calls_off_the_stops_not_sent_for_it(died_first):
    with emulation() as env:
        # Given research's sweep (an hour in, no checkpoint yet) preempted for production's
        # high job, the sweep asked for a checkpoint; when production cancels that job (or
        # a first handling cancelled it and died before the call-off, and it is handled again)
        env.submit(name="sweep", team="research", priority="medium", pool="p5", instances=8, duration=14400, checkpoint_every=7200)
        env.advance(3600)
        event = {
            "version": "0", "id": str(uuid.uuid4()), "detail-type": "Job Cancelled", "source": "preemptor.production",
            "account": "123456789012", "time": "2026-12-06T12:00:00Z", "region": env.stack.region, "resources": [],
            "detail": {"name": "prod"},
        }
        answers = []

        def cancel() -> None:
            if died_first:
                prod = env.store.get("prod")
                env.store.transition(prod, prod.with_changes(status=JobState.CANCELLED, ended_at=env.clock.now()), [JobState.PENDING])
            answers.extend(env.stack.put_event(json.loads(json.dumps(event))).results)

        with when_a_step_returns(env, "preempt", "Ask for a checkpoint", cancel) as done:
            env.submit(name="prod", team="production", priority="high", pool="p5", instances=8, duration=1200)
        assert done
        env.advance(1800)
        # Then the cancel is accepted, and no stop is sent to the sweep for a job that no
        # longer waits: its first run goes on, nothing lost, out of the preemption budget
        assert [(a["outcome"], a["reason"]) for a in answers] == [("accepted", "cancelled-pending")]
        assert env.job("prod").status is JobState.CANCELLED
        swept = env.job("sweep")
        assert (swept.status, swept.incarnation, swept.preemptions) == (JobState.RUNNING, 1, 0)
        assert "stop-requested" not in env.kinds("sweep") and env.store.preemptions_since("p5", 0) == []
        [cancelled] = [e for e in env.store.history("sweep") if e["kind"] == "preemption-cancelled"]
        assert cancelled["reason"] == "preemptor-cancelled"
        # And a cancel of it sent again changes nothing
        [again] = env.put(json.loads(json.dumps(event | {"id": str(uuid.uuid4())}))).results
        assert (again["outcome"], again["reason"]) == ("ignored", "job is CANCELLED") and env.job("sweep") == swept
