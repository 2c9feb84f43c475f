"""What the controller learns of a job (service.learning) and what the planner then sees.

Pure: the store is a stub recording the field updates and the log.
"""

from __future__ import annotations

from preemptor.core.errors import ConflictError
from preemptor.core.jobs import SAVES_ON_STOP_LABEL, JobRecord
from preemptor.core.model import Decision, JobState, WaitCut
from preemptor.service import learning


class StubStore:
    def __init__(self) -> None:
        self.updates: list[tuple[str, dict]] = []
        self.logs: list[tuple[str, str, str]] = []

    def note_learning(self, name: str, **fields) -> None:
        self.updates.append((name, fields))

    def log(self, job: str, at: float, kind: str, reason: str, detail: str = "", **extra) -> None:
        self.logs.append((job, kind, reason))

    def update_fields(self, record: JobRecord, expect, **changes) -> JobRecord:
        if record.status not in expect or self.conflict:
            raise ConflictError(f"{record.name} changed meanwhile")
        self.updates.append((record.name, changes))
        return record.with_changes(**changes)

    conflict = False


def record(**changes) -> JobRecord:
    base = JobRecord(
        name="exp", team="t", priority=50, pool="p", service="sagemaker", gpus=8, request={},
        checkpoint_s3_uri="s3://b/t/exp", submitted_at=0.0, status=JobState.PREEMPTING, started_at=100.0,
        labels={SAVES_ON_STOP_LABEL: "true"},
    )
    return base.with_changes(**changes)


def test_a_checkpoint_during_the_grace_makes_a_declared_job_trusted():
    # Given a declared job stopped at 1000 whose checkpoint appeared at 1040 (in the grace)
    stopped = record(stop_signal_at=1000.0, last_checkpoint_at=1040.0)
    # When it is requeued
    changes = learning.after_stop(stopped)
    # Then it is trusted: the planner will stop it at once next time
    assert changes == {"saved_on_stop": True, "stop_signal_at": None, "stop_fresh": None, "stop_at_once": False, "stop_reason": None}
    assert stopped.with_changes(**changes).as_running().saves_on_stop


def test_no_checkpoint_during_the_grace_revokes_the_trust_and_no_declaration_no_trust():
    # Given a trusted job whose last checkpoint predates its stop signal
    stopped = record(saved_on_stop=True, stop_signal_at=1000.0, last_checkpoint_at=900.0)
    # Then the requeue revokes the trust
    assert learning.after_stop(stopped)["saved_on_stop"] is False
    # And a job that saved but does not declare it is not trusted by the planner
    undeclared = record(saved_on_stop=True, labels={})
    assert undeclared.as_running().saves_on_stop is False and not undeclared.as_running().declares_save_on_stop


def test_a_stop_without_a_fresh_checkpoint_after_a_request_marks_it_ignored():
    # Given a job asked for a checkpoint at 1010 for a preemption started at 1000
    store = StubStore()
    learning.stop_sent(store, record(preempting_since=1000.0, checkpoint_requested_at=1010.0), fresh=False, now=1610.0)
    # Then the stop records the signal and that the request was not honoured
    assert store.updates == [("exp", {"stop_signal_at": 1610.0, "ignored_checkpoint_request": True})]
    # And a stop at once (fresh) marks nothing but the signal
    store = StubStore()
    learning.stop_sent(store, record(preempting_since=1000.0, checkpoint_requested_at=500.0), fresh=True, now=1000.0)
    assert store.updates == [("exp", {"stop_signal_at": 1000.0})]


def test_a_checkpoint_newer_than_the_request_clears_ignored():
    store = StubStore()
    learning.checkpoint_seen(store, record(ignored_checkpoint_request=True, checkpoint_requested_at=100.0), newest=160.0)
    assert store.updates == [("exp", {"ignored_checkpoint_request": False})]
    store = StubStore()
    learning.checkpoint_seen(store, record(ignored_checkpoint_request=True, checkpoint_requested_at=100.0), newest=90.0)
    assert store.updates == []


def test_the_checkpoint_check_of_a_stop_at_once_victim_goes_ahead_without_asking():
    # Given a victim the plan said to stop at once, its last checkpoint 600 s old (limit 900 s)
    store = StubStore()
    answer = learning.at_once_check(store, record(stop_at_once=True, last_checkpoint_at=400.0), now=1000.0, max_age_s=900.0)
    # Then the workflow's check says to stop at once, fresh (within the limit), and says why in the log
    assert answer == {"fresh": True, "age_s": 600.0, "last_checkpoint_at": 400.0, "stop_at_once": True}
    assert store.logs == [("exp", "checkpoint-not-awaited", "stop-at-once")]
    # And a victim the plan said to wait for is checked as before
    assert learning.at_once_check(store, record(stop_at_once=False), now=1000.0, max_age_s=900.0) is None


