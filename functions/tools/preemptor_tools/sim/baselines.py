"""The policies the simulator replays: ours (the real core planner) and the competitors'.

Every policy is a `SimPolicy`: a planner with the core's signature, `(Snapshot, now) ->
Decision`, plus the way its victims are stopped (`StopModel`). The simulator's loop is the
same for all of them; only the planner and the stop model change.

- `preemptor`: `preemptor.core.planner.plan` itself, with a `Policy` (defaults, or a JSON
  file), and the checkpoint protocol of the workflows: a victim is stopped at once when
  its newest checkpoint is fresh, otherwise after a requested checkpoint is confirmed.
- the baselines below run the same core planner, so they share its mechanics (rank
  order, admit what fits, a nominated job claims the GPUs of jobs being stopped, the
  victim walk, fill-back, a job that cannot fit even with every eligible victim claims
  nothing, so lower-ranked jobs may backfill). Each is only what the system it stands for
  does differently: its ranking and victim order (a `Discipline`), who may be a victim
  and what exempts a job (a `Policy`), and how a victim is stopped (a `StopModel`). Each
  docstring cites the behaviour it reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from preemptor.core.model import Decision, PendingJob, RunningJob, Snapshot
from preemptor.core.planner import Discipline
from preemptor.core.planner import plan as core_plan
from preemptor.core.policy import CheckpointTimeoutAction, Policy, PreemptionMode, history_window_s
from preemptor.core.ranking import ranked_by

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
        history_window_s=history_window_s(knobs),
        declares_overhead=True,
        source="preemptor.core.planner.plan with preemptor.core.policy.Policy",
        knobs=policy.model_dump(mode="json"),
    )


# --------------------------------------------------------------------------- baselines
#
# A baseline is the core planner (`preemptor.core.planner.plan`, the same admission, claim,
# victim walk, fill-back and surplus accounting as ours) under a `Discipline` (its ranking,
# its victim order, whether it fills back) and a `Policy` that states who may preempt whom
# (the modes) and what protects a job (e.g. Slurm's PreemptExemptTime as `min_runtime_s`),
# with ours' extras switched off: no aging, no fair share, no SLA or spot caps, no budget,
# no delay, no quotas, no checkpoints asked ahead. What differs from ours is only what the
# system it stands for does.


def _rules(mode: PreemptionMode, **knobs) -> Policy:
    """Eligibility of a baseline: `mode` within and across teams, ours' extras off."""
    return Policy(
        within_team=mode,
        across_teams=mode,
        aging={"rate_per_hour": 0, "starving_after_s": None},
        fair_share={"enabled": False},
        spot_max_priority=None,
        checkpoint_ahead={"max_jobs": 0},
        **knobs,
    )


def _on_core(discipline: Discipline, rules: Policy) -> Planner:
    """The core planner with a baseline's orders and eligibility."""
    return lambda snapshot, now: core_plan(snapshot, rules, now, discipline)


def _knobs(discipline: Discipline, rules: Policy) -> dict:
    """What the bench records of a baseline: its orders and the knobs of its eligibility."""
    return {
        "victim_order_priority_major": discipline.victims_by_priority,
        "fill_back": discipline.fill_back,
        "within_team": rules.within_team.value,
        "across_teams": rules.across_teams.value,
        "min_runtime_s": rules.min_runtime_s,
    }


def _by_priority_then_newest(victim: RunningJob, now: float, borrowed: bool, priority: int) -> tuple:
    """Kueue's candidate order (ordering.go `CandidatesOrdering`): lower priority first,
    then most recently admitted first, then a unique id."""
    return (priority, -victim.started_at, victim.name)


def _newest_first(victim: RunningJob, now: float, borrowed: bool, priority: int) -> tuple:
    """The blunt script's order: most recently started first, whatever the priority."""
    return (-victim.started_at, victim.name)


