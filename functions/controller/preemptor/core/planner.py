"""The scheduler's judgement: `plan(snapshot, policy, now) -> Decision`.

Pure: no I/O, no clock, no randomness. The same snapshot, policy and `now` always give the
same decision, and the snapshot is never mutated. Side effects (reserving capacity,
stopping victims, launching jobs) are carried out by the workflows from the decision.

The steps, per pool (pools are planned independently, each with its own knobs):

1. Rank the pending jobs (`rank_key`): claimed priority (the job's priority capped by the
   SLA and spot rules), aged while it waits; fair share among equal effective priority;
   FIFO; the name last.
2. In rank order, admit every job that fits the free capacity and its team's quota.
3. A job that does not fit is nominated: it claims the free GPUs and the GPUs of jobs
   already being stopped and, if that is not enough, chooses victims (`victim_key`) among
   the running jobs it may preempt (`eligibility`), then fills back. A nominated job
   holds its claim: jobs ranked below it cannot take the capacity it waits for. The
   preemption delay and the preemption budget hold the claim without stopping anything.
4. A job that cannot fit even with every eligible victim claims nothing, so lower-ranked
   jobs may use the free capacity (backfill), unless it has been starving for longer than
   `aging.starving_after_s`, in which case it reserves what is free.

Cost: sorting (P + R) log(P + R) per pool; a Fenwick tree over priorities bounds the
GPUs a job could free, so a job that cannot fit is dismissed in O(log 1000) without
scanning the running jobs; victim scans stop at the first priority a job may not preempt.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from .model import (
    Admission,
    Decision,
    Explanation,
    Failure,
    PastPreemption,
    PendingJob,
    Pool,
    Preemption,
    PreemptionRule,
    Reason,
    RunningJob,
    Snapshot,
    TeamUsage,
    Verdict,
    run_usage,
)
from .policy import (
    MAX_PRIORITY,
    AgingCap,
    MaxPreemptionsAction,
    Policy,
    PoolPolicy,
    PreemptionMode,
    Quota,
    ReclaimMode,
)

# Candidates a preemptor skipped are listed in the decision up to this many per preemptor;
# `explain` lists them all.
MAX_SKIPPED_LINES = 8


# -- ranking ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RankedJob:
    """A pending job with the priorities the planner derived for it."""

    job: PendingJob
    claimed: int  # its priority after the SLA and spot caps: what it may preempt with
    effective: int  # claimed plus aging: what orders the queue
    team_usage: float  # decayed GPU-seconds of its team (0 when fair share is off)
    adjustments: tuple[tuple[Reason, str], ...] = ()
    handover: bool = False  # victims were stopped for it: it is placed before everyone else


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


class _Rules:
    """The ranking rules of one pool, precomputed from its knobs and the tier table."""

    def __init__(self, knobs: PoolPolicy, policy: Policy):
        tiers = sorted(set(policy.tiers.values()))
        self.gated = sorted(
            ((policy.tiers[tier], limit, tier) for tier, limit in knobs.tier_max_sla_s.items()), reverse=True
        )
        self.below = {v: max([t for t in tiers if t < v], default=max(0, v - 1)) for v, _, _ in self.gated}
        self.spot_cap = policy.priority_value(knobs.spot_max_priority)
        self.spot_tier = policy.tier_of(self.spot_cap) if self.spot_cap is not None else None
        self.aging = knobs.aging
        # cap_for[p]: the highest effective priority aging may give a job claiming p.
        self.cap_for = [MAX_PRIORITY] * (MAX_PRIORITY + 1)
        if knobs.aging.cap is AgingCap.BELOW_NEXT_TIER:
            for p in range(MAX_PRIORITY + 1):
                above = next((t for t in tiers if t > p), None)
                self.cap_for[p] = MAX_PRIORITY if above is None else above - 1
        self.tier_names = {v: n for n, v in policy.tiers.items()}

    def claim(self, priority: int, sla_s: float | None, spot: bool) -> tuple[int, list[tuple[Reason, str]]]:
        """The priority a job may claim: its own, capped by the cost rules.

        SLA rule: to claim a gated tier (`tier_max_sla_s`), a job must declare an SLA of
        at most the tier's limit; otherwise it is capped to the next tier below.
        Spot rule: a spot job claims at most `spot_max_priority`.
        """
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
        cap = MAX_PRIORITY if starving else self.cap_for[max(0, min(MAX_PRIORITY, claimed))]
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


def rank_pool(pending: Iterable[PendingJob], knobs: PoolPolicy, policy: Policy, now: float, usage: dict[str, float]) -> list[RankedJob]:
    """The pending jobs of one pool, ranked by `rank_key`."""
    rules = _Rules(knobs, policy)
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


def handover_window_s(knobs: PoolPolicy) -> float:
    """How long capacity freed by a preemption stays handed to its preemptor: the longest
    checkpoint wait and stop wait, plus ten minutes for the relaunch to be planned."""
    return knobs.checkpoint_wait_max_s + knobs.stop_wait_max_s + 600.0


def victim_key(victim: RunningJob, now: float, borrowed: bool = False, priority: int | None = None) -> tuple:
    """Order in which eligible running jobs are offered as victims.

    1. work running on borrowed quota first;
    2. lowest (claimed) priority first;
    3. least work lost: GPUs x (seconds since the last checkpoint + restart overhead);
    4. most recently started first (least sunk cost besides the lost work);
    5. name, unique, as the final tie-breaker.
    """
    return (
        not borrowed,
        victim.priority if priority is None else priority,
        victim.stop_cost_gpu_seconds(now),
        -victim.started_at,
        victim.name,
    )


def may_preempt(preemptor: PendingJob, victim: RunningJob, policy: Policy) -> bool:
    """Whether the policy's modes let `preemptor` stop `victim`, by priority alone.

    The full rule, with quotas, protections and cost caps, is `eligibility` inside `plan`.
    """
    knobs = policy.for_pool(preemptor.pool)
    mode = knobs.within_team if preemptor.team == victim.team else knobs.across_teams
    return _mode_rule(mode, preemptor.priority, preemptor.submitted_at, victim.priority, victim.started_at) is not None


def _mode_rule(mode: PreemptionMode, pj: int, submitted_at: float, pv: int, started_at: float) -> PreemptionRule | None:
    if mode is PreemptionMode.NEVER:
        return None
    if pv < pj:
        return PreemptionRule.LOWER_PRIORITY
    if mode is PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY and pv == pj and started_at > submitted_at:
        return PreemptionRule.NEWER_EQUAL_PRIORITY
    return None


# -- quotas ----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Bucket:
    """The usage of one quota (team, tier) in a pool during planning."""

    key: tuple[str, str | None]
    nominal: int
    ceiling: float
    kept: int
    used: int = 0
    candidate_gpus: int = 0  # GPUs of its running jobs that may still be chosen as victims

    def unused_kept(self, used: int | None = None) -> int:
        return max(0, self.kept - (self.used if used is None else used))

    def label(self) -> str:
        team, tier = self.key
        return team if tier is None else f"{team}/{tier}"


def _unlimited_bucket(team: str) -> _Bucket:
    # A team without a quota entry runs entirely on borrowed capacity.
    return _Bucket((team, "*"), nominal=0, ceiling=math.inf, kept=0)


class _Fenwick:
    """Sums of GPUs per priority 0..1000, with prefix sums in O(log n)."""

    def __init__(self) -> None:
        self.tree = [0] * (MAX_PRIORITY + 2)

    def add(self, priority: int, gpus: int) -> None:
        i = priority + 1
        while i < len(self.tree):
            self.tree[i] += gpus
            i += i & -i

    def prefix(self, priority: int) -> int:
        """GPUs at priorities 0..priority."""
        i, total = min(priority, MAX_PRIORITY) + 1, 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


class _Candidates:
    """Running jobs that may still be chosen as victims, indexed for bounds and scans.

    Two kinds: work on borrowed quota and the rest ("own"). Each kind has a list in
    `victim_key` order (per team for "own" work when quotas are on, since only a job's own
    team may preempt it then) and Fenwick trees of GPUs by priority, per team and overall.
    """

    def __init__(self, per_team_own: bool):
        self.per_team_own = per_team_own
        self.lists: dict[tuple[bool, str | None], list[RunningJob]] = defaultdict(list)
        self.trees: dict[tuple[bool, str | None], _Fenwick] = defaultdict(_Fenwick)
        self.totals: dict[tuple[bool, str | None], int] = defaultdict(int)

    def list_key(self, borrowed: bool, team: str) -> tuple[bool, str | None]:
        return (borrowed, team if (self.per_team_own and not borrowed) else None)

    def add(self, v: RunningJob, borrowed: bool, priority: int, sign: int = 1) -> None:
        for key in ((borrowed, v.team), (borrowed, None)):
            self.trees[key].add(priority, sign * v.gpus)
            self.totals[key] += sign * v.gpus

    def gpus(self, borrowed: bool, team: str | None, top: int) -> int:
        """GPUs of candidates of this kind (of `team`, or all when None) at priority <= top."""
        if top < 0:
            return 0
        key = (borrowed, team)
        return self.totals[key] if top >= MAX_PRIORITY else self.trees[key].prefix(top)


# -- planning one pool -----------------------------------------------------------------------
@dataclass
class _Verdict:
    """Whether a running job may be stopped for a given preemptor, and by which rule."""

    rule: PreemptionRule | None
    reason: Reason
    detail: str


@dataclass
class _Choice:
    victims: list[tuple[RunningJob, _Verdict]] = field(default_factory=list)
    skipped: list[tuple[RunningJob, _Verdict]] = field(default_factory=list)
    dropped: list[RunningJob] = field(default_factory=list)
    fits: bool = False
    short_of: str = "capacity"  # what is missing when it does not fit: capacity | quota
    scanned: dict[tuple[bool, str | None], int] = field(default_factory=dict)  # per candidate list: items looked at


class _PoolPlanner:
    """Mutable working state of one pool during planning (never escapes `plan`)."""

    def __init__(self, pool: Pool, knobs: PoolPolicy, policy: Policy, now: float, running: list[RunningJob], history: Iterable[PastPreemption]):
        self.pool, self.knobs, self.policy, self.now = pool, knobs, policy, now
        self.rules = _Rules(knobs, policy)
        self.admits: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.failures: list[Failure] = []
        self.lines: list[Explanation] = []
        self.running = running
        self.claimed = {v.name: self.rules.claim(v.priority, v.sla_s, v.spot)[0] for v in running}
        used = sum(v.gpus for v in running)
        self.free = max(0, pool.gpus - used)
        self.releasing = sum(v.gpus for v in running if v.stopping)
        self.initial_free = self.free
        self.admitted_gpus = 0
        self.held_gpus = 0  # claimed by nominated jobs ranked earlier
        self.chosen_by: dict[str, str] = {}
        self._setup_quotas(knobs.quotas)
        self._setup_candidates()
        self._setup_budget(history)
        self._protections_reported = False

    # -- setup ----------------------------------------------------------------------------
    def _setup_quotas(self, quotas: tuple[Quota, ...]) -> None:
        self.quotas_on = bool(quotas)
        self.buckets: dict[tuple[str, str | None], _Bucket] = {
            q.key: _Bucket(q.key, q.nominal_gpus, q.ceiling, q.kept) for q in quotas
        }
        self.bucket_of: dict[str, _Bucket | None] = {}
        self.borrowed: set[str] = set()
        if not self.quotas_on:
            for v in self.running:
                self.bucket_of[v.name] = None
            self.reserved_total = 0
            return
        members: dict[int, list[RunningJob]] = defaultdict(list)
        for v in self.running:
            bucket = self.bucket_for(v.team, self.claimed[v.name])
            self.bucket_of[v.name] = bucket
            if not v.stopping:  # a job being stopped no longer counts against its quota
                bucket.used += v.gpus
                members[id(bucket)].append(v)
        # Within a quota, the highest-priority, longest-running work fills the nominal
        # quota first; whatever runs above it runs on borrowed capacity.
        for jobs in members.values():
            bucket = self.bucket_of[jobs[0].name]
            total = 0
            for v in sorted(jobs, key=lambda j: (-self.claimed[j.name], j.started_at, j.name)):
                total += v.gpus
                if total > bucket.nominal:
                    self.borrowed.add(v.name)
        self.reserved_total = sum(b.unused_kept() for b in self.buckets.values())

    def bucket_for(self, team: str, priority: int) -> _Bucket | None:
        """The quota a job of `team` at `priority` counts against: its tier's, else its team's."""
        if not self.quotas_on:
            return None
        tier = self.policy.tier_of(priority)
        bucket = self.buckets.get((team, tier)) or self.buckets.get((team, None))
        if bucket is None:
            bucket = self.buckets.setdefault((team, "*"), _unlimited_bucket(team))
        return bucket

    def _set_used(self, bucket: _Bucket | None, used: int) -> None:
        if bucket is None:
            return
        self.reserved_total += bucket.unused_kept(used) - bucket.unused_kept()
        bucket.used = used

    def protection(self, v: RunningJob) -> _Verdict | None:
        """Protections that depend on the victim alone (stopping, runtime, completion, count)."""
        k, now = self.knobs, self.now
        if v.stopping:
            return _Verdict(None, Reason.ALREADY_STOPPING, "already being stopped; its GPUs are claimed first")
        if v.guaranteed:
            return _Verdict(None, Reason.STARVATION_GUARANTEE, "admitted after starving: runs to completion")
        if v.spared_until is not None and now < v.spared_until:
            return _Verdict(
                None, Reason.RECENTLY_SPARED, f"spared after a checkpoint timeout, until {v.spared_until - now:.0f} s from now"
            )
        if k.max_preemptions is not None and k.on_max_preemptions is MaxPreemptionsAction.PROTECT and v.preemptions >= k.max_preemptions:
            return _Verdict(None, Reason.MAX_PREEMPTIONS_PROTECTED, f"preempted {v.preemptions} times (max_preemptions {k.max_preemptions})")
        ran = now - v.started_at
        if ran < k.min_runtime_s:
            return _Verdict(None, Reason.MIN_RUNTIME_PROTECTED, f"running {ran:.0f} s < min_runtime_s {k.min_runtime_s:g}")
        near = k.near_completion
        if near.remaining_s is not None:
            remaining = v.remaining_s(now)
            if remaining is not None and 0 <= remaining < near.remaining_s:
                return _Verdict(None, Reason.NEAR_COMPLETION_PROTECTED, f"about {remaining:.0f} s left < {near.remaining_s:g} s")
        if near.progress is not None:
            progress = v.progress_at(now)
            if progress is not None and near.progress < progress <= 1.0:
                return _Verdict(None, Reason.NEAR_COMPLETION_PROTECTED, f"{progress:.0%} done > {near.progress:.0%}")
        return None

    def _setup_candidates(self) -> None:
        self.protected: dict[str, _Verdict] = {}
        self.cands = _Candidates(per_team_own=self.quotas_on)
        for v in self.running:
            verdict = self.protection(v)
            if verdict is not None:
                self.protected[v.name] = verdict
                continue
            borrowed = v.name in self.borrowed
            self.cands.lists[self.cands.list_key(borrowed, v.team)].append(v)
            self.cands.add(v, borrowed, self.claimed[v.name])
            bucket = self.bucket_of[v.name]
            if bucket is not None:
                bucket.candidate_gpus += v.gpus
        key = lambda v: victim_key(v, self.now, v.name in self.borrowed, self.claimed[v.name])  # noqa: E731
        for jobs in self.cands.lists.values():
            jobs.sort(key=key)

    def _setup_budget(self, history: Iterable[PastPreemption]) -> None:
        budget = self.knobs.budget
        self.budget_count, self.budget_lost = 0, 0.0
        if budget is None:
            return
        for h in history:
            if h.pool == self.pool.name and self.now - budget.window_s < h.at <= self.now:
                self.budget_count += 1
                self.budget_lost += h.lost_gpu_seconds

    # -- the fit test ---------------------------------------------------------------------
    def fits(self, bucket: _Bucket | None, gpus: int, physical: int, freed: dict[int, tuple[_Bucket, int]]) -> tuple[bool, str]:
        """Whether `gpus` fit in `physical` GPUs and the quota, with `freed` GPUs given back per quota.

        Quota test: the job's quota stays under nominal + borrowing limit, and the GPUs other
        quotas keep for themselves (nominal - lending limit, unused) are not taken.
        """
        if gpus > physical:
            return False, "capacity"
        if bucket is None:
            return True, ""
        own_used = bucket.used - freed.get(id(bucket), (bucket, 0))[1]
        if own_used + gpus > bucket.ceiling:
            return False, "quota"
        reserved = self.reserved_total
        for b, amount in freed.values():
            reserved += b.unused_kept(b.used - amount) - b.unused_kept()
        others = reserved - bucket.unused_kept(own_used)
        if gpus > physical - others:
            return False, "quota"
        return True, ""

    # -- who may be stopped ---------------------------------------------------------------
    @staticmethod
    def _top(mode: PreemptionMode, claimed: int) -> int:
        """The highest victim priority a job claiming `claimed` may preempt under `mode`."""
        if mode is PreemptionMode.NEVER:
            return -1
        return claimed if mode is PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY else claimed - 1

    def may_reclaim(self, bucket: _Bucket | None, gpus: int) -> bool:
        """A job reclaims borrowed capacity when its quota, with it, stays within nominal."""
        return (
            bucket is not None
            and self.knobs.reclaim_within_pool is not ReclaimMode.NEVER
            and bucket.used + gpus <= bucket.nominal
        )

    def eligibility(self, r: RankedJob, v: RunningJob, reclaim: bool) -> _Verdict:
        """Whether preemptor `r` may stop running job `v` (protections aside).

        Another team's work within its nominal quota is guaranteed. Borrowed work of another
        team may be reclaimed by a job within its own nominal quota (`reclaim_within_pool`).
        Otherwise the mode decides: `within_team` for the same team, `across_teams` else.
        """
        pj, pv = r.claimed, self.claimed[v.name]
        same_team = r.job.team == v.team
        if self.quotas_on and not same_team:
            if v.name not in self.borrowed:
                return _Verdict(None, Reason.WITHIN_GUARANTEED_QUOTA, f"runs within {v.team}'s nominal quota")
            if reclaim and (self.knobs.reclaim_within_pool is ReclaimMode.ANY or pv < pj):
                return _Verdict(PreemptionRule.RECLAIM_BORROWED, Reason.BORROWED_CAPACITY_RECLAIMED, f"runs on quota {v.team} borrowed; {r.job.team} needs it back")
        mode = self.knobs.within_team if same_team else self.knobs.across_teams
        scope = "within_team" if same_team else "across_teams"
        if mode is PreemptionMode.NEVER:
            return _Verdict(None, Reason.PREEMPTION_NOT_ALLOWED, f"{scope} is Never")
        rule = _mode_rule(mode, pj, r.job.submitted_at, pv, v.started_at)
        if rule is PreemptionRule.LOWER_PRIORITY:
            return _Verdict(rule, Reason.LOWER_PRIORITY_VICTIM, f"priority {pv} < {pj} of {r.job.name}")
        if rule is PreemptionRule.NEWER_EQUAL_PRIORITY:
            return _Verdict(rule, Reason.NEWER_EQUAL_PRIORITY_VICTIM, f"priority {pv} = {pj} of {r.job.name}, started after it was submitted")
        return _Verdict(None, Reason.NOT_LOWER_PRIORITY, f"priority {pv} is not below {pj} ({scope} {mode.value})")

    def candidate_verdict(self, r: RankedJob, v: RunningJob) -> _Verdict:
        """`eligibility` with the protections and earlier choices in this cycle, for `explain`."""
        if v.name in self.chosen_by:
            return _Verdict(None, Reason.ALREADY_STOPPING, f"chosen as a victim for {self.chosen_by[v.name]} in this plan")
        if v.name in self.protected:
            return self.protected[v.name]
        bucket = self.bucket_for(r.job.team, r.claimed)
        return self.eligibility(r, v, self.may_reclaim(bucket, r.job.gpus))

    def victim_bound(self, r: RankedJob, reclaim: bool) -> int:
        """An upper bound of the GPUs `r` could free by preemption, in O(log 1000).

        Own team: up to the `within_team` mode's top priority. Other teams: borrowed work
        all of it when reclaiming, else up to the `across_teams` top; their other work only
        without quotas (with quotas it is guaranteed).
        """
        team, c = r.job.team, self.cands
        top_within = self._top(self.knobs.within_team, r.claimed)
        top_across = self._top(self.knobs.across_teams, r.claimed)
        bound = 0
        for borrowed in (False, True):
            same = c.gpus(borrowed, team, top_within)
            if borrowed and reclaim:
                others = c.totals[(True, None)] - c.totals[(True, team)]
            elif not borrowed and self.quotas_on:
                others = 0
            else:
                others = c.gpus(borrowed, None, top_across) - c.gpus(borrowed, team, top_across)
            bound += same + others
        return bound

    def choose(self, r: RankedJob, bucket: _Bucket | None, available: int, reclaim: bool) -> _Choice:
        """Take eligible victims in `victim_key` order until `r` fits, then fill back."""
        gpus, choice = r.job.gpus, _Choice()
        freed: dict[int, tuple[_Bucket, int]] = {}
        physical = available
        top_within = self._top(self.knobs.within_team, r.claimed)
        top = max(top_within, self._top(self.knobs.across_teams, r.claimed))

        def give(v: RunningJob, sign: int) -> None:
            b = self.bucket_of[v.name]
            if b is not None:
                prior = freed.get(id(b), (b, 0))[1]
                freed[id(b)] = (b, prior + sign * v.gpus)

        borrowed_key = (True, None)
        own_key = self.cands.list_key(False, r.job.team)
        # With quotas, only the job's own team's work that is not borrowed may be preempted.
        scans = ((borrowed_key, math.inf if reclaim else top), (own_key, top_within if self.quotas_on else top))
        for key, limit in scans:
            choice.scanned[key] = 0
            for v in self.cands.lists.get(key, ()):
                if self.claimed[v.name] > limit:
                    break  # sorted by priority: nothing further may be preempted
                choice.scanned[key] += 1
                verdict = self.eligibility(r, v, reclaim)
                if verdict.rule is None:
                    choice.skipped.append((v, verdict))
                    continue
                choice.victims.append((v, verdict))
                physical += v.gpus
                give(v, +1)
                choice.fits, choice.short_of = self.fits(bucket, gpus, physical, freed)
                if choice.fits:
                    break
            if choice.fits:
                break
        if not choice.fits:
            if not choice.victims:
                choice.short_of = self.fits(bucket, gpus, physical, freed)[1]
            return choice
        # Fill back: the last chosen are the most expensive to stop, so try dropping them first.
        for item in reversed(list(choice.victims)):
            v = item[0]
            give(v, -1)
            if self.fits(bucket, gpus, physical - v.gpus, freed)[0]:
                physical -= v.gpus
                choice.victims.remove(item)
                choice.dropped.append(v)
            else:
                give(v, +1)
        return choice

    # -- one pending job --------------------------------------------------------------------
    def place(self, r: RankedJob) -> None:
        job, k = r.job, self.knobs
        # Caps change what a job may preempt, so they get a line of their own; aging only
        # reorders the queue and is told in `explain` and the rank trace.
        for reason, detail in r.adjustments:
            if reason is not Reason.AGED:
                self.lines.append(Explanation(job.name, Verdict.RANK, reason, detail))
        if k.max_preemptions is not None and k.on_max_preemptions is MaxPreemptionsAction.FAIL and job.preemptions >= k.max_preemptions:
            detail = f"preempted {job.preemptions} times; max_preemptions is {k.max_preemptions} (on_max_preemptions: fail)"
            self.failures.append(Failure(job.name, job.pool, Reason.MAX_PREEMPTIONS_EXCEEDED, detail))
            self.lines.append(Explanation(job.name, Verdict.FAIL, Reason.MAX_PREEMPTIONS_EXCEEDED, detail))
            return
        if job.gpus > self.pool.gpus:
            detail = f"needs {job.gpus} GPUs, pool {self.pool.name} has {self.pool.gpus}"
            self.lines.append(Explanation(job.name, Verdict.SKIP, Reason.LARGER_THAN_POOL, detail))
            return
        bucket = self.bucket_for(job.team, r.claimed)
        ok, _ = self.fits(bucket, job.gpus, self.free, {})
        if ok:
            self._admit(r, bucket)
        else:
            self._nominate(r, bucket)

    def _admit(self, r: RankedJob, bucket: _Bucket | None) -> None:
        job = r.job
        self.free -= job.gpus
        self.admitted_gpus += job.gpus
        borrowed = 0
        if bucket is not None:
            borrowed = max(0, bucket.used + job.gpus - bucket.nominal) - max(0, bucket.used - bucket.nominal)
            self._set_used(bucket, bucket.used + job.gpus)
        reason = Reason.BORROWS_IDLE_QUOTA if borrowed else Reason.FITS_FREE_CAPACITY
        detail = f"{job.gpus} GPUs fit; {self.free} left free in {job.pool}"
        if borrowed:
            detail += f"; {borrowed} of them borrowed above {bucket.label()}'s nominal {bucket.nominal}"
        aging = self.knobs.aging
        guaranteed = aging.starving_after_s is not None and self.now - job.submitted_at >= aging.starving_after_s
        if guaranteed:
            detail += "; admitted after starving, so it runs to completion"
        self.admits.append(Admission(job.name, job.pool, job.gpus, reason, borrowed, guaranteed))
        self.lines.append(Explanation(job.name, Verdict.ADMIT, reason, detail))

    def _hold(self, r: RankedJob, bucket: _Bucket | None) -> int:
        """Claim the free GPUs (then those being freed) a waiting job will need; returns the amount."""
        need = r.job.gpus
        from_free = min(self.free, need)
        from_releasing = min(self.releasing, need - from_free)
        self.free -= from_free
        self.releasing -= from_releasing
        self.held_gpus += from_free + from_releasing
        if bucket is not None:
            self._set_used(bucket, bucket.used + from_free + from_releasing)
        return from_free + from_releasing

    def _report_protections(self) -> None:
        if self._protections_reported:
            return
        self._protections_reported = True
        for v in self.running:
            verdict = self.protected.get(v.name)
            if verdict is not None and verdict.reason is not Reason.ALREADY_STOPPING:
                self.lines.append(Explanation(v.name, Verdict.SPARE, verdict.reason, verdict.detail))

    def _nominate(self, r: RankedJob, bucket: _Bucket | None) -> None:
        """Claim capacity for a job that does not fit now, preempting victims if needed."""
        job, k, now = r.job, self.knobs, self.now
        available = self.free + self.releasing
        ok, short_of = self.fits(bucket, job.gpus, available, {})
        if ok:
            from_releasing = max(0, job.gpus - self.free)
            self._hold(r, bucket)
            detail = f"{from_releasing} of its {job.gpus} GPUs are held by jobs being stopped"
            self.lines.append(Explanation(job.name, Verdict.WAIT, Reason.WAITING_FOR_PREEMPTED_CAPACITY, detail))
            return

        self._report_protections()
        reclaim = self.may_reclaim(bucket, job.gpus)
        choice = _Choice(short_of=short_of)
        if bucket is not None and bucket.used - bucket.candidate_gpus + job.gpus > bucket.ceiling:
            choice.short_of = "quota"  # even stopping all its own quota's work would not make room
        elif available + self.victim_bound(r, reclaim) >= job.gpus:
            spent = self._over_budget([])
            if spent and waited_enough(job, k, now):
                # Any victim would exceed a budget already spent: no need to look for them.
                self._hold(r, bucket)
                detail = f"needs {job.gpus} GPUs; the pool's preemption budget is spent: {spent}"
                self.lines.append(Explanation(job.name, Verdict.WAIT, Reason.BUDGET_EXHAUSTED, detail))
                return
            choice = self.choose(r, bucket, available, reclaim)
        if not choice.fits:
            self._cannot_fit(r, bucket, choice, available, reclaim)
            return

        victims = [v for v, _ in choice.victims]
        names = ", ".join(f"{v.name} ({v.gpus} GPUs)" for v in victims)
        waited = now - job.waiting_since()
        if not waited_enough(job, k, now):
            self._hold(r, bucket)
            detail = (
                f"needs {job.gpus} GPUs; waits {k.preemption_delay_s - waited:.0f} s more for capacity to free "
                f"by itself before preempting {names} (preemption_delay_s {k.preemption_delay_s:g})"
            )
            self.lines.append(Explanation(job.name, Verdict.WAIT, Reason.PREEMPTION_DELAYED, detail))
            return
        over = self._over_budget(victims)
        if over:
            self._hold(r, bucket)
            detail = f"needs {job.gpus} GPUs; preempting {names} would exceed the budget: {over}"
            self.lines.append(Explanation(job.name, Verdict.WAIT, Reason.BUDGET_EXHAUSTED, detail))
            return
        self._commit(r, bucket, choice)

    def _cannot_fit(self, r: RankedJob, bucket: _Bucket | None, choice: _Choice, available: int, reclaim: bool) -> None:
        job, aging = r.job, self.knobs.aging
        waited = self.now - job.submitted_at
        if aging.starving_after_s is not None and waited >= aging.starving_after_s:
            held = self._hold(r, bucket)
            detail = f"waited {waited:.0f} s >= starving_after_s {aging.starving_after_s:g}; holds {held} of its {job.gpus} GPUs"
            self.lines.append(Explanation(job.name, Verdict.WAIT, Reason.STARVATION_RESERVATION, detail))
            return
        if choice.scanned:
            eligible = f"{sum(v.gpus for v, _ in choice.victims)} held by {len(choice.victims)} job(s) it may preempt"
        else:
            eligible = f"at most {self.victim_bound(r, reclaim)} held by jobs it may preempt"
        if choice.short_of == "quota" and bucket is not None:
            reason = Reason.OVER_QUOTA
            ceiling = "unlimited" if math.isinf(bucket.ceiling) else int(bucket.ceiling)
            detail = (
                f"needs {job.gpus} GPUs; quota {bucket.label()} uses {bucket.used} of nominal {bucket.nominal}"
                f" (ceiling {ceiling}); other quotas keep {self.reserved_total - bucket.unused_kept()} GPUs unlent; {eligible}"
            )
        else:
            reason = Reason.BLOCKED_BY_HIGHER_RANKED if job.gpus <= self.initial_free else Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS
            detail = f"needs {job.gpus} GPUs; {self.free} free, {self.releasing} being freed, {eligible}"
            if reason is Reason.BLOCKED_BY_HIGHER_RANKED:
                detail += f"; {self.admitted_gpus} GPUs admitted and {self.held_gpus} held for higher-ranked jobs"
        self.lines.append(Explanation(job.name, Verdict.WAIT, reason, detail))

    def _over_budget(self, victims: list[RunningJob]) -> str:
        """Why stopping `victims` would exceed the pool's budget ('' when it would not).

        With no victims: whether the budget is already spent, so that any preemption would
        exceed it (a count at its maximum, or lost GPU-hours at or over theirs).
        """
        budget = self.knobs.budget
        if budget is None:
            return ""
        count = self.budget_count + len(victims)
        lost_h = (self.budget_lost + sum(v.lost_gpu_seconds(self.now) for v in victims)) / 3600.0
        if budget.max_preemptions is not None and (count > budget.max_preemptions or (not victims and count >= budget.max_preemptions)):
            return f"{count} preemptions {'>' if victims else 'of'} {budget.max_preemptions} per {budget.window_s:g} s"
        if budget.max_gpu_hours is not None and lost_h > budget.max_gpu_hours:
            return f"{lost_h:.2f} GPU-hours lost > {budget.max_gpu_hours:g} per {budget.window_s:g} s"
        return ""

    def _commit(self, r: RankedJob, bucket: _Bucket | None, choice: _Choice) -> None:
        job, now = r.job, self.now
        victims = [v for v, _ in choice.victims]
        victim_gpus = sum(v.gpus for v in victims)
        still_needed = max(0, job.gpus - victim_gpus)  # taken from free, then from releasing
        from_free = min(self.free, still_needed)
        self.free -= from_free
        self.releasing -= still_needed - from_free
        # Surplus from the victims becomes capacity being freed that the next jobs can claim.
        self.releasing += max(0, victim_gpus - job.gpus)
        self.held_gpus += job.gpus
        chosen = {v.name for v in victims}
        for v in victims:
            b = self.bucket_of[v.name]
            if b is not None:
                self._set_used(b, b.used - v.gpus)
                b.candidate_gpus -= v.gpus
            self.cands.add(v, v.name in self.borrowed, self.claimed[v.name], sign=-1)
            self.chosen_by[v.name] = job.name
            self.budget_count += 1
            self.budget_lost += v.lost_gpu_seconds(now)
        for key, scanned in choice.scanned.items():
            if scanned:
                self.cands.lists[key] = _without(self.cands.lists[key], chosen, scanned)
        if bucket is not None:
            self._set_used(bucket, bucket.used + job.gpus)

        limit = self.knobs.checkpoint_max_age_s
        for v, verdict in choice.victims:
            rule = verdict.rule
            age = v.checkpoint_age_s(now)
            borrowed = v.name in self.borrowed
            self.preemptions.append(
                Preemption(
                    victim=v.name,
                    preemptor=job.name,
                    pool=job.pool,
                    gpus=v.gpus,
                    reason=rule.victim_reason,
                    lost_gpu_seconds=v.lost_gpu_seconds(now),
                    checkpoint_age_s=age,
                    rule=rule,
                    cost_gpu_seconds=v.stop_cost_gpu_seconds(now),
                    checkpoint_fresh=age is not None and age <= limit,
                    borrowed=borrowed,
                )
            )
            checkpoint = "no checkpoint yet" if age is None else f"checkpoint {age:.0f} s old"
            detail = (
                f"{verdict.detail}{'; on borrowed quota' if borrowed and rule is not PreemptionRule.RECLAIM_BORROWED else ''}; "
                f"stopping it loses {v.lost_gpu_seconds(now):.0f} GPU-seconds ({checkpoint})"
            )
            self.lines.append(Explanation(v.name, Verdict.PREEMPT, rule.victim_reason, detail, for_job=job.name))
        for v in choice.dropped:
            self.lines.append(Explanation(v.name, Verdict.SPARE, Reason.NOT_NEEDED, f"fill-back: {job.name} fits without it", for_job=job.name))
        for v, verdict in choice.skipped[:MAX_SKIPPED_LINES]:
            self.lines.append(Explanation(v.name, Verdict.SPARE, verdict.reason, verdict.detail, for_job=job.name))
        more = len(choice.skipped) - MAX_SKIPPED_LINES
        reclaims = any(verdict.rule is PreemptionRule.RECLAIM_BORROWED for _, verdict in choice.victims)
        reason = Reason.RECLAIMS_BORROWED if reclaims else Reason.PREEMPTS_LOWER_PRIORITY
        detail = f"needs {job.gpus} GPUs; preempting {', '.join(v.name for v in victims) or 'nothing new'}"
        if more > 0:
            detail += f" ({more} more candidates skipped)"
        self.lines.append(Explanation(job.name, Verdict.WAIT, reason, detail))

    # -- explain support ------------------------------------------------------------------
    def state(self, r: RankedJob) -> dict:
        """The pool as the job found it at its turn, for `explain`."""
        bucket = self.bucket_for(r.job.team, r.claimed)
        out = {
            "pool_gpus": self.pool.gpus,
            "running_gpus": sum(v.gpus for v in self.running),
            "free_gpus": self.free,
            "being_freed_gpus": self.releasing,
            "admitted_ahead_gpus": self.admitted_gpus,
            "held_ahead_gpus": self.held_gpus,
        }
        if bucket is not None:
            out["quota"] = {
                "quota": bucket.label(),
                "used_gpus": bucket.used,
                "nominal_gpus": bucket.nominal,
                "ceiling_gpus": None if math.isinf(bucket.ceiling) else int(bucket.ceiling),
                "kept_unlent_by_others_gpus": self.reserved_total - bucket.unused_kept(),
            }
        budget = self.knobs.budget
        if budget is not None:
            out["budget"] = {
                "window_s": budget.window_s,
                "preemptions": self.budget_count,
                "max_preemptions": budget.max_preemptions,
                "lost_gpu_hours": round(self.budget_lost / 3600.0, 3),
                "max_gpu_hours": budget.max_gpu_hours,
            }
        waited = self.now - r.job.waiting_since()
        if self.knobs.preemption_delay_s:
            out["delay_left_s"] = round(max(0.0, self.knobs.preemption_delay_s - waited), 3)
        return out

    def candidates(self, r: RankedJob) -> list[dict]:
        """Every running job of the pool, in victim order, and whether `r` may stop it."""
        key = lambda v: victim_key(v, self.now, v.name in self.borrowed, self.claimed[v.name])  # noqa: E731
        out = []
        for v in sorted(self.running, key=key):
            verdict = self.candidate_verdict(r, v)
            out.append(
                {
                    "job": v.name,
                    "team": v.team,
                    "priority": self.claimed[v.name],
                    "gpus": v.gpus,
                    "borrowed": v.name in self.borrowed,
                    "lost_gpu_seconds": round(v.lost_gpu_seconds(self.now), 3),
                    "cost_gpu_seconds": round(v.stop_cost_gpu_seconds(self.now), 3),
                    "checkpoint_age_s": None if v.checkpoint_age_s(self.now) is None else round(v.checkpoint_age_s(self.now), 3),
                    "eligible": verdict.rule is not None,
                    "rule": verdict.rule.value if verdict.rule else None,
                    "reason": verdict.reason.value,
                    "detail": verdict.detail,
                }
            )
        return out


def waited_enough(job: PendingJob, knobs: PoolPolicy, now: float) -> bool:
    """Whether a pending job has served its pool's preemption delay."""
    return now - job.waiting_since() >= knobs.preemption_delay_s


