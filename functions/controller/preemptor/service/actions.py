"""The steps the workflows carry out on one job: checkpoint, stop, requeue, launch, finish,
and a cancel from the job's owner.

Every step is idempotent: it checks the job's stored status and incarnation first, so a
retried or duplicated step does nothing twice (no double launch, no double stop, no
capacity released twice). A step whose conditional write finds the job changed re-reads
it and judges again; retryable AWS errors (throttling, 5xx, transaction conflicts) are
raised for the workflow's Retry.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterable

from ..adapters.alerts import Alerts
from ..adapters.checkpoints import CheckpointStore
from ..adapters.runners import Runner
from ..adapters.store import JobsStore, LogLine
from ..core.errors import (
    AccessDenied, CheckpointLocationUnavailable, ConflictError, PreemptorError, RunNameTaken, ServiceJobNotFound, ServiceRejected,
    TransactionConflict,
)
from ..core.jobs import SPOT_INTERRUPTION, SPOT_TIMES_KEPT, JobRecord
from ..core.model import CallOff, EndedRun, JobState, Notice, PreemptionRule, Reason
from ..core.pools import PoolConfig, describe_offering, quota_limit
from ..core.policy import Policy
from ..core.ranking import ClaimRules
from ..core.victims import still_permits
from ..core.progress import at_risk_since, lost_gpu_seconds, saved_in_run_s
from . import learning  # what the controller learns of each job (issue 10)

logger = logging.getLogger(__name__)

OUTCOMES = {"completed": JobState.COMPLETED, "failed": JobState.FAILED, "cancelled": JobState.CANCELLED}
MAX_LAUNCH_ATTEMPTS = 3  # launches the service refuses before the job is failed
LAUNCH_BACKOFF_S = 60.0  # attempt n waits 60 x 2^(n-1) s, plus up to as much again (jitter)
JUDGE_ATTEMPTS = 3  # re-reads of a job that moved under a step before giving up
GAVE_UP_BACKOFF_STEPS = 4  # the longest backoff after launch steps that gave up: 8 to 16 min
MAX_CAPACITY_RETRIES = 24  # launches that met no capacity before the job is failed
CAPACITY_BACKOFF_S = 60.0  # retry n waits min(300, 60 x 2^(n-1)) s, less up to a half (jitter)
CAPACITY_BACKOFF_MAX_S = 300.0
UNAVAILABLE_OFFERING_S = 10 * 60  # how long an instance type that met no capacity is avoided
# How long a pool is planned at what the account's quota leaves it. Reconcile reads the quota
# from Service Quotas at each pass and notes it again while it is still below the pool, or
# forgets it once raised (`reconcile._reread_quota`); unread for this long, it is forgotten
# (the pool planned at its configuration again; a launch over the quota tells it again).
QUOTA_MEMORY_S = 60 * 60
# A refusal of the launch that means "no capacity now", not "never": waited out, not counted
# as a refusal.
CAPACITY_CODES = frozenset({"ResourceLimitExceeded", "InsufficientCapacity", "CapacityError"})


def _current(store: JobsStore, name: str, incarnation: int | None) -> JobRecord | None:
    record = store.require(name)
    if incarnation is not None and record.incarnation != incarnation:
        return None
    return record


def _newest_in_s3(store: JobsStore, checkpoints: CheckpointStore, record: JobRecord, now: float) -> float | None:
    """The newest checkpoint S3 holds for the job, noted on its record when the table had
    not seen it, and as honouring a request made before it. A location that cannot be read is logged, so
    `explain` shows why, and `CheckpointLocationUnavailable` raised."""
    try:
        newest = checkpoints.newest(record.checkpoint_s3_uri)
    except CheckpointLocationUnavailable as e:
        store.log(record.name, now, "checkpoint-unavailable", e.code or "checkpoint-location", str(e))
        raise
    if newest is not None and newest > (record.last_checkpoint_at or 0.0):
        store.note_checkpoint(record.name, newest)
    learning.checkpoint_seen(store, record, newest)  # issue 10: whichever told the table first
    return newest


def note_newest_checkpoint(*, store: JobsStore, checkpoints: CheckpointStore, job: str, now: float) -> dict:
    """Note the newest checkpoint S3 holds for `job`, read from S3 itself: after a stop, the
    requeue judges from the table whether the job saved during the grace (and what the stop
    lost), and the S3 event of a checkpoint written late in the grace may not be there yet.
    A location that cannot be read changes nothing: the requeue goes on with the table."""
    record = store.require(job)
    try:
        newest = _newest_in_s3(store, checkpoints, record, now)
    except CheckpointLocationUnavailable as e:
        return {"last_checkpoint_at": record.last_checkpoint_at, "error": e.code}
    return {"last_checkpoint_at": max(newest or 0.0, record.last_checkpoint_at or 0.0) or None}


def check_checkpoint(
    *,
    store: JobsStore,
    checkpoints: CheckpointStore,
    policy: Policy,
    job: str,
    now: float,
    newer_than: float | None = None,
    since: float | None = None,
) -> dict:
    """Is the newest checkpoint of `job` younger than the policy's limit? With `newer_than`
    (a spot interruption: the instance goes away anyway), only a checkpoint written after
    that time counts. With `since` (the preemption checked for): a job no longer in it
    answers `released` (its preemption was called off or given up: its workflow waits no
    more, stops nothing and plans the pool)."""
    record = store.require(job)
    if _other_preemption(record, since):
        return {"fresh": False, "age_s": None, "last_checkpoint_at": None, "released": True}
    max_age_s = policy.for_pool(record.pool).checkpoint_max_age_s
    at_once = newer_than is None and record.stop_at_once  # the plan said not to wait (issue 10)
    try:
        newest = _newest_in_s3(store, checkpoints, record, now)
    except CheckpointLocationUnavailable as e:
        # No checkpoint can be confirmed: the policy's timeout decides, as for a job that
        # never checkpoints.
        if at_once:
            return learning.at_once_check(store, record, now, max_age_s)
        return {"fresh": False, "age_s": None, "last_checkpoint_at": None, "error": e.code}
    if at_once:
        # Stopped without a wait; its freshness, for the accounting, is what S3 holds now
        # (an S3 event may not have told the table yet).
        newest = max(newest or 0.0, record.last_checkpoint_at or 0.0) or None
        return learning.at_once_check(store, record.with_changes(last_checkpoint_at=newest), now, max_age_s)
    age = None if newest is None else max(0.0, now - newest)
    if newer_than is not None:
        fresh = newest is not None and newest > newer_than
    else:
        # The one rule (core.progress): a relaunched run resumed from that checkpoint, so
        # only the work since the later of it and the run's start is at risk (none while
        # managed spot holds the run interrupted).
        fresh = record.checkpoint_fresh(newest, now, max_age_s)
    if fresh and record.status is JobState.PREEMPTING:  # (released meanwhile: no stop to confirm it for)
        if newer_than is None and record.spot_paused:
            detail = "nothing at risk: managed spot holds its run interrupted (no instances, no work since)"
        else:
            detail = f"newest checkpoint is {age:.0f} s old"
        store.log(job, now, "checkpoint-confirmed", "fresh-checkpoint", detail, checkpoint_age_s=age)
    return {"fresh": fresh, "age_s": age, "last_checkpoint_at": newest}


def request_checkpoint(
    *, store: JobsStore, checkpoints: CheckpointStore, job: str, reason: str, now: float, execution: str | None = None
) -> dict:
    """Write the job's checkpoint-request marker (its training helper answers it).

    `execution` is the workflow's execution, kept on the job (`checkpoint_request_by`)
    before the marker is written: a step retried after its first attempt recorded the
    request (the Lambda died before it answered, before or after writing the marker)
    answers with that request, and writes its marker again with the same time, so the
    marker exists and the helper, which answers a request once per `requested_at`, saves
    once. Its log line is keyed by the execution: written once however often the step is
    retried. The order is record, marker, line: a step that dies anywhere is repaired by its
    retry. A marker the location refuses, or whose write fails (throttled, unavailable),
    gives the record back its earlier request: the job was not known to be asked, so it
    cannot be found to have ignored the request, and a retry asks anew.
    """
    record = store.require(job)
    again = execution is not None and record.checkpoint_request_by == execution and record.checkpoint_requested_at is not None
    at = record.checkpoint_requested_at if again else now
    if not again:
        learning.checkpoint_requested(store, job, now, by=execution)  # issue 10
    try:
        marker = checkpoints.request(record.checkpoint_s3_uri, at, reason)
    except CheckpointLocationUnavailable as e:
        if not again:
            learning.checkpoint_request_undone(store, record)
        store.log(job, now, "checkpoint-unavailable", e.code or "checkpoint-location", f"cannot ask for a checkpoint: {e}")
        return {"requested_at": now, "marker": None, "error": e.code}
    except Exception:
        # Throttled, unavailable, a timeout: the workflow retries the step, or gives up.
        # Either way the job was not known to be asked: a retry asks anew.
        if not again:
            learning.checkpoint_request_undone(store, record)
        raise
    _log_request(store, job, at, reason, marker, execution)
    if again:
        return {"requested_at": at, "marker": marker, "again": True}
    return {"requested_at": at, "marker": marker}


def _log_request(store: JobsStore, job: str, at: float, reason: str, marker: str, execution: str | None) -> None:
    once = None if execution is None else f"checkpoint-request#{execution}"
    store.log(job, at, "checkpoint-requested", reason, f"marker written at {marker}", once=once)


def _stop_recorded(record: JobRecord) -> bool:
    """A stop is recorded for the job's current preemption (`JobsStore.claim_stop`)."""
    return record.stop_signal_at is not None and record.stop_signal_at >= (record.preempting_since or 0.0)


