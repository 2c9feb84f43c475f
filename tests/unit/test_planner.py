"""The planner: ranking, fitting, victim choice, fill-back, explanations."""

from __future__ import annotations

import copy
import gc
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import pending, policy as make_policy, quota, running, snapshot
from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState, PastPreemption, Pool, PreemptionRule, Reason, Snapshot, TeamUsage, Verdict, run_usage
from preemptor.core.planner import plan
from preemptor.core.policy import MaxPreemptionsAction, Policy, PreemptionMode, ReclaimMode
from preemptor.core.requests import JobRequest
from preemptor.core.trace import trace_job
from preemptor_tools.snapshot_file import load_snapshot

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


@pytest.mark.parametrize("stopping", [False, True], ids=["", "a-stop-already-under-way"])
def test_gpus_freed_in_an_over_full_pool_repay_its_excess_before_any_job_counts_on_them(stopping):
    # Given a 64-GPU pool over-full by 24: a team's run the controller adopted holds 80 GPUs
    # (the account gave it ten instances), and a job of the controller's 8 more
    snap = snapshot(64).running(
        running("teams-run", 50, 80, last_checkpoint_at=NOW - 60, stopping=stopping),
        running("small", 200, 8, last_checkpoint_at=NOW - 60),
    ).pending(
        pending("critical", 1000, 8, submitted_at=1), pending("high", 500, 64, submitted_at=2),
    ).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then the team's run is stopped (now, or already) for the critical job, and its 80 GPUs
    # repay the 24 first: 56 come back, 48 after the critical job's 8. The high job cannot
    # count on 64 of them (before: it held 64 of the 72 it thought freed, GPUs that never
    # come, where the next cycle finds it no room); with the small job's 8, 56 are too few.
    assert victims(decision) == ([] if stopping else ["teams-run"]) and not decision.admits
    lines = {e.job: e for e in decision.explanations if e.verdict is Verdict.WAIT}
    assert lines["critical"].reason is (Reason.WAITING_FOR_PREEMPTED_CAPACITY if stopping else Reason.PREEMPTS_LOWER_PRIORITY)
    assert lines["high"].reason is Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS
    freed = "72 being freed (the pool is over-full by 24: they repay that first)" if stopping else "48 being freed"
    assert lines["high"].detail == f"needs 64 GPUs; 0 free, {freed}, at most 8 held by jobs it may preempt"


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
            [running("a", 50, 8, last_checkpoint_at=NOW - 1200), running("b", 50, 8, last_checkpoint_at=NOW - 60)],
            ["b"],
            id="fresh-checkpoint-first",
        ),
        pytest.param(
            # both within checkpoint_max_age_s (900 s) of their checkpoint: the newer run first
            [running("a", 50, 8, started_at=100, last_checkpoint_at=NOW - 60), running("b", 50, 8, started_at=200, last_checkpoint_at=NOW - 600)],
            ["b"],
            id="among-fresh-most-recently-started",
        ),
        pytest.param(
            # a job seen to save on SIGTERM loses nothing: it counts as fresh
            [running("a", 50, 8, started_at=200), running("b", 50, 8, started_at=100, saves_on_stop=True, declares_save_on_stop=True)],
            ["b"],
            id="saves-on-stop-counts-as-fresh",
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
        running("small", 50, 8, started_at=100, last_checkpoint_at=NOW - 10),
        running("big", 50, 32, started_at=0, last_checkpoint_at=NOW - 20),
    ).pending(pending("crit", 1000, 32, submitted_at=NOW)).build()
    # When planning: greedy takes small (8, the newer) then big (40 >= 32); fill-back drops small
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


def test_under_newer_equal_priority_two_jobs_never_preempt_each_other_in_turn():
    # Given two jobs of one priority under LowerOrNewerEqualPriority: "first" submitted at
    # 100, "second" at 200; first was preempted by second, requeued, and relaunched at 300
    policy = Policy(within_team=PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY)
    first_running = running("first", 500, 8, submitted_at=100, started_at=300)
    second_waiting = pending("second", 500, 8, submitted_at=200)
    # When the second waits again, Then it may not preempt the first, though the first's run
    # started after its submission: the first was submitted before it (before: it did, and
    # the first then preempted it back, each run started after the other's submission; sweep
    # sagemaker knobs seed 1: 15 times, 8 GPU-hours lost each)
    assert victims(plan(snapshot(8).running(first_running).pending(second_waiting).build(), policy, NOW)) == []
    # And the first, waiting, may preempt the second: submitted after it, started after it too
    second_running = running("second", 500, 8, submitted_at=200, started_at=300)
    first_waiting = pending("first", 500, 8, submitted_at=100)
    assert victims(plan(snapshot(8).running(second_running).pending(first_waiting).build(), policy, NOW)) == ["second"]
    [line] = [e for e in plan(snapshot(8).running(second_running).pending(first_waiting).build(), policy, NOW).explanations if e.job == "second"]
    assert line.detail.startswith("priority 500 = 500 of first, submitted and started after it was submitted;")


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


# -- victim selection with quotas and fill-back -----------------------------------------------
@pytest.mark.parametrize(
    "victims_running, expected",
    [
        pytest.param(
            [running("own", 50, 8, team="a", started_at=0), running("borrower", 200, 8, team="b", started_at=0)],
            ["borrower"],
            id="borrowed-before-lower-priority",
        ),
    ],
)
def test_victim_order_with_quotas(victims_running, expected):
    # Given quotas a:8, b:0 (b runs on borrowed capacity), a full 16-GPU pool and an 8-GPU critical job of team a
    p = make_policy(quotas=[quota("a", 8), quota("b", 0)])
    snap = snapshot(16).running(*victims_running).pending(pending("crit", 1000, 8, team="a", submitted_at=NOW)).build()
    # When planning, then the victim comes first in the documented order
    assert victims(plan(snap, p, NOW)) == expected


def test_preemption_records_rule_cost_and_borrowing():
    # Given team b borrowing above its zero quota, and team a within its nominal quota
    p = make_policy(quotas=[quota("a", 8), quota("b", 0)])
    snap = snapshot(8).running(running("b-run", 1000, 8, team="b", last_checkpoint_at=NOW - 30, restart_overhead_s=60)).pending(
        pending("a-job", 50, 8, team="a")
    ).build()
    # When planning
    (p0,) = plan(snap, p, NOW).preemptions
    # Then the low job reclaims its quota from the critical borrower, and the cost is recorded
    assert (p0.victim, p0.rule, p0.reason, p0.borrowed) == ("b-run", PreemptionRule.RECLAIM_BORROWED, Reason.BORROWED_CAPACITY_RECLAIMED, True)
    assert (p0.lost_gpu_seconds, p0.cost_gpu_seconds) == (8 * 30, 8 * 90)


def test_freed_capacity_goes_to_work_within_its_nominal_quota_before_a_higher_priority_borrower():
    # Given team a's nominal quota is the pool and team b borrows it; b's critical job was
    # just stopped for a's low job (reclaimed) and both wait for the 8 free GPUs
    p = make_policy(quotas=[quota("a", 8), quota("b", 0, borrowing=8)])
    snap = snapshot(8).pending(
        pending("b-crit", 1000, 8, team="b", submitted_at=1), pending("a-low", 50, 8, team="a", submitted_at=2)
    ).build()
    # When planning
    decision = plan(snap, p, NOW)
    # Then a's job, within its nominal quota, is admitted first (Kueue's order), and b's
    # waits: had b's job borrowed them again, a's job would reclaim them at the next cycle
    assert admitted(decision) == ["a-low"] and not decision.preemptions
    # And explain says why the borrower is placed after it
    trace = trace_job(snap, p, NOW, "b-crit")
    assert trace["position"] == 2 and trace["ahead"] == ["a-low"]
    assert [a["reason"] for a in trace["adjustments"]] == ["borrows-after-nominal"]


def test_a_teams_own_jobs_keep_their_order_when_one_of_them_borrows():
    # Given team a (nominal 8 of 16) with a critical job that would borrow and a low one
    # that would not, and team b's job within its nominal quota
    p = make_policy(quotas=[quota("a", 8, borrowing=8), quota("b", 8)])
    snap = snapshot(16).pending(
        pending("a-crit", 1000, 16, team="a", submitted_at=1), pending("a-low", 50, 8, team="a", submitted_at=2),
        pending("b-mid", 200, 8, team="b", submitted_at=3),
    ).build()
    # When planning
    decision = plan(snap, p, NOW)
    # Then b's job goes first, where a's critical job would have borrowed b's share only to
    # be reclaimed (all 16 of its GPUs stopped for b's 8); a's low job is placed after a's
    # critical one, not ahead of it, and runs in what the critical one cannot use
    assert admitted(decision) == ["b-mid", "a-low"]
    assert trace_job(snap, p, NOW, "a-low")["ahead"] == ["b-mid", "a-crit"]
    assert trace_job(snap, p, NOW, "a-crit")["ahead"] == ["b-mid"]


def test_without_quotas_the_queue_is_placed_in_rank_order():
    snap = snapshot(8).pending(pending("b-crit", 1000, 8, team="b", submitted_at=1), pending("a-low", 50, 8, team="a", submitted_at=2)).build()
    assert admitted(plan(snap, DEFAULT, NOW)) == ["b-crit"]
    assert "adjustments" in trace_job(snap, DEFAULT, NOW, "b-crit") and trace_job(snap, DEFAULT, NOW, "b-crit")["adjustments"] == []


