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
   (`victims.eligibility`, `victims.protector`), then fills back. A nominated job holds
   its claim: jobs ranked below it cannot take the capacity it waits for. The preemption
   delay and the preemption budget hold the claim without stopping anything.
4. A job that cannot fit even with every eligible victim claims nothing, so lower-ranked
   jobs may use the free capacity (backfill), unless it has been starving for longer than
   `aging.starving_after_s`, in which case it reserves what is free.

The mechanics (admit, hold, victim walk, fill-back, surplus accounting) are the same for
every scheduler the simulator compares: a `Discipline` gives the ranking, the victim order
and whether to fill back; the `Policy` gives who may preempt whom and the protections.
Ours is `OURS`.

Cost: sorting (P + R) log(P + R) per pool; sums of candidate GPUs by priority bound the
GPUs a job could free, so a job that cannot fit is dismissed without scanning the running
jobs; victim lists are sorted on their first walk, and scans stop at the first priority a
job may not preempt. A job alike one that could not fit, in the same pool state, is given
its outcome again (`PoolPlanner._no_fit`; under LowerOrNewerEqualPriority an outcome no
walk decided holds whatever the submission time, `_remember`): most of a long queue costs a
look-up and its explanation line. docs/policy.md, "Speed", has the figures.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property, partial
from operator import attrgetter, is_not
from typing import Callable, Iterable, Iterator, Sequence

from . import progress
from .model import (
    Admission,
    CallOff,
    CheckpointRequest,
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
    WaitCut,
)
from .policy import MaxPreemptionsAction, Policy, PoolPolicy, PreemptionMode, escalation_lead_s
from .quotas import Bucket, Freed, Quotas
from .ranking import ClaimRules, RankedJob, Ranker, rank_key, rank_pool, team_usage
from .victims import (
    Candidates,
    Choice,
    Eligibility,
    VictimKey,
    eligibility,
    protector,
    top_priority,
    victim_key,
    walk,
)

NOTHING_FREED: Freed = {}  # no victims chosen yet (never written to)
_INF = float("inf")

# Members used on every pending job and victim, bound once: on Python 3.11 each lookup of an
# enum class attribute goes through `EnumType.__getattr__`, the cost of a function call.
_WAIT, _PREEMPT, _SPARE, _RANK = Verdict.WAIT, Verdict.PREEMPT, Verdict.SPARE, Verdict.RANK
_RECLAIM = PreemptionRule.RECLAIM_BORROWED
# The reasons a job that waits is given after a look at its victims (once per kind of job
# and pool state), and a dropped victim's.
_BUDGET, _RELEASING, _NOT_NEEDED = Reason.BUDGET_EXHAUSTED, Reason.WAITING_FOR_PREEMPTED_CAPACITY, Reason.NOT_NEEDED
_BLOCKED, _NO_VICTIMS = Reason.BLOCKED_BY_HIGHER_RANKED, Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS
_PREEMPTS, _RECLAIMS = Reason.PREEMPTS_LOWER_PRIORITY, Reason.RECLAIMS_BORROWED

