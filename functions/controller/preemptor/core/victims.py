"""Victim selection: who may be stopped for whom, in which order, and the walk that picks them.

- `protector`: what shields a running job from every preemptor (already stopping, not
  stoppable, guaranteed, spared, preempted too often, too young, nearly done);
- `eligibility`: whether one preemptor may stop one running job (quota guarantees,
  reclaiming borrowed capacity, the `within_team` / `across_teams` modes);
- `victim_key`: ours' order of the candidates (others pass their own to the planner);
- `Candidates`: the candidates indexed for bounds (GPUs by priority) and scans;
- `walk`: take eligible candidates in order until the preemptor fits, then fill back.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, NamedTuple

from .model import PreemptionRule, Reason, RunningJob
from .policy import MAX_PRIORITY, MaxPreemptionsAction, PoolPolicy, PreemptionMode, ReclaimMode
from .quotas import Bucket, Freed
from .ranking import RankedJob

# Members looked up for every candidate judged, bound once: on Python 3.11 each lookup of an
# enum class attribute goes through `EnumType.__getattr__`, the cost of a function call.
_NEVER = PreemptionMode.NEVER
_OR_NEWER_EQUAL = PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY
_LOWER = PreemptionRule.LOWER_PRIORITY
_NEWER_EQUAL = PreemptionRule.NEWER_EQUAL_PRIORITY
_LOWER_VICTIM = Reason.LOWER_PRIORITY_VICTIM
_NOT_LOWER = Reason.NOT_LOWER_PRIORITY
_GUARANTEED = Reason.WITHIN_GUARANTEED_QUOTA
_PROTECT = MaxPreemptionsAction.PROTECT  # read for every running job of a pool with max_preemptions

_new = tuple.__new__  # a verdict in one call, all fields given (`Eligibility`)

# (victim, now, runs on borrowed quota, its claimed priority) -> sort key, smallest first
VictimKey = Callable[[RunningJob, float, bool, int], tuple]
# What ours' victim order counts as little at risk by default (`PoolPolicy.checkpoint_max_age_s`).
FRESH_S = float(PoolPolicy.model_fields["checkpoint_max_age_s"].default)


def victim_key(
    victim: RunningJob, now: float, borrowed: bool = False, priority: int | None = None, fresh_s: float = FRESH_S
) -> tuple:
    """Ours: the order in which eligible running jobs are offered as victims.

    1. work running on borrowed quota first;
    2. lowest (claimed) priority first;
    3. little at risk first: a job whose stop throws away at most `fresh_s` seconds of work
       (the pool's `checkpoint_max_age_s`: a fresh checkpoint, a run younger than that, or
       a job seen to save on SIGTERM) before one whose stop would throw away more;
    4. most recently started first (the least sunk cost, as Kueue orders them);
    5. name, unique, as the final tie-breaker.

    It replaced an order by the stop's cost (GPUs x (work at risk + restart overhead + a
    penalty per earlier preemption)) on 2026-12-02: on the busiest Philly week this one made
    18 % fewer preemptions and lost 10 % less work, with shorter waits in every tier but
    medium (docs/policy.md, step 6).
    """
    return (
        not borrowed,
        victim.priority if priority is None else priority,
        victim.work_at_risk_s(now) > fresh_s,
        -victim.started_at,
        victim.name,
    )


class Eligibility(NamedTuple):
    """Whether a running job may be stopped for a given preemptor, and by which rule
    (`rule` None: it may not; `reason` and `detail` say why).

    A named tuple, as the planner's lines: a walk judges every candidate it scans, and
    `eligibility` builds the verdict with `tuple.__new__`, in one call."""

    rule: PreemptionRule | None
    reason: Reason
    detail: str


def protector(knobs: PoolPolicy, now: float) -> Callable[[RunningJob], Eligibility | None]:
    """The protections that depend on the victim alone: the returned function gives a running
    job's (None when it is a candidate). The pool's knobs are read once, here: the planner
    asks it of every running job."""
    max_preemptions = knobs.max_preemptions if knobs.on_max_preemptions is _PROTECT else None
    min_runtime_s = knobs.min_runtime_s
    near = knobs.near_completion
    near_remaining_s, near_progress = near.remaining_s, near.progress

    def protect(v: RunningJob) -> Eligibility | None:
        if v.stopping:
            return Eligibility(None, Reason.ALREADY_STOPPING, "already being stopped; its GPUs are claimed first")
        if not v.stoppable:
            return Eligibility(
                None, Reason.NOT_STOPPABLE, "adopted run without the controller's managed tag: the controller may not stop it"
            )
        if v.guaranteed:
            return Eligibility(None, Reason.STARVATION_GUARANTEE, "admitted after starving: runs to completion")
        if v.spared_until is not None and now < v.spared_until:
            return Eligibility(
                None, Reason.RECENTLY_SPARED, f"spared from its last preemption (a checkpoint timeout, a refused stop or a raised priority), until {v.spared_until - now:.0f} s from now"
            )
        if max_preemptions is not None and v.preemptions >= max_preemptions:
            return Eligibility(None, Reason.MAX_PREEMPTIONS_PROTECTED, f"preempted {v.preemptions} times (max_preemptions {max_preemptions})")
        ran = now - v.started_at
        if ran < min_runtime_s:
            return Eligibility(None, Reason.MIN_RUNTIME_PROTECTED, f"running {ran:.0f} s < min_runtime_s {min_runtime_s:g}")
        if near_remaining_s is not None:
            remaining = v.remaining_s(now)
            if remaining is not None and 0 <= remaining < near_remaining_s:
                return Eligibility(None, Reason.NEAR_COMPLETION_PROTECTED, f"about {remaining:.0f} s left < {near_remaining_s:g} s")
        if near_progress is not None:
            progress = v.progress_at(now)
            if progress is not None and near_progress < progress <= 1.0:
                return Eligibility(None, Reason.NEAR_COMPLETION_PROTECTED, f"{progress:.0%} done > {near_progress:.0%}")
        return None

    return protect


def is_newer(started_at: float, victim_submitted_at: float | None, submitted_at: float) -> bool:
    """Whether a victim whose run started at `started_at` (and submitted at
    `victim_submitted_at`, when known) is newer than a preemptor submitted at `submitted_at`:
    it started after that, and was submitted after it too. By its start alone, two jobs
    that each started after the other's submission (a requeued one relaunched) would each
    be the newer, and preempt each other in turn (sweep sagemaker knobs seed 1: 15 times,
    losing 8 GPU-hours each); by submission the order is total, as Kueue's queue order."""
    return started_at > submitted_at and (victim_submitted_at is None or victim_submitted_at > submitted_at)


