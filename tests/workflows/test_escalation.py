"""Alarms that act: the wait alarm's state change escalates the jobs it is about (executed
on moto, fed with the real CloudWatch alarm state change sample)."""

from __future__ import annotations

import json

import pytest
from aws_faults import aws_says_no, error_response, notice_publish_fails
from emulation import emulation
from eventfiles import load_raw

from preemptor.core.errors import Throttled
from preemptor.core.model import JobState
from preemptor_tools.local.moto_patches import LambdaRuntimeExited

ALARM_SAMPLE = "other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__06df3b84.json"


def _alarm_event(env, state: str = "ALARM", name: str | None = None) -> dict:
    """The real sample, as the stack's wait alarm would send it now."""
    event = json.loads(load_raw(ALARM_SAMPLE))
    alarm = name or env.stack.parameters.get("WaitAlarmName") or f"{env.stack.stack_name}-job-waiting-too-long"
    event["id"] = f"alarm-{state}-{int(env.clock.now())}"
    event["resources"] = [f"arn:aws:cloudwatch:{env.stack.region}:123456789012:alarm:{alarm}"]
    event["detail"]["alarmName"] = alarm
    event["detail"]["state"]["value"] = state
    return event


def _notices(env) -> list[dict]:
    return [json.loads(a) for a in env.stack.alerts()]


def _incident_held_back(env, incident_instances: int = 8, checkpoint_every: int | None = 300) -> None:
    """A research sweep on the whole pool, then a critical incident job that its minimum
    runtime (the tests' policy) keeps waiting for 11 minutes."""
    env.submit(
        name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=checkpoint_every
    )
    env.advance(300)
    env.submit(name="incident", team="production", priority="critical", pool="p5", instances=incident_instances, duration=1200)
    env.advance(660)


def test_the_wait_alarm_lifts_the_soft_protections_for_the_job_waiting_too_long():
    # Given a pool whose running jobs are protected for an hour (min_runtime_s), held by a
    # research sweep, and a critical production job that the protection keeps waiting
    policy = {"min_runtime_s": 3600}
    with emulation(policy=policy) as env:
        _incident_held_back(env)
        assert env.job("incident").status is JobState.PENDING and env.job("sweep").status is JobState.RUNNING
        env.stack.alerts()  # what came before the alarm
        # When the wait alarm (over 10 minutes) goes to ALARM and EventBridge delivers it
        routed = env.put(_alarm_event(env))
        env.stack.drain()
        # Then the intake escalated the critical job, recorded why and told its team
        assert routed.results[0]["outcome"] == "accepted" and routed.results[0]["reason"].startswith("escalated: 1 job")
        incident = env.job("incident")
        assert incident.escalated_at is not None
        [escalated] = [e for e in env.store.history("incident") if e["kind"] == "escalated"]
        assert escalated["reason"] == "wait-alarm"
        # And the next cycle chose the protected sweep as its victim, stopped it, and the
        # critical job runs
        env.advance(300)
        assert env.job("sweep").preemptions == 1
        assert env.job("incident").status is JobState.RUNNING
        started = [e for e in env.store.history("sweep") if e["kind"] == "preemption-started"]
        assert started and "incident" in started[0]["detail"]
        # And the teams were told: production that its job waited too long, research that
        # its sweep would be preempted
        notices = _notices(env)
        kinds = [(n["kind"], n["team"], n["job"]) for n in notices]
        assert ("waiting-too-long", "production", "incident") in kinds
        assert ("preemption-planned", "research", "sweep") in kinds


def test_an_alarm_that_is_not_ours_or_not_in_alarm_escalates_nothing():
    with emulation(policy={"min_runtime_s": 3600}) as env:
        _incident_held_back(env, checkpoint_every=None)
        # When another alarm fires, and ours goes back to OK (delivered to the intake directly:
        # the rule would not even route them)
        intake = env.stack.resources["IntakeFunction"]
        other = env.stack.invoke_lambda(intake, _alarm_event(env, name="ServerCpuTooHigh"))
        ok = env.stack.invoke_lambda(intake, _alarm_event(env, state="OK"))
        # Then both are ignored with the reason, and nobody is escalated
        assert other["outcome"] == "ignored" and "not the controller's wait alarm" in other["reason"]
        assert ok["outcome"] == "ignored" and ok["reason"].endswith("is OK")
        assert env.job("incident").escalated_at is None