def _without(jobs: list[RunningJob], names: set[str], scanned: int) -> list[RunningJob]:
    """`jobs` without `names`, all of which are among the first `scanned` (the rest is copied as is)."""
    return [v for v in jobs[:scanned] if v.name not in names] + jobs[scanned:]


# -- the entry point -------------------------------------------------------------------------
def plan(snapshot: Snapshot, policy: Policy, now: float) -> Decision:
    """Decide which pending jobs to admit, which to fail and which running jobs to preempt.

    See the module docstring for the steps; `rank_key`, `victim_key` and
    `_PoolPlanner.eligibility` for the orders and the rules.
    """
    decision, _ = _run(snapshot, policy, now, trace=None)
    return decision


def trace_job(snapshot: Snapshot, policy: Policy, now: float, name: str) -> dict | None:
    """How pending job `name` ranked and what it found at its turn: for `explain`.

    Returns None when `name` is not a pending job of a configured pool.
    """
    _, traced = _run(snapshot, policy, now, trace=name)
    return traced


def running_verdicts(snapshot: Snapshot, policy: Policy, now: float, name: str) -> dict | None:
    """For running job `name`: its claimed priority, quota status and protection, for `explain`."""
    job = next((v for v in snapshot.running if v.name == name), None)
    pool = next((p for p in snapshot.pools if p.name == (job.pool if job else None)), None)
    if job is None or pool is None:
        return None
    planner = _PoolPlanner(pool, policy.for_pool(pool.name), policy, now, [v for v in snapshot.running if v.pool == pool.name], snapshot.preemption_history)
    protection = planner.protected.get(name)
    return {
        "claimed_priority": planner.claimed[name],
        "borrowed": name in planner.borrowed,
        "protected": None if protection is None else {"reason": protection.reason.value, "detail": protection.detail},
        "lost_gpu_seconds": round(job.lost_gpu_seconds(now), 3),
        "checkpoint_age_s": None if job.checkpoint_age_s(now) is None else round(job.checkpoint_age_s(now), 3),
        "remaining_s": None if job.remaining_s(now) is None else round(job.remaining_s(now), 3),
        "progress": None if job.progress_at(now) is None else round(job.progress_at(now), 4),
    }