def mode_rule(
    mode: PreemptionMode, pj: int, submitted_at: float, pv: int, started_at: float, victim_submitted_at: float | None = None
) -> PreemptionRule | None:
    """The rule under which a preemptor claiming `pj` may stop a victim at `pv` (None: it may not)."""
    if mode is _NEVER:
        return None
    if pv < pj:
        return _LOWER
    if mode is _OR_NEWER_EQUAL and pv == pj and is_newer(started_at, victim_submitted_at, submitted_at):
        return _NEWER_EQUAL
    return None


def still_permits(
    rule: PreemptionRule | None, knobs: PoolPolicy, same_team: bool, pj: int, submitted_at: float, pv: int, started_at: float,
    victim_submitted_at: float | None = None,
) -> bool:
    """Whether `rule`, which chose a victim claiming `pv` (started at `started_at`), still
    lets a preemptor claiming `pj` (submitted at `submitted_at`) stop it, its priority having
    changed since (`eligibility`'s tests, protections aside): borrowed work reclaimed by
    `reclaim_within_pool`, whatever its priority under Any; other work by the pool's mode
    for the same team or across teams. A rule not known is judged by the mode."""
    if rule is PreemptionRule.RECLAIM_BORROWED:
        mode = knobs.reclaim_within_pool
        return mode is ReclaimMode.ANY or (mode is not ReclaimMode.NEVER and pv < pj)
    mode = knobs.within_team if same_team else knobs.across_teams
    return mode_rule(mode, pj, submitted_at, pv, started_at, victim_submitted_at) is not None


