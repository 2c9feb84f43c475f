"""Every policy knob, one table row each: what the planner does with and without it."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pydantic import ValidationError

from builders import pending, policy, quota, running, snapshot
from preemptor_tools.cli import main
from preemptor.core.model import Reason, Snapshot, Verdict
from preemptor.core.planner import plan, rank_pool
from preemptor.core.policy import DEFAULT_TIERS, Policy, PoolPolicy, PreemptionMode

NOW = 100_000.0
H = 3600.0


@dataclass
class Case:
    """Given `snap` under `knobs`, when planning at NOW, then these happen (None: not checked)."""

    knobs: dict
    snap: Snapshot
    admit: list[str] | None = None
    victims: list[str] | None = None
    reasons: dict[str, Reason] = field(default_factory=dict)
    failed: list[str] | None = None


def _main_reasons(decision) -> dict[str, Reason]:
    """The reason of each job's own line (not the lines where it is a candidate victim)."""
    return {e.job: e.reason for e in decision.explanations if e.for_job is None and e.verdict is not Verdict.RANK}


def _check(case: Case):
    decision = plan(case.snap, policy(**case.knobs), NOW)
    if case.admit is not None:
        assert [a.job for a in decision.admits] == case.admit
    if case.victims is not None:
        assert [p.victim for p in decision.preemptions] == case.victims
    if case.failed is not None:
        assert [f.job for f in decision.failures] == case.failed
    reasons = _main_reasons(decision)
    for job, reason in case.reasons.items():
        assert reasons.get(job) is reason, (job, reasons.get(job), decision.explanations)
    return decision


# A full 8-GPU pool with one low job, and a critical job that needs it.
def _full(victim_kw: dict | None = None, job_kw: dict | None = None) -> Snapshot:
    victim = {"priority": 50, "gpus": 8, "started_at": 0, "last_checkpoint_at": NOW - 60, **(victim_kw or {})}
    job = {"priority": 1000, "gpus": 8, "submitted_at": NOW - 600, **(job_kw or {})}
    return snapshot(8).running(running("victim", **victim)).pending(pending("crit", **job)).build()