def test_a_job_that_has_not_waited_past_the_threshold_is_not_escalated_and_an_alarm_twice_escalates_once():
    with emulation(policy={"min_runtime_s": 3600}) as env:
        _incident_held_back(env, incident_instances=4, checkpoint_every=None)
        env.submit(name="fresh", team="production", priority="critical", pool="p5", instances=4, duration=1200)
        # When the alarm fires twice (two state changes, two event ids)
        first = env.put(_alarm_event(env)).results[0]
        env.clock.advance(1)
        second = env.put(_alarm_event(env)).results[0]
        # Then only the job past the threshold was escalated, once
        assert first["reason"].startswith("escalated: 1 job") and "incident" in first["reason"]
        assert second["reason"].startswith("escalated: 0 job")
        assert env.job("fresh").escalated_at is None
        assert [e["kind"] for e in env.store.history("incident")].count("escalated") == 1


def _waits(documents: list[dict], tier: str) -> list[float]:
    """The OldestPendingWaitSeconds values the functions reported for `tier` (EMF documents)."""
    values = [d["OldestPendingWaitSeconds"] for d in documents if "OldestPendingWaitSeconds" in d and d.get("Tier") == tier]
    return [v for value in values for v in (value if isinstance(value, list) else [value])]


def test_a_requeued_victims_hours_of_running_are_not_reported_as_waiting_nor_escalate_it():
    documents: list[dict] = []
    with emulation(metrics=documents) as env:
        # Given a high job that ran for three hours, then was preempted by a critical one
        env.submit(name="sweep", team="research", priority="high", pool="p5", instances=8, duration=4 * 3600, checkpoint_every=300)
        env.advance(3 * 3600)
        before = len(documents)
        env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=3600, checkpoint_every=300)
        env.advance(120)
        sweep = env.job("sweep")
        assert sweep.status is JobState.PENDING and env.clock.now() - sweep.pending_since <= 120
        # Then the wait the functions report for its tier is its wait since the requeue
        waits = _waits(documents[before:], "high")
        assert waits and max(waits) <= 120
        # And the wait alarm firing (for another job) does not escalate it
        result = env.put(_alarm_event(env)).results[0]
        assert "sweep" not in result["reason"]
        assert env.job("sweep").escalated_at is None


def test_an_escalation_whose_schedule_start_is_throttled_plans_the_pool_when_the_event_is_retried():
    with emulation(policy={"min_runtime_s": 3600}) as env:
        _incident_held_back(env)
        # Given Step Functions throttles the schedule start of the first delivery: the intake
        # raises (after the job was escalated), so the event is delivered again
        event = _alarm_event(env)
        throttled = error_response("ThrottlingException", "Rate exceeded", 400)
        with aws_says_no(env.stack.deps().workflows.client, "StartExecution", throttled, times=1) as refused:
            with pytest.raises(Throttled):
                env.put(event)
        assert refused and env.job("incident").escalated_at is not None
        retried = env.put(event).results[0]
        env.stack.drain()
        # Then the retry, which finds the job escalated already, still planned the pool:
        # the sweep was preempted for it
        assert retried["outcome"] == "accepted"
        env.advance(300)
        assert [e["kind"] for e in env.store.history("incident")].count("escalated") == 1
        assert env.job("sweep").preemptions == 1 and env.job("incident").status is JobState.RUNNING


