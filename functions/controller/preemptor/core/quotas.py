"""Quotas and borrowing: what each team's work uses of a pool while the planner plans it.

A quota (team, tier or the whole team) has a nominal share, a ceiling (nominal plus what
it may borrow) and GPUs it keeps unlent. Within a quota, the highest-priority,
longest-running work fills the nominal share first; whatever runs above it runs on
borrowed capacity, which another team within its own nominal quota may reclaim.
A pool without quotas has no buckets: every fit test is a plain capacity test.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from .model import RunningJob
from .policy import Policy, Quota, ReclaimMode


@dataclass(eq=False)
class Bucket:
    """The usage of one quota (team, tier) in a pool during planning."""

    key: tuple[str, str | None]
    nominal: int
    ceiling: float
    kept: int
    used: int = 0
    candidate_gpus: int = 0  # GPUs of its running jobs that may still be chosen as victims

    def unused_kept(self, used: int | None = None) -> int:
        unused = self.kept - (self.used if used is None else used)
        return unused if unused > 0 else 0  # max(0, unused): the fit test's inner loop

    def label(self) -> str:
        team, tier = self.key
        return team if tier is None else f"{team}/{tier}"

    def ceiling_label(self) -> int | str:
        return "unlimited" if math.isinf(self.ceiling) else int(self.ceiling)


def _unlimited_bucket(team: str) -> Bucket:
    # A team without a quota entry runs entirely on borrowed capacity.
    return Bucket((team, "*"), nominal=0, ceiling=math.inf, kept=0)


_NEVER = ReclaimMode.NEVER  # bound once: an enum class attribute costs a call on Python 3.11 (`may_reclaim` runs per job that waits)

# GPUs given back per quota by the victims chosen so far: id(bucket) -> (bucket, GPUs).
Freed = dict[int, tuple[Bucket, int]]


class Quotas:
    """The quota state of one pool: every bucket's usage, which running jobs borrow, and
    the GPUs quotas keep unlent (`reserved_total`)."""

    def __init__(self, quotas: tuple[Quota, ...], policy: Policy, running: list[RunningJob], claimed: dict[str, int]):
        self.policy = policy
        self.on = bool(quotas)
        self.buckets: dict[tuple[str, str | None], Bucket] = {
            q.key: Bucket(q.key, q.nominal_gpus, q.ceiling, q.kept) for q in quotas
        }
        self.bucket_of: dict[str, Bucket | None] = {}
        # (team, priority) -> its bucket, as `bucket_for` found it (the planner reads it per job)
        self.by_claim: dict[tuple[str, int], Bucket] = {}
        self.borrowed: set[str] = set()
        self.reserved_total = 0
        if not self.on:
            for v in running:
                self.bucket_of[v.name] = None
            return
        members: dict[int, list[RunningJob]] = defaultdict(list)
        by_claim = self.by_claim
        for v in running:
            bucket = by_claim.get((v.team, claimed[v.name]))  # `bucket_for`, its look-up inline
            if bucket is None:
                bucket = self.bucket_for(v.team, claimed[v.name])
            self.bucket_of[v.name] = bucket
            if not v.stopping:  # a job being stopped no longer counts against its quota
                bucket.used += v.gpus
                members[id(bucket)].append(v)
        for jobs in members.values():
            bucket = self.bucket_of[jobs[0].name]
            total = 0
            # Decorated, not keyed: no call per job (names are unique, so `v` is never compared).
            for _, _, _, v in sorted([(-claimed[j.name], j.started_at, j.name, j) for j in jobs]):
                total += v.gpus
                if total > bucket.nominal:
                    self.borrowed.add(v.name)
        self.reserved_total = sum(b.unused_kept() for b in self.buckets.values())

    def bucket_for(self, team: str, priority: int) -> Bucket | None:
        """The quota a job of `team` at `priority` counts against: its tier's, else its team's."""
        if not self.on:
            return None
        hit = self.by_claim.get((team, priority))
        if hit is not None:
            return hit
        tier = self.policy.tier_of(priority)
        bucket = self.buckets.get((team, tier)) or self.buckets.get((team, None))
        if bucket is None:
            bucket = self.buckets.setdefault((team, "*"), _unlimited_bucket(team))
        self.by_claim[(team, priority)] = bucket
        return bucket

    def set_used(self, bucket: Bucket | None, used: int) -> None:
        if bucket is None:
            return
        # `bucket.unused_kept(used) - bucket.unused_kept()`, inline: once per victim and per hold
        after, before = bucket.kept - used, bucket.kept - bucket.used
        self.reserved_total += (after if after > 0 else 0) - (before if before > 0 else 0)
        bucket.used = used

    def kept_by_others(self, bucket: Bucket) -> int:
        """GPUs the other quotas keep unlent."""
        return self.reserved_total - bucket.unused_kept()

    def fits(self, bucket: Bucket | None, gpus: int, physical: int, freed: Freed) -> tuple[bool, str]:
        """Whether `gpus` fit in `physical` GPUs and the quota, with `freed` GPUs given back per quota.

        Quota test: the job's quota stays under nominal + borrowing limit, and the GPUs other
        quotas keep for themselves (nominal - lending limit, unused) are not taken.
        Returns (fits, what is short: "capacity" or "quota").
        """
        if gpus > physical:
            return False, "capacity"
        if bucket is None:
            return True, ""
        own_used = bucket.used - freed[id(bucket)][1] if id(bucket) in freed else bucket.used
        if own_used + gpus > bucket.ceiling:
            return False, "quota"
        reserved = self.reserved_total
        for b, amount in freed.values():
            # `b.unused_kept(b.used - amount) - b.unused_kept()`, inline: for every quota a
            # walk's victims gave GPUs back to, at every fit test of the walk
            after, before = b.kept - b.used + amount, b.kept - b.used
            reserved += (after if after > 0 else 0) - (before if before > 0 else 0)
        kept = bucket.kept - own_used  # `bucket.unused_kept(own_used)`, inline: this runs for every victim a walk takes
        others = reserved - (kept if kept > 0 else 0)
        if gpus > physical - others:
            return False, "quota"
        return True, ""

    def may_reclaim(self, bucket: Bucket | None, gpus: int, mode: ReclaimMode) -> bool:
        """A job reclaims borrowed capacity when its quota, with it, stays within nominal."""
        return bucket is not None and mode is not _NEVER and bucket.used + gpus <= bucket.nominal

    def borrowed_above_nominal(self, bucket: Bucket | None, gpus: int) -> int:
        """How many of `gpus` more would run above the quota's nominal share."""
        if bucket is None:
            return 0
        return max(0, bucket.used + gpus - bucket.nominal) - max(0, bucket.used - bucket.nominal)


__all__ = ["Bucket", "Freed", "Quotas"]
