"""The steps the workflows carry out on one job: checkpoint, stop, requeue, launch, finish.

Every step is idempotent: it checks the job's stored status and incarnation first, so a
retried or duplicated step does nothing twice (no double launch, no double stop, no
capacity released twice).
"""

from __future__ import annotations

from ..adapters.checkpoints import CheckpointStore
from ..adapters.runners import Runner
from ..adapters.store import JobsStore
from ..core.errors import ConflictError, ServiceJobNotFound, ServiceRejected
from ..core.jobs import JobRecord
from ..core.model import JobState
from ..core.policy import Policy

SPOT_INTERRUPTION = "spot-interruption"  # `preempted_by` of a job stopped for its instance
OUTCOMES = {"completed": JobState.COMPLETED, "failed": JobState.FAILED, "cancelled": JobState.CANCELLED}


def _current(store: JobsStore, name: str, incarnation: int | None) -> JobRecord | None:
    record = store.require(name)
    if incarnation is not None and record.incarnation != incarnation:
        return None
    return record


def check_checkpoint(
    *, store: JobsStore, checkpoints: CheckpointStore, policy: Policy, job: str, now: float, newer_than: float | None = None
) -> dict:
    """Is the newest checkpoint of `job` younger than the policy's limit? With `newer_than`
    (a spot interruption: the instance goes away anyway), only a checkpoint written after
    that time counts."""
    record = store.require(job)
    newest = checkpoints.newest(record.checkpoint_s3_uri)
    age = None if newest is None else max(0.0, now - newest)
    if newer_than is not None:
        fresh = newest is not None and newest > newer_than
    elif newest is not None:
        # A relaunched run resumed from that checkpoint: what a stop loses is the work since
        # the later of the checkpoint and the run's start (a run still reloading loses none).
        at_risk = now - max(newest, record.started_at or newest)
        fresh = at_risk <= policy.for_pool(record.pool).checkpoint_max_age_s
    else:
        fresh = False
    if newest is not None:
        store.note_checkpoint(job, newest)
    if fresh:
        store.log(
            job, now, "checkpoint-confirmed", "fresh-checkpoint", f"newest checkpoint is {age:.0f} s old", checkpoint_age_s=age
        )
    return {"fresh": fresh, "age_s": age, "last_checkpoint_at": newest}


def request_checkpoint(*, store: JobsStore, checkpoints: CheckpointStore, job: str, reason: str, now: float) -> dict:
    record = store.require(job)
    marker = checkpoints.request(record.checkpoint_s3_uri, now, reason)
    store.log(job, now, "checkpoint-requested", reason, f"marker written at {marker}")
    return {"requested_at": now, "marker": marker}


def stop(*, store: JobsStore, runners: dict[str, Runner], job: str, incarnation: int, fresh: bool, now: float) -> dict:
    """Stop the run of a job being preempted (or cancelled). Stopping twice is harmless."""
    record = _current(store, job, incarnation)
    if record is None or record.status not in (JobState.PREEMPTING, JobState.RUNNING) or not record.run_id:
        return {"stopping": False, "reason": "not-running"}
    why = f"preempted by {record.preempted_by}" if record.preempted_by else "cancelled"
    try:
        runners[record.service].stop(record.run_id, f"preemptor: {why}")
    except ServiceJobNotFound:
        return {"stopping": False, "reason": "run-not-found"}
    detail = why + ("" if fresh else "; WITHOUT a fresh checkpoint: work since the last one is lost")
    store.log(job, now, "stop-requested", "fresh-checkpoint" if fresh else "checkpoint-timeout", detail)
    return {"stopping": True}


def run_state(*, store: JobsStore, runners: dict[str, Runner], job: str, incarnation: int) -> dict:
    """Where the job's current run stands, e.g. to wait until a stop has taken effect."""
    record = _current(store, job, incarnation)
    if record is None or not record.run_id:
        return {"ended": True, "phase": "gone"}
    try:
        state = runners[record.service].state(record.run_id)
    except ServiceJobNotFound:
        return {"ended": True, "phase": "gone"}
    return {"ended": state.ended, "phase": state.phase, "service_status": state.service_status}


def requeue(*, store: JobsStore, policy: Policy, job: str, incarnation: int, fresh: bool, phase: str, now: float) -> dict:
    """Put a stopped victim back in the queue under its next incarnation; free its GPUs.

    A victim that completed on its own while being stopped is recorded as completed.
    """
    record = _current(store, job, incarnation)
    if record is None or record.status is not JobState.PREEMPTING:
        pool = store.require(job).pool
        return {"requeued": False, "reason": "not-preempting", "pool": pool}
    if phase == "completed":
        return finish(
            store=store,
            policy=policy,
            job=job,
            incarnation=incarnation,
            outcome="completed",
            reason="completed-while-stopping",
            now=now,
        )
    if record.preempted_by == SPOT_INTERRUPTION:
        return _back_to_queue(store, policy, record, fresh, now, "interrupted", "stopped before its spot instance goes away")
    return _back_to_queue(store, policy, record, fresh, now, "preempted", f"stopped for {record.preempted_by}")