def test_decision_lists_the_candidates_it_considered():
    # Given a victim it may stop, one it may not (same priority) and one protected by minimum runtime
    p = make_policy(min_runtime_s=600)
    snap = snapshot(24).running(
        running("cheap", 50, 8, started_at=0), running("peer", 1000, 8, started_at=0), running("young", 50, 8, started_at=NOW - 10)
    ).pending(pending("crit", 1000, 8)).build()
    lines = plan(snap, p, NOW).explanations
    # Then each appears with the rule applied to it
    by_job = {(e.job, e.verdict, e.reason) for e in lines}
    assert ("cheap", Verdict.PREEMPT, Reason.LOWER_PRIORITY_VICTIM) in by_job
    assert ("young", Verdict.SPARE, Reason.MIN_RUNTIME_PROTECTED) in by_job
    assert ("crit", Verdict.WAIT, Reason.PREEMPTS_LOWER_PRIORITY) in by_job


def test_fill_back_reports_the_dropped_victim():
    snap = snapshot(40).running(
        running("small", 50, 8, started_at=100, last_checkpoint_at=NOW - 10), running("big", 50, 32, last_checkpoint_at=NOW - 20)
    ).pending(pending("crit", 1000, 32, submitted_at=NOW)).build()
    lines = plan(snap, DEFAULT, NOW).explanations
    assert any(e.job == "small" and e.reason is Reason.NOT_NEEDED and e.for_job == "crit" for e in lines)


def test_pools_are_planned_independently():
    # Given two pools, each with a victim and a critical job
    snap = snapshot(8).pool("p4", 8).running(running("v5", 50, 8), running("v4", 50, 8, pool="p4")).pending(
        pending("c5", 1000, 8), pending("c4", 1000, 8, pool="p4")
    ).build()
    decision = plan(snap, DEFAULT, NOW)
    assert sorted((x.victim, x.preemptor) for x in decision.preemptions) == [("v4", "c4"), ("v5", "c5")]


def test_to_dict_shape_is_stable():
    snap = snapshot(8).running(running("a", 50, 8, last_checkpoint_at=NOW - 10)).pending(pending("x", 1000, 8)).build()
    out = plan(snap, DEFAULT, NOW).to_dict()
    # issue 10 added how the victim is stopped (wait_for_checkpoint, stop, escalated) and the
    # checkpoints asked ahead of preemption, the checkpoint waits cut short and the
    # preemptions called off
    assert set(out) == {"admit", "preempt", "fail", "explanations", "checkpoint_requests", "cut_checkpoint_waits", "call_off"}
    assert out["preempt"][0] == {
        "victim": "a", "preemptor": "x", "pool": "p5", "gpus": 8, "reason": "lower-priority-victim", "rule": "lower-priority",
        "borrowed": False, "lost_gpu_seconds": 80.0, "cost_gpu_seconds": 80.0, "checkpoint_age_s": 10.0, "checkpoint_fresh": True,
        "wait_for_checkpoint": False, "stop": "checkpoint-fresh", "escalated": False,
    }


def test_the_issue_example_snapshot():
    # Given the snapshot of the issue (64 GPUs, 32 running, 32 wanted)
    doc = {
        "now": 10000,
        "pools": [{"name": "p5", "gpus": 64}],
        "running": [{"name": "a", "team": "t1", "priority": 50, "pool": "p5", "gpus": 32, "started_at": 1000, "last_checkpoint_at": 9990}],
        "pending": [{"name": "x", "team": "t2", "priority": 1000, "pool": "p5", "gpus": 32, "submitted_at": 9900}],
    }
    now, snap = load_snapshot(doc)
    out = plan(snap, Policy(), now).to_dict()
    # Then x fits the free half; nothing is stopped
    assert out["admit"] == ["x"] and out["preempt"] == []
    # And with the whole pool wanted, a is preempted
    doc["pending"][0]["gpus"] = 64
    now, snap = load_snapshot(doc)
    out = plan(snap, Policy(), now).to_dict()
    assert out["admit"] == [] and [(p["victim"], p["preemptor"]) for p in out["preempt"]] == [("a", "x")]


def test_snapshot_file_reads_every_optional_field():
    doc = {
        "now": 500,
        "pools": [{"name": "p5", "gpus": 64}],
        "running": [{"name": "a", "priority": "low", "pool": "p5", "gpus": 8, "started_at": 0, "sla_s": 60, "spot": True,
                     "expected_duration_s": 900, "work_done_s": 100, "progress": 0.5, "restart_overhead_s": 30, "stopping": True}],
        "pending": [{"name": "x", "priority": "high", "pool": "p5", "gpus": 8, "submitted_at": 1, "pending_since": 400,
                     "sla_s": 3600, "spot": False, "expected_duration_s": 60, "restart_overhead_s": 5, "preemptions": 2}],
        "usage": {"t1": 1000, "t2": {"gpu_seconds": 50, "at": 100}},
        "preemption_history": [{"pool": "p5", "at": 450, "gpus": 8, "lost_gpu_seconds": 80}],
    }
    now, snap = load_snapshot(doc)
    (a,), (x,) = snap.running, snap.pending
    assert (a.priority, a.spot, a.sla_s, a.expected_duration_s, a.work_done_s, a.progress, a.restart_overhead_s, a.stopping) == (
        50, True, 60, 900, 100, 0.5, 30, True)
    assert (x.priority, x.pending_since, x.sla_s, x.expected_duration_s, x.restart_overhead_s, x.preemptions) == (500, 400, 3600, 60, 5, 2)
    assert snap.usage == (TeamUsage("t1", 1000, 500), TeamUsage("t2", 50, 100))
    assert snap.preemption_history[0].lost_gpu_seconds == 80


def test_job_record_maps_policy_fields_into_planner_inputs():
    record = JobRecord(
        name="j", team="t", priority=200, pool="p5", service="batch", gpus=8, request={}, checkpoint_s3_uri="s3://b/p",
        submitted_at=10, status=JobState.RUNNING, started_at=20, sla_s=3600, expected_duration_s=7200, restart_overhead_s=90,
        spot=True, work_done_s=600, pending_since=15,
    )
    p, r = record.as_pending(), record.as_running()
    assert (p.sla_s, p.spot, p.expected_duration_s, p.restart_overhead_s, p.pending_since) == (3600, True, 7200, 90, 15)
    assert (r.sla_s, r.spot, r.expected_duration_s, r.restart_overhead_s, r.work_done_s) == (3600, True, 7200, 90, 600)


@pytest.mark.parametrize(
    "priority, alarm, escalates_at",
    [
        (1000, "stack-job-waiting-too-long", 300 + 600),  # critical: watched, 10 minutes into its wait (since its requeue at 300)
        (500, "stack-job-waiting-too-long", 300 + 600),  # high: watched
        (200, "stack-job-waiting-too-long", None),  # medium: not watched
        (1000, "", None),  # no wait alarm: nothing escalates
    ],
    ids=["critical", "high", "medium-not-watched", "no-alarm"],
)
def test_a_pending_job_carries_when_the_wait_alarm_escalates_it(priority, alarm, escalates_at):
    from preemptor.config import Settings
    from preemptor.service.scheduling import build_snapshot

    settings = Settings(jobs_table="jobs", pools=(), wait_alarm_name=alarm, wait_alarm_minutes=10)
    record = JobRecord(
        name="j", team="t", priority=priority, pool="p5", service="batch", gpus=8, request={}, checkpoint_s3_uri="s3://b/p",
        submitted_at=10, status=JobState.PENDING, pending_since=300,
    )
    snap = build_snapshot(Pool("p5", 8), [record], [], settings=settings)
    assert snap.pending[0].escalates_at == escalates_at
    # and once escalated in this wait it is not expected to be again
    escalated = replace(record, escalated_at=400)
    assert build_snapshot(Pool("p5", 8), [escalated], [], settings=settings).pending[0].escalates_at is None


@pytest.mark.parametrize(
    "young_priority, min_runtime_s, wake_s",
    [
        (50, 3600, 201),  # a low job the minimum runtime protects: wake when the lead starts
        (1000, 3600, None),  # only critical work protected: escalation would not help the high job
        (50, 0, None),  # no minimum runtime: escalation lifts nothing that keeps it waiting
    ],
    ids=["protected-low-work", "protected-higher-work", "no-min-runtime"],
)
def test_a_pool_is_planned_again_when_a_waiting_job_comes_near_its_escalation(young_priority, min_runtime_s, wake_s):
    from preemptor.config import Settings
    from preemptor.core.model import Explanation
    from preemptor.service.scheduling import _next_wake_s

    # Given a high job submitted at 1000 that waits for lack of victims, the wait alarm at 10 minutes
    settings = Settings(jobs_table="jobs", pools=(), wait_alarm_name="alarm", wait_alarm_minutes=10, policy=Policy(min_runtime_s=min_runtime_s))
    base = dict(team="t", pool="p5", service="batch", gpus=8, request={}, checkpoint_s3_uri="s3://b/p")
    waiting = JobRecord(name="high", priority=500, submitted_at=1000, status=JobState.PENDING, **base)
    young = JobRecord(name="young", priority=young_priority, submitted_at=900, status=JobState.RUNNING, started_at=950, **base)
    decision = plan(snapshot(8).build(), DEFAULT, 1000)  # an empty decision, then the wait line
    decision = replace(decision, explanations=(Explanation("high", Verdict.WAIT, Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS, "needs 8 GPUs"),))
    # When the cycle at 1100 computes its wake-up
    wake = _next_wake_s(decision, {"high": waiting, "young": young}, [young], settings, "p5", 1100.0)
    # Then it is planned again when the 300 s before its escalation begin (1000 + 600 - 300,
    # 200 s from now, and a second past it), only where escalation could let it stop something
    assert wake == wake_s