def test_a_stop_at_once_with_work_at_risk_is_a_stop_without_a_fresh_checkpoint():
    # Given victims the plan said to stop at once, with a checkpoint 600 s old and a 300 s limit
    store = StubStore()
    at_risk = learning.at_once_check(store, record(stop_at_once=True, last_checkpoint_at=400.0), now=1000.0, max_age_s=300.0)
    never = learning.at_once_check(store, record(stop_at_once=True), now=1000.0, max_age_s=300.0)
    # one seen to save on SIGTERM within the grace (and declaring it): its checkpoint comes with the stop
    saver = learning.at_once_check(
        store, record(stop_at_once=True, saved_on_stop=True, labels={SAVES_ON_STOP_LABEL: "true"}), now=1000.0, max_age_s=300.0
    )
    # Then the stop goes ahead for all three, counted as without a fresh checkpoint where it is one
    assert [a["stop_at_once"] for a in (at_risk, never, saver)] == [True, True, True]
    assert [a["fresh"] for a in (at_risk, never, saver)] == [False, False, True]


def test_a_stop_waiting_for_the_checkpoint_asked_for_it_is_one_the_planner_sees_arrive_late():
    # Given a victim whose workflow asked for a checkpoint at 1010, for a preemption begun at 1000
    waiting = record(preempting_since=1000.0, checkpoint_requested_at=1010.0)
    # Then the planner sees its stop waiting for it
    assert waiting.awaits_checkpoint and waiting.as_running().stop_awaits_checkpoint
    # And not once the stop is sent, the wait cut, before the request, or with an older one
    assert not waiting.with_changes(stop_signal_at=1200.0).awaits_checkpoint
    assert not waiting.with_changes(stop_at_once=True).awaits_checkpoint
    assert not waiting.with_changes(checkpoint_requested_at=None).awaits_checkpoint
    assert not waiting.with_changes(checkpoint_requested_at=900.0).awaits_checkpoint
    assert not waiting.with_changes(status=JobState.RUNNING).awaits_checkpoint


def test_a_cut_wait_is_written_on_a_stop_still_waiting_and_not_held_against_the_job():
    store = StubStore()
    waiting = record(preempting_since=1000.0, checkpoint_requested_at=1010.0)
    cut = WaitCut("exp", "p", "crit", "its stop no longer waits for a checkpoint: crit waits for its GPUs")
    # When the plan says to cut the wait of a stop that still waits, and of one already sent
    sent = waiting.with_changes(name="sent", stop_signal_at=1100.0)
    decision = Decision(wait_cuts=(cut, WaitCut("sent", "p", "crit", "x")))
    assert learning.cut_waits(store, decision, {"exp": waiting, "sent": sent}, now=1200.0) == ["exp"]
    # Then only the waiting one is told to stop at once, and the log says for whom
    assert store.updates == [("exp", {"stop_at_once": True})]
    assert store.logs == [("exp", "checkpoint-wait-cut", "checkpoint-wait-cut")]
    # And its next check goes ahead, logged as a cut wait, and the stop does not mark the
    # request it had no time to answer as ignored
    store = StubStore()
    now_cut = waiting.with_changes(stop_at_once=True)
    assert learning.at_once_check(store, now_cut, now=1230.0, max_age_s=900.0)["stop_at_once"] is True
    assert store.logs == [("exp", "checkpoint-not-awaited", "checkpoint-wait-cut")]
    learning.stop_sent(store, now_cut, fresh=False, now=1230.0)
    assert store.updates == [("exp", {"stop_signal_at": 1230.0})]
    # And a record changed meanwhile is left as it is, with a line in its log
    store = StubStore()
    store.conflict = True
    assert learning.cut_waits(store, Decision(wait_cuts=(cut,)), {"exp": waiting}, now=1200.0) == []
    assert store.logs == [("exp", "checkpoint-wait-kept", "conflict")]


def test_a_requeue_tells_what_its_lost_gpu_seconds_are_against_the_stop_signal():
    # The requeue counts the run's GPU time since the checkpoint it resumes from; its line
    # says whether that checkpoint came after the stop signal (the work until the stop is
    # kept: saved on SIGTERM), before it (the work since is redone), or not in this run
    from preemptor.service.actions import _since_checkpoint

    running = dict(status=JobState.PREEMPTING, started_at=1000.0, stop_signal_at=5000.0)
    assert _since_checkpoint(record(**running, last_checkpoint_at=5060.0)) == (
        " (since its checkpoint, written 60 s after the stop signal: the work until the stop is kept)"
    )
    assert _since_checkpoint(record(**running, last_checkpoint_at=4100.0)) == (
        " (since its checkpoint, 900 s before the stop signal: that work is redone)"
    )
    for before_run in (None, 900.0):  # none, or one older than this run (it resumed from it)
        assert _since_checkpoint(record(**running, last_checkpoint_at=before_run)) == " (no checkpoint in this run: its work is redone)"
    # A run ended without the controller's signal (reconcile, an instance gone)
    assert _since_checkpoint(record(**{**running, "stop_signal_at": None}, last_checkpoint_at=4100.0)) == " (since the checkpoint it resumes from)"
