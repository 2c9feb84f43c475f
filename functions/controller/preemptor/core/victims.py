"""Victim selection: who may be stopped for whom, in which order, and the walk that picks them.

- `protection`: what shields a running job from every preemptor (already stopping, not
  stoppable, guaranteed, spared, preempted too often, too young, nearly done);
- `eligibility`: whether one preemptor may stop one running job (quota guarantees,
  reclaiming borrowed capacity, the `within_team` / `across_teams` modes);
- `victim_key`: ours' order of the candidates (others pass their own to the planner);
- `Candidates`: the candidates indexed for bounds (Fenwick trees by priority) and scans;
- `walk`: take eligible candidates in order until the preemptor fits, then fill back.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .model import PreemptionRule, Reason, RunningJob
from .policy import MAX_PRIORITY, MaxPreemptionsAction, PoolPolicy, PreemptionMode, ReclaimMode
from .quotas import Bucket, Freed
from .ranking import RankedJob

# (victim, now, runs on borrowed quota, its claimed priority) -> sort key, smallest first
VictimKey = Callable[[RunningJob, float, bool, int], tuple]


def victim_key(victim: RunningJob, now: float, borrowed: bool = False, priority: int | None = None) -> tuple:
    """Ours: the order in which eligible running jobs are offered as victims.

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


@dataclass
class Eligibility:
    """Whether a running job may be stopped for a given preemptor, and by which rule
    (`rule` None: it may not; `reason` and `detail` say why)."""

    rule: PreemptionRule | None
    reason: Reason
    detail: str


def protection(v: RunningJob, knobs: PoolPolicy, now: float) -> Eligibility | None:
    """Protections that depend on the victim alone; None when it is a candidate."""
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
            None, Reason.RECENTLY_SPARED, f"spared after a checkpoint timeout, until {v.spared_until - now:.0f} s from now"
        )
    k = knobs
    if k.max_preemptions is not None and k.on_max_preemptions is MaxPreemptionsAction.PROTECT and v.preemptions >= k.max_preemptions:
        return Eligibility(None, Reason.MAX_PREEMPTIONS_PROTECTED, f"preempted {v.preemptions} times (max_preemptions {k.max_preemptions})")
    ran = now - v.started_at
    if ran < k.min_runtime_s:
        return Eligibility(None, Reason.MIN_RUNTIME_PROTECTED, f"running {ran:.0f} s < min_runtime_s {k.min_runtime_s:g}")
    near = k.near_completion
    if near.remaining_s is not None:
        remaining = v.remaining_s(now)
        if remaining is not None and 0 <= remaining < near.remaining_s:
            return Eligibility(None, Reason.NEAR_COMPLETION_PROTECTED, f"about {remaining:.0f} s left < {near.remaining_s:g} s")
    if near.progress is not None:
        progress = v.progress_at(now)
        if progress is not None and near.progress < progress <= 1.0:
            return Eligibility(None, Reason.NEAR_COMPLETION_PROTECTED, f"{progress:.0%} done > {near.progress:.0%}")
    return None


def mode_rule(mode: PreemptionMode, pj: int, submitted_at: float, pv: int, started_at: float) -> PreemptionRule | None:
    """The rule under which a preemptor claiming `pj` may stop a victim at `pv` (None: it may not)."""
    if mode is PreemptionMode.NEVER:
        return None
    if pv < pj:
        return PreemptionRule.LOWER_PRIORITY
    if mode is PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY and pv == pj and started_at > submitted_at:
        return PreemptionRule.NEWER_EQUAL_PRIORITY
    return None


def top_priority(mode: PreemptionMode, claimed: int) -> int:
    """The highest victim priority a job claiming `claimed` may preempt under `mode`."""
    if mode is PreemptionMode.NEVER:
        return -1
    return claimed if mode is PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY else claimed - 1


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
            return Eligibility(None, Reason.WITHIN_GUARANTEED_QUOTA, f"runs within {v.team}'s nominal quota")
        if reclaim and (knobs.reclaim_within_pool is ReclaimMode.ANY or pv < pj):
            return Eligibility(
                PreemptionRule.RECLAIM_BORROWED, Reason.BORROWED_CAPACITY_RECLAIMED, f"runs on quota {v.team} borrowed; {r.job.team} needs it back"
            )
    mode = knobs.within_team if same_team else knobs.across_teams
    scope = "within_team" if same_team else "across_teams"
    if mode is PreemptionMode.NEVER:
        return Eligibility(None, Reason.PREEMPTION_NOT_ALLOWED, f"{scope} is Never")
    rule = mode_rule(mode, pj, r.job.submitted_at, pv, v.started_at)
    if rule is PreemptionRule.LOWER_PRIORITY:
        return Eligibility(rule, Reason.LOWER_PRIORITY_VICTIM, f"priority {pv} < {pj} of {r.job.name}")
    if rule is PreemptionRule.NEWER_EQUAL_PRIORITY:
        return Eligibility(rule, Reason.NEWER_EQUAL_PRIORITY_VICTIM, f"priority {pv} = {pj} of {r.job.name}, started after it was submitted")
    return Eligibility(None, Reason.NOT_LOWER_PRIORITY, f"priority {pv} is not below {pj} ({scope} {mode.value})")


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