def test_job_request_accepts_policy_fields():
    body = {"name": "j", "team": "t", "priority": "high", "pool": "p5", "service": "batch", "gpus": 8,
            "request": {"jobQueue": "q", "jobDefinition": "d"}, "checkpoint_s3_uri": "s3://bucket-1/ckpt",
            "expected_duration_s": 3600, "restart_overhead_s": 120, "spot": True}
    req = JobRequest.model_validate(body)
    assert (req.expected_duration_s, req.restart_overhead_s, req.spot) == (3600, 120, True)
    assert JobRequest.model_validate({k: v for k, v in body.items() if k not in ("expected_duration_s", "restart_overhead_s", "spot")}).spot is False


def test_team_usage_decays_and_folds_runs():
    u = TeamUsage("t", 1000.0, 0.0)
    assert u.decayed(3600, 3600) == pytest.approx(500.0)
    folded = u.with_run(8, 0, 3600, 3600)
    assert folded.at == 3600 and folded.gpu_seconds == pytest.approx(500 + run_usage(8, 0, 3600, 3600))
    # a run's decayed usage is below its raw GPU-seconds and approaches it for short runs
    assert run_usage(8, 0, 3600, 3600) < 8 * 3600
    assert run_usage(8, 0, 1, 1e9) == pytest.approx(8.0)


# -- properties over random snapshots and policies ---------------------------------------------
TEAMS = ["a", "b", "c"]
H = 3600.0


@st.composite
def rich_snapshots(draw, max_pending: int = 8):
    """Pools mostly full of running jobs with every optional field, and pending jobs that want in."""
    pools = draw(st.lists(st.sampled_from([("p5", 16), ("p5", 32), ("p5", 64), ("p4", 16)]), min_size=1, max_size=2, unique_by=lambda p: p[0]))
    builder = snapshot()
    builder._pools = []
    for name, gpus in pools:
        builder.pool(name, gpus)
    # Now and then the service has no capacity for a pool (its launches met none), or had none
    builder._pools = [
        replace(pool, no_capacity_until=draw(st.sampled_from([None, None, None, NOW + 300, NOW])))
        for pool in builder._pools
    ]
    recent = st.one_of(st.floats(NOW - 900, NOW), st.floats(0, NOW))
    for pool_name, capacity in pools:
        used = 0
        for i in range(draw(st.integers(0, 10))):
            g = min(draw(gpu_sizes), capacity - used)
            if g <= 0:
                break
            used += g
            has_estimate = draw(st.booleans())
            builder.running(
                running(
                    f"{pool_name}-r{i}",
                    draw(priorities),
                    g,
                    pool=pool_name,
                    team=draw(st.sampled_from(TEAMS)),
                    started_at=draw(recent),
                    last_checkpoint_at=draw(st.one_of(st.none(), st.floats(0, NOW))),
                    stopping=draw(st.sampled_from([False, False, False, True])),
                    preemptions=draw(st.sampled_from([0, 0, 1, 3])),
                    sla_s=draw(st.sampled_from([None, 600, 7200])),
                    spot=draw(st.sampled_from([False, False, True])),
                    expected_duration_s=draw(st.sampled_from([1000, 20_000])) if has_estimate else None,
                    work_done_s=draw(st.sampled_from([0, 500])),
                    progress=draw(st.one_of(st.none(), st.floats(0, 1))),
                    restart_overhead_s=draw(st.sampled_from([0, 60, 900])),
                )
            )
    names = [p for p, _ in pools]
    for i in range(draw(st.integers(0, max_pending))):
        builder.pending(
            pending(
                f"p{i}",
                draw(priorities),
                draw(gpu_sizes),
                pool=draw(st.sampled_from(names * 4 + ["nope"])),
                team=draw(st.sampled_from(TEAMS)),
                submitted_at=draw(recent),
                preemptions=draw(st.sampled_from([0, 0, 1, 3])),
                sla_s=draw(st.sampled_from([None, 600, 7200])),
                spot=draw(st.sampled_from([False, False, True])),
                pending_since=draw(st.one_of(st.none(), st.floats(NOW - 1000, NOW))),
            )
        )
    for team in draw(st.lists(st.sampled_from(TEAMS), unique=True)):
        builder.usage(team, draw(st.floats(0, 1e7)), draw(st.floats(0, NOW)))
    for _ in range(draw(st.integers(0, 3))):
        builder.preempted(draw(st.floats(NOW - 2 * H, NOW)), 8, draw(st.floats(0, 1e5)), pool=draw(st.sampled_from(names)))
    return builder.build()


def _knobs(draw) -> dict:
    quotas = []
    if draw(st.booleans()):
        for team in draw(st.lists(st.sampled_from(TEAMS), unique=True, min_size=1)):
            nominal = draw(st.sampled_from([0, 8, 16]))
            quotas.append(quota(team, nominal, draw(st.sampled_from([None, 0, 8])), draw(st.sampled_from([None, 0, nominal]))))
    return {
        "within_team": draw(st.sampled_from(list(PreemptionMode))),
        "across_teams": draw(st.sampled_from(list(PreemptionMode))),
        "reclaim_within_pool": draw(st.sampled_from(list(ReclaimMode))),
        "quotas": quotas,
        "min_runtime_s": draw(st.sampled_from([0, 0, 300, 5000])),
        "near_completion": {"remaining_s": draw(st.sampled_from([None, 600])), "progress": draw(st.sampled_from([None, 0.8]))},
        "max_preemptions": draw(st.sampled_from([None, None, 0, 2])),
        "on_max_preemptions": draw(st.sampled_from(list(MaxPreemptionsAction))),
        "budget": draw(st.sampled_from([None, None, {"max_preemptions": 1}, {"max_preemptions": 3}, {"max_gpu_hours": 10.0}])),
        "preemption_delay_s": draw(st.sampled_from([0, 0, 300])),
        "tier_max_sla_s": draw(st.sampled_from([{}, {"critical": H}])),
        "spot_max_priority": draw(st.sampled_from(["lowest", None, "medium"])),
        "aging": {"rate_per_hour": draw(st.sampled_from([0, 10, 500])), "cap": draw(st.sampled_from(["below-next-tier", "none"])),
                  "starving_after_s": draw(st.sampled_from([None, 3600]))},
        "fair_share": {"enabled": draw(st.booleans()), "half_life_s": draw(st.sampled_from([600, 604800]))},
    }


@st.composite
def rich_policies(draw):
    knobs = _knobs(draw)
    if draw(st.booleans()):
        knobs["pools"] = {"p4": {k: v for k, v in _knobs(draw).items() if draw(st.booleans())}}
    return Policy(**knobs)


def claimed(job, p: Policy) -> int:
    """Test oracle of the cost rules: SLA caps, then the spot cap."""
    knobs = p.for_pool(job.pool)
    c = job.priority
    for tier, limit in sorted(knobs.tier_max_sla_s.items(), key=lambda kv: -p.tiers[kv[0]]):
        value = p.tiers[tier]
        if c >= value and (job.sla_s is None or job.sla_s > limit):
            c = max([t for t in p.tiers.values() if t < value], default=max(0, value - 1))
    cap = p.priority_value(knobs.spot_max_priority)
    if job.spot and cap is not None:
        c = min(c, cap)
    return c


def _protected(v, knobs, now) -> bool:
    if knobs.max_preemptions is not None and knobs.on_max_preemptions is MaxPreemptionsAction.PROTECT and v.preemptions >= knobs.max_preemptions:
        return True
    if now - v.started_at < knobs.min_runtime_s:
        return True
    remaining = v.remaining_s(now)
    if knobs.near_completion.remaining_s is not None and remaining is not None and 0 <= remaining < knobs.near_completion.remaining_s:
        return True
    progress = v.progress_at(now)
    return knobs.near_completion.progress is not None and progress is not None and knobs.near_completion.progress < progress <= 1