RANKING = [
    # -- aging ---------------------------------------------------------------------------
    pytest.param(
        Case({"aging": {"rate_per_hour": 10, "starving_after_s": None}},
             snapshot(8).pending(pending("old-60", 60, submitted_at=NOW - 2 * H), pending("new-70", 70, submitted_at=NOW)).build(),
             admit=["old-60"]),
        id="aging-lifts-a-waiting-job-over-a-newer-higher-one",
    ),
    pytest.param(
        Case({},
             snapshot(8).pending(pending("old-60", 60, submitted_at=NOW - 2 * H), pending("new-70", 70, submitted_at=NOW)).build(),
             admit=["new-70"]),
        id="aging-off-priority-decides",
    ),
    pytest.param(
        Case({"aging": {"rate_per_hour": 10, "starving_after_s": None}},
             snapshot(8).pending(pending("old-low", 50, submitted_at=NOW - 100 * H), pending("new-medium", 200, submitted_at=NOW)).build(),
             admit=["new-medium"]),
        id="aging-capped-below-the-next-tier",
    ),
    pytest.param(
        Case({"aging": {"rate_per_hour": 10, "cap": "none", "starving_after_s": None}},
             snapshot(8).pending(pending("old-low", 50, submitted_at=NOW - 100 * H), pending("new-medium", 200, submitted_at=NOW)).build(),
             admit=["old-low"]),
        id="aging-uncapped-crosses-tiers",
    ),
    pytest.param(
        Case({"aging": {"rate_per_hour": 10, "starving_after_s": None}},
             snapshot(16).running(running("peer", 1000, 8)).pending(
                 pending("big-low", 50, 16, submitted_at=NOW - 48 * H), pending("small-low", 50, 8, submitted_at=NOW)).build(),
             admit=["small-low"], reasons={"big-low": Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS}),
        id="starvation-guard-off-small-jobs-backfill",
    ),
    pytest.param(
        Case({"aging": {"rate_per_hour": 10, "starving_after_s": 24 * H}},
             snapshot(16).running(running("peer", 1000, 8)).pending(
                 pending("big-low", 50, 16, submitted_at=NOW - 48 * H), pending("small-low", 50, 8, submitted_at=NOW)).build(),
             admit=[], reasons={"big-low": Reason.STARVATION_RESERVATION, "small-low": Reason.BLOCKED_BY_HIGHER_RANKED}),
        id="starvation-guard-reserves-free-capacity",
    ),
    # -- fair share ----------------------------------------------------------------------
    pytest.param(
        Case({"fair_share": {"enabled": True}},
             snapshot(8).usage("heavy", 1e6, NOW).pending(
                 pending("heavy-job", 200, team="heavy", submitted_at=0), pending("light-job", 200, team="light", submitted_at=10)).build(),
             admit=["light-job"]),
        id="fair-share-lower-usage-first",
    ),
    pytest.param(
        Case({},
             snapshot(8).usage("heavy", 1e6, NOW).pending(
                 pending("heavy-job", 200, team="heavy", submitted_at=0), pending("light-job", 200, team="light", submitted_at=10)).build(),
             admit=["heavy-job"]),
        id="fair-share-off-fifo",
    ),
    pytest.param(
        Case({"fair_share": {"enabled": True, "half_life_s": 600}},
             snapshot(8).usage("old", 1e6, 0).usage("recent", 1000, NOW).pending(
                 pending("recent-job", 200, team="recent", submitted_at=0), pending("old-job", 200, team="old", submitted_at=10)).build(),
             admit=["old-job"]),
        id="fair-share-short-half-life-forgets-old-usage",
    ),
    pytest.param(
        Case({"fair_share": {"enabled": True, "half_life_s": 7 * 24 * H}},
             snapshot(8).usage("old", 1e6, 0).usage("recent", 1000, NOW).pending(
                 pending("recent-job", 200, team="recent", submitted_at=0), pending("old-job", 200, team="old", submitted_at=10)).build(),
             admit=["recent-job"]),
        id="fair-share-long-half-life-remembers",
    ),
    pytest.param(
        Case({"fair_share": {"enabled": True}},
             snapshot(16).running(running("busy-run", 500, 8, team="busy", pool="p4")).pool("p4", 8).pending(
                 pending("busy-job", 200, team="busy", submitted_at=0), pending("idle-job", 200, team="idle", submitted_at=10)).build(),
             admit=["idle-job", "busy-job"]),
        id="fair-share-counts-running-jobs",
    ),
    # -- cost rules ----------------------------------------------------------------------
    pytest.param(
        Case({"tier_max_sla_s": {"critical": H}},
             _full({"priority": 500}),
             victims=[], reasons={"crit": Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS}),
        id="sla-rule-caps-critical-without-sla-to-high",
    ),
    pytest.param(
        Case({"tier_max_sla_s": {"critical": H}}, _full({"priority": 500}, {"sla_s": 1800}), victims=["victim"]),
        id="sla-rule-lets-critical-with-short-sla-preempt",
    ),
    pytest.param(
        Case({"tier_max_sla_s": {"critical": H}}, _full({"priority": 500}, {"sla_s": 2 * H}), victims=[]),
        id="sla-rule-long-sla-is-capped",
    ),
    pytest.param(
        Case({}, _full({"priority": 200}, {"spot": True}), victims=[]),
        id="spot-job-claims-low-by-default",
    ),
    pytest.param(
        Case({"spot_max_priority": None}, _full({"priority": 200}, {"spot": True}), victims=["victim"]),
        id="spot-cap-off",
    ),
    pytest.param(
        Case({}, _full({"priority": 1000, "spot": True}, {"priority": 200}), victims=["victim"]),
        id="spot-running-job-counts-as-low",
    ),
]


@pytest.mark.parametrize("case", RANKING)
def test_ranking_knobs(case):
    _check(case)


def _two_teams(*run, pend) -> Snapshot:
    return snapshot(16).running(*run).pending(*pend).build()