ListKey = tuple[bool, "str | None"]


class Candidates:
    """Running jobs that may still be chosen as victims, indexed for bounds and scans.

    Two kinds: work on borrowed quota and the rest ("own"). Each kind has a list in victim
    order (per team for "own" work when quotas are on, since only a job's own team may
    preempt it then) and GPUs by priority, per team and overall, summed by a Fenwick tree
    built on the first bound asked of it (most plans never ask for most of them).
    """

    def __init__(self, per_team_own: bool):
        self.per_team_own = per_team_own
        self.lists: dict[ListKey, list[RunningJob]] = defaultdict(list)
        self.by_priority: dict[ListKey, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.trees: dict[ListKey, _Fenwick] = {}
        self.totals: dict[ListKey, int] = defaultdict(int)

    def list_key(self, borrowed: bool, team: str) -> ListKey:
        return (borrowed, team if (self.per_team_own and not borrowed) else None)

    def add(self, v: RunningJob, borrowed: bool, priority: int, sign: int = 1) -> None:
        for key in ((borrowed, v.team), (borrowed, None)):
            self.by_priority[key][priority] += sign * v.gpus
            self.totals[key] += sign * v.gpus
            tree = self.trees.get(key)
            if tree is not None:
                tree.add(priority, sign * v.gpus)

    def gpus(self, borrowed: bool, team: str | None, top: int) -> int:
        """GPUs of candidates of this kind (of `team`, or all when None) at priority <= top."""
        if top < 0:
            return 0
        key = (borrowed, team)
        if top >= MAX_PRIORITY:
            return self.totals[key]
        tree = self.trees.get(key)
        if tree is None:
            tree = self.trees[key] = _Fenwick()
            for priority, gpus in self.by_priority[key].items():
                tree.add(priority, gpus)
        return tree.prefix(top)

    def bound(self, team: str, top_within: int, top_across: int, quotas_on: bool, reclaim: bool) -> int:
        """An upper bound of the GPUs a job of `team` could free by preemption, in O(log 1000).

        Own team: up to the `within_team` top priority. Other teams: borrowed work all of
        it when reclaiming, else up to the `across_teams` top; their other work only without
        quotas (with quotas it is guaranteed).
        """
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


@dataclass
class Choice:
    """The outcome of a walk: the victims, the candidates skipped and those fill-back dropped."""

    victims: list[tuple[RunningJob, Eligibility]] = field(default_factory=list)
    skipped: list[tuple[RunningJob, Eligibility]] = field(default_factory=list)
    dropped: list[RunningJob] = field(default_factory=list)
    fits: bool = False
    short_of: str = "capacity"  # what is missing when it does not fit: capacity | quota
    scanned: dict[ListKey, int] = field(default_factory=dict)  # per candidate list: items looked at


def walk(
    scans: Iterable[tuple[ListKey, float]],
    cands: Candidates,
    claimed: dict[str, int],
    judge: Callable[[RunningJob], Eligibility],
    fits: Callable[[int, Freed], tuple[bool, str]],
    bucket_of: dict[str, Bucket | None],
    available: int,
    *,
    by_priority: bool,
    fill_back: bool,
) -> Choice:
    """Take eligible victims from the candidate lists `scans` names, in list order, until the
    preemptor `fits` in the GPUs available plus theirs; then, with `fill_back`, drop, last
    chosen first, every victim it still fits without.

    Each scan has a priority limit: a list in priority-major order (`by_priority`) is left
    at the first job above it, since nothing further may be preempted; any other order is
    scanned to its end, ineligible jobs skipped.
    """
    choice = Choice()
    freed: Freed = {}
    physical = available

    def give(v: RunningJob, sign: int) -> None:
        b = bucket_of[v.name]
        if b is not None:
            prior = freed.get(id(b), (b, 0))[1]
            freed[id(b)] = (b, prior + sign * v.gpus)

    for key, limit in scans:
        choice.scanned[key] = 0
        for v in cands.lists.get(key, ()):
            if by_priority and claimed[v.name] > limit:
                break  # sorted by priority: nothing further may be preempted
            choice.scanned[key] += 1
            verdict = judge(v)
            if verdict.rule is None:
                choice.skipped.append((v, verdict))
                continue
            choice.victims.append((v, verdict))
            physical += v.gpus
            give(v, +1)
            choice.fits, choice.short_of = fits(physical, freed)
            if choice.fits:
                break
        if choice.fits:
            break
    if not choice.fits:
        if not choice.victims:
            choice.short_of = fits(physical, freed)[1]
        return choice
    if not fill_back:
        return choice
    # Fill back: the last chosen are the most expensive to stop, so try dropping them first.
    for item in reversed(list(choice.victims)):
        v = item[0]
        give(v, -1)
        if fits(physical - v.gpus, freed)[0]:
            physical -= v.gpus
            choice.victims.remove(item)
            choice.dropped.append(v)
        else:
            give(v, +1)
    return choice


__all__ = [
    "Candidates",
    "Choice",
    "Eligibility",
    "VictimKey",
    "eligibility",
    "mode_rule",
    "protection",
    "top_priority",
    "victim_key",
    "walk",
]