@settings(max_examples=400, deadline=None)
@given(rich_snapshots(), rich_policies())
def test_rich_properties(snap, p):
    before, policy_before = copy.deepcopy(snap), copy.deepcopy(p)
    decision = plan(snap, p, NOW)
    # same input, same output; the input is not mutated
    assert decision == plan(snap, p, NOW)
    assert snap == before and p == policy_before
    by_name = {j.name: j for j in snap.running}
    pend = {j.name: j for j in snap.pending}
    for pool in snap.pools:
        knobs = p.for_pool(pool.name)
        # capacity is never exceeded
        held = sum(j.gpus for j in snap.running if j.pool == pool.name)
        assert held + sum(a.gpus for a in decision.admits if a.pool == pool.name) <= pool.gpus
        # the budget is never exceeded by new preemptions, and nothing is stopped while the
        # service has no capacity for the pool
        new = [x for x in decision.preemptions if x.pool == pool.name]
        if pool.no_capacity_until is not None and NOW < pool.no_capacity_until:
            assert not new
            mine = [e for e in decision.explanations if e.job in pend and pend[e.job].pool == pool.name]
            assert all(e.reason is not Reason.PREEMPTS_LOWER_PRIORITY for e in mine)
        if knobs.budget is not None and knobs.budget.max_preemptions is not None and new:
            window = [h for h in snap.preemption_history if h.pool == pool.name and NOW - knobs.budget.window_s < h.at <= NOW]
            assert len(window) + len(new) <= knobs.budget.max_preemptions
        # quotas: a team admitted in this pool stays under nominal + borrowing limit
        for q in knobs.quotas:
            taken = [a for a in decision.admits if a.pool == pool.name and pend[a.job].team == q.team]
            if taken and q.borrowing_limit is not None:
                used = sum(j.gpus for j in snap.running if j.pool == pool.name and j.team == q.team and not j.stopping)
                freed = sum(x.gpus for x in new if by_name[x.victim].team == q.team)
                assert used - freed + sum(a.gpus for a in taken) <= q.nominal_gpus + q.borrowing_limit
    for x in decision.preemptions:
        victim, preemptor = by_name[x.victim], pend[x.preemptor]
        knobs = p.for_pool(victim.pool)
        pv, pj = claimed(victim, p), claimed(preemptor, p)
        assert victim.pool == preemptor.pool == x.pool
        # never a job already stopping, protected, or within its minimum runtime / near completion
        assert not victim.stopping and not _protected(victim, knobs, NOW)
        # the delay was served
        assert NOW - preemptor.waiting_since() >= knobs.preemption_delay_s
        if x.rule is PreemptionRule.RECLAIM_BORROWED:
            assert knobs.quotas and victim.team != preemptor.team and x.borrowed
            assert knobs.reclaim_within_pool is not ReclaimMode.NEVER
            if knobs.reclaim_within_pool is ReclaimMode.LOWER_PRIORITY:
                assert pv < pj
            continue
        mode = knobs.within_team if victim.team == preemptor.team else knobs.across_teams
        assert mode is not PreemptionMode.NEVER
        if knobs.quotas and victim.team != preemptor.team:
            assert x.borrowed  # other teams' work within their nominal quota is guaranteed
        # no victim of equal or higher priority under LowerPriority
        if mode is PreemptionMode.LOWER_PRIORITY:
            assert pv < pj and x.rule is PreemptionRule.LOWER_PRIORITY
        else:
            assert pv < pj or (pv == pj and victim.started_at > preemptor.submitted_at)
    # every victim is named once; failures are exactly the jobs over their preemption limit
    assert len(victims(decision)) == len(set(victims(decision)))
    for f in decision.failures:
        knobs = p.for_pool(f.pool)
        assert knobs.on_max_preemptions is MaxPreemptionsAction.FAIL and pend[f.job].preemptions >= knobs.max_preemptions
    assert not {f.job for f in decision.failures} & set(admitted(decision))
    # every pending job gets exactly one verdict of its own
    own = [e.job for e in decision.explanations if e.for_job is None and e.verdict in (Verdict.ADMIT, Verdict.WAIT, Verdict.SKIP, Verdict.FAIL)]
    assert sorted(own) == sorted(pend)


def _fits_oracle(snap: Snapshot, p: Policy, job, victim_names: list[str]) -> bool:
    """Does `job` fit once `victim_names` stop? Physical capacity, quota ceiling and lending limits."""
    pool = next(x for x in snap.pools if x.name == job.pool)
    knobs = p.for_pool(pool.name)
    jobs = [j for j in snap.running if j.pool == pool.name]
    stopped = {n for n in victim_names}
    physical = pool.gpus - sum(j.gpus for j in jobs) + sum(j.gpus for j in jobs if j.stopping or j.name in stopped)
    if job.gpus > physical:
        return False
    if not knobs.quotas:
        return True
    quotas = {q.team: q for q in knobs.quotas}
    used = {t: sum(j.gpus for j in jobs if j.team == t and not j.stopping and j.name not in stopped) for t in {j.team for j in jobs} | set(quotas) | {job.team}}
    own = quotas.get(job.team)
    if own is not None and used[job.team] + job.gpus > own.ceiling:
        return False
    kept = sum(max(0, q.kept - used[t]) for t, q in quotas.items() if t != job.team)
    return job.gpus <= physical - kept


@settings(max_examples=400, deadline=None)
@given(rich_snapshots(max_pending=0), rich_policies(), gpu_sizes, priorities, st.sampled_from(TEAMS))
def test_rich_victim_set_is_minimal(snap, p, need, priority, team):
    # Given exactly one pending job, with quotas per team (no tiers)
    job = pending("x", priority, need, team=team, pool=snap.pools[0].name, submitted_at=0)
    snap = Snapshot(snap.pools, snap.running, (job,), snap.usage, snap.preemption_history)
    decision = plan(snap, p, NOW)
    chosen = victims(decision)
    if chosen:
        # Then the victims are enough, and dropping any one of them leaves the job not fitting
        assert _fits_oracle(snap, p, job, chosen)
        for v in chosen:
            assert not _fits_oracle(snap, p, job, [c for c in chosen if c != v])
        # And the job did not fit without preempting
        assert not _fits_oracle(snap, p, job, [])
    if admitted(decision) == ["x"]:
        assert _fits_oracle(snap, p, job, [])


def test_capacity_freed_by_a_preemption_goes_to_its_preemptor():
    # Given a starving low job ranked first by the starvation guard, and a medium job whose
    # victim has just been stopped for it (nominated a minute ago), with the GPUs now free
    policy = Policy(aging={"rate_per_hour": 200, "starving_after_s": 3600})
    snap = snapshot(8).pending(
        pending("starving", 50, 8, submitted_at=NOW - 7200),  # aged to 450, uncapped
        pending("medium", 200, 8, submitted_at=NOW - 120, nominated_at=NOW - 60),  # 206
    ).build()
    assert admitted(plan(type(snap)(snap.pools, (), (snap.pending[0], replace(snap.pending[1], nominated_at=None))), policy, NOW)) == ["starving"]
    # When planning
    decision = plan(snap, policy, NOW)
    # Then the medium job gets the GPUs freed for it; the starving job is next in line
    assert admitted(decision) == ["medium"]
    assert any(e.job == "medium" and e.reason is Reason.CAPACITY_FREED_FOR_IT for e in decision.explanations)


def test_an_old_nomination_hands_nothing_over():
    # (the handover window is the checkpoint wait + the stop wait + 600 s: 2,100 s by default)
    policy = Policy(aging={"rate_per_hour": 200, "starving_after_s": 3600})
    snap = snapshot(8).pending(
        pending("starving", 50, 8, submitted_at=NOW - 7200),
        pending("medium", 200, 8, submitted_at=NOW - 2500, nominated_at=NOW - 2400),
    ).build()
    assert admitted(plan(snap, policy, NOW)) == ["starving"]


def test_a_job_admitted_after_starving_runs_to_completion():
    # Given the starvation guard on, and a low job that waited past it
    policy = Policy(aging={"rate_per_hour": 10, "starving_after_s": 3600})
    snap = snapshot(8).pending(pending("starving", 50, 8, submitted_at=NOW - 7200)).build()
    # When it is admitted, then the admission says it runs to completion
    [admission] = plan(snap, policy, NOW).admits
    assert admission.guaranteed
    # And once running, a critical job cannot preempt it
    snap = snapshot(8).running(running("starving", 50, 8, guaranteed=True)).pending(
        pending("critical", 1000, 8, submitted_at=NOW)
    ).build()
    decision = plan(snap, policy, NOW)
    assert decision.preemptions == ()
    assert any(e.reason is Reason.STARVATION_GUARANTEE for e in decision.explanations)


# -- a run the controller may not stop ----------------------------------------------------------
def test_a_running_job_that_is_not_stoppable_is_never_a_victim():
    # Given a pool held by an adopted low run without the managed tag (not stoppable, the
    # cheapest victim by every order) and a stoppable low job, and a critical job needing 8 GPUs
    snap = snapshot(16).running(
        running("adopted", 50, 8, started_at=9_000, stoppable=False),
        running("managed", 50, 8, started_at=0, last_checkpoint_at=100),
    ).pending(pending("critical", 1000, 8, submitted_at=9_500)).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then the stoppable job is the victim, and the adopted run is spared for its own reason
    assert victims(decision) == ["managed"]
    spared = [e for e in decision.explanations if e.job == "adopted"]
    assert [(e.verdict, e.reason) for e in spared] == [(Verdict.SPARE, Reason.NOT_STOPPABLE)]


def test_a_job_blocked_only_by_an_unstoppable_run_waits_without_victims():
    # Given a pool held only by an adopted run the controller may not stop
    snap = snapshot(8).running(running("adopted", 50, 8, stoppable=False)).pending(
        pending("critical", 1000, 8, submitted_at=100)
    ).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then nothing is preempted, and the critical job waits for lack of eligible victims
    assert not decision.preemptions
    (line,) = [e for e in decision.explanations if e.job == "critical"]
    assert (line.verdict, line.reason) == (Verdict.WAIT, Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS)


# -- checkpoint freshness: one rule (core.progress) ---------------------------------------------
@pytest.mark.parametrize(
    "started_at, checkpoint_at, fresh",
    [
        # Relaunched at 9,800 from a checkpoint of 1,000: 200 s at risk, fresh under 900 s,
        # though the checkpoint itself is 9,000 s old.
        pytest.param(9_800.0, 1_000.0, True, id="relaunched-counts-from-run-start"),
        pytest.param(0.0, 9_000.0, False, id="checkpoint-1000s-old"),
        pytest.param(9_800.0, None, False, id="no-checkpoint-is-never-fresh"),
    ],
)
def test_decision_checkpoint_fresh_counts_from_the_later_of_checkpoint_and_run_start(started_at, checkpoint_at, fresh):
    # Given a low victim holding the pool, started and checkpointed as given, and a critical job
    snap = snapshot(8).running(running("victim", 50, 8, started_at=started_at, last_checkpoint_at=checkpoint_at)).pending(
        pending("critical", 1000, 8, submitted_at=9_900)
    ).build()
    # When planning at 10,000 under the default 900 s limit
    (preemption,) = plan(snap, DEFAULT, NOW).preemptions
    # Then the decision's freshness is the workflow's rule, and the lost work matches it
    assert preemption.checkpoint_fresh is fresh
    at_risk = NOW - max(started_at, checkpoint_at if checkpoint_at is not None else started_at)
    assert preemption.lost_gpu_seconds == pytest.approx(8 * at_risk)