QUOTAS = [
    pytest.param(
        Case({"quotas": [quota("a", 8), quota("b", 8)]},
             _two_teams(pend=[pending("a-big", 50, 16, team="a")]),
             admit=["a-big"], reasons={"a-big": Reason.BORROWS_IDLE_QUOTA}),
        id="quota-borrows-idle-quota",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8, borrowing=4), quota("b", 8)]},
             _two_teams(pend=[pending("a-big", 50, 16, team="a")]),
             admit=[], reasons={"a-big": Reason.OVER_QUOTA}),
        id="quota-borrowing-limit",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8), quota("b", 8, lending=0)]},
             _two_teams(pend=[pending("a-big", 50, 16, team="a")]),
             admit=[], reasons={"a-big": Reason.OVER_QUOTA}),
        id="quota-lending-limit-keeps-gpus",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8), quota("b", 8, lending=4)]},
             _two_teams(pend=[pending("a-12", 50, 12, team="a")]),
             admit=["a-12"]),
        id="quota-lending-limit-lends-the-rest",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8, tier="critical"), quota("a", 0, borrowing=0)]},
             _two_teams(pend=[pending("a-low", 50, 8, team="a"), pending("a-crit", 1000, 8, team="a")]),
             admit=["a-crit"], reasons={"a-low": Reason.OVER_QUOTA}),
        id="quota-per-tier",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8), quota("b", 8)]},
             _two_teams(running("a-old", 1000, 8, team="a", started_at=0), running("a-new", 1000, 8, team="a", started_at=100),
                        pend=[pending("b-job", 50, 8, team="b")]),
             victims=["a-new"], reasons={"b-job": Reason.RECLAIMS_BORROWED}),
        id="reclaim-any-takes-back-borrowed-quota-whatever-its-priority",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8), quota("b", 8)], "reclaim_within_pool": "LowerPriority"},
             _two_teams(running("a-old", 1000, 8, team="a", started_at=0), running("a-new", 1000, 8, team="a", started_at=100),
                        pend=[pending("b-job", 50, 8, team="b")]),
             victims=[]),
        id="reclaim-lower-priority-spares-higher-borrowers",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8), quota("b", 8)], "reclaim_within_pool": "Never"},
             _two_teams(running("a-old", 50, 8, team="a", started_at=0), running("a-new", 50, 8, team="a", started_at=100),
                        pend=[pending("b-job", 50, 8, team="b")]),
             victims=[]),
        id="reclaim-never",
    ),
    pytest.param(
        Case({"quotas": [quota("a", 8), quota("b", 8)]},
             _two_teams(running("b-run", 50, 8, team="b"), running("a-run", 1000, 8, team="a"),
                        pend=[pending("a-crit", 1000, 8, team="a")]),
             victims=[], reasons={"a-crit": Reason.NO_CAPACITY_NO_ELIGIBLE_VICTIMS}),
        id="quota-guarantees-other-teams-nominal-work",
    ),
    pytest.param(
        Case({},
             _two_teams(running("b-run", 50, 8, team="b"), running("a-run", 1000, 8, team="a"),
                        pend=[pending("a-crit", 1000, 8, team="a")]),
             victims=["b-run"]),
        id="no-quotas-priority-alone-decides",
    ),
]


@pytest.mark.parametrize("case", QUOTAS)
def test_quota_knobs(case):
    _check(case)


def _team_snap(victim_team: str, victim_priority: int, victim_started: float = 500.0) -> Snapshot:
    return (
        snapshot(8)
        .running(running("victim", victim_priority, 8, team=victim_team, started_at=victim_started))
        .pending(pending("job", 500, 8, team="a", submitted_at=100))
        .build()
    )


MODES = [
    pytest.param("within_team", "Never", "a", 50, [], id="within-team-never"),
    pytest.param("within_team", "LowerPriority", "a", 50, ["victim"], id="within-team-lower-priority"),
    pytest.param("within_team", "LowerPriority", "a", 500, [], id="within-team-lower-priority-spares-equal"),
    pytest.param("within_team", "LowerOrNewerEqualPriority", "a", 500, ["victim"], id="within-team-newer-equal"),
    pytest.param("across_teams", "Never", "b", 50, [], id="across-teams-never"),
    pytest.param("across_teams", "LowerPriority", "b", 50, ["victim"], id="across-teams-lower-priority"),
    pytest.param("across_teams", "LowerPriority", "b", 500, [], id="across-teams-lower-priority-spares-equal"),
    pytest.param("across_teams", "LowerOrNewerEqualPriority", "b", 500, ["victim"], id="across-teams-newer-equal"),
    pytest.param("across_teams", "Never", "a", 50, ["victim"], id="across-teams-never-leaves-own-team-alone"),
]


@pytest.mark.parametrize("knob, mode, victim_team, victim_priority, expected", MODES)
def test_preemption_modes(knob, mode, victim_team, victim_priority, expected):
    # Given a full pool and a priority-500 job of team a
    snap = _team_snap(victim_team, victim_priority)
    # When planning under the mode, then only the victims it allows are stopped
    decision = plan(snap, policy(**{knob: mode}), NOW)
    assert [p.victim for p in decision.preemptions] == expected