def top_priority(mode: PreemptionMode, claimed: int) -> int:
    """The highest victim priority a job claiming `claimed` may preempt under `mode`."""
    if mode is _NEVER:
        return -1
    return claimed if mode is _OR_NEWER_EQUAL else claimed - 1


def eligibility(r: RankedJob, v: RunningJob, pv: int, knobs: PoolPolicy, quotas_on: bool, borrowed: bool, reclaim: bool) -> Eligibility:
    """Whether preemptor `r` may stop running job `v`, claiming `pv` (protections aside).

    Another team's work within its nominal quota is guaranteed. Borrowed work of another
    team may be reclaimed by a job within its own nominal quota (`reclaim_within_pool`).
    Otherwise the mode decides: `within_team` for the same team, `across_teams` else.
    """
    pj = r.claimed
    same_team = r.job.team == v.team
    if quotas_on and not same_team:
        if not borrowed:
            return Eligibility(None, _GUARANTEED, f"runs within {v.team}'s nominal quota")
        if reclaim and (knobs.reclaim_within_pool is ReclaimMode.ANY or pv < pj):
            return Eligibility(
                PreemptionRule.RECLAIM_BORROWED, Reason.BORROWED_CAPACITY_RECLAIMED, f"runs on quota {v.team} borrowed; {r.job.team} needs it back"
            )
    mode, scope = (knobs.within_team, "within_team") if same_team else (knobs.across_teams, "across_teams")
    if mode is _NEVER:
        return Eligibility(None, Reason.PREEMPTION_NOT_ALLOWED, f"{scope} is Never")
    # `mode_rule`, inline (the mode is not Never here): this runs for every candidate scanned.
    if pv < pj:
        return _new(Eligibility, (_LOWER, _LOWER_VICTIM, f"priority {pv} < {pj} of {r.job.name}"))
    # `is_newer`, inline: this runs for every candidate of equal priority scanned.
    if mode is _OR_NEWER_EQUAL and pv == pj and v.started_at > (s := r.job.submitted_at) and (v.submitted_at is None or v.submitted_at > s):
        return Eligibility(
            _NEWER_EQUAL, Reason.NEWER_EQUAL_PRIORITY_VICTIM, f"priority {pv} = {pj} of {r.job.name}, submitted and started after it was submitted"
        )
    return _new(Eligibility, (None, _NOT_LOWER, f"priority {pv} is not below {pj} ({scope} {mode.value})"))


ListKey = tuple[bool, "str | None"]