def _by_priority_then_smallest(victim: RunningJob, now: float, borrowed: bool, priority: int) -> tuple:
    """Slurm preempt/qos `_gen_job_prio`: QOS priority in the high bits, job size in the low."""
    return (priority, victim.gpus, victim.name)


# fifo and priority never preempt: their victim order is never used (Kueue's, which is cheap).
FIFO = Discipline("fifo", rank=ranked_by(submission_rank), victim_key=_by_priority_then_newest)
PRIORITY = Discipline("priority", rank=ranked_by(index_rank), victim_key=_by_priority_then_newest)
BLUNT = Discipline("blunt", rank=ranked_by(index_rank), victim_key=_newest_first, victims_by_priority=False, fill_back=False)
KUEUE = Discipline("kueue", rank=ranked_by(index_rank), victim_key=_by_priority_then_newest, fill_back=True)
SLURM = Discipline("slurm", rank=ranked_by(index_rank), victim_key=_by_priority_then_smallest, fill_back=False)
ORACLE = Discipline("oracle", rank=ranked_by(index_rank), victim_key=_by_priority_then_newest, fill_back=True)


def fifo_policy() -> SimPolicy:
    """`fifo`: one queue, first come first served, no priority, no preemption.

    AWS Batch with a single job queue (FIFO scheduling policy) for everyone: jobs are
    dispatched in submission order; "a job is dispatched from a queue only if resources are
    available when the queue is evaluated", otherwise the evaluation moves on (AWS Batch
    API, JobQueueDetail.priority). So a job that does not fit does not hold capacity back:
    on the core, ranking by submission, preemption `Never`, so a job that does not fit
    claims nothing.
    """
    rules = _rules(PreemptionMode.NEVER)
    return SimPolicy(
        name="fifo",
        plan=_on_core(FIFO, rules),
        window_rank=submission_rank,
        source="AWS Batch FIFO job queue: dispatch in submission order when resources are available",
        knobs=_knobs(FIFO, rules),
    )


def priority_policy() -> SimPolicy:
    """`priority`: strict priority, no preemption (AWS Batch job-queue priority).

    One Batch job queue per tier sharing a compute environment: "job queues with a higher
    priority are evaluated first"; within a queue, FIFO; a job is dispatched only if
    resources are available, nothing running is ever stopped for it (AWS Batch
    CreateJobQueue `priority`, JobQueueDetail). Running jobs keep their GPUs until they end:
    on the core, the index order, preemption `Never`.
    """
    rules = _rules(PreemptionMode.NEVER)
    return SimPolicy(
        name="priority",
        plan=_on_core(PRIORITY, rules),
        source="AWS Batch job queue priority: higher queues evaluated first, no preemption",
        knobs=_knobs(PRIORITY, rules),
    )