def test_newer_equal_spares_an_older_equal_job():
    # Given an equal-priority victim that started before the preemptor was submitted
    snap = _team_snap("a", 500, victim_started=50)
    decision = plan(snap, policy(within_team=PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY), NOW)
    # Then it is not newer, so it is spared
    assert decision.preemptions == ()


PROTECTIONS = [
    pytest.param(Case({"min_runtime_s": 600}, _full({"started_at": NOW - 100}), victims=[]), id="min-runtime-protects"),
    pytest.param(Case({"min_runtime_s": 600}, _full({"started_at": NOW - 700}), victims=["victim"]), id="min-runtime-elapsed"),
    pytest.param(
        Case({"near_completion": {"remaining_s": 300}}, _full({"started_at": NOW - 3500, "expected_duration_s": 3600}), victims=[]),
        id="near-completion-remaining-time-protects",
    ),
    pytest.param(
        Case({"near_completion": {"remaining_s": 300}}, _full({"started_at": NOW - 3000, "expected_duration_s": 3600}), victims=["victim"]),
        id="near-completion-remaining-time-too-long",
    ),
    pytest.param(
        Case({"near_completion": {"remaining_s": 300}}, _full({"started_at": NOW - 4000, "expected_duration_s": 3600}), victims=["victim"]),
        id="near-completion-overrun-estimate-does-not-protect",
    ),
    pytest.param(
        Case({"near_completion": {"progress": 0.9}}, _full({"progress": 0.95}), victims=[]),
        id="near-completion-reported-progress-protects",
    ),
    pytest.param(
        Case({"near_completion": {"progress": 0.9}}, _full({"started_at": NOW - 50, "expected_duration_s": 1000, "work_done_s": 900}), victims=[]),
        id="near-completion-derived-progress-counts-earlier-runs",
    ),
    pytest.param(
        Case({"near_completion": {"progress": 0.9}}, _full({"progress": 0.5}), victims=["victim"]),
        id="near-completion-progress-too-low",
    ),
    # A managed-spot run held interrupted (or back from it) did no work meanwhile: 3,000 s
    # worked of 3,600 (600 s left), not 3,500 (100 s left)
    pytest.param(
        Case({"near_completion": {"remaining_s": 300}},
             _full({"started_at": NOW - 3500, "expected_duration_s": 3600, "paused": True, "paused_at": NOW - 500}), victims=["victim"]),
        id="near-completion-not-while-managed-spot-holds-it-interrupted",
    ),
    pytest.param(
        Case({"near_completion": {"remaining_s": 300}},
             _full({"started_at": NOW - 3500, "expected_duration_s": 3600, "work_since": NOW - 100, "idle_s": 400}), victims=["victim"]),
        id="near-completion-not-counting-the-managed-spot-pause",
    ),
    pytest.param(Case({"max_preemptions": 3}, _full({"preemptions": 3}), victims=[]), id="max-preemptions-protects"),
    pytest.param(Case({"max_preemptions": 3}, _full({"preemptions": 2}), victims=["victim"]), id="max-preemptions-not-reached"),
    pytest.param(
        Case({"max_preemptions": 3, "on_max_preemptions": "fail"}, _full({"preemptions": 3}), victims=["victim"]),
        id="max-preemptions-fail-does-not-protect",
    ),
    pytest.param(
        Case({"max_preemptions": 3, "on_max_preemptions": "fail"},
             snapshot(8).pending(pending("tired", 50, 8, preemptions=3), pending("fresh", 50, 8, submitted_at=1)).build(),
             admit=["fresh"], failed=["tired"], reasons={"tired": Reason.MAX_PREEMPTIONS_EXCEEDED}),
        id="max-preemptions-fail-fails-the-requeued-job",
    ),
]


@pytest.mark.parametrize("case", PROTECTIONS)
def test_protection_knobs(case):
    decision = _check(case)
    if case.victims == []:
        # Then the protected job is listed with the rule that protects it
        assert any(e.job == "victim" and e.verdict is Verdict.SPARE for e in decision.explanations)