class Candidates:
    """Running jobs that may still be chosen as victims, indexed for bounds and scans.

    Two kinds: work on borrowed quota (`borrowed`) and the rest ("own"). Each kind has a
    list in victim `order` (per team for "own" work when quotas are on, since only a job's
    own team may preempt it then), and GPUs by priority (each job's `claimed`), per team and
    overall. The lists are made on the first walk and each sorted on its own first walk
    (`ordered`): most plans never walk most lists. The GPUs at or below a priority are a sum
    over the kind's distinct priorities (a pool has a few: its tiers), remembered until a
    victim of that kind is chosen.
    """

    def __init__(
        self,
        per_team_own: bool,
        order: Callable[[RunningJob], tuple],
        jobs: list[RunningJob],
        borrowed: set[str],
        claimed: dict[str, int],
    ):
        self.per_team_own = per_team_own
        self.lists: dict[ListKey, list[RunningJob]] = defaultdict(list)
        self._order = order
        self._jobs, self._borrowed = jobs, borrowed
        self._unsorted: set[ListKey] | None = None  # None: the lists are not made yet
        self.by_priority: dict[ListKey, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.totals: dict[ListKey, int] = defaultdict(int)
        # `gpus` answers by kind and top priority, forgotten for a kind when it changes: after
        # each preemption the planner asks the same few again, for every team.
        self._answers: dict[ListKey, dict[int, int]] = {}
        sums: dict[tuple[bool, str, int], int] = defaultdict(int)  # GPUs by kind, team and priority
        for v in jobs:
            sums[(v.name in borrowed, v.team, claimed[v.name])] += v.gpus
        for (on_borrowed, team, priority), gpus in sums.items():
            for key in ((on_borrowed, team), (on_borrowed, None)):
                self.by_priority[key][priority] += gpus
                self.totals[key] += gpus

    def list_key(self, borrowed: bool, team: str) -> ListKey:
        return (borrowed, team if (self.per_team_own and not borrowed) else None)

    def ordered(self, key: ListKey) -> list[RunningJob]:
        """The candidates of list `key`, in victim order."""
        if self._unsorted is None:
            lists, borrowed, per_team = self.lists, self._borrowed, self.per_team_own
            for v in self._jobs:  # `list_key`, inline: once per candidate
                on_borrowed = v.name in borrowed
                lists[(on_borrowed, v.team if per_team and not on_borrowed else None)].append(v)
            self._unsorted = set(lists)
        jobs = self.lists.get(key)
        if jobs is None:
            return []
        if key in self._unsorted:
            self._unsorted.discard(key)
            jobs.sort(key=self._order)
        return jobs

    def add(self, v: RunningJob, borrowed: bool, priority: int, sign: int = 1) -> None:
        gpus = sign * v.gpus
        answers, by_priority, totals = self._answers, self.by_priority, self.totals
        for key in ((borrowed, v.team), (borrowed, None)):
            answers.pop(key, None)
            by_priority[key][priority] += gpus
            totals[key] += gpus

    def gpus(self, borrowed: bool, team: str | None, top: int) -> int:
        """GPUs of candidates of this kind (of `team`, or all when None) at priority <= top."""
        if top < 0:
            return 0
        key = (borrowed, team)
        if top >= MAX_PRIORITY:
            return self.totals[key]
        answers = self._answers.get(key)
        if answers is None:
            answers = self._answers[key] = {}
        gpus = answers.get(top)
        if gpus is None:
            gpus = 0  # a loop, not `sum` over a generator: asked again after every preemption
            for priority, g in self.by_priority[key].items():
                if priority <= top:
                    gpus += g
            answers[top] = gpus
        return gpus

    def bound(self, team: str, top_within: int, top_across: int, quotas_on: bool, reclaim: bool) -> int:
        """An upper bound of the GPUs a job of `team` could free by preemption, from the sums
        by priority (no scan of the candidates).

        Own team: up to the `within_team` top priority. Other teams: borrowed work all of
        it when reclaiming, else up to the `across_teams` top; their other work only without
        quotas (with quotas it is guaranteed).

        Without quotas nothing runs on borrowed quota, and when both tops are the same (the
        modes agree, as by default) the own team's work and the others' add up to the
        pool's: one sum, shared by every team, instead of three per kind.
        """
        if not quotas_on:
            if top_within == top_across:
                return self.gpus(False, None, top_across)
            return self.gpus(False, team, top_within) + self.gpus(False, None, top_across) - self.gpus(False, team, top_across)
        bound = 0
        for borrowed in (False, True):
            same = self.gpus(borrowed, team, top_within)
            if borrowed and reclaim:
                others = self.totals[(True, None)] - self.totals[(True, team)]
            elif not borrowed and quotas_on:
                others = 0
            else:
                others = self.gpus(borrowed, None, top_across) - self.gpus(borrowed, team, top_across)
            bound += same + others
        return bound

    def remove(self, key: ListKey, names: set[str], scanned: int) -> None:
        """Drop `names` from a list; all of them are among its first `scanned` jobs."""
        jobs = self.lists[key]
        jobs[:scanned] = [v for v in jobs[:scanned] if v.name not in names]  # the tail moves in place


class Choice:
    """The outcome of a walk: the victims, the candidates skipped and those fill-back dropped.

    A plain slotted class: one is made for every walk."""

    __slots__ = ("victims", "skipped", "dropped", "fits", "short_of", "scanned")

    def __init__(self) -> None:
        self.victims: list[tuple[RunningJob, Eligibility]] = []
        self.skipped: list[tuple[RunningJob, Eligibility]] = []
        self.dropped: list[RunningJob] = []
        self.fits = False
        self.short_of = "capacity"  # what is missing when it does not fit: capacity | quota
        self.scanned: dict[ListKey, int] = {}  # per candidate list: items looked at

    def __repr__(self) -> str:
        return f"Choice(victims={self.victims!r}, skipped={self.skipped!r}, dropped={self.dropped!r}, fits={self.fits!r}, short_of={self.short_of!r}, scanned={self.scanned!r})"


def walk(
    scans: Iterable[tuple[ListKey, float]],
    cands: Candidates,
    claimed: dict[str, int],
    judge: Callable[[RunningJob], Eligibility],
    fits: Callable[[int, Freed], tuple[bool, str]] | None,
    bucket_of: dict[str, Bucket | None],
    available: int,
    *,
    by_priority: bool,
    fill_back: bool,
    need: int = 0,
) -> Choice:
    """Take eligible victims from the candidate lists `scans` names, in list order, until the
    preemptor `fits` in the GPUs available plus theirs; then, with `fill_back`, drop, last
    chosen first, every victim it still fits without.

    `fits` None: the preemptor counts against no quota, and it fits when its `need` GPUs
    do (`Quotas.fits` without a bucket, inline: the test runs for every victim taken and
    every one fill-back tries to drop). With a quota, `need` is still its GPUs: short of
    them, `fits` is not asked (its first test is the capacity).

    Each scan has a priority limit: a list in priority-major order (`by_priority`) is left
    at the first job above it, since nothing further may be preempted; any other order is
    scanned to its end, ineligible jobs skipped.
    """
    choice = Choice()
    victims, skipped = choice.victims, choice.skipped
    freed: Freed = {}
    physical = available
    ok = False
    for key, limit in scans:
        scanned = 0
        for v in cands.ordered(key):
            if by_priority and claimed[v.name] > limit:
                break  # sorted by priority: nothing further may be preempted
            scanned += 1
            verdict = judge(v)
            if verdict.rule is None:
                skipped.append((v, verdict))
                continue
            victims.append((v, verdict))
            physical += v.gpus
            if fits is None:
                ok = physical >= need
            else:
                bucket = bucket_of[v.name]
                if bucket is not None:  # its GPUs given back to its quota
                    given = freed.get(id(bucket))
                    freed[id(bucket)] = (bucket, v.gpus if given is None else given[1] + v.gpus)
                if physical < need:  # `Quotas.fits`'s first test, inline: short of capacity
                    ok, choice.short_of = False, "capacity"
                else:
                    ok, choice.short_of = fits(physical, freed)
            if ok:
                break
        choice.scanned[key] = scanned
        if ok:
            break
    choice.fits = ok
    if not ok:
        if not victims:
            choice.short_of = ("" if physical >= need else "capacity") if fits is None else fits(physical, freed)[1]
        return choice
    if fits is None:
        choice.short_of = ""
    if not fill_back:
        return choice
    # Fill back: the last chosen are the most expensive to stop, so try dropping them first.
    if fits is None:
        for i in range(len(victims) - 1, -1, -1):
            v = victims[i][0]
            if physical - v.gpus >= need:
                physical -= v.gpus
                del victims[i]
                choice.dropped.append(v)
        return choice
    for i in range(len(victims) - 1, -1, -1):
        v = victims[i][0]
        bucket = bucket_of[v.name]
        if bucket is not None:  # its GPUs no longer given back to its quota; kept: as they were
            given = freed.get(id(bucket), (bucket, 0))[1]
            freed[id(bucket)] = (bucket, given - v.gpus)
        if physical - v.gpus >= need and fits(physical - v.gpus, freed)[0]:  # capacity first, inline
            physical -= v.gpus
            del victims[i]
            choice.dropped.append(v)
        elif bucket is not None:
            freed[id(bucket)] = (bucket, given)
    return choice


__all__ = [
    "Candidates",
    "Choice",
    "Eligibility",
    "VictimKey",
    "eligibility",
    "mode_rule",
    "protector",
    "still_permits",
    "top_priority",
    "victim_key",
    "walk",
]
