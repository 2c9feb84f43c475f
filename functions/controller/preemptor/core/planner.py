"""The scheduler's judgement: `plan(snapshot, policy, now) -> Decision`.

Pure: no I/O, no clock, no randomness. The same snapshot, policy and `now` always give the
same decision, and the snapshot is never mutated. Side effects (reserving capacity,
stopping victims, launching jobs) are carried out by the workflows from the decision.

The steps, per pool (pools are planned independently, each with its own knobs):

1. Rank the pending jobs (`ranking.rank_pool`): claimed priority (the job's priority
   capped by the SLA and spot rules), aged while it waits; fair share among equal
   effective priority; FIFO; the name last.
2. In rank order, admit every job that fits the free capacity and its team's quota
   (`quotas`).
3. A job that does not fit is nominated: it claims the free GPUs and the GPUs of jobs
   already being stopped and, if that is not enough, chooses victims (`victims.walk`, in
   `victims.victim_key` order) among the running jobs it may preempt
   (`victims.eligibility`, `victims.protection`), then fills back. A nominated job holds
   its claim: jobs ranked below it cannot take the capacity it waits for. The preemption
   delay and the preemption budget hold the claim without stopping anything.
4. A job that cannot fit even with every eligible victim claims nothing, so lower-ranked
   jobs may use the free capacity (backfill), unless it has been starving for longer than
   `aging.starving_after_s`, in which case it reserves what is free.

The mechanics (admit, hold, victim walk, fill-back, surplus accounting) are the same for
every scheduler the simulator compares: a `Discipline` gives the ranking, the victim order
and whether to fill back; the `Policy` gives who may preempt whom and the protections.
Ours is `OURS`.

Cost: sorting (P + R) log(P + R) per pool; a Fenwick tree over priorities bounds the
GPUs a job could free, so a job that cannot fit is dismissed in O(log 1000) without
scanning the running jobs; victim scans stop at the first priority a job may not preempt.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

from . import progress
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
)
from .policy import MaxPreemptionsAction, Policy, PoolPolicy
from .quotas import Bucket, Quotas
from .ranking import ClaimRules, RankedJob, Ranker, rank_key, rank_pool, team_usage
from .victims import (
    Candidates,
    Choice,
    Eligibility,
    VictimKey,
    eligibility,
    protection,
    top_priority,
    victim_key,
    walk,
)

# Candidates a preemptor skipped are listed in the decision up to this many per preemptor;
# `explain` lists them all.
MAX_SKIPPED_LINES = 8


@dataclass(frozen=True)
class Discipline:
    """The orders a scheduler puts over the planner's mechanics.

    `rank` orders the pending jobs of a pool; `victim_key` orders the candidates;
    `victims_by_priority` says that order is priority-major (lowest first), so a scan may
    stop at the first priority the preemptor may not preempt; `fill_back` drops, after the
    walk, the victims the preemptor fits without. Who may preempt whom, and the
    protections, are the `Policy`'s.
    """

    name: str
    rank: Ranker = rank_pool
    victim_key: VictimKey = victim_key
    victims_by_priority: bool = True
    fill_back: bool = True


OURS = Discipline("preemptor")


class PoolPlanner:
    """Mutable working state of one pool during planning (never escapes `plan`)."""

    def __init__(
        self,
        pool: Pool,
        knobs: PoolPolicy,
        policy: Policy,
        now: float,
        running: list[RunningJob],
        history: Iterable[PastPreemption],
        discipline: Discipline = OURS,
    ):
        self.pool, self.knobs, self.policy, self.now, self.discipline = pool, knobs, policy, now, discipline
        self.admits: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.failures: list[Failure] = []
        self.lines: list[Explanation] = []
        self.running = running
        rules = ClaimRules(knobs, policy)
        self.claimed = {v.name: rules.claim(v.priority, v.sla_s, v.spot)[0] for v in running}
        self.free = max(0, pool.gpus - sum(v.gpus for v in running))
        self.releasing = sum(v.gpus for v in running if v.stopping)
        self.initial_free = self.free
        self.admitted_gpus = 0
        self.held_gpus = 0  # claimed by nominated jobs ranked earlier
        self.chosen_by: dict[str, str] = {}
        self.quotas = Quotas(knobs.quotas, policy, running, self.claimed)
        self._setup_candidates()
        self._setup_budget(history)
        self._protections_reported = False

    # -- setup ----------------------------------------------------------------------------
    def _setup_candidates(self) -> None:
        """Protections and each quota's candidate GPUs now; the candidate index (lists in
        victim order, GPUs by priority) on first use, as most jobs never look for victims."""
        self.protected: dict[str, Eligibility] = {}
        self._candidates: list[RunningJob] = []
        self._cands: Candidates | None = None
        self._bounds: dict[tuple[str, int, bool], int] = {}
        for v in self.running:
            verdict = protection(v, self.knobs, self.now)
            if verdict is not None:
                self.protected[v.name] = verdict
                continue
            self._candidates.append(v)
            bucket = self.quotas.bucket_of[v.name]
            if bucket is not None:
                bucket.candidate_gpus += v.gpus

    @property
    def cands(self) -> Candidates:
        if self._cands is None:
            cands = self._cands = Candidates(per_team_own=self.quotas.on)
            for v in self._candidates:
                borrowed = v.name in self.quotas.borrowed
                cands.lists[cands.list_key(borrowed, v.team)].append(v)
                cands.add(v, borrowed, self.claimed[v.name])
            for jobs in cands.lists.values():
                jobs.sort(key=self.victim_order)
        return self._cands

    def _setup_budget(self, history: Iterable[PastPreemption]) -> None:
        budget = self.knobs.budget
        self.budget_count, self.budget_lost = 0, 0.0
        if budget is None:
            return
        for h in history:
            if h.pool == self.pool.name and self.now - budget.window_s < h.at <= self.now:
                self.budget_count += 1
                self.budget_lost += h.lost_gpu_seconds

    def victim_order(self, v: RunningJob) -> tuple:
        return self.discipline.victim_key(v, self.now, v.name in self.quotas.borrowed, self.claimed[v.name])

    # -- who may be stopped ---------------------------------------------------------------
    def may_reclaim(self, bucket: Bucket | None, gpus: int) -> bool:
        return self.quotas.may_reclaim(bucket, gpus, self.knobs.reclaim_within_pool)

    def eligibility(self, r: RankedJob, v: RunningJob, reclaim: bool) -> Eligibility:
        return eligibility(r, v, self.claimed[v.name], self.knobs, self.quotas.on, v.name in self.quotas.borrowed, reclaim)

    def candidate_verdict(self, r: RankedJob, v: RunningJob) -> Eligibility:
        """`eligibility` with the protections and earlier choices in this cycle, for `explain`."""
        if v.name in self.chosen_by:
            return Eligibility(None, Reason.ALREADY_STOPPING, f"chosen as a victim for {self.chosen_by[v.name]} in this plan")
        if v.name in self.protected:
            return self.protected[v.name]
        bucket = self.quotas.bucket_for(r.job.team, r.claimed)
        return self.eligibility(r, v, self.may_reclaim(bucket, r.job.gpus))

    def victim_bound(self, r: RankedJob, reclaim: bool) -> int:
        """An upper bound of the GPUs `r` could free by preemption (`Candidates.bound`)."""
        top_within = top_priority(self.knobs.within_team, r.claimed)
        top_across = top_priority(self.knobs.across_teams, r.claimed)
        if top_within < 0 and top_across < 0 and not reclaim:
            return 0  # it may preempt no one
        key = (r.job.team, r.claimed, reclaim)
        bound = self._bounds.get(key)
        if bound is None:  # the same until victims are chosen (`_commit` forgets them)
            bound = self._bounds[key] = self.cands.bound(r.job.team, top_within, top_across, self.quotas.on, reclaim)
        return bound

    def choose(self, r: RankedJob, bucket: Bucket | None, available: int, reclaim: bool) -> Choice:
        """Take eligible victims in victim order until `r` fits, then fill back (`victims.walk`)."""
        top_within = top_priority(self.knobs.within_team, r.claimed)
        top = max(top_within, top_priority(self.knobs.across_teams, r.claimed))
        # With quotas, only the job's own team's work that is not borrowed may be preempted.
        scans = (
            ((True, None), float("inf") if reclaim else top),
            (self.cands.list_key(False, r.job.team), top_within if self.quotas.on else top),
        )
        return walk(
            scans,
            self.cands,
            self.claimed,
            lambda v: self.eligibility(r, v, reclaim),
            lambda physical, freed: self.quotas.fits(bucket, r.job.gpus, physical, freed),
            self.quotas.bucket_of,
            available,
            by_priority=self.discipline.victims_by_priority,
            fill_back=self.discipline.fill_back,
        )

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
        bucket = self.quotas.bucket_for(job.team, r.claimed)
        if self.quotas.fits(bucket, job.gpus, self.free, {})[0]:
            self._admit(r, bucket)
        else:
            self._nominate(r, bucket)

    def _admit(self, r: RankedJob, bucket: Bucket | None) -> None:
        job = r.job
        self.free -= job.gpus
        self.admitted_gpus += job.gpus
        borrowed = self.quotas.borrowed_above_nominal(bucket, job.gpus)
        if bucket is not None:
            self.quotas.set_used(bucket, bucket.used + job.gpus)
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

    def _hold(self, r: RankedJob, bucket: Bucket | None) -> int:
        """Claim the free GPUs (then those being freed) a waiting job will need; returns the amount."""
        need = r.job.gpus
        from_free = min(self.free, need)
        from_releasing = min(self.releasing, need - from_free)
        self.free -= from_free
        self.releasing -= from_releasing
        self.held_gpus += from_free + from_releasing
        if bucket is not None:
            self.quotas.set_used(bucket, bucket.used + from_free + from_releasing)
        return from_free + from_releasing

    def _wait(self, job: PendingJob, reason: Reason, detail: str) -> None:
        self.lines.append(Explanation(job.name, Verdict.WAIT, reason, detail))

    def _report_protections(self) -> None:
        if self._protections_reported:
            return
        self._protections_reported = True
        for v in self.running:
            verdict = self.protected.get(v.name)
            if verdict is not None and verdict.reason is not Reason.ALREADY_STOPPING:
                self.lines.append(Explanation(v.name, Verdict.SPARE, verdict.reason, verdict.detail))

    def _nominate(self, r: RankedJob, bucket: Bucket | None) -> None:
        """Claim capacity for a job that does not fit now, preempting victims if needed."""
        job, k, now = r.job, self.knobs, self.now
        available = self.free + self.releasing
        ok, short_of = self.quotas.fits(bucket, job.gpus, available, {})
        if ok:
            from_releasing = max(0, job.gpus - self.free)
            self._hold(r, bucket)
            self._wait(job, Reason.WAITING_FOR_PREEMPTED_CAPACITY, f"{from_releasing} of its {job.gpus} GPUs are held by jobs being stopped")
            return

        self._report_protections()
        reclaim = self.may_reclaim(bucket, job.gpus)
        choice = Choice(short_of=short_of)
        if bucket is not None and bucket.used - bucket.candidate_gpus + job.gpus > bucket.ceiling:
            choice.short_of = "quota"  # even stopping all its own quota's work would not make room
        elif available + self.victim_bound(r, reclaim) >= job.gpus:
            spent = self._over_budget([])
            if spent and waited_enough(job, k, now):
                # Any victim would exceed a budget already spent: no need to look for them.
                self._hold(r, bucket)
                self._wait(job, Reason.BUDGET_EXHAUSTED, f"needs {job.gpus} GPUs; the pool's preemption budget is spent: {spent}")
                return
            choice = self.choose(r, bucket, available, reclaim)
        if not choice.fits:
            self._cannot_fit(r, bucket, choice, reclaim)
            return

        victims = [v for v, _ in choice.victims]
        names = ", ".join(f"{v.name} ({v.gpus} GPUs)" for v in victims)
        if not waited_enough(job, k, now):
            self._hold(r, bucket)
            detail = (
                f"needs {job.gpus} GPUs; waits {k.preemption_delay_s - (now - job.waiting_since()):.0f} s more for capacity to free "
                f"by itself before preempting {names} (preemption_delay_s {k.preemption_delay_s:g})"
            )
            self._wait(job, Reason.PREEMPTION_DELAYED, detail)
            return
        over = self._over_budget(victims)
        if over:
            self._hold(r, bucket)
            self._wait(job, Reason.BUDGET_EXHAUSTED, f"needs {job.gpus} GPUs; preempting {names} would exceed the budget: {over}")
            return
        self._commit(r, bucket, choice)

    def _cannot_fit(self, r: RankedJob, bucket: Bucket | None, choice: Choice, reclaim: bool) -> None:
        job, aging = r.job, self.knobs.aging
        waited = self.now - job.submitted_at
        if aging.starving_after_s is not None and waited >= aging.starving_after_s:
            held = self._hold(r, bucket)
            detail = f"waited {waited:.0f} s >= starving_after_s {aging.starving_after_s:g}; holds {held} of its {job.gpus} GPUs"
            self._wait(job, Reason.STARVATION_RESERVATION, detail)
            return
        if choice.scanned:
            eligible = f"{sum(v.gpus for v, _ in choice.victims)} held by {len(choice.victims)} job(s) it may preempt"
        else:
            eligible = f"at most {self.victim_bound(r, reclaim)} held by jobs it may preempt"
        if choice.short_of == "quota" and bucket is not None:
            detail = (
                f"needs {job.gpus} GPUs; quota {bucket.label()} uses {bucket.used} of nominal {bucket.nominal}"
                f" (ceiling {bucket.ceiling_label()}); other quotas keep {self.quotas.kept_by_others(bucket)} GPUs unlent; {eligible}"
            )
            self._wait(job, Reason.OVER_QUOTA, detail)
            return
        reason = Reason.BLOCKED_BY_HIGHER_RANKED if job.gpus <= self.initial_free else Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS
        detail = f"needs {job.gpus} GPUs; {self.free} free, {self.releasing} being freed, {eligible}"
        if reason is Reason.BLOCKED_BY_HIGHER_RANKED:
            detail += f"; {self.admitted_gpus} GPUs admitted and {self.held_gpus} held for higher-ranked jobs"
        self._wait(job, reason, detail)

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

    def _commit(self, r: RankedJob, bucket: Bucket | None, choice: Choice) -> None:
        """Stop the chosen victims for `r`: it holds the capacity they free; any surplus
        becomes capacity being freed that the next jobs can claim."""
        job, now = r.job, self.now
        victims = [v for v, _ in choice.victims]
        victim_gpus = sum(v.gpus for v in victims)
        still_needed = max(0, job.gpus - victim_gpus)  # taken from free, then from releasing
        from_free = min(self.free, still_needed)
        self.free -= from_free
        self.releasing -= still_needed - from_free
        self.releasing += max(0, victim_gpus - job.gpus)
        self.held_gpus += job.gpus
        chosen = {v.name for v in victims}
        for v in victims:
            b = self.quotas.bucket_of[v.name]
            if b is not None:
                self.quotas.set_used(b, b.used - v.gpus)
                b.candidate_gpus -= v.gpus
            self.cands.add(v, v.name in self.quotas.borrowed, self.claimed[v.name], sign=-1)
            self.chosen_by[v.name] = job.name
            self.budget_count += 1
            self.budget_lost += v.lost_gpu_seconds(now)
        for key, scanned in choice.scanned.items():
            if scanned:
                self.cands.remove(key, chosen, scanned)
        self._bounds.clear()
        if bucket is not None:
            self.quotas.set_used(bucket, bucket.used + job.gpus)
        for v, verdict in choice.victims:
            self._preempt(job, v, verdict.rule, verdict.detail)
        for v in choice.dropped:
            self.lines.append(Explanation(v.name, Verdict.SPARE, Reason.NOT_NEEDED, f"fill-back: {job.name} fits without it", for_job=job.name))
        for v, verdict in choice.skipped[:MAX_SKIPPED_LINES]:
            self.lines.append(Explanation(v.name, Verdict.SPARE, verdict.reason, verdict.detail, for_job=job.name))
        more = len(choice.skipped) - MAX_SKIPPED_LINES
        reclaims = any(verdict.rule is PreemptionRule.RECLAIM_BORROWED for _, verdict in choice.victims)
        detail = f"needs {job.gpus} GPUs; preempting {', '.join(v.name for v in victims) or 'nothing new'}"
        if more > 0:
            detail += f" ({more} more candidates skipped)"
        self._wait(job, Reason.RECLAIMS_BORROWED if reclaims else Reason.PREEMPTS_LOWER_PRIORITY, detail)

    def _preempt(self, job: PendingJob, v: RunningJob, rule: PreemptionRule, why: str) -> None:
        now = self.now
        age = v.checkpoint_age_s(now)
        borrowed = v.name in self.quotas.borrowed
        lost = v.lost_gpu_seconds(now)
        self.preemptions.append(
            Preemption(
                victim=v.name,
                preemptor=job.name,
                pool=job.pool,
                gpus=v.gpus,
                reason=rule.victim_reason,
                lost_gpu_seconds=lost,
                checkpoint_age_s=age,
                rule=rule,
                cost_gpu_seconds=v.stop_cost_gpu_seconds(now),
                checkpoint_fresh=progress.is_fresh(v.last_checkpoint_at, v.started_at, now, self.knobs.checkpoint_max_age_s),
                borrowed=borrowed,
            )
        )
        checkpoint = "no checkpoint yet" if age is None else f"checkpoint {age:.0f} s old"
        on_borrowed = "; on borrowed quota" if borrowed and rule is not PreemptionRule.RECLAIM_BORROWED else ""
        detail = f"{why}{on_borrowed}; stopping it loses {lost:.0f} GPU-seconds ({checkpoint})"
        self.lines.append(Explanation(v.name, Verdict.PREEMPT, rule.victim_reason, detail, for_job=job.name))


def waited_enough(job: PendingJob, knobs: PoolPolicy, now: float) -> bool:
    """Whether a pending job has served its pool's preemption delay."""
    return now - job.waiting_since() >= knobs.preemption_delay_s