RATE_LIMITS = [
    pytest.param(
        Case({"budget": {"window_s": H, "max_preemptions": 2}}, snapshot(8).preempted(NOW - 100).preempted(NOW - 200).build(), victims=[]),
        id="budget-history-only",
    ),
    pytest.param(
        Case({"budget": {"window_s": H, "max_preemptions": 2}},
             snapshot(8).running(running("victim", 50, 8)).pending(pending("crit", 1000, 8)).preempted(NOW - 100).preempted(NOW - 200).build(),
             victims=[], reasons={"crit": Reason.BUDGET_EXHAUSTED}),
        id="budget-count-exhausted",
    ),
    pytest.param(
        Case({"budget": {"window_s": H, "max_preemptions": 2}},
             snapshot(8).running(running("victim", 50, 8)).pending(pending("crit", 1000, 8)).preempted(NOW - 100).preempted(NOW - 2 * H).build(),
             victims=["victim"]),
        id="budget-old-preemptions-leave-the-window",
    ),
    pytest.param(
        Case({"budget": {"window_s": H, "max_preemptions": 2}},
             snapshot(8).running(running("victim", 50, 8)).pending(pending("crit", 1000, 8)).preempted(NOW - 100, pool="other").preempted(NOW - 200, pool="other").build(),
             victims=["victim"]),
        id="budget-is-per-pool",
    ),
    pytest.param(
        Case({"budget": {"max_gpu_hours": 4}}, _full({"last_checkpoint_at": NOW - H}), victims=[], reasons={"crit": Reason.BUDGET_EXHAUSTED}),
        id="budget-gpu-hours-exhausted",
    ),
    pytest.param(Case({"budget": {"max_gpu_hours": 4}}, _full({"last_checkpoint_at": NOW - 60}), victims=["victim"]), id="budget-gpu-hours-left"),
    pytest.param(
        Case({"preemption_delay_s": 300},
             snapshot(16).running(running("victim", 50, 16)).pending(pending("crit", 1000, 16, submitted_at=NOW - 10)).build(),
             victims=[], reasons={"crit": Reason.PREEMPTION_DELAYED}),
        id="delay-holds-preemption",
    ),
    pytest.param(
        Case({"preemption_delay_s": 300},
             snapshot(16).running(running("victim", 50, 16)).pending(pending("crit", 1000, 16, submitted_at=NOW - 400)).build(),
             victims=["victim"]),
        id="delay-elapsed",
    ),
    pytest.param(
        Case({"preemption_delay_s": 300},
             snapshot(16).running(running("victim", 50, 16)).pending(pending("crit", 1000, 16, submitted_at=0, pending_since=NOW - 10)).build(),
             victims=[], reasons={"crit": Reason.PREEMPTION_DELAYED}),
        id="delay-counts-from-pending-since",
    ),
    pytest.param(
        Case({"preemption_delay_s": 300},
             snapshot(16).running(running("victim", 50, 8)).pending(
                 pending("crit", 1000, 16, submitted_at=NOW - 10), pending("small", 50, 8, submitted_at=NOW)).build(),
             admit=[], victims=[], reasons={"crit": Reason.PREEMPTION_DELAYED}),
        id="delayed-job-holds-the-free-gpus",
    ),
]


@pytest.mark.parametrize("case", RATE_LIMITS)
def test_rate_limit_knobs(case):
    _check(case)


@pytest.mark.parametrize(
    "max_age, fresh",
    [pytest.param(60, False, id="checkpoint-older-than-limit"), pytest.param(900, True, id="checkpoint-within-limit")],
)
def test_checkpoint_freshness_limit(max_age, fresh):
    # Given a victim whose last checkpoint is 100 s old
    snap = _full({"last_checkpoint_at": NOW - 100})
    # When planning with the limit, then the preemption says whether a new checkpoint is needed
    (preemption,) = plan(snap, policy(checkpoint_max_age_s=max_age), NOW).preemptions
    assert preemption.checkpoint_fresh is fresh
    assert preemption.checkpoint_age_s == 100


@pytest.mark.parametrize(
    "pool, action",
    [pytest.param("p5", "spare", id="pool-override"), pytest.param("p4", "stop-anyway", id="default-elsewhere"), pytest.param(None, "stop-anyway", id="no-pool")],
)
def test_on_checkpoint_timeout_per_pool(pool, action):
    p = Policy(pools={"p5": {"on_checkpoint_timeout": "spare", "checkpoint_wait_max_s": 120}})
    assert p.workflow_settings(pool)["on_checkpoint_timeout"] == action


