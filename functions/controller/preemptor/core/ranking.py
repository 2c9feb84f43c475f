"""Ranking: the order in which the planner takes a pool's pending jobs.

Ours (`rank_pool`): claimed priority (the job's priority capped by the SLA and spot rules),
aged while it waits; fair share among equal effective priority; FIFO; the name last; a
job whose victims were just stopped for it goes first. Other schedulers rank by a plain
key over the job (`ranked_by`): the planner's mechanics take either.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

from .model import PendingJob, Reason, Snapshot, run_usage
from .policy import MAX_PRIORITY, AgingCap, Policy, PoolPolicy


@dataclass(frozen=True, slots=True)
class RankedJob:
    """A pending job with the priorities the planner derived for it."""

    job: PendingJob
    claimed: int  # its priority after the SLA and spot caps: what it may preempt with
    effective: int  # claimed plus aging: what orders the queue
    team_usage: float  # decayed GPU-seconds of its team (0 when fair share is off)
    adjustments: tuple[tuple[Reason, str], ...] = ()
    handover: bool = False  # victims were stopped for it: it is placed before everyone else


# (pending jobs of a pool, its knobs, the policy, now, decayed usage per team) -> ranked jobs
Ranker = Callable[[Iterable[PendingJob], PoolPolicy, Policy, float, dict[str, float]], list[RankedJob]]


def rank_key(ranked: RankedJob) -> tuple:
    """Order of pending work in a pool.

    0. a job whose victims were just stopped for it (nominated within the handover window)
       first: the capacity freed for it is its own, whoever ranks above it otherwise (without
       this, a job ranked above it by aging would take the GPUs and it would preempt again);
    1. higher effective priority first (claimed priority plus aging);
    2. fair share: the team with the lower decayed usage first;
    3. FIFO: earlier submission first (a requeued victim keeps its place);
    4. name, unique, as the final tie-breaker.
    """
    return (not ranked.handover, -ranked.effective, ranked.team_usage, ranked.job.submitted_at, ranked.job.name)


class ClaimRules:
    """The priority rules of one pool, precomputed from its knobs and the tier table:
    what a job may claim (SLA and spot caps) and how aging raises it."""

    def __init__(self, knobs: PoolPolicy, policy: Policy):
        tiers = sorted(set(policy.tiers.values()))
        self.gated = sorted(
            ((policy.tiers[tier], limit, tier) for tier, limit in knobs.tier_max_sla_s.items()), reverse=True
        )
        self.below = {v: max([t for t in tiers if t < v], default=max(0, v - 1)) for v, _, _ in self.gated}
        self.spot_cap = policy.priority_value(knobs.spot_max_priority)
        self.spot_tier = policy.tier_of(self.spot_cap) if self.spot_cap is not None else None
        self.aging = knobs.aging
        self.tiers = tiers
        self.capped = knobs.aging.cap is AgingCap.BELOW_NEXT_TIER

    def cap_for(self, claimed: int) -> int:
        """The highest effective priority aging may give a job claiming `claimed`: one
        below the next tier up (`below-next-tier`), else the maximum."""
        if not self.capped:
            return MAX_PRIORITY
        i = bisect_right(self.tiers, claimed)
        return MAX_PRIORITY if i == len(self.tiers) else self.tiers[i] - 1

    def claim(self, priority: int, sla_s: float | None, spot: bool) -> tuple[int, list[tuple[Reason, str]]]:
        """The priority a job may claim: its own, capped by the cost rules.

        SLA rule: to claim a gated tier (`tier_max_sla_s`), a job must declare an SLA of
        at most the tier's limit; otherwise it is capped to the next tier below.
        Spot rule: a spot job claims at most `spot_max_priority`.
        """
        if not self.gated and not (spot and self.spot_cap is not None):
            return priority, []  # no cost rule applies
        notes: list[tuple[Reason, str]] = []
        claimed = priority
        for value, limit, tier in self.gated:
            if claimed >= value and (sla_s is None or sla_s > limit):
                capped = self.below[value]
                declared = "no SLA" if sla_s is None else f"an SLA of {sla_s:g} s"
                notes.append(
                    (Reason.SLA_CAPPED, f"{tier} needs an SLA of at most {limit:g} s; it declares {declared}: {claimed} -> {capped}")
                )
                claimed = capped
        if spot and self.spot_cap is not None and claimed > self.spot_cap:
            notes.append((Reason.SPOT_CAPPED, f"spot capacity claims at most {self.spot_tier}: {claimed} -> {self.spot_cap}"))
            claimed = self.spot_cap
        return claimed, notes

    def effective(self, claimed: int, waited_s: float) -> tuple[int, str | None]:
        """Claimed priority plus aging: `rate_per_hour` whole points per hour waited, capped."""
        rate = self.aging.rate_per_hour
        if rate <= 0 or waited_s <= 0:
            return claimed, None
        starving = self.aging.starving_after_s is not None and waited_s >= self.aging.starving_after_s
        cap = MAX_PRIORITY if starving else self.cap_for(max(0, min(MAX_PRIORITY, claimed)))
        boost = math.floor(rate * waited_s / 3600.0 + 1e-9)
        effective = max(claimed, min(cap, claimed + boost))
        if effective == claimed:
            return claimed, None
        why = "starving: uncapped" if starving else f"capped at {cap}"
        return effective, f"waited {waited_s:.0f} s at {rate:g}/h: {claimed} -> {effective} ({why})"


def team_usage(snapshot: Snapshot, now: float, half_life_s: float) -> dict[str, float]:
    """Decayed GPU-seconds per team: ended runs (`snapshot.usage`) plus the running jobs."""
    usage: dict[str, float] = defaultdict(float)
    for entry in snapshot.usage:
        usage[entry.team] += entry.decayed(now, half_life_s)
    for job in snapshot.running:
        usage[job.team] += run_usage(job.gpus, job.started_at, now, half_life_s)
    return dict(usage)


def handover_window_s(knobs: PoolPolicy) -> float:
    """How long capacity freed by a preemption stays handed to its preemptor: the longest
    checkpoint wait and stop wait, plus ten minutes for the relaunch to be planned."""
    return knobs.checkpoint_wait_max_s + knobs.stop_wait_max_s + 600.0


def rank_pool(pending: Iterable[PendingJob], knobs: PoolPolicy, policy: Policy, now: float, usage: dict[str, float]) -> list[RankedJob]:
    """Ours: the pending jobs of one pool, ranked by `rank_key`."""
    rules = ClaimRules(knobs, policy)
    fair = knobs.fair_share.enabled
    ranked = []
    window = handover_window_s(knobs)
    for job in pending:
        claimed, notes = rules.claim(job.priority, job.sla_s, job.spot)
        effective, aged = rules.effective(claimed, now - job.submitted_at)
        if aged:
            notes.append((Reason.AGED, aged))
        handover = job.nominated_at is not None and 0 <= now - job.nominated_at <= window
        if handover:
            notes.append(
                (Reason.CAPACITY_FREED_FOR_IT, f"victims were stopped for it {now - job.nominated_at:.0f} s ago: placed first")
            )
        ranked.append(
            RankedJob(job, claimed, effective, usage.get(job.team, 0.0) if fair else 0.0, tuple(notes), handover)
        )
    ranked.sort(key=rank_key)
    return ranked


def ranked_by(key: Callable[[PendingJob], tuple]) -> Ranker:
    """A ranking by a plain key over the job: its own priority is what it claims and what
    orders it (no caps, no aging, no fair share, no handover)."""

    def rank(pending: Iterable[PendingJob], knobs: PoolPolicy, policy: Policy, now: float, usage: dict[str, float]) -> list[RankedJob]:
        return [RankedJob(job, job.priority, job.priority, 0.0) for job in sorted(pending, key=key)]

    return rank


__all__ = ["ClaimRules", "RankedJob", "Ranker", "handover_window_s", "rank_key", "rank_pool", "ranked_by", "team_usage"]