def _other_preemption(record: JobRecord | None, since: float | None) -> bool:
    """The job, running or being preempted, is not in the preemption marked at `since` (the
    step's own, handed on by the plan step): that one was called off (`ops.set_priority`) or
    given up (`spare`), and the job was perhaps chosen again since by another, whose own
    workflow acts on it. None: the step names no preemption."""
    return (
        since is not None
        and record is not None
        and record.status in (JobState.RUNNING, JobState.PREEMPTING)
        and record.preempting_since != since
    )


def releasable(record: JobRecord) -> bool:
    """A victim whose preemption may still be called off: being preempted (not stopped for a
    spot interruption, whose instance goes away anyway, nor for a cancel), and no stop sent
    for this preemption yet (`JobsStore.claim_stop` records it before it is sent)."""
    return (
        record.status is JobState.PREEMPTING
        and record.preempted_by not in (None, SPOT_INTERRUPTION)
        and not record.cancel_requested
        and not _stop_recorded(record)
    )


def outranked_preemptions(
    *, store: JobsStore, policy: Policy, preemptor: JobRecord, why: str, now: float, alerts: Alerts | None = None
) -> list[str]:
    """Call off each preemption made for `preemptor`, a pending job whose priority was just
    lowered (`why`: by whom, to what), that its new priority no longer permits and whose
    victim was sent no stop yet; returns the victims left running.

    Each victim is judged by the rule that chose it (its `preemption-started` line) at the
    priorities both claim now (`ClaimRules.claim`, `victims.still_permits`): a lower-priority
    or newer-equal victim by the pool's preemption mode, borrowed work by `reclaim_within_pool`.
    Without this, a victim at or above the lowered job's priority was still stopped for it,
    its work since the checkpoint and its restart lost, and it was ranked back ahead of its
    preemptor at once. A victim called off goes back to RUNNING, leaves the preemption
    budget and is not protected (the next cycle may choose it for a job that outranks it);
    its workflow's next step finds it released (`_other_preemption`). Written conditional on
    the victim as read: a stop claimed meanwhile goes on."""
    if preemptor.status is not JobState.PENDING:
        return []
    knobs = policy.for_pool(preemptor.pool)
    rules = ClaimRules.of(knobs, policy)
    claimed, _ = rules.claim(preemptor.priority, preemptor.sla_s, preemptor.spot)
    spared = []
    for victim in store.active(preemptor.pool):
        if victim.preempted_by != preemptor.name or not releasable(victim):
            continue
        rule = _preemption_rule(store, victim)
        pv, _ = rules.claim(victim.priority, victim.sla_s, victim.spot)
        same_team = victim.team == preemptor.team
        if still_permits(rule, knobs, same_team, claimed, preemptor.submitted_at, pv, victim.as_running().started_at, victim.submitted_at):
            continue
        what = (
            f"its preemptor {preemptor.name} was lowered to {preemptor.priority} ({why}): "
            f"the rule that chose it ({rule.value if rule else 'unknown'}) no longer lets it stop a job at {victim.priority}; left running"
        )
        told = f"{victim.name} is no longer stopped for it (priority {victim.priority}; it was lowered to {preemptor.priority})"
        if _call_off(store, alerts, victim, preemptor.name, "preemptor-lowered", what, told, now):
            spared.append(victim.name)
    return spared


def cancelled_preemptions(*, store: JobsStore, preemptor: JobRecord, now: float, alerts: Alerts | None = None) -> list[str]:
    """Call off every preemption made for `preemptor`, a pending job just cancelled, whose
    victim was sent no stop yet; returns the victims left running. Without this, its victims
    were still stopped for a job that no longer waits: their work since the checkpoint and
    their restart lost, and the GPUs freed went to whoever ranked first, often the victims
    themselves, relaunched. Idempotent: a cancel handled again finishes it."""
    if preemptor.status is not JobState.CANCELLED:
        return []
    return _call_off_all(
        store, alerts, preemptor.pool, lambda v: v.preempted_by == preemptor.name, "preemptor-cancelled",
        lambda v: (f"its preemptor {preemptor.name} was cancelled; left running", f"{v.name} is not stopped for it (it was cancelled)"),
        now,
    )


def drained_preemptions(*, store: JobsStore, pool: str, now: float, alerts: Alerts | None = None) -> list[str]:
    """Call off every preemption in `pool`, just drained, whose victim was sent no stop yet;
    returns the victims left running. A drained pool preempts nothing and admits nothing:
    a victim stopped after the drain would wait in its queue, its work since the checkpoint
    and its restart lost, and its preemptor not admitted either. Its preemptor plans again
    once the pool is undrained."""
    return _call_off_all(
        store, alerts, pool, lambda v: True, "pool-drained",
        lambda v: (
            f"pool {pool} was drained before its stop for {v.preempted_by}; left running",
            f"{v.name} is not stopped for it (pool {pool} was drained)",
        ),
        now,
    )


def unneeded_preemptions(
    *, store: JobsStore, call_offs: Iterable[CallOff], by_name: dict[str, JobRecord], now: float, alerts: Alerts | None = None
) -> list[str]:
    """Call off the preemptions a plan found no longer needed (`Decision.call_offs`): the
    victim's stop is not sent yet (it waits for a checkpoint, or is about to go), and no job
    that may preempt it waits for its GPUs any more (its preemptor was admitted into GPUs a
    run's end freed meanwhile). Before this, the stop went on: the victim lost its restart
    (and its work since the checkpoint, without one) and was relaunched into its own GPUs.
    Only a victim as the plan read it (`by_name`) whose stop is not sent: a stop claimed
    since goes on. Returns the victims left running."""
    spared = []
    for c in call_offs:
        victim = by_name.get(c.job)
        if victim is None or not releasable(victim):
            continue
        told = f"{victim.name} is not stopped for it: it no longer needs its GPUs"
        if _call_off(store, alerts, victim, victim.preempted_by, Reason.PREEMPTION_NO_LONGER_NEEDED.value, f"{c.detail}; left running", told, now):
            spared.append(victim.name)
    return spared


def _call_off_all(
    store: JobsStore,
    alerts: Alerts | None,
    pool: str,
    chosen: Callable[[JobRecord], bool],
    reason: str,
    texts: Callable[[JobRecord], tuple[str, str]],
    now: float,
) -> list[str]:
    """`_call_off` every victim of `pool` whose stop was not sent yet and that `chosen` picks,
    with the lines `texts` gives it (the victim's, its preemptor's); the victims left running."""
    spared = []
    for victim in store.active(pool):
        if releasable(victim) and chosen(victim):
            what, told = texts(victim)
            if _call_off(store, alerts, victim, victim.preempted_by, reason, what, told, now):
                spared.append(victim.name)
    return spared


