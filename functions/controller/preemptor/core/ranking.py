"""Ranking: the order in which the planner takes a pool's pending jobs.

Ours (`rank_pool`): claimed priority (the job's priority capped by the SLA and spot rules),
aged while it waits (aging is off by default); a job whose victims were just stopped for it
first among its equals; fair share among equal effective priority; FIFO; the name last. Other schedulers rank by a plain
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


@dataclass(slots=True)
class RankedJob:
    """A pending job with the priorities the planner derived for it.

    Not frozen, but never changed once built: one is built for every pending job on every
    plan, and a frozen dataclass costs five times as much to build. Treat it as immutable.
    """

    job: PendingJob
    claimed: int  # its priority after the SLA and spot caps: what it may preempt with
    effective: int  # claimed plus aging: what orders the queue
    team_usage: float  # decayed GPU-seconds of its team (0 when fair share is off)
    adjustments: tuple[tuple[Reason, str], ...] = ()
    handover: bool = False  # victims were stopped for it: it is placed first in its tier
    rank_priority: int | None = None  # what orders it (`rank_key`); None: `effective`

    def __post_init__(self) -> None:
        if self.rank_priority is None:
            self.rank_priority = self.effective


# (pending jobs of a pool, its knobs, the policy, now, decayed usage per team) -> ranked jobs
Ranker = Callable[[Iterable[PendingJob], PoolPolicy, Policy, float, dict[str, float]], list[RankedJob]]


def rank_key(ranked: RankedJob) -> tuple:
    """Order of pending work in a pool.

    1. higher rank priority first: the effective priority (claimed plus aging); for a job
       whose victims were just stopped for it (nominated within the handover window), the
       top of its claimed tier (`ClaimRules.tier_ceiling`);
    2. such a "handover" job before the others of the same rank priority.
    3. fair share: the team with the lower decayed usage first;
    4. FIFO: earlier submission first (a requeued victim keeps its place);
    5. name, unique, as the final tie-breaker.

    So the capacity freed for a job is its own against every job of its tier or below,
    however aged (without this, a job ranked above it by aging would take the GPUs and it
    would preempt again), but not against a job claiming a higher tier: a critical job that
    arrives meanwhile takes the GPUs freed first, as it would have preempted for them anyway,
    instead of waiting behind every handover for GPUs still being freed.
    """
    return (-ranked.rank_priority, not ranked.handover, ranked.team_usage, ranked.job.submitted_at, ranked.job.name)


class ClaimRules:
    """The priority rules of one pool, precomputed from its knobs and the tier table:
    what a job may claim (SLA and spot caps) and how aging raises it."""

    _cache: dict[tuple[int, int], tuple[PoolPolicy, Policy, "ClaimRules"]] = {}

    @classmethod
    def of(cls, knobs: PoolPolicy, policy: Policy) -> "ClaimRules":
        """The rules of `knobs` under `policy`, built once per pair (both are immutable), so
        the tier table is not rebuilt on every plan."""
        key = (id(knobs), id(policy))
        hit = cls._cache.get(key)
        if hit is not None and hit[0] is knobs and hit[1] is policy:
            return hit[2]
        if len(cls._cache) > 64:
            cls._cache.clear()
        rules = cls(knobs, policy)
        cls._cache[key] = (knobs, policy, rules)
        return rules

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
        self.caps = bool(self.gated) or self.spot_cap is not None  # some job may claim less than it asks
        self.ages = knobs.aging.rate_per_hour > 0

    def tier_ceiling(self, claimed: int) -> int:
        """One below the next tier above `claimed` (the maximum priority in the top tier)."""
        i = bisect_right(self.tiers, claimed)
        return MAX_PRIORITY if i == len(self.tiers) else self.tiers[i] - 1

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
    # `model.run_usage` inlined: one exp per running job on every plan.
    scale, rate, exp = half_life_s / math.log(2), -math.log(2) / half_life_s, math.exp
    for job in snapshot.running:
        span = now - job.started_at
        if span > 0:
            usage[job.team] += job.gpus * scale * (1.0 - exp(rate * span))
    return dict(usage)


def handover_window_s(knobs: PoolPolicy) -> float:
    """How long capacity freed by a preemption stays handed to its preemptor: the longest
    checkpoint wait and stop wait, plus ten minutes for the relaunch to be planned."""
    return knobs.checkpoint_wait_max_s + knobs.stop_wait_max_s + 600.0


def rank_pool(pending: Iterable[PendingJob], knobs: PoolPolicy, policy: Policy, now: float, usage: dict[str, float]) -> list[RankedJob]:
    """Ours: the pending jobs of one pool, ranked by `rank_key`.

    The caps are computed once per distinct (priority, SLA, spot) and aging only when it
    is on: a long queue of alike jobs costs one tuple and one object per job.
    """
    rules = ClaimRules.of(knobs, policy)
    fair = knobs.fair_share.enabled
    window = handover_window_s(knobs)
    claims: dict[tuple, tuple[int, list[tuple[Reason, str]]]] = {}
    decorated = []
    for job in pending:
        if rules.caps:
            ck = (job.priority, job.sla_s, job.spot)
            hit = claims.get(ck)
            if hit is None:
                hit = claims[ck] = rules.claim(job.priority, job.sla_s, job.spot)
            claimed, notes = hit[0], list(hit[1])
        else:
            claimed, notes = job.priority, []
        effective = claimed
        if rules.ages:
            effective, aged = rules.effective(claimed, now - job.submitted_at)
            if aged:
                notes.append((Reason.AGED, aged))
        handover = job.nominated_at is not None and 0 <= now - job.nominated_at <= window
        if handover:
            notes.append(
                (Reason.CAPACITY_FREED_FOR_IT, f"victims were stopped for it {now - job.nominated_at:.0f} s ago: placed first")
            )
        team_use = usage.get(job.team, 0.0) if fair else 0.0
        order = max(effective, rules.tier_ceiling(claimed)) if handover else effective
        ranked = RankedJob(job, claimed, effective, team_use, tuple(notes) if notes else (), handover, order)
        decorated.append(((-order, not handover, team_use, job.submitted_at, job.name), ranked))
    decorated.sort(key=_first)
    return [r for _, r in decorated]


def _first(pair: tuple) -> tuple:
    return pair[0]


def ranked_by(key: Callable[[PendingJob], tuple]) -> Ranker:
    """A ranking by a plain key over the job: its own priority is what it claims and what
    orders it (no caps, no aging, no fair share, no handover)."""

    def rank(pending: Iterable[PendingJob], knobs: PoolPolicy, policy: Policy, now: float, usage: dict[str, float]) -> list[RankedJob]:
        return [RankedJob(job, job.priority, job.priority, 0.0) for job in sorted(pending, key=key)]

    return rank


__all__ = ["ClaimRules", "RankedJob", "Ranker", "handover_window_s", "rank_key", "rank_pool", "ranked_by", "team_usage"]
