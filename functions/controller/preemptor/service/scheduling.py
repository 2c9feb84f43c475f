"""One scheduling cycle of a pool: take the pool's lease, plan, reserve what was decided,
and let the lease go.

The cycle is the only writer that admits jobs or marks victims, and it holds the pool's
lease while it does, and only then: launches and preemptions (checkpoint and stop waits)
run after it, each victim in its own workflow execution. Every write is still
conditional, so even a cycle whose lease expired cannot oversubscribe the pool or stop a
job twice.

A plan step is idempotent when Step Functions retries it (the Lambda may have done its
work and died before answering): the lease owner is the execution, and each admission or
victim records the cycle that decided it (`decided_by`), so a retried step returns what
it already reserved instead of reserving again or losing it. Each admission and victim
mark is also recorded under its pool with its cycle, in the same transaction
(`JobsStore.cycle_reservations`): once the lease is given back, no attempt of the cycle can
reserve more, and that consistent read is everything the cycle reserved, where the pool's
index may lag. A step hands all of it over, including what an earlier attempt still running
when Step Functions gave it up reserved, and a cycle that failed for good gives its
admissions back (`finish_cycle`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

from ..adapters.alerts import Alerts
from ..adapters.checkpoints import CheckpointStore
from ..adapters.store import JobsStore, LogLine
from ..adapters.workflows import execution_name
from ..config import Mode, Settings
from ..core.errors import ConflictError, LeaseLost, PoolDrained, Retryable
from ..core.jobs import JobRecord
from ..core.model import Decision, JobState, PastPreemption, Pool, PreemptionRule, Reason, Snapshot, TeamUsage
from ..core.policy import Policy, escalation_lead_s, history_window_s
from ..core.explain import explain_job
from ..core.planner import plan
from . import actions, learning

logger = logging.getLogger(__name__)

# The lease covers planning only (a plan step takes seconds; the plan Lambda times out
# after 60 s and a retry keeps the lease, being the same owner). A holder that died keeps
# the pool for this long at most; reconcile clears expired leases.
LEASE_TTL_S = 300
# Cycles one schedule execution runs (planning again while work arrives) before a fresh
# execution continues: a busy pool never grows one execution's history toward the
# 25,000-event cap, which cannot be caught.
MAX_CYCLES = 5
# A cycle whose plan step failed for good, asked meanwhile to plan again (a submission, GPUs
# freed: their executions found the lease held and left the request on it), starts a fresh
# execution that plans after this pause, not after reconcile's next run.
FAILED_CYCLE_RETRY_S = 60


@dataclass(frozen=True)
class CycleResult:
    """What the schedule workflow needs from the plan step."""

    pool: str
    owner: str
    locked: bool
    admits: list[dict]
    preemptions: list[dict]
    waiting: list[dict]
    settings: dict
    oldest_wait_s: dict[str, float] = field(default_factory=dict)
    rerun: bool = False  # work arrived while the lease was held: plan again
    retried: bool = False  # a retried step: what this cycle had reserved was returned again
    # For the metrics (not the workflow): pending jobs per tier, and the pool's GPUs held
    # (running, admitted or being stopped) out of its capacity once this cycle's admissions count.
    depth_by_tier: dict[str, int] = field(default_factory=dict)
    used_gpus: int | None = None
    capacity_gpus: int | None = None
    quota_shortfall_gpus: int = 0  # configured, less what the account's quota leaves it
    # When a job waits out its preemption delay, the pool is planned again once the earliest
    # such delay ends: nothing else would wake it then.
    wake_s: int | None = None
    wake_at: int | None = None  # its epoch second: one wake-up per pool and moment, whichever cycle asks
    # Victims whose checkpoint wait this cycle cut short (`Decision.wait_cuts`), for the metrics.
    wait_cuts: list[str] = field(default_factory=list)
    # Victims whose preemption this cycle called off (`Decision.call_offs`), for the metrics.
    called_off: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "pool": self.pool,
            "owner": self.owner,
            "locked": self.locked,
            "admits": self.admits,
            "preemptions": self.preemptions,
            "waiting": self.waiting,
            "settings": self.settings,
            "has_admits": bool(self.admits),
            "has_preemptions": bool(self.preemptions),
            "oldest_wait_s": self.oldest_wait_s,
            "rerun": self.rerun,
            "retried": self.retried,
            "max_cycles": MAX_CYCLES,
            "continue_as": continuation_name(self.pool, self.owner),
            **({"wake_s": self.wake_s, "wake_as": execution_name("wake", self.pool[:40], str(self.wake_at))} if self.wake_s else {}),
        }


def _digest(text: str, size: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


def continuation_name(pool: str, owner: str) -> str:
    """The execution that continues `owner`'s scheduling of `pool` past its cycle bound:
    deterministic (a retried start is refused as a duplicate), short whatever the chain."""
    return execution_name("more", pool[:40], _digest(owner, 24))


def preemption_names(job: str, incarnation: int, marked_at: float) -> tuple[str, str]:
    """Execution names of a victim's preemption, and of the schedule it starts once the
    GPUs are free: one per marking (the same victim may be marked again after being
    spared), kept unique when a long job name is cut to fit 80 characters."""
    tail = (_digest(job, 8), f"i{incarnation}", f"{int(marked_at)}")
    return execution_name("preempt", job[:40], *tail), execution_name("freed", job[:40], *tail)


def oldest_wait_by_tier(pending: list[JobRecord], policy: Policy, now: float) -> dict[str, float]:
    """How long the oldest pending job of each tier has waited in its current wait (the
    alarm's metric): a requeued victim's wait starts at its requeue, not its submission, or
    its hours of running would page the operators and escalate it at once."""
    oldest: dict[str, float] = {}
    for job in pending:
        tier = policy.tier_of(job.priority)
        oldest[tier] = max(oldest.get(tier, 0.0), now - job.waiting_since())
    return oldest


def escalates_after_s(settings: Settings, priority: int) -> float | None:
    """The wait after which the wait alarm escalates a pending job of `priority`
    (`service.escalation`): its threshold for a tier it watches; None when there is no
    alarm or it does not watch the tier."""
    if not settings.wait_alarm_name or settings.policy.tier_of(priority) not in settings.wait_alarm_tiers:
        return None
    return settings.wait_alarm_minutes * 60.0


def build_snapshot(
    pool: Pool,
    pending: list[JobRecord],
    active: list[JobRecord],
    usage: list[TeamUsage] = (),
    history: list[PastPreemption] = (),
    settings: Settings | None = None,
) -> Snapshot:
    """The planner's view of one pool; with `settings`, each pending job of a tier the wait
    alarm watches carries when it is expected to be escalated (`PendingJob.escalates_at`)."""
    return Snapshot(
        pools=(pool,),
        running=tuple(r.as_running() for r in active),
        pending=tuple(p.as_pending(None if settings is None else escalates_after_s(settings, p.priority)) for p in pending),
        usage=tuple(usage),
        preemption_history=tuple(history),
    )


def plan_cycle(
    *,
    store: JobsStore,
    settings: Settings,
    pool_name: str,
    owner: str,
    now: float,
    cycle: int = 0,
    checkpoints: CheckpointStore | None = None,
    alerts: Alerts | None = None,
) -> CycleResult:
    """Plan one pool under its lease, reserve the decision's admissions and victims, and
    let the lease go (`rerun` tells whether work arrived meanwhile).

    `owner` is the schedule execution's name, `cycle` the cycle number within it: a
    retried step of the same cycle returns what it reserved before. `alerts` publishes the
    notices of the preemptions it calls off (else reconcile does).
    """
    pool_cfg = settings.pool(pool_name)
    if pool_cfg is None:
        raise ValueError(f"pool {pool_name!r} is not configured")
    stored = store.pool(pool_name)
    if stored is None or stored.get("capacity_gpus") != pool_cfg.capacity_gpus:
        store.ensure_pool(pool_name, pool_cfg.capacity_gpus)
    workflow_settings = settings.policy.workflow_settings(pool_name)
    if stored is not None and stored.get("drained"):
        return _drained_cycle(store, settings, pool_name, owner, now, workflow_settings, alerts)
    if not store.acquire_lease(pool_name, owner, now, LEASE_TTL_S):
        return CycleResult(pool_name, owner, False, [], [], [], workflow_settings)

    mark = f"{owner}#{cycle}"
    # The pool's count as read at the cycle's start: after whatever write started the cycle
    # (a victim requeued, a run's end), which the index may not show yet.
    pending, active, snapshot = read_snapshot(store, settings, pool_name, now, pool_item=stored)
    earlier_admits, earlier_victims = _reserved_by(active, mark)
    decision = plan(snapshot, settings.policy, now)
    waiting = [
        {"job": e.job, "reason": e.reason.value, "detail": e.detail}
        for e in decision.explanations
        if e.verdict.value in ("wait", "skip")
    ]
    waits = oldest_wait_by_tier(pending, settings.policy, now)
    depth = Counter(settings.policy.tier_of(r.priority) for r in pending)
    # What it is planned at: less than configured while the account's quota leaves it less.
    capacity = snapshot.pools[0].gpus
    gauges = {"depth_by_tier": dict(depth), "capacity_gpus": capacity, "quota_shortfall_gpus": pool_cfg.capacity_gpus - capacity}
    if settings.mode is Mode.SHADOW:
        _log_shadow(store, decision, now)
        rerun = store.release_lease(pool_name, owner)
        held = sum(r.gpus for r in active if r.status.holds_capacity)
        return CycleResult(pool_name, owner, True, [], [], waiting, workflow_settings, waits, rerun, used_gpus=held, **gauges)

    by_name = {r.name: r for r in pending + active}
    _fail_exhausted(store, decision, by_name, now)
    new_admits = _reserve_admissions(store, decision, by_name, capacity, now, owner, mark)
    admits = _unique(earlier_admits + new_admits)
    preemptions = _unique(earlier_victims + _mark_victims(store, decision, by_name, now, owner, mark))
    if checkpoints is not None and decision.checkpoint_requests:
        learning.request_ahead(store, checkpoints, decision, by_name, now)  # issue 10: ahead of preemption
    cut = learning.cut_waits(store, decision, by_name, now) if decision.wait_cuts else []
    store.remember_waits(pool_name, waiting, now)
    rerun = store.release_lease(pool_name, owner)
    # After the lease: each call-off is conditional on the victim as read, and its notice
    # (an SNS call) need not hold the pool from the next cycle.
    called_off = actions.unneeded_preemptions(store=store, call_offs=decision.call_offs, by_name=by_name, now=now, alerts=alerts) if decision.call_offs else []
    handed, marked = _cycle_reservations(store, pool_name, mark, admits, preemptions)
    retried = bool(earlier_admits or earlier_victims or len(handed) > len(admits) or len(marked) > len(preemptions))
    admits, preemptions = handed, marked
    held = sum(r.gpus for r in active if r.status.holds_capacity) + sum(a["gpus"] for a in new_admits)
    wake = _next_wake_s(decision, by_name, active, settings, pool_name, now)
    return CycleResult(
        pool_name, owner, True, admits, preemptions, waiting, workflow_settings, waits, rerun, retried, used_gpus=held,
        wake_s=wake, wake_at=None if wake is None else math.ceil(now) + wake, wait_cuts=cut, called_off=called_off, **gauges,
    )


# A longer delay is planned again after this much, and again: reconcile plans every pool
# every 5 minutes besides.
MAX_WAKE_S = 300


# Why a job waits that escalation may change: it lifts the minimum runtime of its victims.
_ESCALATION_MAY_HELP = frozenset({Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS, Reason.BLOCKED_BY_HIGHER_RANKED})


def _next_wake_s(decision: Decision, by_name: dict[str, JobRecord], active: list[JobRecord], settings: Settings, pool: str, now: float) -> int | None:
    """Seconds until the pool should be planned again though nothing happens (at most
    MAX_WAKE_S): the earliest end of a waiting job's preemption delay, or the moment a job
    that cannot fit comes within `checkpoint_ahead.before_escalation_s` of its escalation by
    the wait alarm, while lower-priority work runs that the minimum runtime protects (what
    escalation lifts): its likely victims are then asked ahead (`PendingJob.escalates_at`).
    A victim's minimum runtime is left to reconcile and the next event: it runs for an hour
    or more, and the wait alarm escalates a job kept waiting by it."""
    policy = settings.policy
    knobs = policy.for_pool(pool)
    lead = escalation_lead_s(knobs)
    # The lowest priority the minimum runtime protects now (None: it protects nothing).
    young = [
        r.priority for r in active
        if r.status is JobState.RUNNING and r.started_at is not None and now - r.started_at < knobs.min_runtime_s
    ] if lead is not None else []
    lowest_protected = min(young, default=None)
    ends: list[float] = []
    waiting = [e for e in decision.explanations if e.verdict.value in ("wait", "skip")]
    for e in waiting:
        record = by_name.get(e.job)
        if record is None:
            continue
        if e.reason is Reason.PREEMPTION_DELAYED:
            delay = knobs.tier_preemption_delay_s.get(policy.tier_of(record.priority), knobs.preemption_delay_s)
            ends.append(record.waiting_since() + delay)
        elif lowest_protected is not None and lowest_protected < record.priority and e.reason in _ESCALATION_MAY_HELP:
            after = escalates_after_s(settings, record.priority)
            if after is not None:
                ends.append(record.waiting_since() + after - lead)
    future = [t - now for t in ends if t > now]
    return min(MAX_WAKE_S, math.ceil(min(future)) + 1) if future else None


# Why every pending job of a drained pool waits (`preemptor drain POOL`).
POOL_DRAINED = "pool-drained"


def _drained_cycle(
    store: JobsStore, settings: Settings, pool_name: str, owner: str, now: float, workflow_settings: dict, alerts: Alerts | None
) -> CycleResult:
    """A drained pool is not planned: nothing is admitted, nothing preempted. Its pending
    jobs wait for the operator, which the pool item records for `explain` and `queue`.

    The preemptions whose victims were sent no stop yet are called off, as the drain itself
    does (`actions.drained_preemptions`): where AWS refused the drain's own call-offs, the
    pool's next cycle (the drain starts one; reconcile's, within five minutes) does them."""
    actions.drained_preemptions(store=store, pool=pool_name, now=now, alerts=alerts)
    pending = store.pending(pool_name, settings.pending_window)
    detail = f"pool {pool_name} is drained: it admits nothing new and preempts nothing until undrained"
    waiting = [{"job": r.name, "reason": POOL_DRAINED, "detail": detail} for r in pending]
    store.remember_waits(pool_name, waiting, now)
    waits = oldest_wait_by_tier(pending, settings.policy, now)
    return CycleResult(pool_name, owner, True, [], [], waiting, workflow_settings, waits)


def _unique(items: list[dict]) -> list[dict]:
    """Each job once (an earlier attempt's reservation may be found twice: by the index,
    and again by a conflict this attempt met on a stale copy)."""
    seen: set[str] = set()
    return [i for i in items if not (i["job"] in seen or seen.add(i["job"]))]


def _reserved_by(active: list[JobRecord], mark: str) -> tuple[list[dict], list[dict]]:
    """What an earlier attempt of this very cycle reserved and did not hand over yet:
    admitted jobs not launched, victims still being preempted."""
    admits, victims = [], []
    for r in active:
        if r.decided_by != mark:
            continue
        if r.status is JobState.ADMITTED and not r.run_id:
            admits.append({"job": r.name, "incarnation": r.incarnation, "gpus": r.gpus})
        elif r.status is JobState.PREEMPTING and r.preempted_by:
            victims.append(_victim_item(r, r.preempted_by, r.preempting_since, None))
    return admits, victims


def _preempting_reason(rule: PreemptionRule) -> str:
    """The reason of a preemptor's `preempting` line: it reclaims borrowed capacity, or
    preempts a job it outranks."""
    return (Reason.RECLAIMS_BORROWED if rule is PreemptionRule.RECLAIM_BORROWED else Reason.PREEMPTS_LOWER_PRIORITY).value


def _victim_item(victim: JobRecord, preemptor: str, marked_at: float, lost_gpu_seconds: float | None) -> dict:
    execution, then = preemption_names(victim.name, victim.incarnation, marked_at)
    item = {
        "job": victim.name,
        "incarnation": victim.incarnation,
        "preemptor": preemptor,
        "team": victim.team,  # the owner notice's `team` attribute (teams subscribe by it)
        "gpus": victim.gpus,
        "execution": execution,
        "then": then,
        "since": marked_at,  # which preemption its workflow's steps act for (`actions.stop`)
    }
    if lost_gpu_seconds is not None:
        item["lost_gpu_seconds"] = round(lost_gpu_seconds, 3)
    return item


def read_snapshot(
    store: JobsStore, settings: Settings, pool_name: str, now: float, include: str | None = None, pool_item: dict | None = None
) -> tuple[list[JobRecord], list[JobRecord], Snapshot]:
    """What the planner sees of one pool: a bounded number of reads, whatever the queue length.

    `include` adds one pending job even when it ranks beyond the window (for `explain`).
    `pool_item`: the pool's item (its count, its offerings that met no capacity), when the
    caller read it already (else it is read).
    """
    pool_cfg = settings.pool(pool_name)
    knobs = settings.policy.for_pool(pool_name)
    # A job whose launch the service refused waits out its backoff (`not_before`).
    pending = [r for r in store.pending(pool_name, settings.pending_window) if not r.backing_off(now)]
    if include and all(r.name != include for r in pending):
        extra = store.get(include)
        if extra is not None and extra.status is JobState.PENDING and extra.pool == pool_name:
            pending.append(extra)
    # Checkpoint times come from the table (kept current by S3 events and the checkpoint
    # steps; reconcile refreshes them from S3), not from listing S3 on every decision.
    active = store.active(pool_name)
    if pool_item is None:
        pool_item = store.pool(pool_name) or {}
    used_gpus = int(pool_item.get("used_gpus", 0))
    if sum(r.gpus for r in active if r.status.holds_capacity) > used_gpus:
        # The index still shows GPUs given back (it is eventually consistent, and a cycle
        # often runs the moment a run ends or a victim is requeued): the pool's own count,
        # read consistently (`used_gpus`: by the cycle, at its start), says so. Each holder
        # is read again, so the GPUs just freed are planned now, not at the next event or
        # reconcile.
        active = store.still_holding(pool_name, active)
    pending, active = newest_views(pending, active)
    window = history_window_s(knobs)  # the budget's, the checkpoint forecast's
    history = store.preemptions_since(pool_name, now - window) if window is not None else []
    offerings = pool_cfg.offerings if len(pool_cfg.offerings) > 1 else (store.ANY_OFFERING,)  # as launches mark them
    capacity = store.quota_capacity_gpus(pool_item, pool_cfg.capacity_gpus, now)  # the account's quota may leave it less
    pool = Pool(pool_name, capacity, store.no_capacity_until(pool_item, offerings, now))
    snapshot = build_snapshot(pool, pending, active, store.team_usage(pool_name, knobs.fair_share.half_life_s), history, settings)
    return pending, active, snapshot


def newest_views(pending: list[JobRecord], active: list[JobRecord]) -> tuple[list[JobRecord], list[JobRecord]]:
    """A job the index shows both waiting and holding GPUs, in the view it reached last (its
    version; a tie keeps it holding). The index is eventually consistent: a plan step
    retried a moment after its first attempt admitted a job read that job still pending,
    planned it again into a full pool and preempted a victim for a job already running."""
    holding = {r.name: r for r in active}
    both = {r.name for r in pending if r.name in holding}
    if not both:
        return pending, active
    waiting = {r.name: r for r in pending}
    return (
        [r for r in pending if r.name not in both or r.version > holding[r.name].version],
        [r for r in active if r.name not in both or r.version >= waiting[r.name].version],
    )


def explain(*, store: JobsStore, settings: Settings, job: str, now: float) -> dict:
    """`explain` on live state: plan the job's pool as a cycle would (writing nothing) and
    tell why the job waits, runs or was preempted, with its decision log."""
    record = store.get(job)
    if record is None:
        return {"job": job, "status": "unknown", "text": f"{job}: no such job"}
    history = store.history(job)
    if settings.pool(record.pool) is None:
        return explain_job(job, Decision(), Snapshot(pools=()), settings.policy, now, history)
    item = store.pool(record.pool)
    _, _, snapshot = read_snapshot(store, settings, record.pool, now, include=job, pool_item=item)
    answer = explain_job(job, plan(snapshot, settings.policy, now), snapshot, settings.policy, now, history)
    answer["state"] = record.status.value
    configured, planned = settings.pool(record.pool).capacity_gpus, snapshot.pools[0].gpus
    if planned < configured:
        cap = (item or {}).get("quota_cap") or {}
        answer["planned_capacity_gpus"] = planned
        lines = answer["text"].splitlines()
        lines.insert(1, (
            f"  pool {record.pool} is planned at {planned} of its {configured} GPUs: the account's quota "
            f"'{cap.get('quota', '?')}' leaves it no more (a launch met it; read again at each reconcile until Service Quotas "
            f"lists it raised, or an operator says it was: `preemptor quota-raised {record.pool}`)"
        ))
        answer["text"] = "\n".join(lines)
    if record.status.is_terminal:
        lines = answer["text"].splitlines()
        lines[0] = f"{job}: {record.status.value.lower()} ({record.outcome_reason})"
        answer["text"] = "\n".join(lines)
    return answer


def finish_cycle(*, store: JobsStore, settings: Settings, pool_name: str, owner: str, cycle: int | None = None, now: float = 0.0) -> dict:
    """Release the lease after the cycle's plan step failed for good; `rerun` is true when
    work arrived while we held it.

    With `cycle`: what that cycle's plan step admitted before it failed goes back to the
    queue. The workflow launches a cycle's admissions only from the step's answer,
    and there is none: left admitted, each would hold its GPUs, unlaunched, until reconcile
    called it stuck half an hour later (and a preemptor choosing it as a victim would find it
    not running, so not preemptible). No run exists for them: the launch step never ran.
    The victims it marked are handed back (`preemptions`, `settings`: the plan step's
    answer's shape) and the workflow starts their preemptions, under the names the plan gave
    them, as it would have from the answer: the preemptor they were chosen for does not wait
    for reconcile to find them (`PREEMPT_START_GRACE_S`, then its next run: 5 to 10
    minutes). A read refused fails the step, which is retried; given up, the admissions
    wait for reconcile's stuck-admission repair and the victims for its grace.

    `rerun`: a plan was asked for while the cycle held the lease; the workflow then starts
    `retry_as`, which plans the pool after `retry_s` (the request is not dropped until
    reconcile's next run)."""
    rerun = store.release_lease(pool_name, owner)  # first: a read refused below must not lock the pool out
    mark = f"{owner}#{cycle}"
    released, victims = _release_cycle(store, pool_name, mark, now) if cycle is not None else ([], [])
    return {
        "pool": pool_name,
        "owner": owner,
        "rerun": rerun,
        "released": released,
        "preemptions": victims,
        "has_preemptions": bool(victims),
        "settings": settings.policy.workflow_settings(pool_name) if victims else {},
        "retry_as": execution_name("retry", pool_name[:40], _digest(mark, 24)),
        "retry_s": FAILED_CYCLE_RETRY_S,
    }


def _cycle_reservations(
    store: JobsStore, pool_name: str, mark: str, admits: list[dict], victims: list[dict]
) -> tuple[list[dict], list[dict]]:
    """`admits` and `victims` (what this attempt reserved, and what the index showed of
    earlier attempts) and everything else cycle `mark` reserved and did not hand on, read
    back consistently once the lease is given back: what an earlier attempt reserved that
    the index did not show yet, or reserved while this one ran (Step Functions gave it up,
    its Lambda went on). Left out of the answer, an admitted job would hold its GPUs
    unlaunched until reconcile calls it stuck, and a victim would wait for reconcile to
    start its preemption. A read refused now (throttled) leaves what is known: reconcile
    still finds the rest."""
    admits, victims = list(admits), list(victims)
    seen = {a["job"] for a in admits} | {v["job"] for v in victims}
    try:
        for job, incarnation, kind in store.cycle_reservations(pool_name, mark):
            if job in seen:
                continue
            record = store.get(job)
            if record is None or record.incarnation != incarnation:
                continue
            if kind == "admitted" and _admitted_unlaunched(record, mark):
                admits.append({"job": record.name, "incarnation": record.incarnation, "gpus": record.gpus})
            elif kind == "marked" and _marked_by(record, mark):
                victims.append(_victim_item(record, record.preempted_by, record.preempting_since, None))
            seen.add(job)
    except Retryable as e:
        # After the lease is given back: a step failed now would be retried without the
        # request to plan again (`rerun`) that the release read.
        logger.warning("could not read back the cycle's reservations: %s", e, extra={"pool": pool_name, "cycle": mark})
    return admits, victims


def _admitted_unlaunched(record: JobRecord, mark: str) -> bool:
    return record.decided_by == mark and record.status is JobState.ADMITTED and not record.run_id


def _marked_by(record: JobRecord, mark: str) -> bool:
    return record.decided_by == mark and record.status is JobState.PREEMPTING and bool(record.preempted_by)


def _release_cycle(store: JobsStore, pool_name: str, mark: str, now: float) -> tuple[list[str], list[dict]]:
    """Give back what cycle `mark` admitted and did not launch (the admissions the index
    shows, and those recorded with the cycle, `cycle_reservations`, that it does not show
    yet), and find the victims it marked that are still marked (read consistently), for
    their preemptions to be started: (jobs released, victim items)."""
    found = {r.name: r for r in store.active(pool_name) if r.decided_by == mark}
    victims = []
    for job, incarnation, kind in store.cycle_reservations(pool_name, mark):
        if kind == "admitted" and job not in found:
            record = store.get(job)
            if record is not None:
                found[job] = record
        elif kind == "marked":
            record = store.get(job)
            if record is not None and record.incarnation == incarnation and _marked_by(record, mark):
                victims.append(_victim_item(record, record.preempted_by, record.preempting_since, None))
    released = []
    for record in found.values():
        if not _admitted_unlaunched(record, mark):
            continue
        line = LogLine(
            record.name, now, "admission-released", "plan-step-failed",
            "admitted by a scheduling cycle that failed before launching it; back in the queue",
        )
        try:
            store.transition(
                record, record.with_changes(status=JobState.PENDING, admitted_at=None), [JobState.ADMITTED], usage_delta=-record.gpus, log=line
            )
        except ConflictError:
            continue  # it moved meanwhile (cancelled, or released by reconcile): not ours to release
        released.append(record.name)
    return released, victims


def _reserve_admissions(
    store: JobsStore, decision: Decision, by_name: dict[str, JobRecord], capacity: int, now: float, owner: str, mark: str
) -> list[dict]:
    """Admit the decision's jobs, each only while `owner` holds the pool's lease: a plan step
    that outlived its workflow's wait for it (Step Functions gave the cycle up and released
    the lease) admits nothing more, so no admission is left that no launch follows."""
    admitted = []
    for i, admission in enumerate(decision.admits):
        record = by_name[admission.job]
        line = LogLine(
            record.name, now, "admitted", admission.reason.value,
            f"{record.gpus} GPUs reserved in {record.pool} (incarnation {record.incarnation})",
        )
        try:
            store.transition(
                record,
                record.with_changes(
                    status=JobState.ADMITTED, admitted_at=now, guaranteed=admission.guaranteed, decided_by=mark
                ),
                expect=[JobState.PENDING],
                usage_delta=record.gpus,
                pool_limit=capacity,
                lease_owner=owner,
                log=line,
                reserved_by=mark,
            )
        except LeaseLost as e:
            _log_lease_lost(store, record.name, "admission-deferred", len(decision.admits) - i - 1, now, e)
            break
        except ConflictError as e:
            current = store.get(record.name)
            if current is not None and _admitted_unlaunched(current, mark):
                # An earlier attempt of this very cycle admitted it; the index this attempt
                # read had not caught up (it still showed the job pending): hand it over.
                admitted.append({"job": current.name, "incarnation": current.incarnation, "gpus": current.gpus})
                continue
            store.log(record.name, now, "admission-deferred", "conflict", str(e))
            continue
        admitted.append({"job": record.name, "incarnation": record.incarnation, "gpus": record.gpus})
    return admitted


def _mark_victims(
    store: JobsStore, decision: Decision, by_name: dict[str, JobRecord], now: float, owner: str, mark: str
) -> list[dict]:
    """Mark the decision's victims, each only while `owner` holds the pool's lease (a victim
    marked by a cycle that no longer plans the pool would be stopped for nothing)."""
    marked = []
    for i, p in enumerate(decision.preemptions):
        victim = by_name[p.victim]
        # issue 10: the workflow does not ask (a fresh checkpoint it confirms as before)
        at_once = not p.wait_for_checkpoint and p.stop is not Reason.CHECKPOINT_FRESH
        age = "no checkpoint yet" if p.checkpoint_age_s is None else f"last checkpoint {p.checkpoint_age_s:.0f} s old"
        line = LogLine(
            victim.name, now, "preemption-started", p.reason.value,
            f"for {p.preemptor}; {age}; a stop now would lose {p.lost_gpu_seconds:,.0f} GPU-seconds",
            {"preemptor": p.preemptor, "rule": p.rule.value, "lost_gpu_seconds": p.lost_gpu_seconds,
             "checkpoint_age_s": p.checkpoint_age_s},
        )
        try:
            store.transition(
                victim,
                victim.with_changes(
                    status=JobState.PREEMPTING,
                    preempted_by=p.preemptor,
                    preempting_since=now,
                    last_checkpoint_at=victim.last_checkpoint_at,
                    decided_by=mark,
                    stop_at_once=at_once,
                    stop_reason=p.stop.value if at_once else None,
                ),
                expect=[JobState.RUNNING],
                lease_owner=owner,
                log=(line, LogLine(p.preemptor, now, "preempting", _preempting_reason(p.rule), f"stopping {victim.name} ({victim.gpus} GPUs)")),
                preemption=PastPreemption(victim.pool, now, victim.gpus, p.lost_gpu_seconds, victim.name),
                reserved_by=mark,
            )
        except LeaseLost as e:
            _log_lease_lost(store, victim.name, "preemption-skipped", len(decision.preemptions) - i - 1, now, e)
            break
        except ConflictError as e:
            current = store.get(victim.name)
            if current is not None and _marked_by(current, mark):
                # Marked by an earlier attempt of this cycle, read stale by this one.
                marked.append(_victim_item(current, current.preempted_by, current.preempting_since, None))
                continue
            store.log(victim.name, now, "preemption-skipped", "conflict", str(e))
            continue
        store.nominate(p.preemptor, now)
        item = _victim_item(victim, p.preemptor, now, p.lost_gpu_seconds)
        item["reason"] = p.reason.value  # for the metrics: preemptions by reason
        if p.checkpoint_age_s is not None:
            item["checkpoint_age_s"] = round(p.checkpoint_age_s, 3)
        marked.append(item)
    return marked


def _log_lease_lost(store: JobsStore, job: str, kind: str, left: int, now: float, error: LeaseLost) -> None:
    """The first write a cycle that lost its lease, or whose pool was drained meanwhile, was
    refused (one line: a stale cycle may be a step that outlived its time, with many writes
    left that would each be refused)."""
    if isinstance(error, PoolDrained):
        store.log(job, now, kind, POOL_DRAINED, f"{error}; {left} more left undone; nothing is planned there until it is undrained")
        return
    store.log(job, now, kind, "lease-lost", f"{error}; {left} more left undone; the pool's next cycle plans them again")


def _fail_exhausted(store: JobsStore, decision: Decision, by_name: dict[str, JobRecord], now: float) -> None:
    """Fail the pending jobs the policy gave up on (too many preemptions, `fail` configured)."""
    for failure in decision.failures:
        record = by_name[failure.job]
        try:
            store.transition(
                record,
                record.with_changes(status=JobState.FAILED, ended_at=now, outcome_reason=failure.reason.value),
                expect=[JobState.PENDING],
                log=LogLine(record.name, now, "failed", failure.reason.value, failure.detail),
            )
        except ConflictError:
            continue


def _log_shadow(store: JobsStore, decision: Decision, now: float) -> None:
    for a in decision.admits:
        store.log(a.job, now, "shadow-admit", a.reason.value, "shadow mode: would admit")
    for p in decision.preemptions:
        store.log(
            p.victim, now, "shadow-preempt", p.reason.value,
            f"shadow mode: would preempt for {p.preemptor}, losing {p.lost_gpu_seconds:.0f} GPU-seconds",
            preemptor=p.preemptor, lost_gpu_seconds=p.lost_gpu_seconds,
        )
