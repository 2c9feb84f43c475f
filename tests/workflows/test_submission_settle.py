"""A burst of submissions is ranked as one: the settle window (SubmissionSettleSeconds).

Each submission's intake starts the schedule workflow of its pool for the end of the
window the clock is in (one execution per pool and window, named after its end); the
execution waits until then ("Let the submissions settle") and plans every job submitted
within it. Without it, a low job submitted a moment before a high one is launched, then
preempted by it.
"""

from __future__ import annotations

from emulation import emulation
from preemptor.config import Settings
from preemptor.core.model import JobState
from preemptor.service.intake import Intake
from preemptor_tools.local.demo import START


def _schedules(env) -> list[dict]:
    sfn = env.stack.client("stepfunctions")
    arn = env.stack.state_machines["ScheduleStateMachine"]
    return sfn.list_executions(stateMachineArn=arn)["executions"]


def _history(env, job: str) -> list[dict]:
    return [e for e in env.store.all_history() if e["job"] == job]


def test_a_burst_is_planned_once_at_the_end_of_its_window_and_no_job_of_it_is_preempted():
    with emulation() as env:
        # Given a sweep (low, the whole pool) and a release job (high, the whole pool)
        # submitted in the same moment, the sweep first, as AWS delivers a burst: every
        # intake runs before the workflow they start goes past its first wait
        with env.clock.held():
            sweep = env.submit_nowait(name="a-sweep", team="research", priority=50, pool="p5", instances=8, duration=3600)
            release = env.submit_nowait(name="b-release", team="production", priority=500, pool="p5", instances=8, duration=3600)
        env.stack.drain()
        # Then both were accepted; the second intake's start found the window's execution
        # already started (the same input: Step Functions answers with it), so one
        # execution planned both
        assert [r.results[0]["outcome"] for r in (sweep, release)] == ["accepted", "accepted"]
        [run] = _schedules(env)
        assert sweep.results[0]["workflow"] == release.results[0]["workflow"] == run["executionArn"]
        assert run["name"] == f"settle-p5-{round((START + 3) * 1000)}"
        assert "Let the submissions settle" in env.states_visited(run["executionArn"])
        # And it ranked them together at the window's end: the release job launched then,
        # the sweep waits for it, and nothing was launched only to be preempted
        assert env.job("b-release").status is JobState.RUNNING and env.job("a-sweep").status is JobState.PENDING
        [launched] = [e for e in _history(env, "b-release") if e["kind"] == "launched"]
        assert launched["at"] == START + 3
        assert not [e for e in env.store.all_history() if e["kind"] == "preemption-started"]
        assert env.fleet.runs() and {r["name"] for r in env.fleet.runs()} == {"b-release"}


def test_the_same_burst_planned_job_by_job_launches_the_low_job_only_to_preempt_it():
    # Given the settle window off (SubmissionSettleSeconds 0): each submission plans at once
    with emulation(parameters={"SubmissionSettleSeconds": "0"}) as env:
        env.submit(name="a-sweep", team="research", priority=50, pool="p5", instances=8, duration=3600)
        env.submit(name="b-release", team="production", priority=500, pool="p5", instances=8, duration=3600)
        # Then the sweep was launched the moment it was submitted, and preempted for the
        # release job submitted after it: the churn the window prevents
        [launched] = [e for e in _history(env, "a-sweep") if e["kind"] == "launched"]
        assert launched["at"] == START
        assert [e["kind"] for e in _history(env, "a-sweep") if e["kind"] == "preemption-started"] == ["preemption-started"]
        assert all("Let the submissions settle" not in env.states_visited(r["executionArn"]) for r in _schedules(env))


class _Starter:
    """The workflow starter: records each start; a name started before is a repeat (None)."""

    def __init__(self):
        self.started: dict[str, dict] = {}

    def start(self, workflow: str, name: str, payload: dict) -> str | None:
        if name in self.started:
            return None
        self.started[name] = payload
        return f"arn:{name}"


def _intake(settle_s: float, clock) -> tuple[Intake, _Starter]:
    settings = Settings(jobs_table="jobs", pools=(), submission_settle_s=settle_s)
    starter = _Starter()
    return Intake(store=None, workflows=starter, runners={}, settings=settings, clock=clock), starter


def test_the_window_is_the_one_the_clock_is_in_once_the_record_is_written():
    # Given 3 s windows: a submission handled from 100.5 whose record is written by 102.9
    intake, starter = _intake(3.0, clock=lambda: 102.9)
    intake._settled("p5", "event-1", "accepted", "job-submitted", "a", now=100.5)
    # Then it is planned by the execution of the window ending at 105 (its end is read
    # after the write), which waits the whole seconds to it: 2.1 s, rounded up
    assert starter.started == {"settle-p5-105000": {"pool": "p5", "settle_s": 3}}
    # And one written at 105.0, the next window's first moment, by the next execution
    intake.clock = lambda: 105.0
    intake._settled("p5", "event-2", "accepted", "job-submitted", "b", now=104.9)
    assert starter.started["settle-p5-108000"] == {"pool": "p5", "settle_s": 3}
    # And another within that second window: a repeat, no third execution
    intake.clock = lambda: 106.0
    assert intake._settled("p5", "event-3", "accepted", "job-submitted", "c", now=106.0).workflow is None
    assert len(starter.started) == 2


def test_without_a_window_each_submission_starts_its_own_execution_at_once():
    intake, starter = _intake(0.0, clock=lambda: 100.0)
    intake._settled("p5", "event-1", "accepted", "job-submitted", "a", now=100.0)
    assert starter.started == {"schedule-p5-event-1": {"pool": "p5"}}