# The lines and victims written for nearly every job are built with `tuple.__new__` and all
# their fields, in field order: a NamedTuple's own constructor is a Python function, a frame
# per line on top of the tuple (0.10 against 0.26 us, timeit), and a plan writes a line for
# every pending job.
_new = tuple.__new__

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
        waiting: Sequence[PendingJob] = (),
    ):
        self.pool, self.knobs, self.policy, self.now, self.discipline = pool, knobs, policy, now, discipline
        self._waiting = waiting  # the pool's pending jobs, for `escalated`
        # How long before the wait alarm escalates a job its likely victims are named.
        self._escalation_lead = escalation_lead_s(knobs)
        self.admits: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.failures: list[Failure] = []
        self.lines: list[Explanation] = []
        self.running = running
        rules = self.rules = ClaimRules.of(knobs, policy)
        self.claimed = {v.name: v.priority for v in running}
        if rules.caps:
            gated, claims = bool(rules.gated), {}
            for v in running:
                if gated or v.spot:  # otherwise no cost rule applies (`ClaimRules.claim`)
                    key = (v.priority, v.sla_s, v.spot)
                    claimed = claims.get(key)
                    if claimed is None:
                        claimed = claims[key] = rules.claim(v.priority, v.sla_s, v.spot)[0]
                    self.claimed[v.name] = claimed
        self._delays: dict[int, float] = {}
        # (preemptor's claimed, victim's claimed, victim runs the helper) -> the expected wait,
        # the priority weight and their text (`stop_mode`).
        self._wait_terms: dict[tuple[int, int, bool], tuple[float, float, str]] = {}
        self._timed = bool(knobs.preemption_delay_s or knobs.tier_preemption_delay_s)  # delays apply
        self._rate_limited = self._timed or knobs.budget is not None  # whether a job has waited its delay matters
        self._pool_delay = None if knobs.tier_preemption_delay_s else knobs.preemption_delay_s  # None: by tier
        # A job preempted this often is failed at its turn (on_max_preemptions: fail); None: never.
        fails = knobs.max_preemptions is not None and knobs.on_max_preemptions is MaxPreemptionsAction.FAIL
        self._fail_at = knobs.max_preemptions if fails else None
        self._starving_after = knobs.aging.starving_after_s
        used = sum(v.gpus for v in running)
        self.free = max(0, pool.gpus - used)
        # GPUs held beyond the pool's size (runs its teams launched and the controller
        # adopted hold what the account gave them): the first GPUs freed repay them, not
        # the jobs waiting (`_nominate`, `_commit`).
        self.deficit = max(0, used - pool.gpus)
        # The service has no instances for the pool (`Pool.no_capacity_until`): nothing is stopped.
        outage = pool.no_capacity_until
        self._outage = (
            f"the service has had no capacity for {pool.name} (until about {outage - now:.0f} s from now)"
            if outage is not None and now < outage else ""
        )
        self.releasing = 0
        # Stops that still wait for a checkpoint: their GPUs come back late. Each is judged
        # again, soonest first, for the job that comes to wait on it (`_take_releasing`);
        # one that no job which may preempt its victim waits on is called off (`call_offs`).
        self._late: list[list] = []  # [victim, GPUs not yet claimed in this plan, claimed by a job that may preempt it]
        self.releasing_late = 0
        # Stops about to go (no checkpoint waited for) but not sent yet: claimed after those
        # sent, before the late ones, and called off as they are when nobody needs them.
        self._unsent: list[list] = []  # as `_late`
        self.releasing_unsent = 0
        self.wait_cuts: list[WaitCut] = []
        for v in running:
            if v.stopping:
                self.releasing += v.gpus
                if v.stop_awaits_checkpoint:
                    self._late.append([v, v.gpus, False])
                    self.releasing_late += v.gpus
                elif v.preempted_for is not None:
                    self._unsent.append([v, v.gpus, False])
                    self.releasing_unsent += v.gpus
        if len(self._late) > 1:
            self._late.sort(key=lambda e: (self.late_wait_s(e[0]), e[0].name))
        self.initial_free = self.free
        self.admitted_gpus = 0
        self.held_gpus = 0  # claimed by nominated jobs ranked earlier
        self.chosen_by: dict[str, str] = {}
        self.quotas = Quotas(knobs.quotas, policy, running, self.claimed)
        # Jobs that would borrow, placed after other teams' work within its nominal quota (`nominal_first`).
        self.borrowing_last: frozenset[str] = frozenset()
        self._setup_candidates()
        self._bound_teamless = not self.quotas.on and knobs.within_team is knobs.across_teams  # `victim_bound`
        self._setup_budget(history)
        self._protections_reported = False
        # Victims the next preemptions will likely take, in rank order of the jobs that will
        # want them (ahead-of-time checkpoints): (victim, that job, why it waits).
        self._likely_victims: dict[str, tuple[RunningJob, str | None, str]] = {}
        ahead = knobs.checkpoint_ahead
        # Enough to fill `max_jobs` requests though some are chosen as victims later in
        # the plan, never the whole pool.
        self._likely_cap = 2 * ahead.max_jobs
        # Victim walks left in this plan made only to name likely victims (a spent budget,
        # queue pressure): at most `max_jobs`.
        self._ahead_walks = ahead.max_jobs
        self._ahead_keys: set[tuple] = set()
        self._pressure = ahead.on_queue_pressure
        # Outcomes of jobs that could not fit, by what decides them; forgotten whenever
        # capacity, quotas or candidates change (`_changed`). Most of a long queue waits
        # for the same reason as the job before it.
        self._no_fit: dict[tuple, tuple[Reason, str]] = {}
        # Under LowerOrNewerEqualPriority a job may preempt equal priority work started after
        # its own submission, so its submission time decides its outcome too.
        self._by_submission = PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY in (knobs.within_team, knobs.across_teams)

    # -- setup ----------------------------------------------------------------------------
    def _setup_candidates(self) -> None:
        """Protections and each quota's candidate GPUs now; the candidate index (lists in
        victim order, GPUs by priority) on first use, as most jobs never look for victims."""
        self.protected: dict[str, Eligibility] = {}
        self._candidates: list[RunningJob] = []
        self._bounds: dict[tuple[str, int, bool], int] = {}
        self._tops: dict[int, tuple[int, int]] = {}  # claimed -> (`top_priority` within, across teams)
        # Protected only by min_runtime_s, while an escalated job waits: candidates for it alone.
        self._soft: dict[str, Eligibility] = {}
        k, now = self.knobs, self.now
        # Most jobs meet no knob's protection: the protector is asked only where one may apply.
        knobbed = bool(k.max_preemptions is not None or k.min_runtime_s or k.near_completion.remaining_s is not None or k.near_completion.progress is not None)
        protect = protector(k, now)
        for v in self.running:
            if knobbed or v.stopping or not v.stoppable or v.guaranteed or v.spared_until is not None:
                verdict = protect(v)
            else:
                verdict = None
            if verdict is not None:
                if not (verdict.reason is Reason.MIN_RUNTIME_PROTECTED and self.escalated):
                    self.protected[v.name] = verdict
                    continue
                self._soft[v.name] = verdict
            self._candidates.append(v)
            bucket = self.quotas.bucket_of[v.name]
            if bucket is not None:
                bucket.candidate_gpus += v.gpus

    @cached_property
    def escalated(self) -> bool:
        """An escalated job waits in this pool, or one nears its escalation: the jobs only the
        minimum runtime protects are kept apart, candidates for an escalated job only
        (`_setup_candidates`). Looked at only when there is such a job: C loops over the
        whole queue."""
        waiting = self._waiting
        if any(map(_escalated, waiting)):
            return True
        lead = self._escalation_lead
        if lead is None:
            return False
        soon = float(self.now + lead)  # `soon.__ge__`: a float compares with any number
        return any(map(soon.__ge__, filter(_is_set, map(_escalates_at, waiting))))

    @cached_property
    def _victim_key(self) -> VictimKey:
        """The discipline's victim order; ours' "little at risk" is the pool's fresh checkpoint."""
        key_of = self.discipline.victim_key
        if key_of is victim_key:
            return partial(victim_key, fresh_s=self.knobs.checkpoint_max_age_s)
        return key_of

    @cached_property
    def cands(self) -> Candidates:
        """The candidate index, made on first use."""
        borrowed, claimed, key_of, now = self.quotas.borrowed, self.claimed, self._victim_key, self.now

        def order(v: RunningJob) -> tuple:
            return key_of(v, now, v.name in borrowed, claimed[v.name])

        return Candidates(self.quotas.on, order, self._candidates, borrowed, claimed)

    def _setup_budget(self, history: Iterable[PastPreemption]) -> None:
        """The budget spent in its window, and the GPUs the checkpoint forecast expects the
        next preemptions to take (`CheckpointAhead.forecast_window_s`)."""
        budget, ahead, now, pool = self.knobs.budget, self.knobs.checkpoint_ahead, self.now, self.pool.name
        self.budget_count, self.budget_lost = 0, 0.0
        self._spent: str | None = None  # `_budget_spent`, until the next preemption counts
        self.forecast_gpus = 0.0
        forecast = ahead.forecast_window_s if ahead.max_jobs else None
        if budget is None and forecast is None:
            return
        recent = 0
        for h in history:
            if h.pool != pool or h.at > now:
                continue
            if budget is not None and now - budget.window_s < h.at:
                self.budget_count += 1
                self.budget_lost += h.lost_gpu_seconds
            if forecast is not None and now - forecast < h.at:
                recent += h.gpus
        if forecast is not None:
            self.forecast_gpus = recent * ahead.forecast_horizon_s / forecast

    def victim_order(self, v: RunningJob) -> tuple:
        return self._victim_key(v, self.now, v.name in self.quotas.borrowed, self.claimed[v.name])

    # -- who may be stopped ---------------------------------------------------------------
    def may_reclaim(self, bucket: Bucket | None, gpus: int) -> bool:
        return self.quotas.may_reclaim(bucket, gpus, self.knobs.reclaim_within_pool)

    def eligibility(self, r: RankedJob, v: RunningJob, reclaim: bool) -> Eligibility:
        return self.judge(r, reclaim)(v)

    def judge(self, r: RankedJob, reclaim: bool, escalated: bool = False) -> Callable[[RunningJob], Eligibility]:
        """`victims.eligibility` of a candidate for `r`; a candidate protected by the minimum
        runtime (kept apart while an escalated job waits) is one for an escalated job only
        (`escalated`: judge as if `r` were escalated already)."""
        claimed, borrowed, knobs, on = self.claimed, self.quotas.borrowed, self.knobs, self.quotas.on
        soft = None if escalated or r.job.escalated else self._soft
        if not soft:
            return lambda v: eligibility(r, v, claimed[v.name], knobs, on, v.name in borrowed, reclaim)

        def judge(v: RunningJob) -> Eligibility:
            verdict = soft.get(v.name)
            if verdict is not None:
                return verdict
            return eligibility(r, v, claimed[v.name], knobs, on, v.name in borrowed, reclaim)

        return judge

    def candidate_verdict(self, r: RankedJob, v: RunningJob) -> Eligibility:
        """`eligibility` with the protections and earlier choices in this cycle, for `explain`."""
        if v.name in self.chosen_by:
            return Eligibility(None, Reason.ALREADY_STOPPING, f"chosen as a victim for {self.chosen_by[v.name]} in this plan")
        if v.name in self.protected:
            return self.protected[v.name]
        bucket = self.quotas.bucket_for(r.job.team, r.claimed)
        return self.eligibility(r, v, self.may_reclaim(bucket, r.job.gpus))

    def tops(self, claimed: int) -> tuple[int, int]:
        """The highest priority a job claiming `claimed` may preempt within its team and across
        teams (`victims.top_priority` of each mode), once per claimed priority."""
        tops = self._tops.get(claimed)
        if tops is None:
            k = self.knobs
            tops = self._tops[claimed] = (top_priority(k.within_team, claimed), top_priority(k.across_teams, claimed))
        return tops

    def victim_bound(self, r: RankedJob, reclaim: bool) -> int:
        """An upper bound of the GPUs `r` could free by preemption (`Candidates.bound`);
        the same for every team without quotas when both modes agree, as by default."""
        key = (None if self._bound_teamless else r.job.team, r.claimed, reclaim)
        bound = self._bounds.get(key)
        if bound is None:  # the same until victims are chosen (`_commit` forgets them)
            top_within, top_across = self.tops(r.claimed)
            if top_within < 0 and top_across < 0 and not reclaim:
                bound = 0  # it may preempt no one
            else:
                bound = self.cands.bound(r.job.team, top_within, top_across, self.quotas.on, reclaim)
            self._bounds[key] = bound
        return bound

    def choose(self, r: RankedJob, bucket: Bucket | None, available: int, reclaim: bool, escalated: bool = False) -> Choice:
        """Take eligible victims in victim order until `r` fits, then fill back (`victims.walk`);
        `escalated`: the victims `r` would take once escalated."""
        tops = self.tops(r.claimed)
        top_within = tops[0]
        top = max(tops)
        # With quotas, only the job's own team's work that is not borrowed may be preempted.
        cands = self.cands
        scans = (
            ((True, None), _INF if reclaim else top),
            (cands.list_key(False, r.job.team), top_within if self.quotas.on else top),
        )
        return walk(
            scans,
            cands,
            self.claimed,
            self.judge(r, reclaim, escalated),
            None if bucket is None else partial(self.quotas.fits, bucket, r.job.gpus),
            self.quotas.bucket_of,
            available,
            by_priority=self.discipline.victims_by_priority,
            fill_back=self.discipline.fill_back,
            need=r.job.gpus,
        )

    # -- the queue ---------------------------------------------------------------------------
    def nominal_first(self, ranked: list[RankedJob]) -> list[RankedJob]:
        """The order the pool's queue is placed in: with quotas, Kueue's. Work that would run
        within its quota's nominal share (at the plan's start) goes before work that would
        borrow, each in rank order (a job's quota counted with the jobs of that quota placed
        before it); a team's jobs keep their own order (once one of its jobs borrows, the
        team's later jobs follow it). `borrowing_last` names the jobs some other team's work
        within its nominal quota was placed before.

        Without it, GPUs a job within its nominal quota reclaimed from a borrowing team went
        back to that team's higher-priority job as soon as they were free (it borrows them
        again), so the reclaim stopped the borrower for nothing and its reclaimer waited on,
        or reclaimed again at the next cycle: a stop and a restart each time."""
        quotas = self.quotas
        if not quotas.on:
            return ranked
        by_claim, bucket_for = quotas.by_claim, quotas.bucket_for
        within: list[RankedJob] = []
        later: list[RankedJob] = []
        borrowing_teams: set[str] = set()
        placed: dict[int, int] = {}  # GPUs of the jobs within nominal so far, by quota
        overtaken = 0  # the first `overtaken` of `later` have work within nominal placed before them
        for r in ranked:
            job = r.job
            team = job.team
            if team not in borrowing_teams:
                bucket = by_claim.get((team, r.claimed))
                if bucket is None:
                    bucket = bucket_for(team, r.claimed)
                ahead = placed.get(id(bucket), 0) + job.gpus
                if bucket.used + ahead <= bucket.nominal:
                    placed[id(bucket)] = ahead
                    within.append(r)
                    overtaken = len(later)
                    continue
                borrowing_teams.add(team)
            later.append(r)
        if not overtaken:
            return ranked
        self.borrowing_last = frozenset(r.job.name for r in later[:overtaken])
        return within + later

    def place(self, r: RankedJob) -> None:
        """Place one pending job (`place_all` of it alone)."""
        self.place_all((r,))

    def place_all(self, ranked: Iterable[RankedJob]) -> None:
        """Place the pending jobs in rank order: admit, nominate, or give a job alike one
        that could not fit its outcome again (`_no_fit`).

        Most of a long queue is served by that look-up, so what it reads of the pool is
        bound once for the queue, not once per job; none of it changes during the plan
        (the cache is cleared in place, `_changed`).
        """
        quotas, no_fit, now = self.quotas, self._no_fit, self.now
        append, on, by_claim = self.lines.append, quotas.on, quotas.by_claim
        rate_limited, pool_delay = self._rate_limited, self._pool_delay
        by_submission, after, pool_gpus = self._by_submission, self._starving_after, self.pool.gpus
        cacheable = self._fail_at is None  # a job at max_preemptions (fail) is judged on its own
        for r in ranked:
            job, claimed = r.job, r.claimed
            # Caps change what a job may preempt, so they get a line of their own; aging
            # only reorders the queue and is told in `explain` and the rank trace.
            if r.notes:
                for reason, detail in r.notes:
                    append(_new(Explanation, (job.name, _RANK, reason, detail, None)))
            # What decides the outcome of a job that does not fit, besides the pool's state
            # (its quota is its team's at its claimed priority: `quotas.bucket_for`, found
            # only for a job the look-up does not serve).
            if not rate_limited or job.escalated:
                waited = True
            elif pool_delay is not None:  # `waited_enough`, inline
                since = job.pending_since
                waited = not pool_delay or now - (job.submitted_at if since is None else since) >= pool_delay
            else:
                waited = self.waited_enough(r)
            # A job near its escalation names other victims (`_note_escalation`) than one that is not.
            nearing = job.escalates_at is not None and self.nears_escalation(job)
            gpus, submitted = job.gpus, job.submitted_at
            key = (claimed, job.team, gpus, job.escalated, waited, nearing)
            if no_fit and cacheable and gpus <= pool_gpus:
                # A job alike one that could not fit, since nothing changed: the same
                # outcome (it does not fit the free GPUs either, so it is not admitted).
                starving = after is not None and now - submitted >= after  # `starving`, inline
                # Under LowerOrNewerEqualPriority, in one pool state, jobs alike but for
                # their submission time are all decided by a walk (remembered with the
                # submission time) or all without one (remembered without, `_remember`):
                # the key without is looked up first, as most of a long queue waits without
                # a walk.
                cached = no_fit.get(key)
                if cached is None and by_submission:
                    cached = no_fit.get(key + (submitted,))
                if cached is not None:
                    if starving and cached[0] is not _BUDGET:
                        # It cannot fit either: it reserves what is left (`_cannot_fit`).
                        self._reserve(r, quotas.bucket_for(job.team, claimed))
                    else:
                        # A spent budget is remembered only when nothing was left to hold:
                        # a starving job is told the same (`_nominate`).
                        append(_new(Explanation, (job.name, _WAIT, cached[0], cached[1], None)))
                    continue
            bucket = None
            if on:  # `quotas.bucket_for`, its look-up inline
                bucket = by_claim.get((job.team, claimed))
                if bucket is None:
                    bucket = quotas.bucket_for(job.team, claimed)
            self._place_anew(r, bucket, key + (submitted,) if by_submission else key, waited)

    def _place_anew(self, r: RankedJob, bucket: Bucket | None, key: tuple, waited: bool | None = None) -> None:
        """Place a job no remembered outcome decides: fail it at its max_preemptions, skip
        it when larger than the pool, admit it when it fits, else nominate it (`key`: what
        its outcome is remembered by; `waited`: its `waited_enough`, when known)."""
        job = r.job
        if self._fail_at is not None and job.preemptions >= self._fail_at:
            k = self.knobs
            detail = f"preempted {job.preemptions} times; max_preemptions is {k.max_preemptions} (on_max_preemptions: fail)"
            self.failures.append(Failure(job.name, job.pool, Reason.MAX_PREEMPTIONS_EXCEEDED, detail))
            self.lines.append(Explanation(job.name, Verdict.FAIL, Reason.MAX_PREEMPTIONS_EXCEEDED, detail))
            return
        if job.gpus > self.pool.gpus:
            detail = f"needs {job.gpus} GPUs, pool {self.pool.name} has {self.pool.gpus}"
            self.lines.append(Explanation(job.name, Verdict.SKIP, Reason.LARGER_THAN_POOL, detail))
            return
        if bucket is None:
            if job.gpus <= self.free:
                self._admit(r, bucket)
                return
            fit = None
        else:
            fit = self.quotas.fits(bucket, job.gpus, self.free, NOTHING_FREED)
            if fit[0]:
                self._admit(r, bucket)
                return
        # Nothing is being freed: the capacity `_nominate` tests is the free capacity.
        self._nominate(r, bucket, key, self.waited_enough(r) if waited is None else waited, None if self.releasing else fit)

    def _remember(self, key: tuple, outcome: tuple[Reason, str], choice: Choice | None) -> None:
        """Remember the outcome of a job that could not fit for the jobs alike (`place`).

        The submission time in `key` (LowerOrNewerEqualPriority) is read only by the victim
        walk: an outcome without one (`choice` None) holds for any submission time, so a
        long queue of jobs waiting for the same reason is not walked job by job. A starving
        job alike reserves what is left instead, as `_cannot_fit` has it, but for a spent
        budget: that is remembered only when nothing was left to hold, and a starving job
        is told the same (`_nominate`).
        """
        self._no_fit[key[:-1] if choice is None and self._by_submission else key] = outcome

    def _changed(self) -> None:
        """Capacity, quotas or candidates changed: cached no-fit outcomes no longer hold."""
        if self._no_fit:
            self._no_fit.clear()

    def delay_for(self, claimed: int) -> float:
        """The preemption delay of a job claiming `claimed` (its tier's, else the pool's)."""
        k = self.knobs
        if not k.tier_preemption_delay_s:
            return k.preemption_delay_s
        delay = self._delays.get(claimed)
        if delay is None:
            delay = self._delays[claimed] = k.tier_preemption_delay_s.get(self.policy.tier_of(claimed), k.preemption_delay_s)
        return delay

    def waited_enough(self, r: RankedJob) -> bool:
        """Whether `r` has served its preemption delay (an escalated job has none)."""
        job = r.job
        if job.escalated:
            return True
        delay = self._pool_delay
        if delay is None:
            delay = self.delay_for(r.claimed)
        if not delay:
            return True  # none to serve, though its clock ran ahead of the plan's
        since = job.pending_since  # `job.waiting_since()`, inline: this runs for every job
        return self.now - (job.submitted_at if since is None else since) >= delay

    def _admit(self, r: RankedJob, bucket: Bucket | None) -> None:
        job = r.job
        self._changed()
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

    def _free_for(self, bucket: Bucket | None, need: int) -> int:
        """How many of `need` GPUs a job of quota `bucket` may take from the free ones: not
        those other quotas keep unlent (it waits for GPUs being freed instead, and keeps
        their stops: were it to hold the kept ones, a stop it needs would be called off as
        nobody's, and made again by the next plan's walk)."""
        free = self.free if bucket is None else self.free - self.quotas.kept_by_others(bucket)
        return min(free, need) if free > 0 else 0

    def _hold(self, r: RankedJob, bucket: Bucket | None) -> int:
        """Claim the free GPUs its quota may take (then those being freed) a waiting job will
        need; returns the amount."""
        need = r.job.gpus
        from_free = self._free_for(bucket, need)
        from_releasing = min(self.releasing, need - from_free)
        if not (from_free or from_releasing):
            return 0  # nothing left to hold: nothing changes
        self._changed()
        self.free -= from_free
        self._take_releasing(r, from_releasing)
        self.held_gpus += from_free + from_releasing
        if bucket is not None:
            self.quotas.set_used(bucket, bucket.used + from_free + from_releasing)
        return from_free + from_releasing

    def _take_releasing(self, r: RankedJob, gpus: int) -> None:
        """`r` claims `gpus` of the GPUs being freed: those of stops already signalled first
        (they come back within the grace), then those of stops that still wait for a
        checkpoint, soonest first. Such a stop was judged worth its wait for the job it was
        made for; `r` now waits on it too, so it is judged again for `r` (`judge_late`),
        with the wait that is left: cut short when the wait no longer pays. Only a job that
        may preempt the victim judges its stop, and keeps it from being called off."""
        if gpus <= 0:
            return
        late = gpus - (self.releasing - self.releasing_late)  # beyond the signalled stops
        if self._unsent:
            self._take_unsent(r, gpus - (self.releasing - self.releasing_late - self.releasing_unsent))
        self.releasing -= gpus
        if late <= 0:
            return
        self.releasing_late -= late
        for entry in self._claim(self._late, late, r):
            if self.judge_late(r, entry[0]):
                # Stopped now: its GPUs not yet claimed come back within the grace too.
                self.releasing_late -= entry[1]
                entry[1] = 0

    def _take_unsent(self, r: RankedJob, gpus: int) -> None:
        """`r` claims `gpus` beyond the stops already sent: first those of stops not sent
        yet that wait for no checkpoint (they come back within the grace too), in order."""
        taken = min(max(0, gpus), self.releasing_unsent)
        self.releasing_unsent -= taken
        for _ in self._claim(self._unsent, taken, r):
            pass

    def _claim(self, entries: list[list], gpus: int, r: RankedJob) -> Iterator[list]:
        """`r` takes `gpus` from `entries` ([victim, GPUs not claimed yet, wanted]) in order;
        yields each entry it took from whose victim it may preempt, marked wanted (a job
        that only waits for the GPUs neither keeps nor judges a stop not made for it)."""
        for entry in entries:
            if gpus <= 0:
                return
            v, left, _ = entry
            if not left:
                continue
            part = min(left, gpus)
            gpus -= part
            entry[1] = left - part
            if self._may_stop(r, v):
                entry[2] = True
                yield entry

    def _may_stop(self, r: RankedJob, v: RunningJob) -> bool:
        """Whether `r` may preempt `v`, a victim being stopped, by the pool's rules (its
        protections aside: it is chosen already). A job being stopped no longer counts
        against its quota, so it is judged as the borrowed work it was when another team
        chose it: under quotas, the only work of another team a job may stop."""
        quotas = self.quotas
        bucket = quotas.bucket_for(r.job.team, r.claimed) if quotas.on else None
        reclaim = self.may_reclaim(bucket, r.job.gpus)
        return eligibility(r, v, self.claimed[v.name], self.knobs, quotas.on, True, reclaim).rule is not None

    def call_offs(self) -> list[CallOff]:
        """After the queue is placed: the preemptions whose stop is not sent yet (it waits for
        a checkpoint, or is about to go) and whose GPUs no job that may preempt the victim waits for in this plan (its
        preemptor was admitted into GPUs freed otherwise, or fits without them), to be
        called off (`CallOff`): the stop would throw away the victim's work since its
        checkpoint and its restart for nobody, or for a job that may not stop it."""
        out = []
        for v, left, wanted in self._unsent + self._late:
            if wanted or v.preempted_for is None:
                continue
            detail = (
                f"no job that may preempt it waits for its {v.gpus} GPUs any more ({v.preempted_for}, which it was "
                "being stopped for, no longer needs them): its stop, not sent yet, is called off"
            )
            out.append(CallOff(v.name, self.pool.name, detail))
            self.lines.append(Explanation(v.name, _SPARE, Reason.PREEMPTION_NO_LONGER_NEEDED, detail, v.preempted_for))
        return out

    def late_wait_s(self, v: RunningJob) -> float:
        """How much longer the stop of `v` is expected to wait for its checkpoint: the
        expected wait of a job running the training helper, while it lasts; else (and
        after it) until the workflow gives up at `checkpoint_wait_max_s`."""
        k = self.knobs
        asked = v.checkpoint_requested_at
        waited = 0.0 if asked is None else max(0.0, self.now - asked)
        expected = k.checkpoint_wait.expected_wait_s
        if v.declares_save_on_stop and waited < expected:
            return expected - waited
        return max(0.0, k.checkpoint_wait_max_s - waited)

    def late_cost(self, r: RankedJob, v: RunningJob) -> tuple[bool, float, str]:
        """For `r`, a job that would wait for the GPUs of `v`, whose stop waits for a
        checkpoint: (cut the wait short?, what the better of the two costs, the figures).
        The rule of `stop_mode` with the wait that is left: the work the checkpoint saves
        (victim GPUs x seconds at risk) against `r`'s GPUs x that wait, weighted by
        priority; an escalated job never waits on it."""
        left = self.late_wait_s(v)
        if r.job.escalated:
            return True, 0.0, f"{r.job.name} is escalated"
        weight = r.claimed / max(1, self.claimed[v.name]) if self.knobs.checkpoint_wait.priority_weighted else 1.0
        saved = v.gpus * v.work_at_risk_s(self.now)
        cost = r.job.gpus * left * weight
        figures = f"{saved:.0f} GPU-s at risk vs {r.job.gpus} GPUs x {left:.0f} s left x {weight:.2f} = {cost:.0f}"
        return saved <= cost, min(saved, cost), figures

    def late_costs(self, r: RankedJob, gpus: int) -> float:
        """What claiming `gpus` of the GPUs being freed costs `r` beyond the stops already
        signalled (`late_cost` of each stop it would wait on, soonest first); 0 when the
        signalled stops cover them."""
        late = gpus - (self.releasing - self.releasing_late)
        total = 0.0
        for v, left, _ in self._late:
            if late <= 0:
                break
            if left:
                late -= left
                total += self.late_cost(r, v)[1]
        return total

    def judge_late(self, r: RankedJob, v: RunningJob) -> bool:
        """Whether the stop of `v`, waiting for a checkpoint, is cut short for `r`, a job
        that now waits for its GPUs (`late_cost`). Either way `r`'s wait on it is told in
        `explain`."""
        cut, _, figures = self.late_cost(r, v)
        if cut:
            detail = f"its stop no longer waits for a checkpoint: {r.job.name} waits for its GPUs; {figures}"
            self.wait_cuts.append(WaitCut(v.name, self.pool.name, r.job.name, detail))
            self.lines.append(Explanation(v.name, _PREEMPT, Reason.CHECKPOINT_WAIT_CUT, detail, r.job.name))
        else:
            detail = f"{r.job.name} waits for its GPUs, its stop for a checkpoint: {figures}"
            self.lines.append(Explanation(v.name, _PREEMPT, Reason.CHECKPOINT_WAIT_KEPT, detail, r.job.name))
        return cut

    def _wait(self, job: PendingJob, reason: Reason, detail: str) -> None:
        self.lines.append(_new(Explanation, (job.name, _WAIT, reason, detail, None)))

    def _report_protections(self) -> None:
        if self._protections_reported:
            return
        self._protections_reported = True
        for v in self.running:
            verdict = self.protected.get(v.name)
            if verdict is not None and verdict.reason is not Reason.ALREADY_STOPPING:
                self.lines.append(Explanation(v.name, Verdict.SPARE, verdict.reason, verdict.detail))

    def _nominate(self, r: RankedJob, bucket: Bucket | None, key: tuple, waited: bool, fit: tuple[bool, str] | None = None) -> None:
        """Claim capacity for a job that does not fit now, preempting victims if needed
        (`waited`: its `waited_enough`; `fit`: its `Quotas.fits` in the GPUs available, when
        known)."""
        job, k, now = r.job, self.knobs, self.now
        available = self.free + self.releasing - self.deficit
        if fit is not None:
            ok, short_of = fit
        elif bucket is None:  # `Quotas.fits` without a quota, inline
            ok, short_of = (True, "") if job.gpus <= available else (False, "capacity")
        else:
            ok, short_of = self.quotas.fits(bucket, job.gpus, available, NOTHING_FREED)
        if ok and self.releasing_late and self._preempts_instead(r, bucket, available):
            return
        if ok:
            from_releasing = job.gpus - self._free_for(bucket, job.gpus)
            self._hold(r, bucket)
            self._wait(job, _RELEASING, f"{from_releasing} of its {job.gpus} GPUs are held by jobs being stopped")
            return

        if not self._protections_reported:
            self._report_protections()
        reclaim = bucket is not None and self.quotas.may_reclaim(bucket, job.gpus, k.reclaim_within_pool)
        choice = None  # no victims looked for
        bound = self._bounds.get((None if self._bound_teamless else job.team, r.claimed, reclaim))  # `victim_bound`'s look-up, inline
        if bucket is not None and bucket.used - bucket.candidate_gpus + job.gpus > bucket.ceiling:
            short_of = "quota"  # even stopping all its own quota's work would not make room
        elif available + (self.victim_bound(r, reclaim) if bound is None else bound) >= job.gpus:
            spent = "" if k.budget is None else self._spent if self._spent is not None else self._budget_spent()
            if spent and waited:
                # Any victim would exceed a budget already spent: they are looked for only
                # to be asked for a checkpoint before the budget allows their stop.
                if self._ahead_walks > 0 and self._ahead_walk(key) and len(self._likely_victims) < self._likely_cap:
                    choice = self.choose(r, bucket, available, reclaim)
                    if choice.fits:
                        self._note_likely(choice.victims, job.name, "whose preemption waits for the preemption budget")
                held = self._hold(r, bucket) if self.free or self.releasing else 0  # (nothing to hold: `_hold` would do nothing)
                detail = f"needs {job.gpus} GPUs; the pool's preemption budget is spent: {spent}"
                self.lines.append(_new(Explanation, (job.name, _WAIT, _BUDGET, detail, None)))
                if not held and not self.starving(job):
                    self._remember(key, (_BUDGET, detail), None)  # nothing was left to hold
                return
            choice = self.choose(r, bucket, available, reclaim)
            short_of = choice.short_of
        if choice is None or not choice.fits:
            if self._pressure and short_of != "quota":
                self._note_pressure(r, bucket, available, reclaim, choice, key)
            if short_of != "quota" and job.escalates_at is not None and self.nears_escalation(job):
                self._note_escalation(r, bucket, available, reclaim, key)
            outcome = self._cannot_fit(r, bucket, choice, short_of, reclaim)
            if outcome is not None:
                self._remember(key, outcome, choice)
            return

        victims = [v for v, _ in choice.victims]
        if not waited:
            self._hold(r, bucket)
            delay = self.delay_for(r.claimed)
            knob = "tier_preemption_delay_s" if delay != k.preemption_delay_s or k.tier_preemption_delay_s.get(self.policy.tier_of(r.claimed)) is not None else "preemption_delay_s"
            detail = (
                f"needs {job.gpus} GPUs; waits {delay - (now - job.waiting_since()):.0f} s more for capacity to free "
                f"by itself before preempting {_names(victims)} ({knob} {delay:g})"
            )
            self._wait(job, Reason.PREEMPTION_DELAYED, detail)
            self._note_likely(choice.victims, job.name, "whose preemption is delayed")
            return
        if self._outage:
            self._hold(r, bucket)
            detail = f"needs {job.gpus} GPUs; {self._outage}: stopping {_names(victims)} would hand their instances back to it"
            self._wait(job, Reason.NO_SERVICE_CAPACITY, detail)
            self._note_likely(choice.victims, job.name, "whose preemption waits for the service's capacity")
            return
        over = self._over_budget(victims) if k.budget is not None else ""
        if over:
            self._hold(r, bucket)
            self._wait(job, Reason.BUDGET_EXHAUSTED, f"needs {job.gpus} GPUs; preempting {_names(victims)} would exceed the budget: {over}")
            self._note_likely(choice.victims, job.name, "whose preemption waits for the preemption budget")
            return
        self._commit(r, bucket, choice)

    def _preempts_instead(self, r: RankedJob, bucket: Bucket | None, available: int) -> bool:
        """`r` fits the GPUs being freed only with some whose stop waits for a checkpoint:
        it preempts instead, and returns True, when new victims stopped at once cost less
        (their work lost, restart overhead and re-preemption penalty: the stop cost of the
        victim order; the stop waited on is made anyway) than waiting on those stops, or
        cutting their wait, costs (`late_costs`), it has served its preemption delay and
        the budget allows them."""
        job, now = r.job, self.now
        soon = available - self.releasing_late
        waiting = self.late_costs(r, job.gpus - self.free)
        if not waiting or not self.waited_enough(r) or self._outage:
            return False
        reclaim = self.quotas.may_reclaim(bucket, job.gpus, self.knobs.reclaim_within_pool)
        if soon + self.victim_bound(r, reclaim) < job.gpus:
            return False
        choice = self.choose(r, bucket, soon, reclaim)
        if not choice.fits or not choice.victims:
            return False
        cost = 0.0
        for v, _ in choice.victims:
            at_risk = v.work_at_risk_s(now)
            fresh = progress.is_fresh(v.last_checkpoint_at, v.started_at, now, self.knobs.checkpoint_max_age_s)
            if self.stop_mode(r, v, at_risk, fresh)[0]:
                return False  # its stop would wait for a checkpoint too
            cost += v.stop_cost_gpu_seconds(now, at_risk)
        if cost >= waiting or self._over_budget([v for v, _ in choice.victims]):
            return False
        self._commit(r, bucket, choice)
        return True

    def _reserve(self, r: RankedJob, bucket: Bucket | None) -> None:
        """A starving job that cannot fit holds what is free (and being freed) for itself."""
        job = r.job
        held = self._hold(r, bucket)
        waited = self.now - job.submitted_at
        detail = f"waited {waited:.0f} s >= starving_after_s {self.knobs.aging.starving_after_s:g}; holds {held} of its {job.gpus} GPUs"
        self._wait(job, Reason.STARVATION_RESERVATION, detail)

    def starving(self, job: PendingJob) -> bool:
        """Whether `job` has waited `aging.starving_after_s` (it then reserves capacity)."""
        after = self._starving_after
        return after is not None and self.now - job.submitted_at >= after

    def _cannot_fit(self, r: RankedJob, bucket: Bucket | None, choice: Choice | None, short_of: str, reclaim: bool) -> tuple[Reason, str] | None:
        """A job that cannot fit even with every eligible victim waits; returns the
        (reason, detail) it was given, or None when it reserved capacity (starving).
        `choice` is the walk, None when no victims were looked for; `short_of` what is missing."""
        job = r.job
        if self.starving(job):
            self._reserve(r, bucket)
            return None
        if choice is not None and choice.scanned:
            eligible = f"{sum(v.gpus for v, _ in choice.victims)} held by {len(choice.victims)} job(s) it may preempt"
        else:
            eligible = f"at most {self.victim_bound(r, reclaim)} held by jobs it may preempt"
        if short_of == "quota" and bucket is not None:
            detail = (
                f"needs {job.gpus} GPUs; quota {bucket.label()} uses {bucket.used} of nominal {bucket.nominal}"
                f" (ceiling {bucket.ceiling_label()}); other quotas keep {self.quotas.kept_by_others(bucket)} GPUs unlent; {eligible}"
            )
            self._wait(job, Reason.OVER_QUOTA, detail)
            return Reason.OVER_QUOTA, detail
        reason = _BLOCKED if job.gpus <= self.initial_free else _NO_VICTIMS
        over = f" (the pool is over-full by {self.deficit}: they repay that first)" if self.deficit else ""
        detail = f"needs {job.gpus} GPUs; {self.free} free, {self.releasing} being freed{over}, {eligible}"
        if reason is _BLOCKED:
            detail += f"; {self.admitted_gpus} GPUs admitted and {self.held_gpus} held for higher-ranked jobs"
        self._wait(job, reason, detail)
        return reason, detail

    def _budget_spent(self) -> str:
        """Why any preemption would exceed the budget now (`_over_budget` of no victims),
        remembered until a preemption counts against it (`_preempt`): once it is spent,
        every job of the queue that would preempt asks, and the answer is the same."""
        spent = self._spent
        if spent is None:
            spent = self._spent = self._over_budget(())
        return spent

    def _over_budget(self, victims: Sequence[RunningJob]) -> str:
        """Why stopping `victims` would exceed the pool's budget ('' when it would not).

        With no victims: whether the budget is already spent, so that any preemption would
        exceed it (a count at its maximum, or lost GPU-hours at or over theirs).
        """
        budget = self.knobs.budget
        if budget is None:
            return ""
        count = self.budget_count + len(victims)
        if budget.max_preemptions is not None and (count > budget.max_preemptions or (not victims and count >= budget.max_preemptions)):
            return f"{count} preemptions {'>' if victims else 'of'} {budget.max_preemptions} per {budget.window_s:g} s"
        if budget.max_gpu_hours is None:
            return ""  # the work the victims would lose counts against no limit
        lost = self.budget_lost + sum(v.lost_gpu_seconds(self.now) for v in victims) if victims else self.budget_lost
        lost_h = lost / 3600.0
        if lost_h > budget.max_gpu_hours:
            return f"{lost_h:.2f} GPU-hours lost > {budget.max_gpu_hours:g} per {budget.window_s:g} s"
        return ""

    def _commit(self, r: RankedJob, bucket: Bucket | None, choice: Choice) -> None:
        """Stop the chosen victims for `r`: it holds the capacity they free; any surplus
        becomes capacity being freed that the next jobs can claim."""
        job = r.job
        self._changed()
        quotas, cands, claimed, chosen_by = self.quotas, self.cands, self.claimed, self.chosen_by
        bucket_of, borrowed = quotas.bucket_of, quotas.borrowed
        chosen: set[str] = set()
        victim_gpus = 0
        for v, _ in choice.victims:
            name, gpus = v.name, v.gpus
            victim_gpus += gpus
            chosen.add(name)
            b = bucket_of[name]
            if b is not None:
                quotas.set_used(b, b.used - gpus)
                b.candidate_gpus -= gpus
            cands.add(v, name in borrowed, claimed[name], -1)
            chosen_by[name] = job.name
        still_needed = max(0, job.gpus - victim_gpus)  # taken from free, then from releasing
        from_free = min(self.free, still_needed)
        self.free -= from_free
        if still_needed > from_free:
            self._take_releasing(r, still_needed - from_free)
        surplus = max(0, victim_gpus - job.gpus)
        if self.deficit:  # an over-full pool is repaid first
            repaid = min(self.deficit, surplus)
            self.deficit -= repaid
            surplus -= repaid
        self.releasing += surplus
        self.held_gpus += job.gpus
        for key, scanned in choice.scanned.items():
            if scanned:
                cands.remove(key, chosen, scanned)
        self._bounds.clear()
        if bucket is not None:
            quotas.set_used(bucket, bucket.used + job.gpus)
        lines, reclaims = self.lines, False
        for v, verdict in choice.victims:
            self._preempt(r, v, verdict.rule, verdict.detail)
            reclaims = reclaims or verdict.rule is _RECLAIM
        if choice.dropped:
            dropped = f"fill-back: {job.name} fits without it"
            for v in choice.dropped:
                lines.append(_new(Explanation, (v.name, _SPARE, _NOT_NEEDED, dropped, job.name)))
        for v, verdict in choice.skipped[:MAX_SKIPPED_LINES]:
            lines.append(_new(Explanation, (v.name, _SPARE, verdict.reason, verdict.detail, job.name)))
        more = len(choice.skipped) - MAX_SKIPPED_LINES
        detail = f"needs {job.gpus} GPUs; preempting {', '.join([v.name for v, _ in choice.victims]) or 'nothing new'}"
        if job.escalated:
            detail += "; escalated: minimum runtime, checkpoint wait and preemption delay lifted"
        if more > 0:
            detail += f" ({more} more candidates skipped)"
        self._wait(job, _RECLAIMS if reclaims else _PREEMPTS, detail)

    def stop_mode(self, r: RankedJob, v: RunningJob, at_risk: float, fresh: bool) -> tuple[bool, Reason, str]:
        """How victim `v` is stopped for `r`: (wait for a requested checkpoint?, why, detail).
        `at_risk`: its `work_at_risk_s` now; `fresh`: its checkpoint is within
        `checkpoint_max_age_s` (`progress.is_fresh`).

        At once when nothing is at risk or waiting does not pay: the preemptor is
        escalated; the victim has been seen to save on SIGTERM within the grace; its
        checkpoint is fresh; it ignored its last checkpoint request; or the work a
        checkpoint would save (victim GPUs x seconds at risk) is not worth the wait
        (preemptor GPUs x the expected wait, times preemptor priority / victim priority
        when `priority_weighted`). The expected wait is `checkpoint_wait.expected_wait_s`
        for a job that runs the training helper (`declares_save_on_stop`), else
        `checkpoint_wait_max_s`. Otherwise the workflow asks and waits.
        """
        k = self.knobs
        if r.job.escalated:
            return False, Reason.ESCALATED_STOP, f"stopped at once: {r.job.name} is escalated"
        if v.saves_on_stop:
            return False, Reason.SAVES_ON_STOP, "stopped at once: it was seen to save on SIGTERM within the grace"
        if fresh:
            return False, Reason.CHECKPOINT_FRESH, f"stopped at once: {at_risk:.0f} s at risk <= checkpoint_max_age_s {k.checkpoint_max_age_s:g}"
        if v.ignored_checkpoint_request:
            return False, Reason.IGNORED_LAST_REQUEST, "stopped at once: it did not honour its last checkpoint request"
        terms_key = (r.claimed, self.claimed[v.name], v.declares_save_on_stop)
        terms = self._wait_terms.get(terms_key)
        if terms is None:  # a few per pool: a tier pair and whether the victim runs the helper
            wait = k.checkpoint_wait
            weight = r.claimed / max(1, terms_key[1]) if wait.priority_weighted else 1.0
            # A job without the training helper cannot answer a request: only its own periodic
            # checkpoint can come, so the wait to expect is the workflow's longest.
            expected = wait.expected_wait_s if terms_key[2] else float(k.checkpoint_wait_max_s)
            terms = self._wait_terms[terms_key] = (expected, weight, f"{expected:g} s x {weight:.2f}")
        expected, weight, text = terms
        saved = v.gpus * at_risk
        cost = r.job.gpus * expected * weight
        figures = f"{saved:.0f} GPU-s at risk vs {r.job.gpus} GPUs x {text} = {cost:.0f}"
        if saved > cost:
            return True, Reason.WAIT_FOR_CHECKPOINT, f"asks for a checkpoint and waits: {figures}"
        return False, Reason.WAIT_DOES_NOT_PAY, f"stopped at once: {figures}"

    def _note_pressure(self, r: RankedJob, bucket: Bucket | None, available: int, reclaim: bool, choice: Choice | None, key: tuple) -> None:
        """Queue pressure: `r` cannot fit even with every victim it may take, but once a
        little more capacity frees it takes them; they are likely victims. When the bound
        spared the walk they are looked for (`_ahead_walk`)."""
        if choice is None:
            if not self.victim_bound(r, reclaim) or not self._ahead_walk(key):
                return
            choice = self.choose(r, bucket, available, reclaim)
        if choice.victims:
            short = r.job.gpus - available - sum(v.gpus for v, _ in choice.victims)
            self._note_likely(choice.victims, r.job.name, f"which may preempt it once {short} more GPUs free")

    def nears_escalation(self, job: PendingJob) -> bool:
        """Whether the wait alarm escalates `job` within `checkpoint_ahead.before_escalation_s`
        (or should have already: the alarm is evaluated once a minute)."""
        lead = self._escalation_lead
        return lead is not None and not job.escalated and job.escalates_at is not None and job.escalates_at - self.now <= lead

    def _note_escalation(self, r: RankedJob, bucket: Bucket | None, available: int, reclaim: bool, key: tuple) -> None:
        """`r` cannot fit now, and the wait alarm escalates it soon (`nears_escalation`):
        escalated, it may stop the jobs the minimum runtime protects now, and stops its
        victims without waiting for a checkpoint. The victims it would take then are
        likely ones, looked for in a walk of their own (`_ahead_walk`)."""
        if not self._ahead_walk(("escalation", *key)):
            return
        choice = self.choose(r, bucket, available, reclaim, escalated=True)
        if choice.fits and choice.victims:
            left = r.job.escalates_at - self.now
            when = f"in {left:.0f} s" if left > 0 else f"now (its wait passed the threshold {-left:.0f} s ago)"
            self._note_likely(
                choice.victims, r.job.name, f"which the wait alarm escalates {when}: an escalated job stops its victims without waiting for a checkpoint"
            )

    def _ahead_walk(self, key: tuple) -> bool:
        """Whether a victim walk made only to name likely victims may be made for a job of
        `key` (`place`): at most `max_jobs` per plan, one per kind of job (the key an outcome
        no walk decided is remembered by, `_remember`), so that jobs alike, remembered or
        not, cost one walk."""
        if self._by_submission:
            key = key[:-1]
        if self._ahead_walks <= 0 or key in self._ahead_keys:
            return False
        self._ahead_walks -= 1
        self._ahead_keys.add(key)
        return True

    def _note_likely(self, choice: Iterable[tuple[RunningJob, object]], for_job: str | None, why: str) -> None:
        """Remember the victims of `choice` worth asking for a checkpoint ahead, as likely
        ones of `for_job` (the first, highest-ranked claim wins): running the training
        helper but not known to save on SIGTERM, that honoured their last request, with more
        than `min_at_risk_s` at risk, and not asked within `min_interval_s` (nor
        `checkpoint_wait_max_s`: a request still being answered)."""
        likely = self._likely_victims
        for v, _ in choice:
            if len(likely) >= self._likely_cap:
                return
            if v.name in likely:
                continue
            at_risk = self._worth_asking(v)
            if at_risk is None:
                continue
            who = "of the next preemptions:" if for_job is None else f"of {for_job},"
            likely[v.name] = (v, for_job, f"likely victim {who} {why}; {at_risk:.0f} s of work at risk")

    def _worth_asking(self, v: RunningJob) -> float | None:
        """A likely victim's work at risk if it is worth asking ahead (`_note_likely`), else
        None: only a job running the training helper can answer a request; one seen to save
        on SIGTERM needs none."""
        if not v.declares_save_on_stop or v.saves_on_stop or v.ignored_checkpoint_request:
            return None
        ahead, now = self.knobs.checkpoint_ahead, self.now
        asked = v.checkpoint_requested_at
        if asked is not None and now - asked < max(ahead.min_interval_s, self.knobs.checkpoint_wait_max_s):
            return None
        at_risk = v.work_at_risk_s(now)
        return at_risk if at_risk > ahead.min_at_risk_s else None

    def _note_forecast(self) -> None:
        """The running jobs first in victim order, up to the GPUs the forecast expects the
        next preemptions to take beyond the free ones, are likely victims (none of the top
        tier: nothing could preempt them)."""
        chosen, claimed, ahead = self.chosen_by, self.claimed, self.knobs.checkpoint_ahead
        left = self.forecast_gpus - self.free  # what the free GPUs cannot serve
        why = (
            f"the next {ahead.forecast_horizon_s:g} s are expected to need {self.forecast_gpus:.1f} GPUs "
            f"by preemption (from {self.pool.name}'s preemptions of the last {ahead.forecast_window_s:g} s), {self.free} are free"
        )
        top = max(self.policy.tiers.values())
        offered = [v for v in self._candidates if v.name not in chosen and claimed[v.name] < top]
        if all(self._worth_asking(v) is None for v in offered):
            return  # none would be asked, whatever the order
        # Each victim brings at least one GPU: the first ceil(left) in victim order suffice.
        for v in heapq.nsmallest(math.ceil(left), offered, key=self.victim_order):
            if left <= 0:
                return
            left -= v.gpus
            self._note_likely(((v, None),), None, why)

    def ahead_requests(self) -> list[CheckpointRequest]:
        """Checkpoints to ask now of the likely victims (`CheckpointAhead`): in the rank
        order of the jobs that will want them, then the forecast's, at most `max_jobs`,
        none already chosen as a victim in this plan (it is stopped now, or its stop waits
        for its checkpoint)."""
        if self.forecast_gpus > self.free and len(self._likely_victims) < self._likely_cap:
            self._note_forecast()
        out: list[CheckpointRequest] = []
        for v, for_job, detail in self._likely_victims.values():
            if len(out) >= self.knobs.checkpoint_ahead.max_jobs:
                break
            if v.name not in self.chosen_by:
                out.append(CheckpointRequest(v.name, self.pool.name, for_job, Reason.AHEAD_OF_PREEMPTION, detail))
        return out

    def _preempt(self, r: RankedJob, v: RunningJob, rule: PreemptionRule, why: str) -> None:
        """Record the stop of victim `v` for `r`, and count it against the pool's budget."""
        job = r.job
        age, at_risk, lost, fresh, cost = v.stop_figures(self.now, self.knobs.checkpoint_max_age_s)
        borrowed = v.name in self.quotas.borrowed
        if self.knobs.budget is not None:
            self.budget_count += 1
            self.budget_lost += lost
            self._spent = None
        wait, stop, how = self.stop_mode(r, v, at_risk, fresh)
        reason = rule.victim_reason
        # Positional, in `Preemption`'s field order: victim, preemptor, pool, gpus, reason,
        # lost, checkpoint age, rule, cost, fresh, borrowed, wait for checkpoint, stop, escalated.
        self.preemptions.append(
            _new(Preemption, (v.name, job.name, job.pool, v.gpus, reason, lost, age, rule, cost, fresh, borrowed, wait, stop, job.escalated))
        )
        checkpoint = "no checkpoint yet" if age is None else f"checkpoint {age:.0f} s old"
        on_borrowed = "; on borrowed quota" if borrowed and rule is not _RECLAIM else ""
        soft = self._soft.get(v.name) if job.escalated else None
        lifted = f"; escalated: {soft.detail} lifted" if soft is not None else ""
        detail = f"{why}{on_borrowed}{lifted}; stopping it loses {lost:.0f} GPU-seconds ({checkpoint}); {how}"
        self.lines.append(_new(Explanation, (v.name, _PREEMPT, reason, detail, job.name)))


