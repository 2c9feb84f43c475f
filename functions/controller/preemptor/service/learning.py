"""What the controller learns of a job from what it observes, for the planner.

The planner stops a victim at once when nothing is at risk (`RunningJob.saves_on_stop`),
and waits for a requested checkpoint only when it pays and the job honoured its last
request (`RunningJob.ignored_checkpoint_request`). Those inputs are facts the controller
saw, recorded on the job record (`core.jobs.JobRecord`):

- `saved_on_stop`: after the job's last stop, a checkpoint appeared during the grace
  (newer than the stop signal; the workflows read S3 itself before the requeue,
  `actions.note_newest_checkpoint`, so a late S3 event does not hide it). It is trusted
  only for a job that declares it saves on SIGTERM (`SAVES_ON_STOP_LABEL`); a stop without
  one revokes it.
- `ignored_checkpoint_request`: a checkpoint was requested and the wait ran out without
  one (the workflow stopped it without a fresh checkpoint); cleared when a checkpoint
  newer than a request is seen.
- `checkpoint_requested_at`: the last request (by the preemption workflow, or ahead of a
  preemption by the schedule step), so an ahead-of-time request is not repeated.
- `stop_at_once`: the plan that chose it as a victim said not to wait for a checkpoint; the
  workflow's checkpoint check then answers "go ahead" without asking. A later plan sets it
  on a victim whose stop already waits for a checkpoint to cut the wait short
  (`cut_waits`): the next check of the wait answers "go ahead", and the request it was
  not given the time to answer is not held against the job.

The steps in `service.actions` and `service.scheduling` call these functions; each is a
plain field update, never a status transition.
"""

from __future__ import annotations

from ..adapters.checkpoints import CheckpointStore
from ..adapters.store import JobsStore
from ..core.errors import CheckpointLocationUnavailable, ConflictError
from ..core.jobs import JobRecord
from ..core.model import Decision, JobState, Reason


# Why the plan stopped a victim without asking (`JobRecord.stop_reason`), for the log.
_AT_ONCE_WHY = {
    Reason.ESCALATED_STOP.value: "its preemptor is escalated",
    Reason.IGNORED_LAST_REQUEST.value: "it did not honour its last checkpoint request",
    Reason.WAIT_DOES_NOT_PAY.value: "a wait would not pay",
    Reason.SAVES_ON_STOP.value: "saves on SIGTERM within the grace",
}


def at_once_check(store: JobsStore, record: JobRecord, now: float, max_age_s: float) -> dict | None:
    """The checkpoint check of a victim the plan said to stop at once: the answer that lets
    the workflow stop it without asking (None when the plan said to wait). `fresh` is the
    truth, for the accounting: its newest checkpoint is within `max_age_s`, or it is trusted
    to save on SIGTERM within the grace (the checkpoint comes with the stop)."""
    if not record.stop_at_once:
        return None
    trusted = record.saved_on_stop and record.declares_save_on_stop
    if record.asked_for_this_stop:
        store.log(record.name, now, "checkpoint-not-awaited", "checkpoint-wait-cut", "stopped before the checkpoint it was asked for: the wait was cut short")
    else:
        why = "saves on SIGTERM within the grace" if trusted else _AT_ONCE_WHY.get(record.stop_reason or "", "a wait would not pay")
        store.log(record.name, now, "checkpoint-not-awaited", "stop-at-once", f"stopped without asking for a checkpoint: {why}")
    age = None if record.last_checkpoint_at is None else max(0.0, now - record.last_checkpoint_at)
    fresh = trusted or record.checkpoint_fresh(record.last_checkpoint_at, now, max_age_s)
    return {"fresh": fresh, "age_s": age, "last_checkpoint_at": record.last_checkpoint_at, "stop_at_once": True}


def checkpoint_seen(store: JobsStore, record: JobRecord, newest: float | None) -> None:
    """A checkpoint newer than the last request honours it."""
    asked = record.checkpoint_requested_at
    if newest is not None and asked is not None and newest > asked and record.ignored_checkpoint_request:
        store.note_learning(record.name, ignored_checkpoint_request=False)