@pytest.mark.parametrize("how", ["throttled", "died"])
def test_an_escalation_is_told_once_even_when_its_notice_is_refused_or_its_writer_dies(how):
    with emulation(policy={"min_runtime_s": 3600}) as env:
        _incident_held_back(env)
        _notices(env)  # what came before the alarm
        event = _alarm_event(env)
        # Given SNS throttling the escalation's notice, or the intake dying as it publishes
        # it (EventBridge then delivers the event again, and the retry finds the job escalated)
        with notice_publish_fails(env.stack.deps().alerts.client, "waiting-too-long", how) as failed:
            if how == "died":
                with pytest.raises(LambdaRuntimeExited):
                    env.put(event)
            env.put(event)
        env.stack.drain()
        assert failed and env.job("incident").escalated_at is not None
        # Then the escalation is in the job's log once, written with its mark
        assert env.kinds("incident").count("escalated") == 1
        assert "waiting-too-long" not in [n["kind"] for n in _notices(env)]
        # And once reconcile passes, a minute on, the team is told, once
        env.advance(60)
        for _ in range(2):
            env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
            env.stack.drain()
        told = [n for n in _notices(env) if n["kind"] == "waiting-too-long"]
        assert [(n["team"], n["job"], n["action"]) for n in told] == [("production", "incident", "escalated")]
        assert [n for n, _ in env.store.notices("p5") if n.kind == "waiting-too-long"] == []


def _advance_with_reconcile(env, seconds: float) -> None:
    """`env.advance`, with the scheduled reconcile (rate 5 minutes) firing as it comes round."""
    end = env.clock.now() + seconds
    while env.clock.now() < end:
        env.advance(min(30.0, end - env.clock.now()))
        env.stack.fire_schedules()


@pytest.mark.parametrize("ahead", [True, False], ids=["asked-ahead", "before-escalation-off"])
def test_the_victim_of_a_job_near_its_escalation_is_asked_for_a_checkpoint_before_the_alarm(ahead):
    # Given a sweep on the whole pool that runs the training helper but writes no periodic
    # checkpoint, and a critical job that the minimum runtime keeps waiting; the reconcile
    # plans the pool every 5 minutes
    policy = {"min_runtime_s": 3600}
    if not ahead:
        policy["checkpoint_ahead"] = {"before_escalation_s": None}
    with emulation(policy=policy) as env:
        env.stack.fire_schedules()  # the schedule's clock starts with the stack
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=None, runs_training_helper=True)
        _advance_with_reconcile(env, 300)
        submitted = env.clock.now()
        env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=1200)
        _advance_with_reconcile(env, 660)
        # Then, within 5 minutes of the wait alarm's threshold (10 minutes), the cycle of the
        # reconcile asked the sweep for a checkpoint, saying for whom and why
        asked = [e for e in env.store.history("sweep") if e["kind"] == "checkpoint-requested"]
        if ahead:
            [request] = asked
            assert submitted + 300 <= request["at"] <= submitted + 600
            assert request["reason"] == "checkpoint-ahead-of-preemption" and request["extra"]["preemptor"] == "incident"
            assert "which the wait alarm escalates in" in request["detail"]
        else:
            assert asked == []
        # When the alarm escalates the critical job
        env.put(_alarm_event(env))
        env.stack.drain()
        _advance_with_reconcile(env, 300)
        # Then the sweep is stopped at once for it, with the checkpoint it wrote when asked
        # (fresh), not without one
        [started] = [e for e in env.store.history("sweep") if e["kind"] == "preemption-started"]
        [stop] = [e for e in env.store.history("sweep") if e["kind"] == "stop-requested"]
        assert started["extra"]["preemptor"] == "incident"
        [at_once] = [e for e in env.store.history("sweep") if e["kind"] == "checkpoint-not-awaited"]
        assert at_once["detail"] == "stopped without asking for a checkpoint: its preemptor is escalated"
        if ahead:
            assert started["extra"]["checkpoint_age_s"] is not None and started["extra"]["checkpoint_age_s"] <= 900  # checkpoint_max_age_s
            assert stop["reason"] == "fresh-checkpoint"
        else:
            assert started["extra"]["checkpoint_age_s"] is None and "WITHOUT a fresh checkpoint" in stop["detail"]
        assert env.job("incident").status is JobState.RUNNING