_escalated = attrgetter("escalated")
_escalates_at = attrgetter("escalates_at")
_is_set = partial(is_not, None)


def _names(victims: list[RunningJob]) -> str:
    return ", ".join(f"{v.name} ({v.gpus} GPUs)" for v in victims)


# -- the entry point -------------------------------------------------------------------------
# Called with each pool's planner, the ranked queue, and the job at its turn, before it is placed.
Observer = Callable[[PoolPlanner, list[RankedJob], int, RankedJob], None]


def plan(snapshot: Snapshot, policy: Policy, now: float, discipline: Discipline = OURS) -> Decision:
    """Decide which pending jobs to admit, which to fail and which running jobs to preempt.

    See the module docstring for the steps. `discipline` replaces ours' ranking and victim
    order (the simulator's baselines); the Policy gives eligibility and protections.

    The cyclic garbage collector is paused while it plans: a plan makes no reference cycles
    (tests/unit/test_planner.py holds it to that), so a collection could free nothing, yet
    each one walks the plan's young objects and, once the decision's survivors add up, the
    whole heap (the snapshot, the handler's modules): 5 to 12 % of a 10k-job plan's fastest
    run on the bench VM, more in its tail. Reference counting frees what the plan discards
    as it goes. The pause is the process's (a Lambda runs one plan at a time; a plan
    started while the collector is off, by a caller or another thread's plan, leaves it as
    it found it).
    """
    if not gc.isenabled():
        return run(snapshot, policy, now, discipline)
    gc.disable()
    try:
        return run(snapshot, policy, now, discipline)
    finally:
        gc.enable()


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
    requests: list[CheckpointRequest] = []
    cuts: list[WaitCut] = []
    call_offs: list[CallOff] = []
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
        waiting = pending_by_pool.get(pool.name, ())
        ranked = discipline.rank(waiting, knobs, policy, now, usage_cache[fair])
        planner = PoolPlanner(pool, knobs, policy, now, running_by_pool.get(pool.name, []), snapshot.preemption_history, discipline, waiting)
        ranked = planner.nominal_first(ranked)
        if observe is None:
            planner.place_all(ranked)
        else:
            for position, r in enumerate(ranked, start=1):
                observe(planner, ranked, position, r)
                planner.place(r)
        admits += planner.admits
        preemptions += planner.preemptions
        failures += planner.failures
        cuts += planner.wait_cuts
        if planner._late or planner._unsent:
            call_offs += planner.call_offs()
        lines += planner.lines
        if planner._likely_victims or planner.forecast_gpus > planner.free:
            for c in planner.ahead_requests():
                requests.append(c)
                lines.append(Explanation(c.job, Verdict.SPARE, c.reason, c.detail, for_job=c.for_job))
    unknown = pending_by_pool.keys() - seen  # most snapshots name only configured pools: no second pass
    for job in snapshot.pending if unknown else ():
        if job.pool in unknown:
            lines.append(Explanation(job.name, Verdict.SKIP, Reason.UNKNOWN_POOL, f"pool {job.pool!r} is not configured"))
    return Decision(tuple(admits), tuple(preemptions), tuple(lines), tuple(failures), tuple(requests), tuple(cuts), tuple(call_offs))


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