# -- issue 10: how a victim is stopped; escalation; checkpoints ahead of preemption ----------


def test_escalated_job_lifts_min_runtime_checkpoint_wait_and_delay():
    # Given a low job that started 60 s ago (min_runtime_s 1800 protects it), whose work since
    # its start is at risk, a 600 s preemption delay, and a medium job of 8 GPUs that has
    # waited only 10 s
    knobs = Policy(min_runtime_s=1800, preemption_delay_s=600)
    victim = running("young", 50, 8, started_at=NOW - 60)
    waiting = pending("urgent", 200, 8, submitted_at=NOW - 10)
    plain = snapshot(8).running(victim).pending(waiting).build()
    escalated = snapshot(8).running(victim).pending(replace(waiting, escalated=True)).build()
    # When planning without and with the escalation
    before = plan(plain, knobs, NOW)
    after = plan(escalated, knobs, NOW)
    # Then the plain job preempts nothing (the young job is protected)
    assert victims(before) == []
    # and the escalated one stops it at once, without a checkpoint wait, and says why
    assert victims(after) == ["young"]
    p = after.preemptions[0]
    assert p.escalated and not p.wait_for_checkpoint and p.stop is Reason.ESCALATED_STOP
    line = next(e for e in after.explanations if e.job == "young" and e.verdict is Verdict.PREEMPT)
    assert "escalated" in line.detail and "min_runtime_s" in line.detail
    wait = next(e for e in after.explanations if e.job == "urgent" and e.verdict is Verdict.WAIT)
    assert "escalated" in wait.detail


def test_escalation_of_one_job_does_not_lift_protections_for_others():
    # Given an escalated job that fits in free GPUs and a plain one that would need the young job
    knobs = Policy(min_runtime_s=1800)
    snap = snapshot(16).running(running("young", 50, 8, started_at=NOW - 60)).pending(
        pending("escalated", 200, 8, submitted_at=1, escalated=True), pending("plain", 200, 8, submitted_at=2)
    ).build()
    # When planning
    decision = plan(snap, knobs, NOW)
    # Then the escalated job is admitted and the plain one may not stop the protected job
    assert admitted(decision) == ["escalated"]
    assert victims(decision) == []


@pytest.mark.parametrize(
    "victim_kw, preemptor, expected_wait, expected_stop",
    [
        # seen to save on SIGTERM: nothing at risk
        (dict(saves_on_stop=True), ("crit", 1000), False, Reason.SAVES_ON_STOP),
        # checkpoint 100 s old <= 900 s: fresh
        (dict(last_checkpoint_at=NOW - 100), ("med", 200), False, Reason.CHECKPOINT_FRESH),
        # did not honour its last request
        (dict(ignored_checkpoint_request=True), ("med", 200), False, Reason.IGNORED_LAST_REQUEST),
        # 8 GPUs x 7200 s = 57,600 at risk > 8 GPUs x 200 s (expected wait) x 1000/50 = 32,000: waits
        (dict(started_at=NOW - 7200), ("crit", 1000), True, Reason.WAIT_FOR_CHECKPOINT),
        # 8 x 1000 s = 8,000 at risk > 8 x 200 s x 200/50 = 6,400: waits
        (dict(started_at=NOW - 1000), ("med", 200), True, Reason.WAIT_FOR_CHECKPOINT),
        # 8 x 1000 s = 8,000 at risk < 8 x 200 s x 1000/50 = 32,000: does not pay
        (dict(started_at=NOW - 1000), ("crit", 1000), False, Reason.WAIT_DOES_NOT_PAY),
        # no training helper: the wait to expect is checkpoint_wait_max_s (600 s);
        # 8 x 3600 = 28,800 at risk > 8 x 600 s x 200/50 = 19,200: waits
        (dict(declares_save_on_stop=False), ("med", 200), True, Reason.WAIT_FOR_CHECKPOINT),
        # 8 x 3600 = 28,800 < 8 x 600 s x 1000/50 = 96,000: does not pay
        (dict(declares_save_on_stop=False), ("crit", 1000), False, Reason.WAIT_DOES_NOT_PAY),
    ],
    ids=[
        "saves-on-stop", "fresh", "ignored-request", "pays", "pays-for-medium", "does-not-pay-for-critical",
        "no-helper-medium-waits", "no-helper-critical-does-not",
    ],
)
def test_stop_at_once_or_wait_for_a_checkpoint(victim_kw, preemptor, expected_wait, expected_stop):
    # Given a low victim of 8 GPUs filling the pool, running the training helper, started
    # 3600 s ago unless given, with no checkpoint unless given, and a preemptor of 8 GPUs
    kw = {"started_at": NOW - 3600, "declares_save_on_stop": True, **victim_kw}
    snap = snapshot(8).running(running("victim", 50, 8, **kw)).pending(pending(preemptor[0], preemptor[1], 8, submitted_at=1)).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then the victim is stopped as the costs say
    [p] = decision.preemptions
    assert (p.wait_for_checkpoint, p.stop) == (expected_wait, expected_stop)


def test_delayed_preemption_asks_its_likely_victims_for_a_checkpoint_ahead():
    # Given a medium job within its tier's 900 s preemption delay and two low jobs running
    # the training helper filling the pool: one with 1000 s at risk, one seen to save on SIGTERM
    knobs = Policy(tier_preemption_delay_s={"medium": 900})
    snap = snapshot(16).running(
        running("at-risk", 50, 8, started_at=NOW - 1000, declares_save_on_stop=True), running("saver", 50, 8, started_at=NOW - 2000, saves_on_stop=True, declares_save_on_stop=True)
    ).pending(pending("med", 200, 16, submitted_at=NOW - 100)).build()
    # When planning
    decision = plan(snap, knobs, NOW)
    # Then nothing is preempted yet, and only the job with work at risk is asked ahead
    assert victims(decision) == []
    assert [(c.job, c.for_job, c.reason) for c in decision.checkpoint_requests] == [("at-risk", "med", Reason.AHEAD_OF_PREEMPTION)]
    # and a job asked within the checkpoint wait (600 s) is not asked again
    asked = replace(snap, running=tuple(replace(v, checkpoint_requested_at=NOW - 60) for v in snap.running))
    assert plan(asked, knobs, NOW).checkpoint_requests == ()


def test_a_preemption_held_by_the_budget_asks_its_likely_victims_ahead():
    # Given a pool whose budget allows one lost GPU-hour per hour, a low job of 8 GPUs with
    # 7200 s at risk filling it, and a medium job that would have to stop it
    knobs = Policy(budget={"window_s": 3600, "max_gpu_hours": 1})
    snap = snapshot(8).running(running("at-risk", 50, 8, started_at=NOW - 7200, declares_save_on_stop=True)).pending(pending("med", 200, 8, submitted_at=NOW - 100)).build()
    # When planning
    decision = plan(snap, knobs, NOW)
    # Then nothing is stopped, and the victim the budget holds back is asked now
    assert victims(decision) == []
    [c] = decision.checkpoint_requests
    assert (c.job, c.for_job, c.reason) == ("at-risk", "med", Reason.AHEAD_OF_PREEMPTION)
    assert "waits for the preemption budget" in c.detail


def test_queue_pressure_asks_the_victims_a_waiting_job_will_take_once_capacity_frees():
    # Given a pool of 24 GPUs: a high job of 16 GPUs (not preemptible by medium work) and
    # a low job of 8 GPUs with 3600 s at risk; a medium job of 16 GPUs cannot fit even by
    # stopping the low job
    snap = snapshot(24).running(running("high", 500, 16), running("low", 50, 8, started_at=NOW - 3600, declares_save_on_stop=True)).pending(
        pending("med", 200, 16, submitted_at=NOW - 100)
    ).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then the medium job waits, and the low job it will stop once 8 more GPUs free is asked now
    assert victims(decision) == []
    [c] = decision.checkpoint_requests
    assert (c.job, c.for_job) == ("low", "med")
    assert "once 8 more GPUs free" in c.detail and "3600 s of work at risk" in c.detail
    # and not with queue pressure turned off
    assert plan(snap, Policy(checkpoint_ahead={"on_queue_pressure": False}), NOW).checkpoint_requests == ()


@pytest.mark.parametrize(
    "victim_kw, asked",
    [
        (dict(started_at=NOW - 200), False),  # 200 s at risk <= min_at_risk_s 300
        (dict(saves_on_stop=True), False),  # nothing at risk on a stop
        (dict(declares_save_on_stop=False), False),  # no training helper: cannot answer
        (dict(ignored_checkpoint_request=True), False),  # would not answer
        (dict(checkpoint_requested_at=NOW - 1200), False),  # asked 20 min ago < min_interval_s 1800
        (dict(checkpoint_requested_at=NOW - 2000), True),  # asked 33 min ago
        (dict(), True),
    ],
    ids=["little-at-risk", "saves-on-stop", "no-helper", "ignored-last", "asked-recently", "asked-long-ago", "at-risk"],
)
def test_which_likely_victims_are_asked_ahead(victim_kw, asked):
    # Given queue pressure on a low job started 3600 s ago unless given
    kw = {"started_at": NOW - 3600, "declares_save_on_stop": True, **victim_kw}
    snap = snapshot(24).running(running("high", 500, 16), running("low", 50, 8, **kw)).pending(
        pending("med", 200, 16, submitted_at=NOW - 100)
    ).build()
    # When planning, then it is asked or not as the budget and what was learned say
    assert [c.job for c in plan(snap, DEFAULT, NOW).checkpoint_requests] == (["low"] if asked else [])