def _back_to_queue(
    store: JobsStore, policy: Policy, record: JobRecord, fresh: bool, now: float, reason: str, why: str
) -> dict:
    started = record.started_at or now
    since = max(record.last_checkpoint_at or 0.0, started)
    lost = record.gpus * max(0.0, now - since)
    saved = max(0.0, (record.last_checkpoint_at or 0.0) - started)
    new = record.with_changes(
        status=JobState.PENDING,
        pending_since=now,
        work_done_s=record.work_done_s + saved,
        admitted_at=None,
        spared_until=None,
        incarnation=record.incarnation + 1,
        run_id=None,
        run_name=None,
        started_at=None,
        preemptions=record.preemptions + 1,
        lost_gpu_seconds=record.lost_gpu_seconds + lost,
        stops_without_fresh_checkpoint=record.stops_without_fresh_checkpoint + (0 if fresh else 1),
        preempting_since=None,
    )
    try:
        store.transition(record, new, expect=[record.status], usage_delta=-record.gpus)
    except ConflictError:
        return {"requeued": False, "reason": "conflict", "pool": record.pool}
    _fold_usage(store, policy, record, now)
    store.log(
        record.name,
        now,
        "requeued",
        reason,
        f"{why}; {lost:.0f} GPU-seconds lost; resumes from its checkpoint as {new.next_run_name}",
        preemptor=record.preempted_by,
        lost_gpu_seconds=lost,
        fresh_checkpoint=fresh,
    )
    return {"requeued": True, "pool": record.pool, "lost_gpu_seconds": lost, "fresh": fresh, "released": True}


def interrupt(*, store: JobsStore, job: str, incarnation: int, reason: str, now: float) -> dict:
    """Mark a running job as going away (spot interruption), so it is stopped and requeued once."""
    record = _current(store, job, incarnation)
    if record is None or record.status is not JobState.RUNNING:
        return {"interrupting": False}
    try:
        store.transition(
            record,
            record.with_changes(status=JobState.PREEMPTING, preempted_by=reason, preempting_since=now),
            expect=[JobState.RUNNING],
        )
    except ConflictError:
        return {"interrupting": False}
    store.log(job, now, "interruption", reason, "checkpoint requested; will stop and requeue")
    return {"interrupting": True}


def spare(*, store: JobsStore, policy: Policy, job: str, incarnation: int, now: float) -> dict:
    """Give up a preemption (the victim could not checkpoint in time and policy says spare).

    The victim is protected for one more checkpoint wait, so the next cycles do not pick it
    again at once; by then the checkpoint it was asked for has usually been written.
    """
    record = _current(store, job, incarnation)
    if record is None or record.status is not JobState.PREEMPTING:
        return {"spared": False}
    until = now + policy.for_pool(record.pool).checkpoint_wait_max_s
    try:
        store.transition(
            record,
            record.with_changes(status=JobState.RUNNING, preempted_by=None, preempting_since=None, spared_until=until),
            expect=[JobState.PREEMPTING],
        )
    except ConflictError:
        return {"spared": False}
    store.log(
        job, now, "preemption-cancelled", "checkpoint-timeout", f"no fresh checkpoint in time; left running, protected for {until - now:.0f} s"
    )
    return {"spared": True}


def launch(*, store: JobsStore, runners: dict[str, Runner], job: str, incarnation: int, now: float) -> dict:
    """Create the admitted job's run in SageMaker or Batch and mark it running."""
    record = _current(store, job, incarnation)
    if record is None or record.status is not JobState.ADMITTED:
        return {"launched": False, "reason": "not-admitted"}
    try:
        run_id = runners[record.service].launch(record)
    except ServiceRejected as e:
        store.transition(record, record.with_changes(status=JobState.PENDING), [JobState.ADMITTED], usage_delta=-record.gpus)
        store.log(job, now, "launch-failed", "service-rejected", str(e))
        return {"launched": False, "reason": "service-rejected", "error": str(e)}
    new = record.with_changes(
        status=JobState.RUNNING,
        run_id=run_id,
        run_name=record.next_run_name,
        started_at=now,
        first_started_at=record.first_started_at if record.first_started_at is not None else now,
    )
    store.transition(record, new, expect=[JobState.ADMITTED], alias=True)
    if record.incarnation > 1:
        store.log(job, now, "relaunched", "capacity-free", f"{new.run_name} resumes from {record.checkpoint_s3_uri}")
    else:
        store.log(job, now, "launched", "capacity-free", f"{new.run_name} created in {record.service}")
    return {"launched": True, "run_id": run_id, "run_name": new.run_name}


def finish(*, store: JobsStore, policy: Policy, job: str, incarnation: int, outcome: str, reason: str, now: float) -> dict:
    """Record that a run ended for good; free its GPUs once."""
    record = _current(store, job, incarnation)
    if record is None or not record.status.holds_capacity:
        return {"released": False, "pool": None, "reason": "not-holding-capacity"}
    if outcome == "interrupted":
        return _back_to_queue(store, policy, record, False, now, "interrupted", reason)
    state = OUTCOMES[outcome]
    new = record.with_changes(status=state, ended_at=now, outcome_reason=reason, preempting_since=None)
    try:
        store.transition(
            record,
            new,
            expect=[JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTING],
            usage_delta=-record.gpus,
        )
    except ConflictError:
        return {"released": False, "pool": record.pool, "reason": "conflict"}
    _fold_usage(store, policy, record, now)
    store.log(job, now, outcome, reason, f"{record.run_name or record.name} ended: {state.value}")
    return {"released": True, "pool": record.pool}


def _fold_usage(store: JobsStore, policy: Policy, record: JobRecord, now: float) -> None:
    """A run that ended counts towards its team's fair-share usage."""
    if record.started_at is None:
        return
    half_life = policy.for_pool(record.pool).fair_share.half_life_s
    store.add_usage(record.pool, record.team, record.gpus, record.started_at, now, half_life)