# -- the entry point -------------------------------------------------------------------------
# Called with each pool's planner, the ranked queue, and the job at its turn, before it is placed.
Observer = Callable[[PoolPlanner, list[RankedJob], int, RankedJob], None]


def plan(snapshot: Snapshot, policy: Policy, now: float, discipline: Discipline = OURS) -> Decision:
    """Decide which pending jobs to admit, which to fail and which running jobs to preempt.

    See the module docstring for the steps. `discipline` replaces ours' ranking and victim
    order (the simulator's baselines); the Policy gives eligibility and protections.
    """
    return run(snapshot, policy, now, discipline)


def run(snapshot: Snapshot, policy: Policy, now: float, discipline: Discipline = OURS, observe: Observer | None = None) -> Decision:
    """`plan`, calling `observe` at every job's turn (the explain trace, `core.trace`)."""
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
    seen: set[str] = set()
    for pool in snapshot.pools:
        if pool.name in seen:
            continue
        seen.add(pool.name)
        knobs = policy.for_pool(pool.name)
        fair = (knobs.fair_share.enabled, knobs.fair_share.half_life_s)
        if fair not in usage_cache:
            usage_cache[fair] = team_usage(snapshot, now, fair[1]) if fair[0] else {}
        ranked = discipline.rank(pending_by_pool.get(pool.name, ()), knobs, policy, now, usage_cache[fair])
        planner = PoolPlanner(pool, knobs, policy, now, running_by_pool.get(pool.name, []), snapshot.preemption_history, discipline)
        for position, r in enumerate(ranked, start=1):
            if observe is not None:
                observe(planner, ranked, position, r)
            planner.place(r)
        admits += planner.admits
        preemptions += planner.preemptions
        failures += planner.failures
        lines += planner.lines
    for job in snapshot.pending:
        if job.pool not in seen:
            lines.append(Explanation(job.name, Verdict.SKIP, Reason.UNKNOWN_POOL, f"pool {job.pool!r} is not configured"))
    return Decision(tuple(admits), tuple(preemptions), tuple(lines), tuple(failures))


__all__ = [
    "OURS",
    "Discipline",
    "PoolPlanner",
    "RankedJob",
    "TeamUsage",
    "plan",
    "rank_key",
    "rank_pool",
    "run",
    "team_usage",
    "victim_key",
]