def blunt_policy() -> SimPolicy:
    """`blunt`: the mission's SageMaker story, a script that kills the newest lower-priority jobs.

    Plain SageMaker training jobs have no priority; the do-it-yourself answer is a script
    that, when an important job cannot start, calls StopTrainingJob on the most recently
    started jobs of lower priority until it fits, without looking at checkpoints and without
    dropping victims it turned out not to need: on the core, `LowerPriority`, victims
    newest first, no fill-back.
    """
    rules = _rules(PreemptionMode.LOWER_PRIORITY)
    return SimPolicy(
        name="blunt",
        plan=_on_core(BLUNT, rules),
        source="StopTrainingJob on the newest lower-priority jobs until the job fits",
        knobs=_knobs(BLUNT, rules),
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
    rules = _rules(PreemptionMode.LOWER_PRIORITY)
    return SimPolicy(
        name="kueue",
        plan=_on_core(KUEUE, rules),
        source="kueue pkg/scheduler/preemption: LowerPriority, priority then most recent admission, fill-back",
        knobs=_knobs(KUEUE, rules),
    )


SLURM_PREEMPT_EXEMPT_S = 1800.0
SLURM_SCHED_INTERVAL_S = 60.0  # slurm.conf SchedulerParameters sched_interval default


def slurm_policy(preempt_exempt_s: float = SLURM_PREEMPT_EXEMPT_S) -> SimPolicy:
    """`slurm`: Slurm's preempt/qos plugin with PreemptMode=REQUEUE and PreemptExemptTime.

    One QOS per tier; a QOS may preempt the lower ones (`LowerPriority`).
    `find_preemptable_jobs` in `src/plugins/preempt/qos/preempt_qos.c` sorts candidates by
    `_gen_job_prio`: QOS priority in the high bits, job size (node count; GPUs here) in the
    low bits, so the lowest tier goes first and, within it, the smallest job. Jobs that
    have run less than PreemptExemptTime are not candidates (slurm.conf; 0, i.e. off, by
    default; set to 30 minutes here as sites that protect fresh jobs do): on the core, the
    `min_runtime_s` protection. Candidates are taken in order until the job fits, no
    fill-back; the victims are requeued (killed after GraceTime, checkpoints ignored).
    Because a job becomes a candidate when its exemption ends, with no event, the
    simulator also plans every `sched_interval` (60 s), as slurmctld's main loop does.
    """
    rules = _rules(PreemptionMode.LOWER_PRIORITY, min_runtime_s=preempt_exempt_s)
    return SimPolicy(
        name="slurm",
        plan=_on_core(SLURM, rules),
        replan_every_s=SLURM_SCHED_INTERVAL_S,
        source="slurm preempt/qos: lowest QOS then smallest job; PreemptExemptTime; PreemptMode=REQUEUE",
        knobs={"preempt_exempt_s": preempt_exempt_s, **_knobs(SLURM, rules)},
    )


def oracle_policy() -> SimPolicy:
    """`oracle`: instant, free preemption, the lower bound on waiting.

    Preemption costs nothing and takes no time (no grace, no lost work, no restart
    overhead, no relaunch delay), so a job is never held back by a job of lower priority:
    each job sees only jobs of its own or higher priority. No real system can do better
    on waiting; the gap between it and a policy is what that policy's preemptions cost.
    On the core: Kueue's orders and eligibility; the stop model is what is free.
    """
    rules = _rules(PreemptionMode.LOWER_PRIORITY)
    return SimPolicy(
        name="oracle",
        plan=_on_core(ORACLE, rules),
        stop=StopModel.FREE,
        source="idealised preemptive priority scheduling: preemption is instant and free",
        knobs=_knobs(ORACLE, rules),
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


def _ours_with_aging() -> SimPolicy:
    """Ours with the default Policy but the former default aging (10 points per hour, no
    starvation rule): a diagnostic of what aging does under the pending window."""
    return preemptor_policy(Policy(aging={"rate_per_hour": 10, "starving_after_s": None}), name="preemptor-aging")


NEVER_S = 1e9  # a preemption delay no job waits out (31 years)


def _ours_top_tiers_only() -> SimPolicy:
    """Ours where only critical and high jobs preempt (medium and low wait for GPUs to free
    by themselves): the fewest preemptions that keep the higher tiers' waits, so its restart
    overhead is a floor under the lost GPU-hours of any policy that keeps them."""
    delays = {"medium": NEVER_S, "low": NEVER_S}
    return preemptor_policy(Policy(tier_preemption_delay_s=delays), name="preemptor-top-tiers")


# Variants of ours the bench may add as extra columns; never counted as baselines.
VARIANTS: dict[str, Callable[[], SimPolicy]] = {
    "preemptor-aging": _ours_with_aging,
    "preemptor-top-tiers": _ours_top_tiers_only,
}


def policy_by_name(name: str) -> SimPolicy:
    if name == "preemptor":
        return preemptor_policy()
    factory = BASELINES.get(name) or VARIANTS.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)} or a Policy JSON file")
    return factory()