def _call_off(
    store: JobsStore, alerts: Alerts | None, victim: JobRecord, preemptor: str, reason: str, what: str, told: str, now: float
) -> bool:
    """`victim`'s preemption for `preemptor` ends without a stop: back to RUNNING, out of the
    preemption budget, unprotected, with a line on both logs and a notice to the victim's
    team, which was told the preemption was planned (`preemption-called-off`: published
    with `alerts` at once, else by reconcile); conditional on the victim as read (False: it
    changed meanwhile, its stop claimed or its run ended: left to its workflow, whose next
    step finds it released otherwise, `_other_preemption`)."""
    lines = (
        LogLine(victim.name, now, "preemption-cancelled", reason, what, {"preemptor": preemptor}),
        LogLine(preemptor, now, "victim-spared", reason, f"{told}; the pool is planned again", {"victim": victim.name}),
    )
    notice = Notice(
        victim.pool, now, "preemption-called-off", victim.name, victim.team,
        f"Preemptor: job {victim.name} will not be stopped for {preemptor}",
        {"pool": victim.pool, "preemptor": preemptor, "reason": reason, "detail": what},
    )
    try:
        store.transition(
            victim,
            victim.left_running(),
            expect=[JobState.PREEMPTING],
            log=lines,
            called_off=True,  # it stopped nothing: out of the preemption budget
            notice=notice,
        )
    except ConflictError:
        return False
    announce(store, alerts, notice)  # refused, or no alerts at hand: reconcile publishes it
    return True


def _preemption_rule(store: JobsStore, victim: JobRecord) -> PreemptionRule | None:
    """The rule its current preemption chose it under (its `preemption-started` line, written
    with its mark), None when the line is not found or names no rule this version knows."""
    for entry in reversed(store.history(victim.name)):
        if entry["kind"] == "preemption-started" and abs(float(entry["at"]) - (victim.preempting_since or 0.0)) < 1e-3:
            rule = entry.get("extra", {}).get("rule")
            return PreemptionRule(rule) if rule in PreemptionRule._value2member_map_ else None
    return None


def stop(
    *,
    store: JobsStore,
    runners: dict[str, Runner],
    job: str,
    incarnation: int,
    fresh: bool,
    now: float,
    since: float | None = None,
    policy: Policy | None = None,
) -> dict:
    """Stop the run of a job being preempted (or cancelled). Stopping twice is harmless.
    `since`: the preemption the step stops for (its mark's time); a job no longer in it is
    not stopped (`_other_preemption`). `fresh`: the workflow found its checkpoint fresh;
    judged again at the stop against the pool's `checkpoint_max_age_s` (`policy`), as a
    step retried under throttling may come minutes after the check. Returns whether it
    stopped, and with a fresh checkpoint."""
    record = _current(store, job, incarnation)
    if _other_preemption(record, since) or (record is not None and record.status is JobState.RUNNING and not record.preempted_by):
        # Released while it waited for its checkpoint (the operator raised its priority:
        # `ops.set_priority`): no stop is sent; the pool is planned again.
        return {"stopping": False, "reason": "released"}
    if record is None or record.status is not JobState.PREEMPTING or not record.run_id:
        return {"stopping": False, "reason": "not-running"}
    # The stop is recorded before it is sent (`claim_stop`): a release decided on the job as
    # read before cannot land once the stop is on its way. A retried step (the first
    # attempt's Lambda died after the claim) finds this preemption's claim and sends again,
    # harmlessly; the signal's time, which decides whether a checkpoint came during the
    # grace, stays the first.
    max_age_s = policy.for_pool(record.pool).checkpoint_max_age_s if policy is not None else None

    def aged(victim: JobRecord, at: float) -> bool:
        """Fresh when the workflow checked, no longer when the stop goes at `at` (its step
        came late: throttled, retried): told as it is, and counted as a stop without a
        fresh checkpoint."""
        return fresh and max_age_s is not None and not victim.checkpoint_fresh(victim.last_checkpoint_at, at, max_age_s)

    if _stop_recorded(record):
        signal_at = record.stop_signal_at
    elif store.claim_stop(record, now, fresh=fresh and not aged(record, now)):
        signal_at = now
    else:
        current = _current(store, job, incarnation)
        if current is not None and current.status in (JobState.RUNNING, JobState.PREEMPTING) and current.preempting_since != record.preempting_since:
            # Released, and perhaps chosen again since by another preemption, whose own
            # workflow stops it: this one is over.
            return {"stopping": False, "reason": "released"}
        if current is None or current.status is not JobState.PREEMPTING or not _stop_recorded(current):
            return {"stopping": False, "reason": "not-running"}
        record, signal_at = current, current.stop_signal_at  # an earlier attempt's claim
    if signal_at != now and record.stop_fresh is not None:
        # The stop went out before (a step retried, a workflow restarted): its checkpoint is
        # what it was then. A check made since finds the one written during the grace,
        # which kept nothing of the work at risk when the signal went (before, it made the
        # stop "fresh-checkpoint" though a stop at once had thrown that work away).
        fresh, too_old = record.stop_fresh, False
    else:
        too_old = aged(record, signal_at)
    why = f"preempted by {record.preempted_by}" if record.preempted_by else "cancelled"
    try:
        runners[record.service].stop(record.run_id, f"preemptor: {why}")
    except ServiceJobNotFound:
        return {"stopping": False, "reason": "run-not-found"}
    except AccessDenied as e:
        # The controller may not stop this run (IAM: only runs tagged preemptor:managed).
        # Raised for the workflow to give up loudly; reconcile repairs the preemption.
        store.log(job, now, "stop-refused", "access-denied", str(e))
        raise
    # A stop at once (the plan said not to wait) is told as one, never as a checkpoint that
    # aged since a check: its check answers "fresh" for a victim trusted to save on SIGTERM
    # (the checkpoint comes with the stop), which is counted, as any, by the checkpoint it
    # had when the signal went.
    trusted = record.stop_at_once and record.saved_on_stop and record.declares_save_on_stop
    if too_old:
        fresh = False
        if not record.stop_at_once:
            why += f"; its checkpoint, fresh when checked, is over checkpoint_max_age_s {max_age_s:g} at the stop"
    lost = "it is trusted to save on SIGTERM within the grace" if trusted else "work since the last one is lost"
    detail = why + ("" if fresh else f"; WITHOUT a fresh checkpoint: {lost}")
    saved_from = at_risk_since(record.last_checkpoint_at, record.work_started_at)
    if fresh and not record.spot_paused and saved_from is not None and signal_at - saved_from >= 1 and max_age_s is not None:
        # Fresh is the policy's bound: what the run did since its checkpoint is still at risk
        # (an escalated preemptor's stop does not wait for a newer one), said with its age.
        kept = lost if trusted else "the work since it is lost unless the run saves on SIGTERM"
        at_risk = signal_at - saved_from
        age = f"its checkpoint is {at_risk:.0f} s old" if saved_from == record.last_checkpoint_at else f"no checkpoint yet, {at_risk:.0f} s into its run"
        detail += f"; {age} (fresh: within checkpoint_max_age_s {max_age_s:g}): {kept}"
    # Why it goes now: its checkpoint is fresh (or aged past the bound since it was checked);
    # the plan said not to wait (issue 10); or the wait ran out.
    if fresh:
        reason = "fresh-checkpoint"
    elif record.stop_at_once:
        reason = "stop-at-once"
    else:
        reason = "checkpoint-aged" if too_old else "checkpoint-timeout"
    # Once per preemption however often the step is retried (keyed by the claim's time).
    store.log(job, signal_at, "stop-requested", reason, detail, once=f"stop#{record.incarnation}#{signal_at:.3f}")
    learning.stop_sent(store, record, fresh, signal_at)  # issue 10
    return {"stopping": True, "fresh": fresh}


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


