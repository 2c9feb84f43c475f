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
from operator import attrgetter
from typing import Callable, Iterable, NamedTuple

from .model import PendingJob, Reason, Snapshot, run_usage
from .policy import MAX_PRIORITY, AgingCap, Policy, PoolPolicy


class RankedJob(NamedTuple):
    """A pending job with the priorities the planner derived for it.

    A named tuple: one is built for every pending job on every plan, by `rank_pool` with
    `tuple.__new__` and all its fields (0.10 against 0.17 us for a slotted class's
    `__init__`, timeit). `notes` are the adjustments told on the job's rank lines (the caps,
    the handover); `adjustments` adds how aging raised it, written only when asked for
    (`explain`), as the planner never prints it and nearly every job of a long queue is aged.
    """

    job: PendingJob
    claimed: int  # its priority after the SLA and spot caps: what it may preempt with
    effective: int  # claimed plus aging: what orders the queue
    team_usage: float  # decayed GPU-seconds of its team (0 when fair share is off)
    rank_priority: int  # what orders it (`rank_key`): the effective priority, or its tier's top for a handover
    notes: tuple[tuple[Reason, str], ...] = ()  # the caps, then the handover
    handover: bool = False  # victims were stopped for it: it is placed first in its tier
    aged_by: "ClaimRules | None" = None  # the rules that aged it (None: not aged)
    waited_s: float = 0.0  # how long it had waited when it was aged

    @property
    def adjustments(self) -> tuple[tuple[Reason, str], ...]:
        """How its priority was derived, in order: the caps, aging, the handover."""
        if self.aged_by is None:
            return self.notes
        aged = (Reason.AGED, self.aged_by.aging_note(self.claimed, self.effective, self.waited_s))
        if self.handover:  # the handover note is the last one
            return (*self.notes[:-1], aged, self.notes[-1])
        return (*self.notes, aged)


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
        self.starving_after = knobs.aging.starving_after_s

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

    def starving(self, waited_s: float) -> bool:
        """Whether a job that waited `waited_s` is starving (`aging.starving_after_s`)."""
        return self.starving_after is not None and waited_s >= self.starving_after

    def aging_note(self, claimed: int, effective: int, waited_s: float) -> str:
        """How aging raised a job from `claimed` to `effective` (`rank_pool`), for `explain`."""
        why = "starving: uncapped" if self.starving(waited_s) else f"capped at {self.cap_for(max(0, min(MAX_PRIORITY, claimed)))}"
        return f"waited {waited_s:.0f} s at {self.aging.rate_per_hour:g}/h: {claimed} -> {effective} ({why})"


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
    is on: a long queue of alike jobs costs one object per job. The sort is `rank_key`'s
    without a key tuple per job: the jobs, sorted once by submission (stably: ties stay in
    queue order), are grouped by its first three keys (without aging, a handful of
    priorities times teams), so each group is in submission order; only where submission
    times tie is each group sorted by name then, stably, by submission again.
    """
    rules = ClaimRules.of(knobs, policy)
    fair, caps, ages = knobs.fair_share.enabled, rules.caps, rules.ages
    window = handover_window_s(knobs)
    gated = bool(rules.gated)
    rate, starving_after, floor = rules.aging.rate_per_hour, rules.starving_after, math.floor
    # What a job claims, its cap notes and aging's cap on it, by what decides them: the
    # (priority, SLA, spot) of a job a cost rule may apply to, else its priority alone.
    claims: dict[object, tuple[int, tuple[tuple[Reason, str], ...], int]] = {}
    groups: dict[tuple[int, bool, float], list[RankedJob]] = {}
    ordered = sorted(pending, key=_submitted)
    ties = len(set(map(_submitted, ordered))) < len(ordered)  # two jobs share a submission time
    for job in ordered:
        submitted = job.submitted_at
        priority = job.priority
        if caps and (gated or job.spot):  # otherwise no cost rule applies (`ClaimRules.claim`)
            ck = (priority, job.sla_s, job.spot)
            hit = claims.get(ck)
            if hit is None:
                claimed, why = rules.claim(priority, job.sla_s, job.spot)
                hit = claims[ck] = (claimed, tuple(why), rules.cap_for(max(0, min(MAX_PRIORITY, claimed))))
        else:
            hit = claims.get(priority)
            if hit is None:
                hit = claims[priority] = (priority, (), rules.cap_for(max(0, min(MAX_PRIORITY, priority))))
        claimed, notes, cap = hit
        effective, aged_by, waited = claimed, None, 0.0
        if ages:
            # Aging: `rate_per_hour` whole points per hour waited, capped at `cap_for`,
            # uncapped once starving; inline, as it runs for every job.
            waited = now - submitted
            if waited > 0:
                effective = claimed + floor(rate * waited / 3600.0 + 1e-9)
                if effective > cap and (starving_after is None or waited < starving_after):
                    effective = cap
                elif effective > MAX_PRIORITY:
                    effective = MAX_PRIORITY
                if effective > claimed:
                    aged_by = rules
                else:
                    effective = claimed
        nominated = job.nominated_at
        if nominated is not None and 0 <= now - nominated <= window:
            handover = True
            notes = (*notes, (Reason.CAPACITY_FREED_FOR_IT, f"victims were stopped for it {now - nominated:.0f} s ago: placed first"))
            order = max(effective, rules.tier_ceiling(claimed))
        else:
            handover, order = False, effective
        team_use = usage.get(job.team, 0.0) if fair else 0.0
        ranked = _new(RankedJob, (job, claimed, effective, team_use, order, notes, handover, aged_by, waited))
        key = (-order, not handover, team_use)
        group = groups.get(key)
        if group is None:
            groups[key] = [ranked]
        else:
            group.append(ranked)
    queue: list[RankedJob] = []
    for key in sorted(groups):
        group = groups[key]
        if ties and len(group) > 1:  # by name among jobs submitted at the same time
            group.sort(key=_by_name)
            group.sort(key=_by_submission)
        queue += group
    return queue


_new = tuple.__new__  # a RankedJob in one call, all fields given, in field order
_submitted = attrgetter("submitted_at")
_by_name = attrgetter("job.name")
_by_submission = attrgetter("job.submitted_at")


def ranked_by(key: Callable[[PendingJob], tuple]) -> Ranker:
    """A ranking by a plain key over the job: its own priority is what it claims and what
    orders it (no caps, no aging, no fair share, no handover)."""

    def rank(pending: Iterable[PendingJob], knobs: PoolPolicy, policy: Policy, now: float, usage: dict[str, float]) -> list[RankedJob]:
        return [RankedJob(job, job.priority, job.priority, 0.0, job.priority) for job in sorted(pending, key=key)]

    return rank


__all__ = ["ClaimRules", "RankedJob", "Ranker", "handover_window_s", "rank_key", "rank_pool", "ranked_by", "team_usage"]