def _held_by_min_runtime(escalates_in: float | None, **victim_kw):
    """A low job of 8 GPUs that started 900 s ago (min_runtime_s 1800 protects it) with all
    of that at risk, filling the pool, and a critical job of 8 GPUs that the wait alarm
    escalates in `escalates_in` s (None: a tier it does not watch)."""
    kw = {"started_at": NOW - 900, "declares_save_on_stop": True, **victim_kw}
    at = None if escalates_in is None else NOW + escalates_in
    return snapshot(8).running(running("young", 50, 8, **kw)).pending(
        pending("urgent", 1000, 8, submitted_at=NOW - 400, escalates_at=at)
    ).build()


@pytest.mark.parametrize(
    "escalates_in, knobs, asked",
    [
        (200.0, {}, True),  # within before_escalation_s (300 s)
        (-30.0, {}, True),  # past the threshold, the alarm not evaluated yet
        (400.0, {}, False),  # not yet
        (None, {}, False),  # the alarm does not watch its tier
        (200.0, {"checkpoint_ahead": {"before_escalation_s": None}}, False),  # turned off
        (200.0, {"checkpoint_ahead": {"max_jobs": 0}}, False),  # no checkpoints ahead at all
    ],
    ids=["within-lead", "past-threshold", "not-yet", "not-watched", "off", "ahead-off"],
)
def test_a_job_near_its_escalation_asks_the_victims_it_will_then_take(escalates_in, knobs, asked):
    # Given a critical job that the minimum runtime keeps waiting, as the wait alarm nears
    snap = _held_by_min_runtime(escalates_in)
    # When planning
    decision = plan(snap, Policy(min_runtime_s=1800, **knobs), NOW)
    # Then nothing is stopped (the victim is still protected), and the victim it will stop
    # once escalated is asked for a checkpoint now, saying why
    assert victims(decision) == []
    requests = [(c.job, c.for_job, c.reason) for c in decision.checkpoint_requests]
    assert requests == ([("young", "urgent", Reason.AHEAD_OF_PREEMPTION)] if asked else [])
    if asked:
        detail = decision.checkpoint_requests[0].detail
        assert "wait alarm escalates" in detail and "without waiting for a checkpoint" in detail and "900 s of work at risk" in detail
        line = next(e for e in decision.explanations if e.job == "young" and e.reason is Reason.AHEAD_OF_PREEMPTION)
        assert line.for_job == "urgent"
    # and the critical job's own line is unchanged: it waits for lack of victims
    wait = next(e for e in decision.explanations if e.job == "urgent")
    assert wait.reason is Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS


def test_asked_before_its_escalation_the_victim_loses_only_the_work_since_that_checkpoint():
    # Given the victim was asked 300 s before the escalation and wrote its checkpoint 60 s later
    knobs = Policy(min_runtime_s=1800)
    asked = plan(_held_by_min_runtime(300.0), knobs, NOW)
    assert [c.job for c in asked.checkpoint_requests] == ["young"]
    later = NOW + 300
    escalated = replace(_held_by_min_runtime(None, last_checkpoint_at=NOW + 60, checkpoint_requested_at=NOW), pending=(
        pending("urgent", 1000, 8, submitted_at=NOW - 400, escalated=True),
    ))
    # When the alarm has escalated the critical job
    decision = plan(escalated, knobs, later)
    # Then it stops the young job at once, losing the 240 s since that checkpoint, not the
    # 1200 s since its start
    [p] = decision.preemptions
    assert p.escalated and not p.wait_for_checkpoint
    assert p.lost_gpu_seconds == pytest.approx(8 * 240)
    # and the same stop without the request ahead loses it all
    unasked = replace(escalated, running=(running("young", 50, 8, started_at=NOW - 900, declares_save_on_stop=True),))
    assert plan(unasked, knobs, later).preemptions[0].lost_gpu_seconds == pytest.approx(8 * 1200)


def test_a_job_near_its_escalation_takes_no_victim_the_escalation_would_not_lift():
    # Given the young job is the only candidate but not stoppable (a hard protection)
    snap = _held_by_min_runtime(200.0, stoppable=False)
    # When planning, then nothing is asked: escalation would not let it stop that job
    assert plan(snap, Policy(min_runtime_s=1800), NOW).checkpoint_requests == ()


def test_ahead_requests_stay_within_max_jobs_and_skip_what_is_stopped_now():
    # Given 12 low jobs of 1 GPU with work at risk under queue pressure (a medium job of
    # 16 GPUs cannot fit beside a high job of 8), then a critical job of 1 GPU that stops one
    lows = [running(f"low-{i:02d}", 50, 1, started_at=NOW - 3600 - i, declares_save_on_stop=True) for i in range(12)]
    snap = snapshot(20).running(running("high", 500, 8), *lows).pending(
        pending("crit", 1000, 1, submitted_at=NOW - 10), pending("med", 200, 16, submitted_at=NOW - 100)
    ).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then one low job is stopped for the critical one, and 8 others (the default max_jobs)
    # are asked ahead, not the one being stopped
    [stopped] = victims(decision)
    asked = [c.job for c in decision.checkpoint_requests]
    assert len(asked) == 8 and stopped not in asked
    assert len(plan(snap, Policy(checkpoint_ahead={"max_jobs": 3}), NOW).checkpoint_requests) == 3
    assert plan(snap, Policy(checkpoint_ahead={"max_jobs": 0}), NOW).checkpoint_requests == ()


def test_a_job_short_of_quota_puts_no_pressure_on_other_teams():
    # Given a pool with research's quota at its ceiling and research's medium job waiting
    # beside a low job of another team with work at risk
    knobs = make_policy(quotas=[quota("research", 8, borrowing=0), quota("prod", 16)])
    snap = snapshot(24).running(
        running("r-high", 500, 8, team="research"), running("p-low", 50, 8, team="prod", started_at=NOW - 3600), running("p-high", 500, 8, team="prod")
    ).pending(pending("r-med", 200, 8, team="research", submitted_at=NOW - 100)).build()
    # When planning, then nothing is asked: the quota, not capacity, keeps it waiting
    decision = plan(snap, knobs, NOW)
    assert victims(decision) == [] and decision.checkpoint_requests == ()


def test_the_forecast_asks_the_first_victims_in_order_for_the_gpus_recent_preemptions_predict():
    # Given a full pool of 16 GPUs: three low jobs of 4 GPUs with work at risk (the most
    # recently started first in victim order) and a critical job; 32 GPUs preempted in the
    # last hour, so the next 900 s are expected to need 8
    lows = [running(f"low-{i}", 50, 4, started_at=NOW - 3600 + 100 * i, last_checkpoint_at=NOW - 3000 + 500 * i, declares_save_on_stop=True) for i in range(3)]
    history = [PastPreemption("p5", NOW - 600, 32)]
    snap = snapshot(16).running(*lows, running("crit", 1000, 4)).build()
    snap = replace(snap, preemption_history=tuple(history))
    # When planning with nothing pending
    decision = plan(snap, DEFAULT, NOW)
    # Then the two jobs first in victim order are asked, for no job in particular
    assert [(c.job, c.for_job) for c in decision.checkpoint_requests] == [("low-2", None), ("low-1", None)]
    assert "expected to need 8.0 GPUs by preemption" in decision.checkpoint_requests[0].detail
    # and none when the history is older than the window, or the forecast is off
    assert plan(replace(snap, preemption_history=(PastPreemption("p5", NOW - 4000, 32),)), DEFAULT, NOW).checkpoint_requests == ()
    assert plan(snap, Policy(checkpoint_ahead={"forecast_window_s": None}), NOW).checkpoint_requests == ()


def test_free_gpus_serve_the_forecast_first():
    # Given 8 free GPUs of 16 and a forecast of 8 GPUs: nothing needs a victim
    snap = snapshot(16).running(running("low", 50, 8, started_at=NOW - 3600, declares_save_on_stop=True)).build()
    snap = replace(snap, preemption_history=(PastPreemption("p5", NOW - 600, 32),))
    assert plan(snap, DEFAULT, NOW).checkpoint_requests == ()
    # and with 4 free, 4 more are needed: the low job is asked
    snap = replace(snap, running=snap.running + (running("high", 500, 4),))
    assert [c.job for c in plan(snap, DEFAULT, NOW).checkpoint_requests] == ["low"]


def test_aging_is_off_by_default():
    # Given a low job that has waited 10 hours and a high job just submitted, one slot
    snap = snapshot(8).pending(pending("old-low", 50, submitted_at=NOW - 36_000), pending("new-high", 500, submitted_at=NOW)).build()
    # When planning under the defaults
    decision = plan(snap, DEFAULT, NOW)
    # Then the claimed priority orders the queue, as the pending index does
    assert admitted(decision) == ["new-high"]