def requeue(
    *, store: JobsStore, policy: Policy, job: str, incarnation: int, fresh: bool, phase: str, now: float, alerts: Alerts | None = None
) -> dict:
    """Put a stopped victim back in the queue under its next incarnation; free its GPUs.

    A victim that completed on its own while being stopped is recorded as completed.
    `fresh`: the workflow's check found its checkpoint fresh; a stop recorded with its own
    verdict (`stop`: judged as it went) is counted by that one instead.
    """
    record = _current(store, job, incarnation)
    if record is None or record.status is not JobState.PREEMPTING:
        pool = store.require(job).pool
        return {"requeued": False, "reason": "not-preempting", "pool": pool}
    if _stop_recorded(record) and record.stop_fresh is not None:
        fresh = record.stop_fresh
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
    if record.cancel_requested:
        # Cancelled while being preempted: the stop was the end, never a relaunch.
        return finish(
            store=store, policy=policy, job=job, incarnation=incarnation, outcome="cancelled", reason="cancelled", now=now
        )
    if record.preempted_by == SPOT_INTERRUPTION:
        return _back_to_queue(store, policy, record, fresh, now, "interrupted", "stopped before its spot instance goes away", alerts)
    return _back_to_queue(store, policy, record, fresh, now, "preempted", f"stopped for {record.preempted_by}", alerts)


def _since_checkpoint(record: JobRecord) -> str:
    """What the GPU-seconds a requeue counts lost are: the run's GPU time since the checkpoint
    it resumes from (or since its start). Told against the stop signal: a checkpoint written
    after it kept the work done until the stop, one before it did not."""
    signal, saved = record.stop_signal_at, record.last_checkpoint_at
    if record.spot_paused:
        return " (managed spot had taken its instances: nothing ran since, and the work lost then was counted then)"
    if saved is None or (record.started_at is not None and saved < record.started_at):
        return " (no checkpoint in this run: its work is redone)"
    if signal is None:
        return " (since the checkpoint it resumes from)"
    if saved > signal:
        return f" (since its checkpoint, written {saved - signal:.0f} s after the stop signal: the work until the stop is kept)"
    return f" (since its checkpoint, {signal - saved:.0f} s before the stop signal: that work is redone)"


def _back_to_queue(
    store: JobsStore, policy: Policy, record: JobRecord, fresh: bool, now: float, reason: str, why: str, alerts: Alerts | None = None
) -> dict:
    started = record.started_at or now
    # A run managed spot held interrupted ran nothing since: its loss was counted then.
    lost = 0.0 if record.spot_paused else lost_gpu_seconds(record.gpus, record.last_checkpoint_at, record.work_started_at or now, now)
    saved = saved_in_run_s(record.last_checkpoint_at, started)
    if record.adopted:
        return _end_adopted(store, policy, record, fresh, now, reason, why, lost, saved, alerts)
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
        **learning.after_stop(record),  # issue 10: a checkpoint during the grace?
    )
    line = LogLine(
        record.name, now, "requeued", reason,
        f"{why}; {lost:.0f} GPU-seconds lost{_since_checkpoint(record)}; resumes from its checkpoint as {new.next_run_name}",
        {"preemptor": record.preempted_by, "lost_gpu_seconds": lost, "fresh_checkpoint": fresh},
    )
    notice = Notice(
        record.pool, now, "preempted", record.name, record.team, f"Preemptor: job {record.name} was {reason}",
        {
            "why": why, "by": record.preempted_by, "pool": record.pool, "lost_gpu_seconds": round(lost, 1),
            "fresh_checkpoint": fresh, "resumes_as": new.next_run_name,
        },
    )
    moved = _release_stopped(store, policy, record, new, fresh, now, alerts, line, notice)
    if moved is not None:
        return moved
    announce(store, alerts, notice)
    return {"requeued": True, "pool": record.pool, "lost_gpu_seconds": lost, "fresh": fresh, "released": True}


def _release_stopped(
    store: JobsStore, policy: Policy, record: JobRecord, new: JobRecord, fresh: bool, now: float, alerts: Alerts | None,
    log: LogLine, notice: Notice,
) -> dict | None:
    """Write a stopped victim's next state (with `log`, its line, and `notice`, its team's
    notice), free its GPUs and record its run's end for its team's usage; None when done.
    If it moved meanwhile (a cancel request, an end event), it is judged again on the fresh
    item and that answer returned."""
    try:
        store.transition(
            record, new, expect=[record.status], usage_delta=-record.gpus, log=log, ended_run=_ended_run(record, now), notice=notice
        )
    except ConflictError:
        current = store.get(record.name)
        if current is not None and current.status is JobState.PREEMPTING and current.incarnation == record.incarnation:
            return requeue(
                store=store, policy=policy, job=record.name, incarnation=record.incarnation, fresh=fresh, phase="stopped", now=now,
                alerts=alerts,
            )
        return {"requeued": False, "reason": "conflict", "pool": record.pool}
    return None


def _end_adopted(
    store: JobsStore, policy: Policy, record: JobRecord, fresh: bool, now: float, reason: str, why: str, lost: float, saved: float,
    alerts: Alerts | None,
) -> dict:
    """A stopped run the controller adopted ends here: it was launched outside the
    controller, which holds no request to create it again (a relaunch of nothing would be
    refused by the service, again and again, holding the pool's GPUs). Its team relaunches
    it, from its checkpoint, and is told so; the stop is accounted as any other."""
    end = f"{why}; launched outside the controller, it is not relaunched by it: its team relaunches it"
    new = record.with_changes(
        status=JobState.CANCELLED,
        ended_at=now,
        outcome_reason=f"{reason}-not-relaunched: {end}",
        work_done_s=record.work_done_s + saved,
        preemptions=record.preemptions + 1,
        lost_gpu_seconds=record.lost_gpu_seconds + lost,
        stops_without_fresh_checkpoint=record.stops_without_fresh_checkpoint + (0 if fresh else 1),
        preempting_since=None,
    )
    line = LogLine(
        record.name, now, f"{reason}-not-relaunched", reason, f"{end}; {lost:.0f} GPU-seconds lost{_since_checkpoint(record)}",
        {"preemptor": record.preempted_by, "lost_gpu_seconds": lost, "fresh_checkpoint": fresh},
    )
    notice = Notice(
        record.pool, now, "preempted", record.name, record.team, f"Preemptor: job {record.name} was {reason}; relaunch it",
        {
            "why": end, "by": record.preempted_by, "pool": record.pool, "lost_gpu_seconds": round(lost, 1),
            "fresh_checkpoint": fresh, "resumes_as": None, "checkpoint": record.checkpoint_s3_uri or None,
        },
    )
    moved = _release_stopped(store, policy, record, new, fresh, now, alerts, line, notice)
    if moved is not None:
        return moved
    announce(store, alerts, notice)
    return {"requeued": False, "reason": "adopted-not-relaunched", "pool": record.pool, "lost_gpu_seconds": lost, "fresh": fresh, "released": True}


def interrupt(*, store: JobsStore, job: str, incarnation: int, reason: str, now: float, execution: str | None = None) -> dict:
    """Mark a running job as going away (spot interruption), so it is stopped and requeued once.

    `execution` is the spot workflow's execution, kept on the job (`decided_by`): when the
    step is retried after its mark was written (the Lambda died before it answered), the
    same execution is told it took the job and goes on to stop it. Any other execution
    (another instance's notice of the same run) is told the job is handled already.
    """
    record = _current(store, job, incarnation)
    if record is None:
        return {"interrupting": False}
    if execution is not None and record.status is JobState.PREEMPTING and record.decided_by == execution:
        # Its log line, if the first attempt died between the mark and the line (once: keyed by the execution)
        _log_interruption(store, job, record.preempting_since if record.preempting_since is not None else now, reason, execution)
        return {"interrupting": True, "again": True}
    if record.status is not JobState.RUNNING:
        return {"interrupting": False}
    try:
        store.transition(
            record,
            record.with_changes(status=JobState.PREEMPTING, preempted_by=reason, preempting_since=now, decided_by=execution),
            expect=[JobState.RUNNING],
        )
    except ConflictError:
        return {"interrupting": False}
    _log_interruption(store, job, now, reason, execution)
    return {"interrupting": True}


def _log_interruption(store: JobsStore, job: str, at: float, reason: str, execution: str | None) -> None:
    once = None if execution is None else f"interruption#{execution}"
    store.log(job, at, "interruption", reason, "checkpoint requested; will stop and requeue", once=once)


