"""The policies the simulator replays: ours (the real core planner) and the competitors'.

Every policy is a `SimPolicy`: a planner with the core's signature, `(Snapshot, now) ->
Decision`, plus the way its victims are stopped (`StopModel`). The simulator's loop is the
same for all of them; only the planner and the stop model change.

- `preemptor`: `preemptor.core.planner.plan` itself, with a `Policy` (defaults, or a JSON
  file), and the checkpoint protocol of the workflows: a victim is stopped at once when
  its newest checkpoint is fresh, otherwise after a requested checkpoint is confirmed.
- the baselines below are small planners written for the simulator. They share the core's
  mechanics (rank order, admit what fits, a nominated job claims the GPUs of jobs being
  stopped, a job that cannot fit even with every eligible victim claims nothing, so
  lower-ranked jobs may backfill) and differ where the systems they stand for differ:
  ranking, who may be a victim, victim order, fill-back, exemptions, and how a victim is
  stopped. Each docstring cites the behaviour it reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from preemptor.core.model import (
    Admission,
    Decision,
    Explanation,
    PendingJob,
    Preemption,
    Reason,
    RunningJob,
    Snapshot,
    Verdict,
)
from preemptor.core.planner import plan as core_plan
from preemptor.core.policy import CheckpointTimeoutAction, Policy

Planner = Callable[[Snapshot, float], Decision]


class StopModel(StrEnum):
    """How a victim chosen by the planner is stopped (see docs/simulator.md)."""

    IMMEDIATE = "immediate"  # stop signal at once; work since the last checkpoint is lost
    CHECKPOINT_GATED = "checkpoint-gated"  # ours: confirm a fresh checkpoint, then stop
    FREE = "free"  # oracle: instant, nothing lost, no restart overhead, no relaunch delay


def index_rank(job: PendingJob) -> tuple:
    """Order of the pending index the controller reads its window from (priority desc,
    submission asc, name): the sort key `adapters.store.pending_rank` encodes."""
    return (-job.priority, job.submitted_at, job.name)


def submission_rank(job: PendingJob) -> tuple:
    """First come, first served: submission time, then name."""
    return (job.submitted_at, job.name)


@dataclass(frozen=True)
class SimPolicy:
    name: str
    plan: Planner
    window_rank: Callable[[PendingJob], tuple] = index_rank
    stop: StopModel = StopModel.IMMEDIATE
    checkpoint_max_age_s: float = 0.0  # CHECKPOINT_GATED: a newer checkpoint is fresh enough
    checkpoint_poll_s: float = 30.0  # CHECKPOINT_GATED: how often the workflow looks for it
    checkpoint_wait_max_s: float = 600.0  # CHECKPOINT_GATED: then `on_checkpoint_timeout`
    spare_on_timeout: bool = False  # CHECKPOINT_GATED: leave the victim running on timeout
    replan_every_s: float | None = None  # also plan periodically (eligibility that changes with time)
    usage_half_life_s: float | None = None  # pass the teams' decayed usage (fair share) in the snapshot
    history_window_s: float | None = None  # pass the recent preemptions (preemption budget)
    declares_overhead: bool = False  # jobs declare `restart_overhead_s` (a field of our job request)
    source: str = ""
    knobs: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- ours

RECONCILE_EVERY_S = 300.0  # template.yaml: the reconcile function runs rate(5 minutes) and starts a cycle


def preemptor_policy(policy: Policy | None = None, name: str = "preemptor", pool: str = "sim") -> SimPolicy:
    """Ours: the core planner the Lambdas run, with the checkpoint protocol of the workflows.

    The planner is `preemptor.core.planner.plan(snapshot, policy, now)`, unchanged. The stop
    follows the preemption workflow: a victim whose newest checkpoint is younger than
    `policy.checkpoint_max_age_s` is stopped at once; otherwise a checkpoint is requested
    and the workflow polls every `checkpoint_poll_s` for a newer one, up to
    `checkpoint_wait_max_s`, then applies `on_checkpoint_timeout`. Besides the events, the
    controller plans every 5 minutes (the scheduled reconcile starts a cycle per pool).
    """
    policy = policy or Policy()
    # The knobs of the simulated pool: its overrides under `pools`, else the defaults.
    knobs = policy.for_pool(pool) if hasattr(policy, "for_pool") else policy
    fair_share = getattr(knobs, "fair_share", None)
    budget = getattr(knobs, "budget", None)
    return SimPolicy(
        name=name,
        plan=lambda snapshot, now: core_plan(snapshot, policy, now),
        window_rank=index_rank,
        stop=StopModel.CHECKPOINT_GATED,
        checkpoint_max_age_s=float(knobs.checkpoint_max_age_s),
        checkpoint_poll_s=float(knobs.checkpoint_poll_s),
        checkpoint_wait_max_s=float(knobs.checkpoint_wait_max_s),
        spare_on_timeout=knobs.on_checkpoint_timeout is CheckpointTimeoutAction.SPARE,
        replan_every_s=RECONCILE_EVERY_S,
        usage_half_life_s=fair_share.half_life_s if fair_share is not None and fair_share.enabled else None,
        history_window_s=budget.window_s if budget is not None else None,
        declares_overhead=True,
        source="preemptor.core.planner.plan with preemptor.core.policy.Policy",
        knobs=policy.model_dump(mode="json"),
    )


# --------------------------------------------------------------------------- baselines


def fifo_policy() -> SimPolicy:
    """`fifo`: one queue, first come first served, no priority, no preemption.

    AWS Batch with a single job queue (FIFO scheduling policy) for everyone: jobs are
    dispatched in submission order; "a job is dispatched from a queue only if resources are
    available when the queue is evaluated", otherwise the evaluation moves on (AWS Batch
    API, JobQueueDetail.priority). So a job that does not fit does not hold capacity back.
    """
    return SimPolicy(
        name="fifo",
        plan=_greedy(rank=submission_rank, eligible=_never, victim_order=None, fill_back=False),
        window_rank=submission_rank,
        source="AWS Batch FIFO job queue: dispatch in submission order when resources are available",
    )


def priority_policy() -> SimPolicy:
    """`priority`: strict priority, no preemption (AWS Batch job-queue priority).

    One Batch job queue per tier sharing a compute environment: "job queues with a higher
    priority are evaluated first"; within a queue, FIFO; a job is dispatched only if
    resources are available, nothing running is ever stopped for it (AWS Batch
    CreateJobQueue `priority`, JobQueueDetail). Running jobs keep their GPUs until they end.
    """
    return SimPolicy(
        name="priority",
        plan=_greedy(rank=index_rank, eligible=_never, victim_order=None, fill_back=False),
        source="AWS Batch job queue priority: higher queues evaluated first, no preemption",
    )


def blunt_policy() -> SimPolicy:
    """`blunt`: the mission's SageMaker story, a script that kills the newest lower-priority jobs.

    Plain SageMaker training jobs have no priority; the do-it-yourself answer is a script
    that, when an important job cannot start, calls StopTrainingJob on the most recently
    started jobs of lower priority until it fits, without looking at checkpoints and without
    dropping victims it turned out not to need (no fill-back).
    """
    return SimPolicy(
        name="blunt",
        plan=_greedy(rank=index_rank, eligible=_lower_priority, victim_order=_newest_first, fill_back=False),
        source="StopTrainingJob on the newest lower-priority jobs until the job fits",
    )


def kueue_policy() -> SimPolicy:
    """`kueue`: Kueue's classical preemption with `withinClusterQueue: LowerPriority`.

    Victims are workloads of strictly lower priority (LowerPriority). Candidates are ordered
    as in kueue `pkg/scheduler/preemption/common/ordering.go` (`CandidatesOrdering`):
    already evicted first (here: jobs being stopped, whose GPUs the preemptor claims
    before any new victim), lower priority first, then most recently admitted
    (`QuotaReserved` transition time) first, then UID. Kueue takes candidates in that order
    until the preemptor fits, then fills back (`pkg/scheduler/preemption/preemption.go`:
    walks the chosen targets in reverse and drops those it still fits without). Eviction
    ignores checkpoints (kueue#477): the pods get their termination grace period.
    """
    return SimPolicy(
        name="kueue",
        plan=_greedy(rank=index_rank, eligible=_lower_priority, victim_order=_kueue_order, fill_back=True),
        source="kueue pkg/scheduler/preemption: LowerPriority, priority then most recent admission, fill-back",
    )


SLURM_PREEMPT_EXEMPT_S = 1800.0
SLURM_SCHED_INTERVAL_S = 60.0  # slurm.conf SchedulerParameters sched_interval default


def slurm_policy(preempt_exempt_s: float = SLURM_PREEMPT_EXEMPT_S) -> SimPolicy:
    """`slurm`: Slurm's preempt/qos plugin with PreemptMode=REQUEUE and PreemptExemptTime.

    One QOS per tier; a QOS may preempt the lower ones. `find_preemptable_jobs` in
    `src/plugins/preempt/qos/preempt_qos.c` sorts candidates by `_gen_job_prio`: QOS
    priority in the high bits, job size (node count; GPUs here) in the low bits, so the
    lowest tier goes first and, within it, the smallest job. Jobs that have run less than
    PreemptExemptTime are not candidates (slurm.conf; 0, i.e. off, by default; set to 30
    minutes here as sites that protect fresh jobs do). Candidates are taken in order until
    the job fits; the victims are requeued (killed after GraceTime, checkpoints ignored).
    Because a job becomes a candidate when its exemption ends, with no event, the
    simulator also plans every `sched_interval` (60 s), as slurmctld's main loop does.
    """
    def eligible(job: PendingJob, victim: RunningJob, now: float) -> bool:
        return victim.priority < job.priority and now - victim.started_at >= preempt_exempt_s

    return SimPolicy(
        name="slurm",
        plan=_greedy(rank=index_rank, eligible=eligible, victim_order=_slurm_order, fill_back=False),
        replan_every_s=SLURM_SCHED_INTERVAL_S,
        source="slurm preempt/qos: lowest QOS then smallest job; PreemptExemptTime; PreemptMode=REQUEUE",
        knobs={"preempt_exempt_s": preempt_exempt_s},
    )


def oracle_policy() -> SimPolicy:
    """`oracle`: instant, free preemption, the lower bound on waiting.

    Preemption costs nothing and takes no time (no grace, no lost work, no restart
    overhead, no relaunch delay), so a job is never held back by a job of lower priority:
    each job sees only jobs of its own or higher priority. No real system can do better
    on waiting; the gap between it and a policy is what that policy's preemptions cost.
    """
    return SimPolicy(
        name="oracle",
        plan=_greedy(rank=index_rank, eligible=_lower_priority, victim_order=_kueue_order, fill_back=True),
        stop=StopModel.FREE,
        source="idealised preemptive priority scheduling: preemption is instant and free",
    )


BASELINES: dict[str, Callable[[], SimPolicy]] = {
    "fifo": fifo_policy,
    "priority": priority_policy,
    "blunt": blunt_policy,
    "kueue": kueue_policy,
    "slurm": slurm_policy,
    "oracle": oracle_policy,
}
POLICY_NAMES: tuple[str, ...] = ("preemptor", *BASELINES)


def _ours_without_aging() -> SimPolicy:
    """Ours with the default Policy except aging (no rise, no starvation rule): a diagnostic
    that separates what aging does from what checkpoint-aware victim choice does."""
    return preemptor_policy(Policy(aging={"rate_per_hour": 0, "starving_after_s": None}), name="preemptor-no-aging")


# Variants of ours the bench may add as extra columns; never counted as baselines.
VARIANTS: dict[str, Callable[[], SimPolicy]] = {"preemptor-no-aging": _ours_without_aging}


def policy_by_name(name: str) -> SimPolicy:
    if name == "preemptor":
        return preemptor_policy()
    factory = BASELINES.get(name) or VARIANTS.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)} or a Policy JSON file")
    return factory()


# --------------------------------------------------------------------------- the shared planner

Eligible = Callable[[PendingJob, RunningJob, float], bool]


def _never(job: PendingJob, victim: RunningJob, now: float) -> bool:
    return False


def _lower_priority(job: PendingJob, victim: RunningJob, now: float) -> bool:
    return victim.priority < job.priority


def _newest_first(victim: RunningJob, now: float) -> tuple:
    return (-victim.started_at, victim.name)


def _kueue_order(victim: RunningJob, now: float) -> tuple:
    return (victim.priority, -victim.started_at, victim.name)


def _slurm_order(victim: RunningJob, now: float) -> tuple:
    return (victim.priority, victim.gpus, victim.name)


def _greedy(
    *,
    rank: Callable[[PendingJob], tuple],
    eligible: Eligible,
    victim_order: Callable[[RunningJob, float], tuple] | None,
    fill_back: bool,
) -> Planner:
    """A planner with the core's mechanics and the given ranking and victim rules.

    Pending jobs are taken in `rank` order. A job that fits the free GPUs is admitted. One
    that does not first claims the free GPUs and those of jobs being stopped; if that is
    not enough, it takes victims in `victim_order` among the running jobs `eligible` lets
    it preempt, until it fits, then (if `fill_back`) drops, last first, every victim it
    still fits without. A job that cannot fit even with all eligible victims claims
    nothing, so lower-ranked jobs may use the free GPUs.
    """

    def plan(snapshot: Snapshot, now: float) -> Decision:
        admits: list[Admission] = []
        preemptions: list[Preemption] = []
        explanations: list[Explanation] = []
        for pool in snapshot.pools:
            running = [j for j in snapshot.running if j.pool == pool.name]
            free = max(0, pool.gpus - sum(j.gpus for j in running))
            releasing = sum(j.gpus for j in running if j.stopping)
            candidates = [j for j in running if not j.stopping]
            if victim_order is not None:
                candidates.sort(key=lambda j: victim_order(j, now))
            # Eligibility depends on the preemptor only through its priority (and `now`):
            # cache the eligible list per priority until the candidates change.
            eligible_by_priority: dict[int, tuple[list[RunningJob], int]] = {}
            pending = sorted((j for j in snapshot.pending if j.pool == pool.name), key=rank)
            for job in pending:
                if job.gpus > pool.gpus:
                    explanations.append(
                        Explanation(job.name, Verdict.SKIP, Reason.LARGER_THAN_POOL, f"needs {job.gpus} GPUs")
                    )
                    continue
                if job.gpus <= free:
                    free -= job.gpus
                    admits.append(Admission(job.name, pool.name, job.gpus, Reason.FITS_FREE_CAPACITY))
                    continue
                available = free + releasing
                if available >= job.gpus:
                    releasing -= job.gpus - free
                    free = 0
                    continue
                if victim_order is None:
                    continue
                cached = eligible_by_priority.get(job.priority)
                if cached is None:
                    allowed = [v for v in candidates if eligible(job, v, now)]
                    cached = (allowed, sum(v.gpus for v in allowed))
                    eligible_by_priority[job.priority] = cached
                allowed, allowed_gpus = cached
                if available + allowed_gpus < job.gpus:
                    continue  # cannot fit even with every eligible victim: claims nothing
                chosen: list[RunningJob] = []
                covered = available
                for victim in allowed:
                    if covered >= job.gpus:
                        break
                    chosen.append(victim)
                    covered += victim.gpus
                if fill_back:
                    for victim in reversed(list(chosen)):
                        if covered - victim.gpus >= job.gpus:
                            chosen.remove(victim)
                            covered -= victim.gpus
                victim_gpus = sum(v.gpus for v in chosen)
                still_needed = max(0, job.gpus - victim_gpus)
                from_free = min(free, still_needed)
                free -= from_free
                releasing -= still_needed - from_free
                releasing += max(0, victim_gpus - job.gpus)
                names = {v.name for v in chosen}
                candidates = [v for v in candidates if v.name not in names]
                eligible_by_priority.clear()
                for victim in chosen:
                    age = None if victim.last_checkpoint_at is None else max(0.0, now - victim.last_checkpoint_at)
                    preemptions.append(
                        Preemption(
                            victim=victim.name,
                            preemptor=job.name,
                            pool=pool.name,
                            gpus=victim.gpus,
                            reason=Reason.LOWER_PRIORITY_VICTIM,
                            lost_gpu_seconds=victim.lost_gpu_seconds(now),
                            checkpoint_age_s=age,
                        )
                    )
        return Decision(tuple(admits), tuple(preemptions), tuple(explanations))

    return plan