# -- stops that wait for a checkpoint, judged again for the jobs that come to wait on them ----
def _late(name: str = "late", gpus: int = 8, **kw) -> object:
    """A low job being stopped whose workflow asked for its checkpoint 60 s ago and waits
    (no training helper: up to checkpoint_wait_max_s, 540 s left); 3600 s at risk."""
    kw = {"started_at": NOW - 3600, "stopping": True, "stop_awaits_checkpoint": True, "checkpoint_requested_at": NOW - 60, **kw}
    return running(name, 50, gpus, **kw)


def test_a_critical_job_cuts_short_the_checkpoint_wait_it_would_wait_on():
    # Given a stop already signalled (8 GPUs) and one that waits for a checkpoint (8 GPUs),
    # and a critical job of 16 GPUs
    signalled = running("signalled", 50, 8, stopping=True)
    snap = snapshot(16).running(signalled, _late()).pending(pending("crit", 1000, 16, submitted_at=NOW - 10)).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then it takes both, and the wait is cut: 8 x 3600 = 28,800 GPU-s at risk < 16 GPUs x
    # 540 s left x 1000/50 = 172,800
    assert [(c.job, c.for_job) for c in decision.wait_cuts] == [("late", "crit")]
    [line] = [e for e in decision.explanations if e.job == "late"]
    assert (line.verdict, line.reason, line.for_job) == (Verdict.PREEMPT, Reason.CHECKPOINT_WAIT_CUT, "crit")
    assert "28800 GPU-s at risk vs 16 GPUs x 540 s left x 20.00 = 172800" in line.detail
    assert decision.to_dict()["cut_checkpoint_waits"][0]["job"] == "late"
    # And a critical job of 8 GPUs takes the signalled stop's GPUs first: nothing is cut
    small = replace(snap, pending=(pending("crit", 1000, 8, submitted_at=NOW - 10),))
    decision = plan(small, DEFAULT, NOW)
    assert decision.wait_cuts == () and not [e for e in decision.explanations if e.job == "late"]


def test_a_checkpoint_wait_that_still_pays_is_kept_and_explained_and_escalation_cuts_it():
    # Given a stop waiting for a checkpoint, and a medium job of 8 GPUs: 8 x 3600 = 28,800 at
    # risk > 8 GPUs x 540 s x 200/50 = 17,280
    snap = snapshot(8).running(_late()).pending(pending("med", 200, 8, submitted_at=NOW - 10)).build()
    decision = plan(snap, DEFAULT, NOW)
    # Then it waits on the stop, which goes on waiting for its checkpoint, and says so
    assert decision.wait_cuts == () and victims(decision) == []
    [line] = [e for e in decision.explanations if e.job == "late"]
    assert (line.reason, line.for_job) == (Reason.CHECKPOINT_WAIT_KEPT, "med")
    # And an escalated job never waits on it
    escalated = replace(snap, pending=(pending("med", 200, 8, submitted_at=NOW - 10, escalated=True),))
    assert [c.job for c in plan(escalated, DEFAULT, NOW).wait_cuts] == ["late"]


def test_the_wait_left_of_a_job_running_the_training_helper_is_its_expected_wait_then_the_longest():
    # Given stops waiting for a checkpoint asked 60 s ago (helper: 200 s expected, 140 s left)
    # and 300 s ago (past the expected wait: until the 600 s limit, 300 s left)
    policy_ = DEFAULT
    snap = snapshot(8).running(_late(declares_save_on_stop=True)).pending(pending("crit", 1000, 8, submitted_at=NOW - 10)).build()
    [line] = [e for e in plan(snap, policy_, NOW).explanations if e.job == "late"]
    assert "x 140 s left" in line.detail
    later = replace(snap, running=(_late(declares_save_on_stop=True, checkpoint_requested_at=NOW - 300),))
    [line] = [e for e in plan(later, policy_, NOW).explanations if e.job == "late"]
    assert "x 300 s left" in line.detail


def test_a_job_that_would_wait_on_a_checkpoint_preempts_instead_when_a_new_victim_loses_less():
    # Given a stop waiting for a checkpoint (8 GPUs, 28,800 GPU-s at risk) and a low job with
    # a checkpoint 100 s old (fresh: stopped at once, 800 GPU-s lost), and a critical job of 8
    snap = snapshot(16).running(_late(), running("fresh", 50, 8, started_at=NOW - 3600, last_checkpoint_at=NOW - 100)).pending(
        pending("crit", 1000, 8, submitted_at=NOW - 10)
    ).build()
    decision = plan(snap, DEFAULT, NOW)
    # Then it preempts the fresh job rather than wait 540 s or cut the other's wait
    assert victims(decision) == ["fresh"] and decision.wait_cuts == ()
    assert decision.preemptions[0].wait_for_checkpoint is False
    # And with a preemption delay not yet served it waits on the stop (and cuts its wait)
    delayed = Policy(preemption_delay_s=300)
    decision = plan(snap, delayed, NOW)
    assert victims(decision) == [] and [c.job for c in decision.wait_cuts] == ["late"]


def test_a_stop_waiting_for_a_checkpoint_is_called_off_once_its_preemptor_runs_in_gpus_freed_otherwise():
    # Given a low job whose stop waits for its checkpoint, made for a medium job of 8 GPUs,
    # and 8 GPUs a run's end just freed
    snap = snapshot(16).running(_late(preempted_for="med")).pending(pending("med", 200, 8, submitted_at=NOW - 60, nominated_at=NOW - 30)).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then the medium job is admitted into the free GPUs, and the stop nobody waits for is
    # called off, naming the job it was made for
    assert admitted(decision) == ["med"]
    assert [(c.job, c.pool) for c in decision.call_offs] == [("late", "p5")] and decision.wait_cuts == ()
    [line] = [e for e in decision.explanations if e.job == "late"]
    assert (line.verdict, line.reason, line.for_job) == (Verdict.SPARE, Reason.PREEMPTION_NO_LONGER_NEEDED, "med")
    assert decision.to_dict()["call_off"][0]["job"] == "late"
    # And while the medium job still waits for those GPUs, the stop goes on
    full = replace(snap, pools=(Pool("p5", 8),))
    assert plan(full, DEFAULT, NOW).call_offs == ()


def test_a_stop_waiting_for_a_checkpoint_is_neither_kept_nor_cut_for_a_job_that_may_not_preempt_its_victim():
    # Given a low job whose stop waits for its checkpoint, made for a medium job now running
    # elsewhere, and a low job of its own priority (which may not preempt it) that would
    # take its GPUs: under an escalated low job, a wait is always cut for the job waiting
    other = pending("other-low", 50, 8, submitted_at=NOW - 60, escalated=True)
    snap = snapshot(8).running(_late(preempted_for="med")).pending(other).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then its stop is called off, not cut short for the low job
    assert [c.job for c in decision.call_offs] == ["late"] and decision.wait_cuts == ()
    # And a stop for a spot interruption or a cancel (made for no job) is never called off
    spot = replace(snap, running=(_late(),))
    assert plan(spot, DEFAULT, NOW).call_offs == ()


def test_a_stop_about_to_go_is_called_off_too_when_its_preemptor_ran_elsewhere_and_kept_while_it_waits():
    # Given a low job being stopped for a medium job, its stop not sent yet and waiting for
    # no checkpoint (a fresh one: it goes at once), and 8 GPUs a run's end just freed
    about_to_go = running("going", 50, 8, started_at=NOW - 3600, last_checkpoint_at=NOW - 60, stopping=True, preempted_for="med")
    snap = snapshot(16).running(about_to_go).pending(pending("med", 200, 8, submitted_at=NOW - 60, nominated_at=NOW - 30)).build()
    # When planning, then the medium job runs in the free GPUs and the stop is called off
    decision = plan(snap, DEFAULT, NOW)
    assert admitted(decision) == ["med"] and [c.job for c in decision.call_offs] == ["going"]
    # And while the medium job still needs its GPUs, or once its stop is sent, it goes on
    assert plan(replace(snap, pools=(Pool("p5", 8),)), DEFAULT, NOW).call_offs == ()
    sent = replace(snap, running=(replace(about_to_go, preempted_for=None),))
    assert plan(sent, DEFAULT, NOW).call_offs == ()


def test_a_stop_reclaiming_borrowed_quota_is_kept_for_its_reclaimer_whatever_their_priorities():
    # Given production's nominal quota is the pool and research runs on borrowed quota; a
    # medium research job whose stop waits for a checkpoint, reclaimed by production's job,
    # lowered since to low (a job being stopped no longer counts against its quota)
    late = running(
        "late", 200, 8, team="research", started_at=NOW - 3600, stopping=True, stop_awaits_checkpoint=True,
        checkpoint_requested_at=NOW - 60, preempted_for="prod",
    )
    snap = snapshot(8).running(late).pending(pending("prod", 50, 8, team="production", submitted_at=NOW - 60, nominated_at=NOW - 30)).build()
    reclaiming = make_policy(quotas=[quota("production", 8), quota("research", 0, borrowing=8)])
    # When planning, then the reclaim goes on: the reclaimer waits for its GPUs
    assert plan(snap, reclaiming, NOW).call_offs == ()
    # While without quotas a low job may not stop a medium one: the stop is called off
    assert [c.job for c in plan(snap, make_policy(), NOW).call_offs] == ["late"]