def managed_spot(*, store: JobsStore, record: JobRecord, interrupted: bool, at: float, now: float, told_by: str = "") -> tuple[str, str]:
    """SageMaker managed spot took the current run's instances away (`interrupted`) or is
    bringing the run back from its checkpoint, at `at`. The service restarts the run
    itself; the controller accounts for it, once however often it is told (an event and its
    redeliveries, reconcile's reading of the training job: `JobRecord.spot_interruption_counted`,
    `spot_restart_seen`), as of when it happened:
    - the interruption: the work it lost (GPUs x time since the latest of the last
      checkpoint, the run's start and an earlier restart, as they stood then), added to
      the job's lost work with its line; the run is held paused (`spot_paused`): nothing
      runs, so nothing is at risk, and a stop of it needs no checkpoint (none could be
      written);
    - the restart: from then on only the work since the later of the checkpoint and the
      restart is at risk (`work_started_at`).
    They may be told in either order: an interruption older than a restart already seen is
    counted, and pauses nothing. `told_by` ends the line's detail (" (reconcile: ...)").

    Returns (outcome, detail): "accepted", "duplicate" or "ignored" (the job left the run)."""
    # Within the run's life, as it is of the current run: no later than its handling (a time
    # ahead of the clock, skew or a malformed event, would hold the run restarted in the
    # future, nothing at risk until then), no earlier than the run's start (a time before it
    # would count, as this run's loss, work since a checkpoint of an earlier run).
    at = min(max(at, record.started_at if record.started_at is not None else at), now)
    incarnation = record.incarnation
    for _ in range(JUDGE_ATTEMPTS):
        if not interrupted:
            if record.spot_restart_seen(at):
                return "duplicate", f"managed-spot restart of {record.run_name} already seen"
            line = LogLine(record.name, at, "spot-restarting", "managed-spot", f"{record.run_name} restarts from its checkpoint{told_by}")
            new = record.with_changes(spot_resumed_at=max(at, record.spot_resumed_at or at))
        else:
            if record.spot_interruption_counted(at):
                return "duplicate", f"managed-spot interruption of {record.run_name} already counted"
            # Its work at risk when the instances went: since the latest of the checkpoint,
            # the run's start and an earlier restart, as they stood then (a restart or a
            # checkpoint told before it, but after it, are not).
            known = [t for t in (record.last_checkpoint_at, record.started_at, record.spot_resumed_at) if t is not None and t <= at]
            lost = record.gpus * (at - max(known)) if known else 0.0
            line = LogLine(
                record.name, at, "spot-interrupted", "managed-spot",
                f"{record.run_name} lost its spot instances; SageMaker restarts it from its checkpoint "
                f"(~{lost:.0f} GPU-seconds lost){told_by}",
                {"lost_gpu_seconds": lost},
            )
            resumed_after = record.spot_resumed_at is not None and record.spot_resumed_at >= at
            new = record.with_changes(
                lost_gpu_seconds=record.lost_gpu_seconds + lost,
                spot_interruptions=sorted([*record.spot_interruptions, at])[-SPOT_TIMES_KEPT:],
                spot_interrupted_at=record.spot_interrupted_at if resumed_after else max(at, record.spot_interrupted_at or at),
            )
        try:
            store.transition(record, new, [record.status], log=line)
            return "accepted", f"managed-spot {'interruption' if interrupted else 'restart'} of {record.run_name}"
        except ConflictError:
            record = store.get(record.name)
            if record is None or record.incarnation != incarnation or record.status.is_terminal:
                return "ignored", "stale: a managed-spot change of a run its job has left"
    raise TransactionConflict(f"job {record.name} kept changing while a managed-spot change was counted")


def spare(
    *, store: JobsStore, policy: Policy, job: str, incarnation: int, now: float, why: str = "checkpoint-timeout", since: float | None = None
) -> dict:
    """Give up a preemption: the victim could not checkpoint in time and the policy says
    spare (`checkpoint-timeout`), or its stop was refused (`stop-refused`: IAM lets the
    controller stop only the runs it launched, and a denial is not retried).

    The victim goes back to RUNNING, protected for one more checkpoint wait, so the next
    cycles do not pick it again at once (by then the checkpoint it was asked for has
    usually been written); its preemptor is planned again and may choose another victim.
    `since`: the preemption given up (its mark's time); a job in another is left alone.
    """
    record = _current(store, job, incarnation)
    if record is None or record.status is not JobState.PREEMPTING or _other_preemption(record, since):
        return {"spared": False}
    until = now + policy.for_pool(record.pool).checkpoint_wait_max_s
    what = "no fresh checkpoint in time" if why == "checkpoint-timeout" else "its stop was refused"
    lines = [LogLine(job, now, "preemption-cancelled", why, f"{what}; left running, protected for {until - now:.0f} s")]
    if record.preempted_by and record.preempted_by != SPOT_INTERRUPTION:
        lines.append(
            LogLine(record.preempted_by, now, "victim-spared", why, f"{record.name} was not stopped ({what}); the pool is planned again")
        )
    try:
        store.transition(
            record,
            # The stop it may have been claimed (a refused one) belongs to this preemption,
            # which is over: a later one starts with no signal recorded.
            record.left_running(spared_until=until),
            expect=[JobState.PREEMPTING],
            log=tuple(lines),
            called_off=True,  # it stopped nothing: out of the preemption budget
        )
    except ConflictError:
        return {"spared": False}
    return {"spared": True, "why": why}


def launch(
    *,
    store: JobsStore,
    runners: dict[str, Runner],
    job: str,
    incarnation: int,
    now: float,
    alerts: Alerts | None = None,
    offerings: dict[str, tuple[str, ...]] | None = None,
    pools: dict[str, PoolConfig] | None = None,
) -> dict:
    """Create the admitted job's run in SageMaker or Batch and mark it running.

    `pools`: the configured pools by name, for what a quota refusal tells of the pool
    (`_learn_quota`).

    A launch the service refuses for good (validation, quota, a name taken by another run)
    is counted on the job (`launch_attempts`): the job goes back to the queue until
    `not_before` (exponential backoff with jitter), and after MAX_LAUNCH_ATTEMPTS it is
    failed with the reason and an alert. Throttling and 5xx are raised for the workflow's
    Retry: they are not refusals. A job cancelled while admitted is not launched, and a run
    created just before the cancel landed is stopped.
    """
    record = _current(store, job, incarnation)
    if record is None or record.status is not JobState.ADMITTED:
        return {"launched": False, "reason": "not-admitted"}
    if record.cancel_requested:
        return _cancel_admitted(store, record, now)
    pool_offerings = (offerings or {}).get(record.pool, ())
    instance_type = _offering(store, record, pool_offerings, now)
    try:
        run_id = runners[record.service].launch(record, instance_type, pool_offerings)
    except ServiceRejected as e:
        return _launch_refused(store, alerts, record, e, now, instance_type, (pools or {}).get(record.pool))
    new = running_on(record, run_id, now, instance_type)
    for _ in range(JUDGE_ATTEMPTS):
        notice = _relaunch_notice(record, new, instance_type, now)
        try:
            store.transition(
                record, new, expect=[JobState.ADMITTED], alias=True, log=_launch_line(record, new, instance_type, now), notice=notice
            )
            break
        except ConflictError:
            current = store.get(job)
            if current is not None and current.incarnation == incarnation and current.run_id == run_id and current.status is not JobState.ADMITTED:
                # Another invocation of this step (a Retry while the first still ran) created
                # the same run, found it its own (the name is the run's identity), and
                # recorded it first: it is the job's run, not one nobody accounts for.
                return {"launched": True, "run_id": run_id, "run_name": current.run_name, "pool": record.pool, "relaunch": record.incarnation > 1, "recorded": "already"}
            if current is None or current.status is not JobState.ADMITTED or current.incarnation != incarnation:
                # Released or cancelled while the run was being created: nobody accounts
                # for that run, so it must not keep running.
                runners[record.service].stop(run_id, "preemptor: cancelled before it started")
                store.log(job, now, "launch-withdrawn", "job-moved", f"{record.next_run_name} stopped: the job is no longer admitted")
                return {"launched": False, "reason": "job-moved", "run_id": run_id}
            record, new = current, current.with_changes(**{k: getattr(new, k) for k in _LAUNCH_FIELDS})
    else:
        raise ConflictError(f"job {job} kept changing while its launch was recorded")
    if record.cancel_requested:
        runners[record.service].stop(run_id, "preemptor: cancelled")
        store.log(job, now, "cancel-requested", "job-cancelled", f"{new.run_name} was created as the cancel arrived; stopping it")
        return {"launched": True, "run_id": run_id, "run_name": new.run_name, "stopping": True}
    announce(store, alerts, notice)
    return {"launched": True, "run_id": run_id, "run_name": new.run_name, "pool": record.pool, "relaunch": record.incarnation > 1}