@pytest.mark.parametrize(
    "knobs, expected",
    [
        pytest.param({}, {"checkpoint_poll_s": 30, "checkpoint_attempts": 20, "stop_poll_s": 30, "stop_attempts": 30}, id="workflow-defaults"),
        pytest.param({"checkpoint_poll_s": 10, "checkpoint_wait_max_s": 60}, {"checkpoint_poll_s": 10, "checkpoint_attempts": 6}, id="checkpoint-poll-and-wait"),
        pytest.param({"checkpoint_poll_s": 60, "checkpoint_wait_max_s": 30}, {"checkpoint_attempts": 1}, id="checkpoint-wait-shorter-than-poll"),
        pytest.param({"stop_poll_s": 15, "stop_wait_max_s": 300}, {"stop_poll_s": 15, "stop_attempts": 20}, id="stop-poll-and-wait"),
    ],
)
def test_workflow_knobs_per_pool(knobs, expected):
    # Given the knobs set for p5 only, then p5's workflows loop on them and other pools on the defaults
    settings = Policy(pools={"p5": knobs}).workflow_settings("p5")
    assert {k: settings[k] for k in expected} == expected
    assert Policy(pools={"p5": knobs}).workflow_settings("p4") == Policy().workflow_settings()


def test_pool_overrides_apply_to_their_pool_only():
    # Given a minimum runtime only in p5, and the same situation in p5 and p4
    p = policy(pools={"p5": {"min_runtime_s": 3600}})
    snap = (
        snapshot(8).pool("p4", 8)
        .running(running("v5", 50, 8, started_at=NOW - 60), running("v4", 50, 8, pool="p4", started_at=NOW - 60))
        .pending(pending("c5", 1000, 8), pending("c4", 1000, 8, pool="p4"))
        .build()
    )
    # When planning, then only p4's victim is stopped
    assert [x.victim for x in plan(snap, p, NOW).preemptions] == ["v4"]


def test_pool_override_merges_object_knobs_key_by_key():
    p = Policy(budget={"window_s": 600, "max_preemptions": 5}, pools={"p5": {"budget": {"max_preemptions": 1}}})
    assert p.for_pool("p5").budget.window_s == 600 and p.for_pool("p5").budget.max_preemptions == 1
    assert p.for_pool("elsewhere").budget.max_preemptions == 5


def test_custom_tiers_drive_aging_caps_and_names():
    # Given tiers named differently
    p = Policy(tiers={"Gold": 900, "Bronze": 100}, aging={"rate_per_hour": 100, "starving_after_s": None}, fair_share={"enabled": False})
    assert p.tier_of(950) == "gold" and p.tier_of(100) == "bronze" and p.tier_of(5) == "below-bronze"
    assert p.priority_value("GOLD") == 900
    # When a bronze job waits 20 hours, then it ages up to 899, below gold
    (ranked,) = rank_pool([pending("j", 100, submitted_at=NOW - 20 * H)], p.for_pool("p5"), p, NOW, {})
    assert (ranked.claimed, ranked.effective) == (100, 899)


def test_defaults_match_the_issue():
    # Given no policy file, then LowerPriority within and across teams, no min runtime, no budget, no delay
    p = Policy()
    assert p.tiers == dict(DEFAULT_TIERS)
    assert (p.within_team, p.across_teams) == (PreemptionMode.LOWER_PRIORITY, PreemptionMode.LOWER_PRIORITY)
    assert p.min_runtime_s == 0 and p.budget is None and p.preemption_delay_s == 0 and p.quotas == ()
    assert p.for_pool("any") == p.for_pool("other")


