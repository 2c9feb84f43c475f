"""plan()'s shortcuts decide nothing: without them, the decision is the same.

Within one plan the planner remembers the outcome of a job that could not fit (the next
job alike in the same pool state is given it without looking again; under
LowerOrNewerEqualPriority alike includes the submission time when a victim walk decided
it), the victim bound of each kind of job, and the GPU sums behind the bounds (sums by
priority over the candidates); it ranks the queue by groups rather than by one key per
job. The plain path turns all of that off: every job is placed from scratch, every bound
and sum recomputed from the candidates, and the queue sorted by `rank_key`. Its decision
must equal the fast one in every admission, preemption, checkpoint request and
explanation line, in order, under every preemption mode.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import replace
from unittest.mock import patch

import pytest
from hypothesis import given, settings, strategies as st

from preemptor.core.model import PastPreemption, Pool, Reason, Snapshot
from preemptor.core.planner import Discipline, PoolPlanner, plan, rank_key, rank_pool
from builders import pending, running, snapshot
from preemptor.core.policy import Policy, PreemptionMode
from preemptor.core.victims import Candidates
from preemptor_tools.bench_plan import NOW as BENCH_NOW, build
from test_planner import NOW, rich_policies, rich_snapshots


class _Forgetful(dict):
    """A cache that never remembers: every lookup misses."""

    def __setitem__(self, key, value) -> None:
        pass


def _plain_gpus(self: Candidates, borrowed: bool, team: str | None, top: int) -> int:
    """`Candidates.gpus` from the plain sums, without trees or remembered answers."""
    return 0 if top < 0 else sum(gpus for priority, gpus in self.by_priority[(borrowed, team)].items() if priority <= top)


def _sorted_rank(pending, knobs, policy, now, usage):
    return sorted(rank_pool(pending, knobs, policy, now, usage), key=rank_key)


PLAIN = Discipline("plain", rank=_sorted_rank)


@contextmanager
def plain_path(forget_outcomes: bool = True):
    """plan() with bounds and GPU sums recomputed each time and, with `forget_outcomes`,
    every job placed from scratch."""
    init = PoolPlanner.__init__

    def forgetful(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._bounds = _Forgetful()
        if forget_outcomes:
            self._no_fit = _Forgetful()

    with patch.object(PoolPlanner, "__init__", forgetful), patch.object(Candidates, "gpus", _plain_gpus):
        yield


def _plain_plan(snapshot: Snapshot, policy: Policy, now: float):
    with plain_path():
        return plan(snapshot, policy, now, PLAIN)


def _seeded(seed: int, roomy: bool) -> tuple[Snapshot, Policy]:
    """The benchmark's snapshot, small, with escalated, handed-over and requeued jobs, and
    optionally room in the pools (admissions)."""
    snap, every_knob = build(400, 100, 2, seed)
    rng = random.Random(seed)
    pending = []
    for job in snap.pending:
        roll = rng.random()
        if roll < 0.03:
            job = replace(job, escalated=True)
        elif roll < 0.06:
            job = replace(job, nominated_at=BENCH_NOW - rng.uniform(0, 3000))
        elif roll < 0.09:
            job = replace(job, pending_since=BENCH_NOW - rng.uniform(0, 300))
        pending.append(job)
    # Half the running jobs run the training helper, some asked for a checkpoint lately:
    # likely victims to ask ahead.
    running = tuple(
        replace(v, declares_save_on_stop=True, checkpoint_requested_at=rng.choice([None, None, BENCH_NOW - rng.uniform(0, 3600)]))
        if rng.random() < 0.5
        else v
        for v in snap.running
    )
    pools = tuple(Pool(p.name, p.gpus + (64 if roomy else 0)) for p in snap.pools)
    return replace(snap, pools=pools, pending=tuple(pending), running=running), every_knob


def _policies(every_knob: Policy) -> dict[str, Policy]:
    knobs = every_knob.model_dump(mode="json", exclude={"pools"})
    return {
        "every-knob": every_knob,
        "defaults": Policy(),
        "starving": Policy.model_validate({**knobs, "aging": {"rate_per_hour": 10, "starving_after_s": 36 * 3600}}),
        "tier-delays": Policy.model_validate({**knobs, "tier_preemption_delay_s": {"critical": 0, "high": 300}, "budget": None}),
        "fail-at-max": Policy.model_validate({**knobs, "on_max_preemptions": "fail", "max_preemptions": 1}),
        "never-across": Policy.model_validate({**knobs, "across_teams": "Never", "reclaim_within_pool": "LowerPriority"}),
        "lower-only": Policy.model_validate({**knobs, "within_team": "LowerPriority"}),
        "lower-only-starving": Policy.model_validate(
            {**knobs, "within_team": "LowerPriority", "aging": {"rate_per_hour": 10, "starving_after_s": 36 * 3600}}
        ),
    }


@pytest.mark.parametrize("roomy", [False, True], ids=["full-pools", "room-left"])
@pytest.mark.parametrize("seed", [7, 8])
def test_seeded_snapshots_plan_the_same_without_shortcuts(seed, roomy):
    # Given the benchmark's snapshot (small) under policies that reach every outcome
    snap, every_knob = _seeded(seed, roomy)
    asked = 0
    for name, policy in _policies(every_knob).items():
        # When it is planned with the shortcuts and without
        fast, plain = plan(snap, policy, BENCH_NOW), _plain_plan(snap, policy, BENCH_NOW)
        # Then the decisions are the same, line for line
        assert fast.explanations == plain.explanations, name
        assert fast == plain, name
        asked += len(fast.checkpoint_requests)
    # (checkpoints asked ahead among them)
    assert asked


@settings(max_examples=150, deadline=None)
@given(rich_snapshots(max_pending=30), rich_policies())
def test_rich_snapshots_plan_the_same_without_shortcuts(snap, p):
    assert plan(snap, p, NOW) == _plain_plan(snap, p, NOW)


# Copies of a pending job under another name: (which job, how long ago submitted, capacity
# handed to it), so that the remembered outcomes (jobs alike) are given and looked at.
_clones = st.lists(st.tuples(st.integers(0, 9), st.floats(0, 60 * 3600), st.booleans()), max_size=20)


@settings(max_examples=400, deadline=None)
@given(rich_snapshots(max_pending=10), rich_policies(), _clones, st.integers(0, 4))
def test_queues_of_alike_jobs_plan_the_same_without_shortcuts(snap, p, clones, spent):
    # Given a snapshot whose queue repeats some jobs, old enough to starve or handed
    # capacity, and preemptions in the budget's window that may have spent it
    pending = list(snap.pending)
    for i, (k, age, handed) in enumerate(clones):
        if k < len(snap.pending):
            j = snap.pending[k]
            pending.append(replace(j, name=f"c{i}", submitted_at=NOW - age, pending_since=None, nominated_at=NOW - 30 if handed else None))
    history = tuple(PastPreemption(pool.name, NOW - 60, 8, 1e5) for pool in snap.pools for _ in range(spent))
    snap = replace(snap, pending=tuple(pending), preemption_history=snap.preemption_history + history)
    # Then the decisions with and without shortcuts are the same
    assert plan(snap, p, NOW) == _plain_plan(snap, p, NOW)


def test_the_queue_is_in_rank_key_order_with_ties():
    # Given jobs that tie on priority, team usage and submission time (only the name differs)
    snap, every_knob = build(300, 10, 1, 9)
    jobs = [replace(j, submitted_at=float(int(j.submitted_at) // 7200 * 7200)) for j in snap.pending]
    random.Random(9).shuffle(jobs)
    usage = {f"team-{i}": float(i % 3) for i in range(12)}
    for policy in (every_knob, Policy()):
        knobs = policy.for_pool("pool-0")
        # When they are ranked, then the queue is `rank_key`'s order
        ranked = rank_pool(jobs, knobs, policy, BENCH_NOW, usage)
        assert [r.job.name for r in ranked] == [r.job.name for r in sorted(ranked, key=rank_key)]


def test_aging_is_told_in_the_adjustments_and_not_on_rank_lines():
    # Given a bronze job aged and handed capacity, and capped by the spot rule
    p = Policy(tiers={"gold": 900, "bronze": 100}, aging={"rate_per_hour": 100}, fair_share={"enabled": False}, spot_max_priority="bronze")
    snap, _ = build(1, 1, 1, 7)
    job = replace(snap.pending[0], priority=900, spot=True, submitted_at=BENCH_NOW - 20 * 3600, nominated_at=BENCH_NOW - 60, pool="pool-0")
    (ranked,) = rank_pool([job], p.for_pool("pool-0"), p, BENCH_NOW, {})
    # Then the adjustments are the cap, the aging, then the handover, in that order
    assert [reason for reason, _ in ranked.adjustments] == [Reason.SPOT_CAPPED, Reason.AGED, Reason.CAPACITY_FREED_FOR_IT]
    assert ranked.adjustments[1][1] == "waited 72000 s at 100/h: 100 -> 899 (capped at 899)"
    # and the planner's rank lines are all of them but the aging
    assert ranked.notes == (ranked.adjustments[0], ranked.adjustments[2])


def test_a_remembered_outcome_respects_the_newer_equal_rule():
    # Given one running job and two alike pending jobs of its team and priority, under
    # LowerOrNewerEqualPriority: "late" (handed capacity, so first) was submitted after the
    # running job started, "early" before, so only "early" may preempt it
    p = Policy(within_team="LowerOrNewerEqualPriority")
    snap = (
        snapshot(16)
        .running(running("v", 200, 16, team="a", started_at=5000.0))
        .pending(pending("late", 200, 16, team="a", submitted_at=6000.0, nominated_at=NOW - 60))
        .pending(pending("early", 200, 16, team="a", submitted_at=4000.0))
        .build()
    )
    # When it is planned, then "early" preempts "v", as it does on the plain path: the
    # outcome remembered for "late" (it waits) is not reused for a job submitted earlier
    assert [x.victim for x in plan(snap, p, NOW).preemptions] == ["v"]


@pytest.mark.parametrize("mode", ["LowerPriority", "LowerOrNewerEqualPriority"])
def test_a_starving_job_behind_a_spent_budget_is_told_so_as_on_the_plain_path(mode):
    # Given a full pool whose preemption budget is spent, and two alike jobs that could
    # preempt its work: "handed" (capacity was freed for it, so first) and "starving",
    # which has waited past starving_after_s
    p = Policy(
        within_team=mode, across_teams=mode, budget={"window_s": 3600, "max_preemptions": 1},
        aging={"rate_per_hour": 0, "starving_after_s": 3600}, fair_share={"enabled": False},
    )
    snap = (
        snapshot(16)
        .running(running("v", 50, 16, team="a", started_at=NOW - 5000))
        .pending(pending("handed", 500, 8, team="a", submitted_at=NOW - 60, nominated_at=NOW - 30))
        .pending(pending("starving", 500, 8, team="a", submitted_at=NOW - 7200))
        .preempted(NOW - 100)
        .build()
    )
    # When it is planned, then the starving job, given the outcome remembered for the job
    # before it, is told what a look of its own tells it: the budget is spent (with nothing
    # free there is nothing to reserve)
    fast = plan(snap, p, NOW)
    assert fast == _plain_plan(snap, p, NOW)
    assert [(e.job, e.reason) for e in fast.explanations if e.job == "starving"] == [("starving", Reason.BUDGET_EXHAUSTED)]


def test_the_decisions_fingerprint_is_stable_and_sees_one_changed_line():
    # `bench_plan --digest`, what a change meant only to speed plan() up is checked with,
    # before and after: the same planner gives the same fingerprint
    from preemptor_tools import bench_plan

    first = bench_plan.digest(3)
    assert first == bench_plan.digest(3) and first[0] == 6
    # And a planner that decides one explanation line differently has another one
    real = bench_plan.plan

    def one_line_less(snap, policy, now):
        decision = real(snap, policy, now)
        return replace(decision, explanations=decision.explanations[:-1])

    with patch.object(bench_plan, "plan", one_line_less):
        assert bench_plan.digest(3) != first


def test_repeat_plans_the_bench_snapshot_as_measure_does(capsys):
    # `bench_plan --repeat`, what instruction counts are taken over: the same snapshot and
    # policies as the timed runs, planned the number of times asked
    from preemptor_tools import bench_plan

    snap, every_knob = build(300, 200, 2, 7)
    expected = len(plan(snap, every_knob, BENCH_NOW).preemptions)
    assert bench_plan.repeat(2, "every-knob", 300, 200, 2, 7) == expected > 0
    assert bench_plan.main(["--repeat", "1", "--policy", "defaults", "--pending", "300", "--running", "200", "--pools", "2"]) == 0
    assert capsys.readouterr().out.startswith("1 plans [defaults], ")