def _relaunch_notice(record: JobRecord, new: JobRecord, instance_type: str | None, now: float) -> Notice | None:
    """The team's notice of a launch that resumes a run it had before (none for a first one,
    nor for one cancelled meanwhile: its run is stopped as soon as it is recorded)."""
    if record.incarnation <= 1 or record.first_started_at is None or record.cancel_requested:
        return None
    return Notice(
        record.pool, now, "relaunched", record.name, record.team, f"Preemptor: job {record.name} relaunched as {new.run_name}",
        {"run": new.run_name, "pool": record.pool, "resumes_from": record.checkpoint_s3_uri, "offering": instance_type},
    )


def _launch_line(record: JobRecord, new: JobRecord, instance_type: str | None, now: float) -> LogLine:
    """The decision-log line of a launch, written with the run's record."""
    on = "" if not instance_type else f" to {instance_type}" if record.service == "batch" else f" on {describe_offering(instance_type)}"
    extra = {"instance_type": instance_type}
    if record.incarnation > 1 and record.first_started_at is None:
        # The earlier runs never got capacity, or their names were taken by other runs:
        # nothing was trained, nothing to resume.
        earlier = (
            f"after {record.capacity_retries} that met no capacity" if record.capacity_retries
            else "under the next name: an earlier one was taken by another run"
        )
        detail = f"{new.run_name}{on}: a new run {earlier} (nothing trained yet)"
        return LogLine(record.name, now, "relaunched", "capacity-free", detail, extra)
    if record.incarnation > 1:
        return LogLine(record.name, now, "relaunched", "capacity-free", f"{new.run_name}{on} resumes from {record.checkpoint_s3_uri}", extra)
    return LogLine(record.name, now, "launched", "capacity-free", f"{new.run_name} created in {record.service}{on}", extra)


def running_on(record: JobRecord, run_id: str, started_at: float, instance_type: str | None = None) -> JobRecord:
    """The admitted job, running its incarnation's run `run_id` (created on `instance_type`,
    when the launch chose one) since `started_at`: its launch refusals forgotten."""
    return record.with_changes(
        status=JobState.RUNNING,
        run_id=run_id,
        run_name=record.next_run_name,
        started_at=started_at,
        first_started_at=record.first_started_at if record.first_started_at is not None else started_at,
        launch_attempts=0,
        launches_given_up=0,
        not_before=None,
        last_launch_error=None,
        launched_instance_type=instance_type,
    )


_LAUNCH_FIELDS = (
    "status", "run_id", "run_name", "started_at", "first_started_at", "launch_attempts", "launches_given_up", "not_before",
    "last_launch_error", "launched_instance_type",
)


def _offering(store: JobsStore, record: JobRecord, offerings: tuple[str, ...], now: float) -> str | None:
    """What to launch on: the pool's first offering (its own instance type, then its
    fallbacks in order; spot before on-demand) that did not just meet no capacity (the
    unavailable-offerings cache); when every one did, the preferred one."""
    if len(offerings) < 2:
        return None  # nothing to choose: the request as admitted
    unavailable = store.unavailable_offerings(record.pool, now)
    return next((t for t in offerings if t not in unavailable), offerings[0])


def launch_backoff_s(job: str, attempts: int) -> float:
    """How long a job waits after its `attempts`-th refused launch: 60 s x 2^(attempts-1),
    plus a jitter of up to as much again, drawn from the job and attempt (deterministic)."""
    base = LAUNCH_BACKOFF_S * 2 ** (attempts - 1)
    return base + random.Random(f"{job}#{attempts}").uniform(0, base)


def gave_up_backoff_s(job: str, given_up: int) -> float:
    """How long a job waits after its `given_up`-th launch step in a row that gave up
    (throttling or 5xx through every retry): `launch_backoff_s` of it, at most its fourth
    (8 to 16 min): an outage ends at any moment, and the job should start soon after."""
    return launch_backoff_s(job, min(given_up, GAVE_UP_BACKOFF_STEPS))


def capacity_backoff_s(job: str, retries: int) -> float:
    """How long a job waits after its `retries`-th launch that met no capacity:
    min(300 s, 60 s x 2^(retries-1)), less a jitter of up to half of it drawn from the job and
    the retry (deterministic). Capped low: capacity comes back at any moment, and a job
    should start within one step of it."""
    base = min(CAPACITY_BACKOFF_MAX_S, CAPACITY_BACKOFF_S * 2 ** (retries - 1))
    return base - random.Random(f"{job}#capacity#{retries}").uniform(0, base / 2)


def _wait_for_capacity(
    store: JobsStore, alerts: Alerts | None, record: JobRecord, reason: str, now: float, *, run_created: bool, outage: bool = True
) -> dict:
    """The launch met no capacity: the job goes back to the queue until `not_before`, its
    GPUs released. A run the service created (and failed) used the incarnation's name, which
    SageMaker never gives again: the next launch is a new incarnation. After
    MAX_CAPACITY_RETRIES the job is failed with the reason and an alert.

    `outage`: the service itself had no instances (not the account's quota): the offering is
    remembered as such, and while every offering of the pool is, its plans stop nobody
    (`Pool.no_capacity_until`): a victim's instances would go back to the service, not to
    the job that waits for them."""
    if outage:
        offering = record.launched_instance_type or store.ANY_OFFERING
        store.mark_unavailable(record.pool, offering, now + UNAVAILABLE_OFFERING_S, cache="no_capacity")
    retries = record.capacity_retries + 1
    if retries > MAX_CAPACITY_RETRIES:
        why = f"no capacity after {MAX_CAPACITY_RETRIES} launches; last: {reason}"
        notice = Notice(
            record.pool, now, "failed", record.name, record.team, f"Preemptor: job {record.name} failed: no capacity",
            {"pool": record.pool, "retries": MAX_CAPACITY_RETRIES, "reason": reason},
        )
        try:
            store.transition(
                record,
                record.with_changes(status=JobState.FAILED, ended_at=now, outcome_reason=why, capacity_retries=retries),
                [record.status],
                usage_delta=-record.gpus,
                log=LogLine(record.name, now, "failed", "no-capacity", why),
                notice=notice,
            )
        except ConflictError:
            return {"released": False, "pool": record.pool, "reason": "conflict"}  # it moved meanwhile: its own step decides
        announce(store, alerts, notice)
        return {"released": True, "pool": record.pool, "failed": True, "reason": "no-capacity"}
    if record.launched_instance_type:
        # Launches avoid this offering for a while; the next one goes to a fallback.
        store.mark_unavailable(record.pool, record.launched_instance_type, now + UNAVAILABLE_OFFERING_S)
    wait = capacity_backoff_s(record.name, retries)
    changes: dict = {
        "status": JobState.PENDING,
        "admitted_at": None,
        "not_before": now + wait,
        "capacity_retries": retries,
        "last_launch_error": reason,
        "preempting_since": None,
    }
    if run_created:
        changes.update(incarnation=record.incarnation + 1, run_id=None, run_name=None, started_at=None)
        if record.first_started_at == record.started_at:
            changes["first_started_at"] = None  # that run never trained: the job has not started yet
    line = LogLine(
        record.name, now, "capacity-wait", "no-capacity", f"launch {retries} met no capacity ({reason}); tried again after {wait:.0f} s",
        {"retries": retries, "not_before": now + wait, "run_created": run_created},
    )
    try:
        store.transition(record, record.with_changes(**changes), [record.status], usage_delta=-record.gpus, log=line)
    except ConflictError:
        return {"released": False, "pool": record.pool, "reason": "conflict"}
    # Whole seconds, rounded up: a Wait state's SecondsPath takes a non-negative integer, and
    # the pool planned after it must find the backoff over (not_before <= now).
    return {"released": True, "pool": record.pool, "reason": "no-capacity", "not_before": now + wait, "wait_s": math.ceil(wait)}