def test_a_preemptor_that_needs_only_part_of_the_gpus_being_freed_keeps_the_stops_it_waits_on_and_no_more():
    # Given two stops waiting for checkpoints, made for one critical job of 16 GPUs, which
    # now needs only 8 (8 GPUs freed otherwise)
    first = _late("late-1", checkpoint_requested_at=NOW - 300, preempted_for="crit")  # 300 s left: soonest
    second = _late("late-2", preempted_for="crit")  # 540 s left
    snap = snapshot(24).running(first, second).pending(pending("crit", 1000, 16, submitted_at=NOW - 60, nominated_at=NOW - 30)).build()
    # When planning
    decision = plan(snap, DEFAULT, NOW)
    # Then it waits on the stop that frees its GPUs soonest, and the other is called off
    assert [c.job for c in decision.call_offs] == ["late-2"]
    assert [c.job for c in decision.wait_cuts] == ["late-1"]


@pytest.mark.parametrize(
    "knobs",
    [{}, {"budget": {"window_s": 3600, "max_preemptions": 5}}, {"tier_preemption_delay_s": {"critical": 0, "high": 300}}],
    ids=["no-delay", "budget-only", "tier-delay-0"],
)
def test_a_zero_preemption_delay_holds_no_job_whose_clock_ran_ahead(knobs):
    # Given a critical job submitted half a second "after" the plan's clock (another
    # Lambda's clock, a little ahead), no preemption delay for it, and a low job to preempt
    snap = (
        snapshot(16)
        .running(running("low", 50, 16, started_at=NOW - 5000, last_checkpoint_at=NOW - 10))
        .pending(pending("crit", 1000, 8, submitted_at=NOW + 0.5))
        .build()
    )
    decision = plan(snap, Policy(**knobs), NOW)
    # Then it preempts now: there is no delay to serve, however its clock stood
    assert victims(decision) == ["low"]
    assert not [e for e in decision.explanations if e.reason is Reason.PREEMPTION_DELAYED]


def _cycles_left(make) -> int:
    """Objects `make()` built and dropped that only the cyclic collector could free: with
    the collector off, what it allocates stays in the youngest generation, so collecting
    that generation alone (fast, however large the test process's heap) finds them."""
    gc.disable()
    try:
        gc.collect(0)  # what was young before is collected or moves on
        made = make()
        del made
        return gc.collect(0)
    finally:
        gc.enable()


@settings(max_examples=60, deadline=None)
@given(rich_snapshots(max_pending=12), rich_policies())
def test_a_plan_makes_no_reference_cycles_and_gives_the_collector_back(snap, policy_):
    # plan() pauses the cyclic collector while it plans: that is sound only while a plan's
    # garbage is freed by reference counting alone
    assert _cycles_left(lambda: plan(snap, policy_, NOW)) == 0
    # And a plan run with the collector on leaves it on, and one with it off leaves it off
    plan(snap, policy_, NOW)
    assert gc.isenabled()
    gc.disable()
    try:
        plan(snap, policy_, NOW)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_bench_snapshot_plans_without_reference_cycles():
    # The worst case of `bench_plan` (2,000 pending of it), under every costly knob and the defaults
    from preemptor_tools.bench_plan import NOW as BENCH_NOW, build

    snap, every_knob = build(2000, 400, 4, 7)
    for policy_ in (every_knob, DEFAULT):
        assert plan(snap, policy_, BENCH_NOW).preemptions
        assert _cycles_left(lambda: plan(snap, policy_, BENCH_NOW)) == 0


def test_the_cycle_check_sees_a_cycle():
    # The check itself: a plan that left a cycle behind would be caught
    snap = snapshot(8).running(running("low", 50, 8)).pending(pending("crit", 1000, 8)).build()

    def leaky():
        loop: list = [plan(snap, DEFAULT, NOW)]
        loop.append(loop)
        return None

    assert _cycles_left(leaky) >= 1


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=0, max_size=12),
    priorities=st.lists(st.sampled_from([50, 200, 500]), min_size=12, max_size=12),
    need=st.integers(0, 64),
    available=st.integers(0, 16),
)
def test_a_walk_without_a_quota_is_the_plain_capacity_test(sizes, priorities, need, available):
    # A walk for a preemptor with no quota bucket tests `need <= GPUs` inline (`fits` None):
    # it must choose, drop and report what the quota test without a bucket gives
    from functools import partial

    from preemptor.core.quotas import Quotas
    from preemptor.core.victims import Candidates, Eligibility, walk

    jobs = [running(f"r{i}", priority=priorities[i], gpus=g, started_at=float(i)) for i, g in enumerate(sizes)]
    claimed = {v.name: v.priority for v in jobs}
    quotas = Quotas((), Policy(), jobs, claimed)

    def judge(v):
        ok = v.priority < 500
        return Eligibility(PreemptionRule.LOWER_PRIORITY if ok else None, Reason.LOWER_PRIORITY_VICTIM if ok else Reason.NOT_LOWER_PRIORITY, v.name)

    def choice(fits):
        cands = Candidates(False, lambda v: (claimed[v.name], v.name), jobs, set(), claimed)
        scans = (((True, None), float("inf")), ((False, None), 200.0))
        c = walk(scans, cands, claimed, judge, fits, quotas.bucket_of, available, by_priority=True, fill_back=True, need=need)
        return c.victims, c.skipped, c.dropped, c.fits, c.short_of, c.scanned

    assert choice(None) == choice(partial(quotas.fits, None, need))


@pytest.mark.parametrize("reclaim_mode", list(ReclaimMode))
@pytest.mark.parametrize("mode", list(PreemptionMode))
@pytest.mark.parametrize("same_team", [True, False])
def test_eligibility_inlines_the_mode_rule_and_a_rule_judged_again_still_permits_what_it_would(reclaim_mode, mode, same_team):
    # `eligibility` inlines `mode_rule` for speed: without quotas, its rule is the mode's
    # rule for every priority pair and start/submission order, ties included. And
    # `still_permits`, which judges a victim again by the rule that chose it (its
    # preemptor's priority changed since), permits exactly what `eligibility` (protections
    # aside) would choose under that rule
    from preemptor.core.ranking import RankedJob
    from preemptor.core.victims import eligibility, mode_rule, still_permits

    knobs = Policy(within_team=mode.value, across_teams=mode.value, reclaim_within_pool=reclaim_mode.value).for_pool("p5")
    for pj in (50, 200):
        for pv in (50, 200, 500):
            for started, submitted in ((100.0, 200.0), (200.0, 200.0), (300.0, 200.0)):
                r = RankedJob(pending("p", priority=pj, team="t1", submitted_at=submitted), pj, pj, 0.0, pj)
                v = running("v", priority=pv, team="t1" if same_team else "t2", started_at=started)
                # by priority (no quotas): the mode's rules
                by_mode = eligibility(r, v, pv, knobs, False, False, False)
                assert by_mode.rule == mode_rule(mode, pj, submitted, pv, started)
                for rule in (PreemptionRule.LOWER_PRIORITY, PreemptionRule.NEWER_EQUAL_PRIORITY, None):
                    assert still_permits(rule, knobs, same_team, pj, submitted, pv, started) == (by_mode.rule is not None)
                if same_team:
                    continue
                # another team's borrowed work, reclaimed by a job within its nominal quota
                reclaimed = eligibility(r, v, pv, knobs, True, True, reclaim_mode is not ReclaimMode.NEVER)
                assert still_permits(PreemptionRule.RECLAIM_BORROWED, knobs, False, pj, submitted, pv, started) == (
                    reclaimed.rule is PreemptionRule.RECLAIM_BORROWED
                )


@pytest.mark.parametrize("awaits_checkpoint", [False, True], ids=["about-to-go", "waiting-for-its-checkpoint"])
def test_a_stop_that_frees_its_preemptors_quota_is_kept_though_as_many_gpus_are_free(awaits_checkpoint: bool):
    # Given research's critical job of 16 GPUs, for which research's medium job of 32 is
    # being stopped (its stop not sent yet), and 16 GPUs free, 4 of which applied keeps
    # unlent (nominal 40, lending limit 20, 16 in use): it may take 12 of them
    waits = {"stop_awaits_checkpoint": True, "checkpoint_requested_at": NOW - 60, "last_checkpoint_at": NOW - 3000}
    going = running(
        "going", 200, 32, team="research", started_at=NOW - 3600, stopping=True, preempted_for="crit",
        **(waits if awaits_checkpoint else {"last_checkpoint_at": NOW - 60}),
    )
    busy = running("busy", 500, 16, team="applied", started_at=NOW - 3600)
    crit = pending("crit", 1000, 16, team="research", submitted_at=NOW - 600, nominated_at=NOW - 1)
    snap = snapshot(64).running(going, busy).pending(crit).build()
    quotas = make_policy(quotas=[quota("research", 16, borrowing=16), quota("applied", 40, lending=20), quota("production", 8, borrowing=0)])
    # When planning
    decision = plan(snap, quotas, NOW)
    # Then it waits for 4 of the victim's GPUs, and the stop goes on (before: it held the 16
    # free GPUs, the stop was called off as nobody's, and the next plan chose the victim
    # again: a stop waiting for its checkpoint could be called off by every plan, and the
    # critical job wait as long; chaos sweep sagemaker knobs seed 618)
    assert admitted(decision) == [] and decision.call_offs == ()
    [line] = [e for e in decision.explanations if e.job == "crit" and e.verdict is Verdict.WAIT]
    assert (line.reason, line.detail) == (Reason.WAITING_FOR_PREEMPTED_CAPACITY, "4 of its 16 GPUs are held by jobs being stopped")
    # And once it has stopped, the critical job runs in GPUs its quota may take
    stopped = snapshot(64).running(busy).pending(crit).build()
    assert admitted(plan(stopped, quotas, NOW)) == ["crit"]
