"""Level-triggered safety net: repair what missed events, failed workflows or manual actions
left behind. Runs on a schedule; every repair is logged with its reason."""

from __future__ import annotations

from ..adapters.checkpoints import CheckpointStore
from ..adapters.runners import Runner
from ..adapters.store import JobsStore
from ..adapters.workflows import WorkflowStarter, execution_name
from ..config import Settings
from ..core.errors import ConflictError, ServiceJobNotFound
from ..core.model import JobState
from . import actions
from .scheduling import oldest_wait_by_tier

STUCK_PREEMPTION_S = 3 * 3600
STUCK_ADMISSION_S = 30 * 60  # the launch step retries for minutes, not half an hour


def _refresh_checkpoint(store: JobsStore, checkpoints: CheckpointStore, record) -> None:
    """The safety net for S3 events that did not arrive (bucket not sending them to EventBridge)."""
    newest = checkpoints.newest(record.checkpoint_s3_uri)
    if newest is not None and (record.last_checkpoint_at is None or newest > record.last_checkpoint_at):
        store.note_checkpoint(record.name, newest)


def _check_admission(store: JobsStore, record, now: float) -> dict | None:
    """An admitted job whose launch never happened (its workflow died) goes back to the queue."""
    if record.status is not JobState.ADMITTED or now - (record.admitted_at or now) < STUCK_ADMISSION_S:
        return None
    try:
        store.transition(
            record, record.with_changes(status=JobState.PENDING, admitted_at=None), [JobState.ADMITTED], usage_delta=-record.gpus
        )
    except ConflictError:
        return None
    store.log(record.name, now, "admission-released", "reconcile", "admitted but never launched; back in the queue")
    return {"job": record.name, "repair": "stuck-admission-released"}


def reconcile(
    *,
    store: JobsStore,
    runners: dict[str, Runner],
    workflows: WorkflowStarter,
    checkpoints: CheckpointStore,
    settings: Settings,
    now: float,
) -> dict:
    repairs: list[dict] = []
    oldest: dict[str, float] = {}
    for pool in settings.pools:
        store.ensure_pool(pool.name, pool.capacity_gpus)
        for record in store.active(pool.name):
            repair = _check_run(store, runners, settings, record, now)
            if repair:
                repairs.append(repair)
            elif record.status is JobState.RUNNING and record.checkpoint_s3_uri:
                _refresh_checkpoint(store, checkpoints, record)
        active = store.active(pool.name)
        used = sum(r.gpus for r in active)
        stored = (store.pool(pool.name) or {}).get("used_gpus", 0)
        if stored != used:
            store.set_pool_usage(pool.name, used)
            repairs.append({"pool": pool.name, "repair": "usage", "from": stored, "to": used})
        pending = store.pending(pool.name, settings.pending_window)
        for tier, wait in oldest_wait_by_tier(pending, settings.policy, now).items():
            oldest[tier] = max(oldest.get(tier, 0.0), wait)
        if pending:
            workflows.start("schedule", execution_name("reconcile", pool.name, f"{int(now)}"), {"pool": pool.name})
    return {"repairs": repairs, "oldest_wait_s": oldest}


def _check_run(store: JobsStore, runners: dict[str, Runner], settings: Settings, record, now: float) -> dict | None:
    if not record.run_id:
        return _check_admission(store, record, now)
    try:
        state = runners[record.service].state(record.run_id)
    except ServiceJobNotFound:
        state = None
    if state is not None and not state.ended:
        return None
    if record.status is JobState.PREEMPTING:
        if now - (record.preempting_since or now) < STUCK_PREEMPTION_S:
            return None  # its workflow is still on it
        result = actions.requeue(
            store=store, policy=settings.policy, job=record.name, incarnation=record.incarnation, fresh=False, phase="stopped", now=now
        )
        return {"job": record.name, "repair": "stuck-preemption-requeued", **result}
    outcome = "failed" if state is None else {"stopped": "cancelled"}.get(state.phase, state.phase)
    reason = "reconcile: run not found" if state is None else f"reconcile: missed end event ({state.service_status})"
    result = actions.finish(store=store, policy=settings.policy, job=record.name, incarnation=record.incarnation, outcome=outcome, reason=reason, now=now)
    return {"job": record.name, "repair": "missed-end", **result}