@pytest.mark.parametrize(
    "config, message",
    [
        pytest.param({"pools": {"p5": {"bogus": 1}}}, "unknown knob", id="unknown-pool-knob"),
        pytest.param({"bogus": 1}, "Extra inputs", id="unknown-top-level-knob"),
        pytest.param({"tier_max_sla_s": {"platinum": 60}}, "unknown tier", id="sla-rule-unknown-tier"),
        pytest.param({"tier_max_sla_s": {"critical": 0}}, "must be positive", id="sla-rule-non-positive"),
        pytest.param({"spot_max_priority": "nope"}, "unknown tier", id="spot-cap-unknown-tier"),
        pytest.param({"spot_max_priority": 5000}, "outside", id="spot-cap-out-of-range"),
        pytest.param({"quotas": [quota("a", 8, lending=9)]}, "lending_limit", id="lending-above-nominal"),
        pytest.param({"quotas": [quota("a", 8), quota("a", 4)]}, "repeated", id="duplicate-quota"),
        pytest.param({"quotas": [quota("a", 8, tier="gold")]}, "unknown tier", id="quota-unknown-tier"),
        pytest.param({"pools": {"p5": {"min_runtime_s": -1}}}, "pools.p5", id="invalid-pool-value"),
        pytest.param({"within_team": "Sometimes"}, "within_team", id="unknown-mode"),
        pytest.param({"near_completion": {"progress": 1.5}}, "progress", id="progress-above-one"),
        pytest.param({"tiers": {"x": 2000}}, "outside", id="tier-out-of-range"),
        # Not a number, or an infinity (JSON's 1e999 reads as one): an infinite aging rate
        # made every plan an OverflowError; an infinite time protects or delays forever.
        pytest.param({"aging": {"rate_per_hour": float("inf")}}, "aging.rate_per_hour\n  Input should be a finite number", id="aging-rate-infinite"),
        pytest.param({"min_runtime_s": float("nan")}, "min_runtime_s\n  Input should be a finite number", id="min-runtime-nan"),
        pytest.param({"tier_preemption_delay_s": {"high": float("inf")}}, "tier_preemption_delay_s.high\n  Input should be a finite number", id="tier-delay-infinite"),
        pytest.param({"tier_max_sla_s": {"critical": float("nan")}}, "tier_max_sla_s.critical\n  Input should be a finite number", id="sla-rule-nan"),
        pytest.param({"budget": {"max_gpu_hours": float("inf")}}, "budget.max_gpu_hours\n  Input should be a finite number", id="budget-infinite"),
        pytest.param({"pools": {"p5": {"checkpoint_max_age_s": float("inf")}}}, "pools.p5: (.|\n)*checkpoint_max_age_s\n  Input should be a finite number", id="pool-value-infinite"),
    ],
)
def test_invalid_policies_are_rejected_with_the_knob_named(config, message):
    with pytest.raises(ValidationError, match=message):
        Policy(**config)


def test_a_deployed_policy_with_an_infinite_knob_is_refused_as_it_is_read():
    # Given the stack's PolicyConfig as the functions read it: 1e999 is valid JSON, and an infinity
    from preemptor.config import Settings

    env = {"JOBS_TABLE": "jobs", "POLICY_CONFIG": '{"aging": {"rate_per_hour": 1e999}}'}
    # Then reading the settings names the knob (`preemptor submit --policy` checks the same before a deploy)
    with pytest.raises(ValidationError, match="aging.rate_per_hour\n  Input should be a finite number"):
        Settings.from_env(env)
    assert Settings.from_env({**env, "POLICY_CONFIG": '{"aging": {"rate_per_hour": 10}}'}).policy.aging.rate_per_hour == 10


# -- the reference in docs/policy.md stays true --------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "policy.md").read_text()
SHOWN = re.findall(r"<!-- output: (preemptor [^>]*?) -->\n```\w+\n(.*?)\n```", DOC, re.S)


def test_every_knob_is_documented():
    knobs = set(Policy.model_fields) | set(PoolPolicy.model_fields)
    assert not {k for k in knobs if f"`{k}" not in DOC}


def test_example_policy_is_the_documented_one():
    documented = json_block_after("## A complete example")
    assert documented == json.loads((ROOT / "examples" / "policy.json").read_text())
    Policy(**documented)


def json_block_after(heading: str) -> dict:
    section = DOC[DOC.index(heading):]
    return json.loads(re.search(r"```json\n(.*?)\n```", section, re.S).group(1))


@pytest.mark.parametrize("command, shown", SHOWN, ids=[c.split(" --")[0] for c, _ in SHOWN])
def test_documented_outputs_are_real(command, shown, capsys, monkeypatch):
    # Given the command shown in docs/policy.md, run from the repository root
    monkeypatch.chdir(ROOT)
    main(shlex.split(command)[1:])
    # Then it prints what the document shows
    assert capsys.readouterr().out.rstrip("\n") == shown


def test_the_document_shows_plan_and_explain():
    assert {c.split()[1] for c, _ in SHOWN} == {"plan", "explain"} and len(SHOWN) >= 5
