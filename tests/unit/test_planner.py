"""The planner: ranking, fitting, victim choice, fill-back, explanations."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import pending, running, snapshot
from preemptor.core.model import Reason, Verdict
from preemptor.core.planner import plan
from preemptor.core.policy import Policy, PreemptionMode

NOW = 10_000.0
DEFAULT = Policy()


def victims(decision) -> list[str]:
    return [p.victim for p in decision.preemptions]


def admitted(decision) -> list[str]:
    return [a.job for a in decision.admits]


def test_admits_in_rank_order_while_capacity_lasts():
    # Given an empty pool of 16 GPUs and three pending jobs of 8
    snap = snapshot(16).pending(
        pending("low-early", 50, submitted_at=1),
        pending("high-late", 500, submitted_at=5),
        pending("high-early", 500, submitted_at=2),
    ).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then higher priority goes first, then earlier submission
    assert admitted(decision) == ["high-early", "high-late"]
    assert not decision.preemptions


def test_mission_story_one_victim_for_the_critical_job():
    # Given a low experiment holding the whole pool and a critical job waiting for all of it
    snap = snapshot(512).running(running("experiment", 50, 512, started_at=0, last_checkpoint_at=100)).pending(
        pending("production", 1000, 512, submitted_at=120)
    ).build()
    # When planning
    decision = plan(snap, DEFAULT, 130)
    # Then the experiment is the only victim, and production waits for its GPUs
    assert victims(decision) == ["experiment"]
    assert decision.preemptions[0].preemptor == "production"
    assert decision.preemptions[0].lost_gpu_seconds == 512 * 30
    assert admitted(decision) == []


@pytest.mark.parametrize(
    "victims_running, expected",
    [
        pytest.param(
            [running("a", 50, 8, last_checkpoint_at=NOW - 600), running("b", 50, 8, last_checkpoint_at=NOW - 60)],
            ["b"],
            id="least-work-lost-first",
        ),
        pytest.param(
            [running("a", 200, 8, last_checkpoint_at=NOW - 10), running("b", 50, 8, last_checkpoint_at=NOW - 900)],
            ["b"],
            id="lowest-priority-before-least-lost",
        ),
        pytest.param(
            [running("a", 50, 8, started_at=100), running("b", 50, 8, started_at=200)],
            ["b"],
            id="equal-loss-most-recently-started",
        ),
        pytest.param(
            [running("b", 50, 8, started_at=100), running("a", 50, 8, started_at=100)],
            ["a"],
            id="full-tie-broken-by-name",
        ),
    ],
)
def test_victim_order(victims_running, expected):
    # Given a full 16-GPU pool and an 8-GPU critical job
    snap = snapshot(16).running(*victims_running).pending(pending("crit", 1000, 8, submitted_at=NOW)).build()
    # When planning, then the cheapest victim by the documented order is chosen
    assert victims(plan(snap, DEFAULT, NOW)) == expected


def test_fill_back_drops_victims_that_are_not_needed():
    # Given victims ordered small-cheap first, and a job that a single big victim satisfies
    snap = snapshot(40).running(
        running("small", 50, 8, last_checkpoint_at=NOW - 10),
        running("big", 50, 32, last_checkpoint_at=NOW - 20),
    ).pending(pending("crit", 1000, 32, submitted_at=NOW)).build()
    # When planning: greedy takes small (8) then big (40 >= 32); fill-back drops small
    decision = plan(snap, DEFAULT, NOW)
    assert victims(decision) == ["big"]


def test_equal_priority_never_preempts_by_default():
    snap = snapshot(8).running(running("a", 500, 8)).pending(pending("b", 500, 8, submitted_at=NOW)).build()
    decision = plan(snap, DEFAULT, NOW)
    assert decision.preemptions == ()
    assert any(e.job == "b" and e.reason is Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS for e in decision.explanations)


def test_never_mode_blocks_preemption_within_team_only():
    policy = Policy(within_team=PreemptionMode.NEVER)
    snap = snapshot(16).running(running("same", 50, 8, team="a"), running("other", 50, 8, team="b")).pending(
        pending("crit", 1000, 8, team="a", submitted_at=NOW)
    ).build()
    assert victims(plan(snap, policy, NOW)) == ["other"]


def test_newer_equal_priority_mode():
    policy = Policy(within_team=PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY)
    snap = snapshot(8).running(running("newer", 500, 8, started_at=200)).pending(
        pending("older", 500, 8, submitted_at=100)
    ).build()
    assert victims(plan(snap, policy, NOW)) == ["newer"]


def test_jobs_being_stopped_are_claimed_before_new_victims():
    # Given a victim already being stopped for the waiting job
    snap = snapshot(16).running(
        running("stopping", 50, 8, stopping=True), running("other", 50, 8)
    ).pending(pending("crit", 1000, 8, submitted_at=NOW)).build()
    decision = plan(snap, DEFAULT, NOW)
    # Then nothing more is stopped: the job waits for the capacity being freed
    assert decision.preemptions == ()
    assert any(e.reason is Reason.WAITING_FOR_PREEMPTED_CAPACITY for e in decision.explanations)


def test_nominated_job_holds_free_capacity_against_lower_jobs():
    # Given 8 free GPUs, a 16-GPU critical job that needs them plus one 8-GPU victim,
    # and a small low job that would fit the free GPUs
    snap = snapshot(16).running(running("victim", 50, 8)).pending(
        pending("crit", 1000, 16, submitted_at=1), pending("small", 50, 8, submitted_at=2)
    ).build()
    decision = plan(snap, DEFAULT, NOW)
    # Then the free 8 stay claimed by the critical job, not given to the small one
    assert victims(decision) == ["victim"]
    assert admitted(decision) == []


def test_surplus_of_a_victim_is_not_wasted():
    # Given 8 free GPUs and a critical job that one 16-GPU victim satisfies alone
    snap = snapshot(24).running(running("victim", 50, 16)).pending(
        pending("crit", 1000, 16, submitted_at=1), pending("small", 50, 8, submitted_at=2)
    ).build()
    decision = plan(snap, DEFAULT, NOW)
    # Then the free 8 GPUs are not needed by the critical job and go to the small one
    assert victims(decision) == ["victim"]
    assert admitted(decision) == ["small"]


def test_backfill_when_the_head_cannot_fit_at_all():
    # Given a head job that cannot fit even with every eligible victim
    snap = snapshot(16).running(running("peer", 1000, 8)).pending(
        pending("huge", 1000, 16, submitted_at=1), pending("small", 50, 8, submitted_at=2)
    ).build()
    decision = plan(snap, DEFAULT, NOW)
    # Then lower work may use the free GPUs meanwhile
    assert admitted(decision) == ["small"]


@pytest.mark.parametrize(
    "job_pool, gpus, reason",
    [
        pytest.param("nope", 8, Reason.UNKNOWN_POOL, id="unknown-pool"),
        pytest.param("p5", 128, Reason.LARGER_THAN_POOL, id="larger-than-pool"),
    ],
)
def test_unplaceable_jobs_are_skipped_with_a_reason(job_pool, gpus, reason):
    snap = snapshot(64).pending(pending("j", 50, gpus, pool=job_pool)).build()
    decision = plan(snap, DEFAULT, NOW)
    assert [(e.job, e.verdict, e.reason) for e in decision.explanations] == [("j", Verdict.SKIP, reason)]


def test_cascade_low_by_medium_and_medium_by_critical():
    snap = snapshot(16).running(running("low", 50, 8), running("medium", 200, 8)).pending(
        pending("critical", 1000, 16, submitted_at=NOW)
    ).build()
    assert sorted(victims(plan(snap, DEFAULT, NOW))) == ["low", "medium"]


# -- properties ----------------------------------------------------------------------------
priorities = st.sampled_from([0, 50, 200, 500, 1000])
gpu_sizes = st.sampled_from([1, 2, 4, 8, 16, 32])


@st.composite
def snapshots(draw):
    capacity = draw(st.sampled_from([16, 32, 64]))
    builder = snapshot(capacity)
    used = 0
    for i in range(draw(st.integers(0, 8))):
        g = draw(gpu_sizes)
        if used + g > capacity:
            break
        used += g
        builder.running(
            running(
                f"r{i}",
                draw(priorities),
                g,
                team=draw(st.sampled_from(["a", "b"])),
                started_at=draw(st.floats(0, NOW)),
                last_checkpoint_at=draw(st.one_of(st.none(), st.floats(0, NOW))),
                stopping=draw(st.booleans()),
            )
        )
    for i in range(draw(st.integers(0, 8))):
        builder.pending(
            pending(f"p{i}", draw(priorities), draw(gpu_sizes), team=draw(st.sampled_from(["a", "b"])), submitted_at=draw(st.floats(0, NOW)))
        )
    return builder.build()


policies = st.builds(
    Policy,
    within_team=st.sampled_from(list(PreemptionMode)),
    across_teams=st.sampled_from(list(PreemptionMode)),
)


@settings(max_examples=300, deadline=None)
@given(snapshots(), policies)
def test_properties(snap, policy):
    before = copy.deepcopy(snap)
    decision = plan(snap, policy, NOW)
    again = plan(snap, policy, NOW)
    # same input, same output; the input is not mutated
    assert decision == again
    assert snap == before
    pool = snap.pools[0]
    by_name = {j.name: j for j in snap.running}
    pend = {j.name: j for j in snap.pending}
    # capacity is never exceeded by admissions
    used = sum(j.gpus for j in snap.running)
    assert used + sum(a.gpus for a in decision.admits) <= pool.gpus
    # victims are running, not already stopping, and strictly lower priority unless the mode allows equal
    for p in decision.preemptions:
        victim, preemptor = by_name[p.victim], pend[p.preemptor]
        assert not victim.stopping
        mode = policy.within_team if victim.team == preemptor.team else policy.across_teams
        assert mode is not PreemptionMode.NEVER
        if mode is PreemptionMode.LOWER_PRIORITY:
            assert victim.priority < preemptor.priority
        else:
            assert victim.priority <= preemptor.priority
    # every victim is named once
    assert len(victims(decision)) == len(set(victims(decision)))


@settings(max_examples=300, deadline=None)
@given(snapshots(), policies, gpu_sizes, priorities)
def test_victim_set_is_minimal(snap, policy, need, priority):
    # Given exactly one pending job
    snap = type(snap)(snap.pools, snap.running, (pending("x", priority, need, submitted_at=NOW),))
    decision = plan(snap, policy, NOW)
    # Then the victims with the capacity already free or being freed are enough, and
    # dropping any one of them would leave the job short
    pool = snap.pools[0]
    available = pool.gpus - sum(j.gpus for j in snap.running) + sum(j.gpus for j in snap.running if j.stopping)
    sizes = {j.name: j.gpus for j in snap.running}
    chosen = [sizes[p.victim] for p in decision.preemptions]
    if chosen:
        assert available + sum(chosen) >= need
        assert all(available + sum(chosen) - g < need for g in chosen)
