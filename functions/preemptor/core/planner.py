"""The scheduler's judgement: `plan(snapshot, policy, now) -> Decision`.

Pure: no I/O, no clock, no randomness. The same snapshot, policy and `now` always give the
same decision, and the snapshot is never mutated. Side effects (reserving capacity,
stopping victims, launching jobs) are carried out by the workflows from the decision.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .model import (
    Admission,
    Decision,
    Explanation,
    PendingJob,
    Pool,
    Preemption,
    Reason,
    RunningJob,
    Snapshot,
    Verdict,
)
from .policy import Policy, PreemptionMode


def rank_key(job: PendingJob) -> tuple:
    """Order of pending work: higher priority first, then earlier submission, then name."""
    return (-job.priority, job.submitted_at, job.name)


def victim_key(victim: RunningJob, now: float) -> tuple:
    """Order in which running jobs are offered as victims.

    1. lowest priority first;
    2. least work lost by a stop (GPUs x seconds since the last checkpoint);
    3. most recently started first (it has the least sunk cost besides the lost work);
    4. name, unique, as the final tie-breaker.
    """
    return (victim.priority, victim.lost_gpu_seconds(now), -victim.started_at, victim.name)


def may_preempt(preemptor: PendingJob, victim: RunningJob, policy: Policy) -> bool:
    """Whether the policy lets `preemptor` stop `victim` (Kueue's preemption modes)."""
    mode = policy.within_team if preemptor.team == victim.team else policy.across_teams
    if mode is PreemptionMode.NEVER:
        return False
    if victim.priority < preemptor.priority:
        return True
    if mode is PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY:
        return victim.priority == preemptor.priority and victim.started_at > preemptor.submitted_at
    return False


@dataclass
class _PoolState:
    """Mutable working copy of one pool during planning (never escapes `plan`)."""

    pool: Pool
    free: int
    releasing: int  # GPUs held by jobs already being stopped, not yet claimed by a preemptor
    candidates: list[RunningJob] = field(default_factory=list)


def plan(snapshot: Snapshot, policy: Policy, now: float) -> Decision:
    """Decide which pending jobs to admit and which running jobs to preempt for them.

    Pools are planned independently. Within a pool, pending jobs are taken in `rank_key`
    order. A job that fits the free capacity is admitted. One that does not is nominated:
    it claims the free GPUs and the GPUs of jobs already being stopped, and, if that is not
    enough, preempts victims chosen in `victim_key` order among the running jobs the
    policy lets it preempt, until it fits; the chosen set is then filled back (walked in
    reverse, dropping every victim it still fits without), so no unneeded job is stopped.
    A nominated job holds its claim: jobs ranked below it cannot take the capacity it is
    waiting for. A job that cannot fit even with every eligible victim claims nothing,
    and lower-ranked jobs may use the free capacity (backfill).
    """
    admits: list[Admission] = []
    preemptions: list[Preemption] = []
    explanations: list[Explanation] = []

    pools = {pool.name: pool for pool in snapshot.pools}
    states: dict[str, _PoolState] = {}
    running_by_pool: dict[str, list[RunningJob]] = defaultdict(list)
    for job in snapshot.running:
        running_by_pool[job.pool].append(job)
    for name, pool in pools.items():
        jobs = running_by_pool[name]
        used = sum(j.gpus for j in jobs)
        states[name] = _PoolState(
            pool=pool,
            free=max(0, pool.gpus - used),
            releasing=sum(j.gpus for j in jobs if j.stopping),
            candidates=sorted((j for j in jobs if not j.stopping), key=lambda j: victim_key(j, now)),
        )

    for job in sorted(snapshot.pending, key=rank_key):
        state = states.get(job.pool)
        if state is None:
            explanations.append(
                Explanation(job.name, Verdict.SKIP, Reason.UNKNOWN_POOL, f"pool {job.pool!r} is not configured")
            )
            continue
        if job.gpus > state.pool.gpus:
            explanations.append(
                Explanation(
                    job.name,
                    Verdict.SKIP,
                    Reason.LARGER_THAN_POOL,
                    f"needs {job.gpus} GPUs, pool {state.pool.name} has {state.pool.gpus}",
                )
            )
            continue
        if job.gpus <= state.free:
            state.free -= job.gpus
            admits.append(Admission(job.name, job.pool, job.gpus, Reason.FITS_FREE_CAPACITY))
            explanations.append(
                Explanation(
                    job.name,
                    Verdict.ADMIT,
                    Reason.FITS_FREE_CAPACITY,
                    f"{job.gpus} GPUs fit; {state.free} left free in {job.pool}",
                )
            )
            continue
        _nominate(job, state, policy, now, preemptions, explanations)

    return Decision(tuple(admits), tuple(preemptions), tuple(explanations))


def _nominate(
    job: PendingJob,
    state: _PoolState,
    policy: Policy,
    now: float,
    preemptions: list[Preemption],
    explanations: list[Explanation],
) -> None:
    """Claim capacity for a job that does not fit now, preempting victims if needed."""
    available = state.free + state.releasing
    if available >= job.gpus:
        claimed_from_releasing = job.gpus - state.free
        state.free = 0
        state.releasing -= claimed_from_releasing
        explanations.append(
            Explanation(
                job.name,
                Verdict.WAIT,
                Reason.WAITING_FOR_PREEMPTED_CAPACITY,
                f"{claimed_from_releasing} of its {job.gpus} GPUs are held by jobs being stopped",
            )
        )
        return

    eligible = [v for v in state.candidates if may_preempt(job, v, policy)]
    chosen: list[RunningJob] = []
    covered = available
    for victim in eligible:
        if covered >= job.gpus:
            break
        chosen.append(victim)
        covered += victim.gpus
    if covered < job.gpus:
        explanations.append(
            Explanation(
                job.name,
                Verdict.WAIT,
                Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS,
                f"needs {job.gpus} GPUs; {state.free} free, {state.releasing} being freed, "
                f"{covered - available} held by {len(eligible)} job(s) it may preempt",
            )
        )
        return

    # Fill back: the last chosen are the most expensive to stop, so try dropping them first.
    for victim in reversed(list(chosen)):
        if covered - victim.gpus >= job.gpus:
            chosen.remove(victim)
            covered -= victim.gpus

    victim_gpus = sum(v.gpus for v in chosen)
    still_needed = max(0, job.gpus - victim_gpus)  # taken from free, then from releasing
    from_free = min(state.free, still_needed)
    state.free -= from_free
    state.releasing -= still_needed - from_free
    # Surplus from the victims becomes capacity being freed that the next jobs can claim.
    state.releasing += max(0, victim_gpus - job.gpus)
    chosen_names = {v.name for v in chosen}
    state.candidates = [v for v in state.candidates if v.name not in chosen_names]

    for victim in chosen:
        age = None if victim.last_checkpoint_at is None else max(0.0, now - victim.last_checkpoint_at)
        preemptions.append(
            Preemption(
                victim=victim.name,
                preemptor=job.name,
                pool=job.pool,
                gpus=victim.gpus,
                reason=Reason.LOWER_PRIORITY_VICTIM,
                lost_gpu_seconds=victim.lost_gpu_seconds(now),
                checkpoint_age_s=age,
            )
        )
        explanations.append(
            Explanation(
                victim.name,
                Verdict.PREEMPT,
                Reason.LOWER_PRIORITY_VICTIM,
                f"priority {victim.priority} < {job.priority} of {job.name}; stopping it loses "
                f"{victim.lost_gpu_seconds(now):.0f} GPU-seconds",
            )
        )
    explanations.append(
        Explanation(
            job.name,
            Verdict.WAIT,
            Reason.PREEMPTS_LOWER_PRIORITY,
            f"needs {job.gpus} GPUs; preempting {', '.join(v.name for v in chosen) or 'nothing new'}",
        )
    )