def _run(snapshot: Snapshot, policy: Policy, now: float, trace: str | None) -> tuple[Decision, dict | None]:
    running_by_pool: dict[str, list[RunningJob]] = defaultdict(list)
    for job in snapshot.running:
        running_by_pool[job.pool].append(job)
    pending_by_pool: dict[str, list[PendingJob]] = defaultdict(list)
    for job in snapshot.pending:
        pending_by_pool[job.pool].append(job)

    admits: list[Admission] = []
    preemptions: list[Preemption] = []
    failures: list[Failure] = []
    lines: list[Explanation] = []
    usage_cache: dict[tuple[bool, float], dict[str, float]] = {}
    traced: dict | None = None
    seen: set[str] = set()
    for pool in snapshot.pools:
        if pool.name in seen:
            continue
        seen.add(pool.name)
        knobs = policy.for_pool(pool.name)
        fair = (knobs.fair_share.enabled, knobs.fair_share.half_life_s)
        if fair not in usage_cache:
            usage_cache[fair] = team_usage(snapshot, now, fair[1]) if fair[0] else {}
        ranked = rank_pool(pending_by_pool.get(pool.name, ()), knobs, policy, now, usage_cache[fair])
        planner = _PoolPlanner(pool, knobs, policy, now, running_by_pool.get(pool.name, []), snapshot.preemption_history)
        for position, r in enumerate(ranked, start=1):
            if r.job.name == trace:
                traced = {
                    "pool": pool.name,
                    "position": position,
                    "queue_length": len(ranked),
                    "ahead": [a.job.name for a in ranked[: position - 1][:5]],
                    "priority": r.job.priority,
                    "claimed_priority": r.claimed,
                    "effective_priority": r.effective,
                    "team_usage_gpu_s": round(r.team_usage, 3),
                    "adjustments": [{"reason": reason.value, "detail": detail} for reason, detail in r.adjustments],
                    "state": planner.state(r),
                    "candidates": planner.candidates(r),
                }
            planner.place(r)
        admits += planner.admits
        preemptions += planner.preemptions
        failures += planner.failures
        lines += planner.lines
    for job in snapshot.pending:
        if job.pool not in seen:
            lines.append(Explanation(job.name, Verdict.SKIP, Reason.UNKNOWN_POOL, f"pool {job.pool!r} is not configured"))
    return Decision(tuple(admits), tuple(preemptions), tuple(lines), tuple(failures)), traced


__all__ = [
    "RankedJob",
    "TeamUsage",
    "may_preempt",
    "plan",
    "rank_key",
    "rank_pool",
    "running_verdicts",
    "team_usage",
    "trace_job",
    "victim_key",
]