def _learn_quota(store: JobsStore, pool: PoolConfig, message: str, now: float) -> str:
    """A launch over the account's quota of the pool's own offering (SageMaker's
    ResourceLimitExceeded names the quota and its value) when that quota is below what the
    pool is configured for: the pool is planned at what the quota leaves it until reconcile
    reads it raised, or reads nothing for QUOTA_MEMORY_S (`JobsStore.note_quota`).
    Otherwise its plans count GPUs the account cannot have: a job admitted into them meets
    the quota at every launch, and nobody is stopped for it, since it "fits"; a critical
    job behind a low one holding the rest would wait until its capacity retries failed it.
    Operators are told by the
    QuotaShortfallGpus alarm. A pool with several offerings is left as it is (another
    offering may have the room; the refused one is avoided a while).

    Returns what to add to the job's capacity-wait line ("" when nothing was learned)."""
    limit = quota_limit(message)
    if limit is None or pool.service != "sagemaker" or len(pool.offerings) != 1 or pool.offerings[0] != limit.offering:
        return ""
    gpus = limit.instances * pool.gpus_per_instance
    if gpus >= pool.capacity_gpus:
        return ""  # the quota covers the pool: runs outside it hold the rest
    try:
        store.note_quota(pool.name, gpus, now + QUOTA_MEMORY_S, limit.name)
    except PreemptorError as e:
        # The capacity wait goes on all the same; the next launch over the quota tells it again.
        logger.warning("the quota below pool %s was not written: %s", pool.name, e, extra={"pool": pool.name, "error": type(e).__name__})
        return ""
    return (
        f"; the account's quota '{limit.name}' is {limit.instances} instances, below pool {pool.name}'s "
        f"{pool.capacity_gpus} GPUs: planned at {gpus} GPUs until Service Quotas lists it raised (raise the quota, or the pool down to it)"
    )


def no_capacity_in_queue(*, store: JobsStore, runners: dict[str, Runner], record: JobRecord, reason: str, now: float) -> dict:
    """A Batch run that never found instances (RUNNABLE past the pool's limit) is terminated
    and its job waits for capacity like a SageMaker launch that met none."""
    try:
        runners[record.service].stop(record.run_id, f"{NO_CAPACITY_STOP_PREFIX} ({reason})"[:255])
    except ServiceJobNotFound:
        pass  # it ended meanwhile: the capacity wait below still holds
    # Reconcile has no alerts topic: the 24th wait fails the job with its reason, unannounced.
    return _wait_for_capacity(store, None, record, f"no capacity: {reason}", now, run_created=True)


def _launch_refused(
    store: JobsStore, alerts: Alerts | None, record: JobRecord, error: ServiceRejected, now: float, instance_type: str | None = None,
    pool: PoolConfig | None = None,
) -> dict:
    if error.code in CAPACITY_CODES:
        if instance_type:
            record = record.with_changes(launched_instance_type=instance_type)  # the offering that was refused
        # ResourceLimitExceeded is the account's quota: a victim's stop does give it room.
        outage = error.code != "ResourceLimitExceeded"
        learned = "" if outage or pool is None else _learn_quota(store, pool, str(error), now)
        result = _wait_for_capacity(store, alerts, record, f"{error.code}: {error}{learned}", now, run_created=False, outage=outage)
        return {"launched": False, **result, **({"quota_shortfall": True} if learned else {})}
    attempts = record.launch_attempts + 1
    reason = f"launch-rejected: {error.code or type(error).__name__}"
    if attempts >= MAX_LAUNCH_ATTEMPTS:
        new = record.with_changes(
            status=JobState.FAILED, ended_at=now, outcome_reason=reason, launch_attempts=attempts, last_launch_error=str(error)
        )
        line = LogLine(record.name, now, "failed", "launch-rejected", f"launch refused {attempts} times; last: {error}")
        notice = Notice(
            record.pool, now, "failed", record.name, record.team, f"Preemptor: job {record.name} failed to launch",
            {"pool": record.pool, "attempts": attempts, "reason": reason, "error": str(error)},
        )
        store.transition(record, new, [JobState.ADMITTED], usage_delta=-record.gpus, log=line, notice=notice)
        announce(store, alerts, notice)
        return {"launched": False, "reason": "launch-rejected", "failed": True, "attempts": attempts, "error": str(error)}
    wait = launch_backoff_s(record.name, attempts)
    # A run name someone else took (SageMaker's names are the account's, for good) is never
    # given back: the next attempt is the next incarnation, under the next name.
    taken = isinstance(error, RunNameTaken)
    new = record.with_changes(
        status=JobState.PENDING,
        admitted_at=None,
        launch_attempts=attempts,
        not_before=now + wait,
        last_launch_error=str(error),
        incarnation=record.incarnation + (1 if taken else 0),
    )
    line = LogLine(
        record.name, now, "launch-failed", "service-rejected",
        f"attempt {attempts} of {MAX_LAUNCH_ATTEMPTS} refused: {error}; retried after {wait:.0f} s"
        + (f" as {new.next_run_name}" if taken else ""),
        {"attempts": attempts, "not_before": now + wait},
    )
    store.transition(record, new, [JobState.ADMITTED], usage_delta=-record.gpus, log=line)
    return {
        "launched": False, "reason": "service-rejected", "attempts": attempts, "not_before": now + wait, "wait_s": math.ceil(wait),
        "error": str(error),
    }


def _cancel_admitted(store: JobsStore, record: JobRecord, now: float) -> dict:
    try:
        store.transition(
            record,
            record.with_changes(status=JobState.CANCELLED, ended_at=now, outcome_reason="cancelled", admitted_at=None),
            [JobState.ADMITTED],
            usage_delta=-record.gpus,
            log=LogLine(record.name, now, "cancelled", "job-cancelled", "cancelled before its launch; GPUs released"),
        )
    except ConflictError:
        return {"launched": False, "reason": "conflict"}
    return {"launched": False, "reason": "cancelled"}


def cancel(*, store: JobsStore, runners: dict[str, Runner], job: str, now: float, alerts: Alerts | None = None) -> dict:
    """Cancel a job on its owner's request, whatever it is doing.

    PENDING: out of the queue, and the preemptions made for it whose victims were sent no
    stop yet are called off (`cancelled_preemptions`). ADMITTED: its reservation is released and it is never
    launched (a launch that created the run meanwhile stops it). RUNNING or PREEMPTING: the
    cancel is recorded on the job first (so a requeue ends it instead of relaunching it, and
    its end counts as cancelled), then its run is stopped. Returns {"outcome", "reason"}.
    """
    for _ in range(JUDGE_ATTEMPTS):
        record = store.get(job)
        if record is None:
            return {"outcome": "ignored", "reason": f"unknown job {job}"}
        if record.status.is_terminal:
            # A cancel handled again: the call-off of its preemptions, if its first handling
            # died before it, is done now.
            spared = cancelled_preemptions(store=store, preemptor=record, now=now, alerts=alerts)
            if spared:
                return {"outcome": "accepted", "reason": "cancelled-pending", "victims_spared": spared}
            return {"outcome": "ignored", "reason": f"job is {record.status.value}"}
        if record.status is JobState.PENDING:
            try:
                cancelled = store.transition(
                    record, record.with_changes(status=JobState.CANCELLED, ended_at=now, outcome_reason="cancelled"), [JobState.PENDING],
                    log=LogLine(job, now, "cancelled", "job-cancelled", "removed from the queue"),
                )
            except ConflictError:
                continue
            # Victims still waiting for their checkpoints are not stopped for it.
            spared = cancelled_preemptions(store=store, preemptor=cancelled, now=now, alerts=alerts)
            return {"outcome": "accepted", "reason": "cancelled-pending"} | ({"victims_spared": spared} if spared else {})
        if record.status is JobState.ADMITTED:
            result = _cancel_admitted(store, record, now)
            if result["reason"] == "conflict":
                continue
            return {"outcome": "accepted", "reason": "cancelled-admitted"}
        # The line is written with the request, before the stop: a function that dies between
        # the two leaves a stop told (a cancel handled again, the job still running, sends
        # it again and leaves one line: keyed by the incarnation).
        line = LogLine(job, record.cancel_requested_at or now, "cancel-requested", "job-cancelled", f"stopping {record.run_name}", once=f"cancel#{record.incarnation}")
        if not store.request_cancel(record, now, line):
            continue
        if record.run_id:
            try:
                runners[record.service].stop(record.run_id, "preemptor: cancelled")
            except ServiceJobNotFound:
                pass  # already gone: its end event (or reconcile) records the end
        return {"outcome": "accepted", "reason": "stopping-for-cancel"}
    return {"outcome": "ignored", "reason": "job kept moving while cancelling; retry"}