def checkpoint_requested(store: JobsStore, name: str, now: float, by: str | None = None) -> None:
    """A checkpoint was asked of the job at `now`, by the workflow execution `by` (None:
    the schedule step, ahead of a preemption)."""
    store.note_learning(name, checkpoint_requested_at=now, checkpoint_request_by=by)


def checkpoint_request_undone(store: JobsStore, record: JobRecord) -> None:
    """A request recorded on the job (`checkpoint_requested`) whose marker its location
    refused: the job keeps the request it had before, as it was never asked this one."""
    store.note_learning(record.name, checkpoint_requested_at=record.checkpoint_requested_at, checkpoint_request_by=record.checkpoint_request_by)


def stop_sent(store: JobsStore, record: JobRecord, fresh: bool, now: float) -> None:
    """The stop signal went out at `now`. Without a fresh checkpoint after a request made
    for this preemption, the job did not honour it: it is not waited for again."""
    changes: dict = {"stop_signal_at": now}
    if not fresh and not record.stop_at_once and record.asked_for_this_stop:
        changes["ignored_checkpoint_request"] = True  # a cut wait (`stop_at_once`) did not run out
    store.note_learning(record.name, **changes)


def cut_waits(store: JobsStore, decision: Decision, by_name: dict[str, JobRecord], now: float) -> list[str]:
    """Cut short the checkpoint waits the decision says to (`Decision.wait_cuts`): the
    victim's next checkpoint check answers "stop now". Only a stop that still waits is
    cut, in the incarnation the plan saw (a stop already sent, or a job that moved on
    meanwhile, is left as it is); returns the jobs cut."""
    cut = []
    for c in decision.wait_cuts:
        record = by_name.get(c.job)
        if record is None or not record.awaits_checkpoint:
            continue
        try:
            store.update_fields(record, [JobState.PREEMPTING], stop_at_once=True)
        except ConflictError as e:
            store.log(c.job, now, "checkpoint-wait-kept", "conflict", f"the wait could not be cut: {e}")
            continue
        store.log(c.job, now, "checkpoint-wait-cut", "checkpoint-wait-cut", c.detail, preemptor=c.for_job)
        cut.append(c.job)
    return cut


def after_stop(record: JobRecord) -> dict:
    """The changes the requeue of a stopped victim makes to what was learned: whether a
    checkpoint appeared during the grace (newer than the stop signal), and a clean slate
    for the next preemption's decision."""
    signal = record.stop_signal_at
    saved = signal is not None and record.last_checkpoint_at is not None and record.last_checkpoint_at > signal
    return {"saved_on_stop": saved, "stop_signal_at": None, "stop_fresh": None, "stop_at_once": False, "stop_reason": None}


def request_ahead(store: JobsStore, checkpoints: CheckpointStore, decision: Decision, by_name: dict[str, JobRecord], now: float) -> list[str]:
    """Write the checkpoint-request markers the decision asks for ahead of a preemption
    (`Decision.checkpoint_requests`); returns the jobs asked. A location that cannot be
    written is logged and skipped."""
    asked = []
    for c in decision.checkpoint_requests:
        record = by_name.get(c.job)
        if record is None:
            continue
        try:
            marker = checkpoints.request(record.checkpoint_s3_uri, now, c.reason.value)
        except CheckpointLocationUnavailable as e:
            store.log(c.job, now, "checkpoint-unavailable", e.code or "checkpoint-location", f"cannot ask for a checkpoint: {e}")
            continue
        checkpoint_requested(store, c.job, now)
        by = {} if c.for_job is None else {"preemptor": c.for_job}  # None: asked on the pool's forecast
        store.log(c.job, now, "checkpoint-requested", c.reason.value, f"{c.detail}; marker written at {marker}", **by)
        asked.append(c.job)
    return asked


__all__ = ["after_stop", "at_once_check", "checkpoint_requested", "checkpoint_seen", "cut_waits", "request_ahead", "stop_sent"]