# SageMaker's FailureReason when it cannot provision the instances ("CapacityError: Unable to
# provision requested ML compute capacity. ..."): the job was created, then Failed.
CAPACITY_ERROR_PREFIX = "CapacityError"
SPOT_RECLAIM_PREFIX = "Host EC2"  # Batch statusReason when the instance went away under the job
# Batch statusReason of a job a queue's state time limit action cancelled in RUNNABLE, by the
# reason the queue was configured with ("CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY", ...).
BATCH_CAPACITY_PREFIX = "CAPACITY:"
# The reason the controller terminates a Batch run that found no instances with
# (`no_capacity_in_queue`): Batch ends it FAILED with it as its statusReason.
NO_CAPACITY_STOP_PREFIX = "preemptor: no capacity"


def ended_outcome(service: str, outcome: str, reason: str, secondary: str | None = None, cancel_requested: bool = False) -> tuple[str, str]:
    """What a run's end (`outcome`: completed, failed or stopped, with the service's `reason`
    and SageMaker's `secondary` status) means for its job, as `finish` takes it: the same
    whether its end event told it (the intake) or reconcile found it ended (the event lost).
    A Batch run whose instance went away is interrupted (requeued), not failed; one that
    met no capacity waits for it; a stopped run is cancelled (by its team, or by hand), as is
    a failed one its team cancelled (Batch ends a terminated job FAILED)."""
    if outcome == "failed" and service == "batch" and reason.startswith(SPOT_RECLAIM_PREFIX):
        return "interrupted", f"spot reclaim: {reason}"
    if outcome == "failed" and service == "batch" and reason.startswith(BATCH_CAPACITY_PREFIX):
        return "capacity-error", reason  # a job queue's state time limit cancelled it in RUNNABLE
    if outcome == "failed" and service == "batch" and reason.startswith(NO_CAPACITY_STOP_PREFIX) and not cancel_requested:
        # The controller terminated it, RUNNABLE past its pool's limit (reconcile): a capacity
        # wait, whether reconcile recorded the wait before this end was told or its write was
        # refused after the terminate (before, the end failed the job for good: chaos seed 2 of
        # batch-queue-fallback.yaml, the critical hotfix Failed 20 minutes in)
        return "capacity-error", reason
    if outcome == "failed" and service == "sagemaker" and secondary == "MaxWaitTimeExceeded":
        # Managed spot found no spot capacity within MaxWaitTimeInSeconds: wait and relaunch.
        return "capacity-error", f"MaxWaitTimeExceeded: {reason}"
    if outcome == "failed" and service == "sagemaker" and reason.startswith(CAPACITY_ERROR_PREFIX):
        return "capacity-error", reason  # no instances to be had: it did not fail
    if outcome == "stopped":
        return "cancelled", "cancelled" if cancel_requested else "stopped outside the controller"
    if outcome == "failed" and cancel_requested:
        return "cancelled", "cancelled"
    return outcome, reason


def finish(
    *,
    store: JobsStore,
    policy: Policy,
    job: str,
    incarnation: int,
    outcome: str,
    reason: str,
    now: float,
    alerts: Alerts | None = None,
) -> dict:
    """Record that a run ended for good; free its GPUs once. A run that met no capacity
    (`capacity-error`) sends its job back to wait for capacity instead, unless the job is an
    adopted run (failed: its team relaunches it). `outcome` is the
    run's end as `ended_outcome` reads it."""
    record = _current(store, job, incarnation)
    if record is not None and record.status is OUTCOMES.get(outcome):
        # This run's end is recorded already: a retried step whose first attempt wrote it
        # and lost its answer, or the same end reported again. Its GPUs were freed then;
        # the pool is planned again (`replan`), as the first attempt's workflow may never
        # have got to start that plan.
        return {"released": False, "pool": record.pool, "reason": "already-recorded", "replan": True}
    if record is None or not record.status.holds_capacity:
        return {"released": False, "pool": None, "reason": "not-holding-capacity"}
    if outcome == "interrupted":
        return _back_to_queue(store, policy, record, False, now, "interrupted", reason)
    if outcome == "capacity-error" and record.adopted:
        # Its team's run met no capacity: the controller holds no request to create it again
        # (a capacity wait would plan it, preempt for it, and have its launch refused).
        outcome, reason = "failed", f"{reason}; launched outside the controller, it is not relaunched by it: its team relaunches it"
    if outcome == "capacity-error":
        return _wait_for_capacity(store, alerts, record, reason, now, run_created=True)
    state = OUTCOMES[outcome]
    for _ in range(JUDGE_ATTEMPTS):
        new = record.with_changes(status=state, ended_at=now, outcome_reason=reason, preempting_since=None)
        notice = None if state is not JobState.FAILED else Notice(
            record.pool, now, "failed", job, record.team, f"Preemptor: job {job} failed",
            {"run": record.run_name or record.name, "pool": record.pool, "reason": reason},
        )
        try:
            store.transition(
                record,
                new,
                expect=[JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTING],
                usage_delta=-record.gpus,
                log=LogLine(job, now, outcome, reason, f"{record.run_name or record.name} ended: {state.value}"),
                ended_run=_ended_run(record, now),
                notice=notice,
            )
            break
        except ConflictError:
            # The run ended for good whatever else changed meanwhile (a cancel request, a
            # preemption mark): finish it on the fresh item, unless it already finished.
            current = store.get(job)
            if current is None or current.incarnation != incarnation or not current.status.holds_capacity:
                return {"released": False, "pool": record.pool, "reason": "conflict"}
            record = current
    else:
        return {"released": False, "pool": record.pool, "reason": "conflict"}
    announce(store, alerts, notice)
    return {"released": True, "pool": record.pool}


def _ended_run(record: JobRecord, now: float) -> EndedRun | None:
    """The run's end, for its team's fair-share usage (reconcile folds it in; the planner adds it until then)."""
    if record.started_at is None:
        return None
    return EndedRun(record.pool, record.team, record.name, record.incarnation, record.gpus, record.started_at, now)


def priority_changed(
    record: JobRecord, priority: int, tier: str, now: float, by: str, who: str, note: str = "", also: str = "", **told
) -> tuple[LogLine, Notice]:
    """The decision-log line (`priority-changed`, reason `by`: "operator" or "team") and the
    team's notice that tell `record`'s new priority, written with it (`JobsStore.set_priority`).
    `who` says who changed it ("set by the operator"), `also` what else the line says, `told`
    what else the notice carries. A lowering withdraws an escalation: said."""
    was = record.priority
    detail = f"priority {was} -> {priority} ({tier}), {who}" + (f": {note}" if note else "") + also
    if priority < was and record.escalated_at is not None:
        detail += "; its escalation is withdrawn"
    line = LogLine(record.name, now, "priority-changed", by, detail, {"from": was, "to": priority})
    subject = f"Preemptor: job {record.name} now has priority {priority} (was {was})"
    message = {"pool": record.pool, "from": was, "to": priority, "state": record.status.value, "note": note, "by": by, **told}
    return line, Notice(record.pool, now, "priority-changed", record.name, record.team, subject, message)


def announce(store: JobsStore, alerts: Alerts | None, notice: Notice | None) -> None:
    """Publish a notice written with its change, and mark it sent. One SNS refused, or one
    whose writer died before publishing it, stays in the table, and reconcile publishes it:
    a notice may then come twice (its mark was lost), never not at all."""
    if notice is None or alerts is None or not alerts.send(notice):
        return
    try:
        store.notice_sent(notice)
    except PreemptorError as e:
        logger.warning("notice published, not marked sent (reconcile publishes it again): %s", e, extra={"job": notice.job})
