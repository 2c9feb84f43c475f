"""`explain_job` and `preemptor explain`: why a job waits, and who preempted it."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings

from builders import pending, policy, quota, running, snapshot
from preemptor_tools.cli import main
from preemptor.core.explain import explain_job, preemptions_from_history
from preemptor.core.planner import plan
from test_planner import rich_policies, rich_snapshots

NOW = 100_000.0


def explain(name, snap, p=None, history=None):
    p = p or policy()
    return explain_job(name, plan(snap, p, NOW), snap, p, NOW, history)


def _candidate(answer, job):
    return next(c for c in answer["pending"]["candidates"] if c["job"] == job)


def test_pending_job_position_and_victims():
    # Given two pending jobs and a pool held by a cheap and a protected job
    p = policy(min_runtime_s=600)
    snap = (
        snapshot(16)
        .running(running("cheap", 50, 8, started_at=0), running("young", 50, 8, started_at=NOW - 60))
        .pending(pending("first", 1000, 8, submitted_at=1), pending("second", 1000, 8, submitted_at=2))
        .build()
    )
    # When explaining the second
    answer = explain("second", snap, p)
    info = answer["pending"]
    # Then it is second in line, behind `first`, which took the only preemptible job
    assert answer["status"] == "pending"
    assert (info["position"], info["queue_length"], info["ahead"]) == (2, 2, ["first"])
    assert info["reason"] == "no-capacity-no-eligible-victims"
    assert _candidate(answer, "cheap")["detail"] == "chosen as a victim for first in this plan"
    assert _candidate(answer, "young")["reason"] == "min-runtime-protected"
    assert "position 2 of 2" in answer["text"] and "young" in answer["text"]


@pytest.mark.parametrize(
    "knobs, snap, reason, blocker",
    [
        pytest.param(
            {"quotas": [quota("a", 8, borrowing=0), quota("b", 8)]},
            snapshot(16).pending(pending("job", 50, 16, team="a")).build(),
            "over-quota",
            "quota a: uses 0 of nominal 8 (ceiling 8)",
            id="quota",
        ),
        pytest.param(
            {"budget": {"max_preemptions": 1}},
            snapshot(8).running(running("v", 50, 8)).pending(pending("job", 1000, 8)).preempted(NOW - 10).build(),
            "preemption-budget-exhausted",
            "budget: 1 preemptions (max 1)",
            id="budget",
        ),
        pytest.param(
            {"preemption_delay_s": 300},
            snapshot(8).running(running("v", 50, 8)).pending(pending("job", 1000, 8, submitted_at=NOW - 100)).build(),
            "preemption-delayed",
            "delay: preempts only after 200 s more",
            id="delay",
        ),
        pytest.param(
            {},
            snapshot(8).running(running("v", 500, 8)).pending(pending("job", 50, 8)).build(),
            "no-capacity-no-eligible-victims",
            "capacity: needs 8 GPUs; 0 of 8 free",
            id="capacity",
        ),
    ],
)
def test_what_is_in_the_way(knobs, snap, reason, blocker):
    # Given a pending job held back by one knob, when explained, then the knob is named
    answer = explain("job", snap, policy(**knobs))
    assert answer["pending"]["reason"] == reason
    assert any(blocker in sentence for sentence in answer["pending"]["in_the_way"]), answer["pending"]["in_the_way"]


@pytest.mark.parametrize(
    "victim_kw, knobs, eligible, reason",
    [
        pytest.param({"priority": 50}, {}, True, "lower-priority-victim", id="lower-priority"),
        pytest.param({"priority": 1000}, {}, False, "not-lower-priority", id="equal-priority"),
        pytest.param({"priority": 50, "team": "b"}, {"across_teams": "Never"}, False, "preemption-mode-never", id="mode-never"),
        pytest.param({"priority": 50, "preemptions": 2}, {"max_preemptions": 2}, False, "max-preemptions-protected", id="max-preemptions"),
        pytest.param({"priority": 50, "progress": 0.99}, {"near_completion": {"progress": 0.9}}, False, "near-completion-protected", id="near-completion"),
        pytest.param({"priority": 50, "team": "b"}, {"quotas": [quota("b", 8), quota("t1", 8)]}, False, "within-guaranteed-quota", id="guaranteed-quota"),
        pytest.param({"priority": 1000, "team": "b"}, {"quotas": [quota("b", 0), quota("t1", 24)]}, True, "borrowed-capacity-reclaimed", id="reclaim"),
        pytest.param({"priority": 50, "stopping": True}, {}, False, "already-stopping", id="stopping"),
    ],
)
def test_every_candidate_gets_its_rule(victim_kw, knobs, eligible, reason):
    snap = snapshot(16).running(running("v", gpus=8, **victim_kw), running("peer", 1000, 8)).pending(pending("job", 1000, 16)).build()
    c = _candidate(explain("job", snap, policy(**knobs)), "v")
    assert (c["eligible"], c["reason"]) == (eligible, reason)


def test_sla_capped_job_says_so():
    p = policy(tier_max_sla_s={"critical": 3600})
    snap = snapshot(8).running(running("v", 500, 8)).pending(pending("job", 1000, 8)).build()
    answer = explain("job", snap, p)
    assert answer["pending"]["claimed_priority"] == 500
    assert answer["pending"]["adjustments"][0]["reason"] == "sla-capped"
    assert "sla-capped" in answer["text"]


def test_running_job_preempted_in_this_plan():
    snap = snapshot(8).running(running("v", 50, 8, last_checkpoint_at=NOW - 120)).pending(pending("crit", 1000, 8)).build()
    answer = explain("v", snap)
    now = answer["running"]["preempted_now"]
    assert answer["status"] == "running"
    assert (now["preemptor"], now["rule"], now["checkpoint_age_s"]) == ("crit", "lower-priority", 120)
    assert "preempts it for crit under lower-priority" in answer["text"]


def test_protected_running_job():
    snap = snapshot(8).running(running("v", 50, 8, started_at=NOW - 30)).pending(pending("crit", 1000, 8)).build()
    answer = explain("v", snap, policy(min_runtime_s=600))
    assert answer["running"]["protected"]["reason"] == "min-runtime-protected"
    assert answer["running"]["preempted_now"] is None


HISTORY = [
    {"at": 100.0, "kind": "admitted", "reason": "fits-free-capacity", "detail": "", "extra": {}},
    {"at": 500.0, "kind": "preemption-started", "reason": "lower-priority-victim", "detail": "for prod",
     "extra": {"preemptor": "prod", "lost_gpu_seconds": 640.0, "checkpoint_age_s": 80.0}},
    {"at": 530.0, "kind": "checkpoint-confirmed", "reason": "fresh-checkpoint", "detail": "", "extra": {}},
    {"at": 540.0, "kind": "stop-requested", "reason": "fresh-checkpoint", "detail": "", "extra": {}},
    {"at": 600.0, "kind": "requeued", "reason": "preempted", "detail": "",
     "extra": {"preemptor": "prod", "lost_gpu_seconds": 320.0, "fresh_checkpoint": True}},
    {"at": 900.0, "kind": "preemption-started", "reason": "borrowed-capacity-reclaimed", "detail": "",
     "extra": {"preemptor": "owner", "checkpoint_age_s": None, "rule": "reclaim-borrowed"}},
    {"at": 960.0, "kind": "stop-requested", "reason": "checkpoint-timeout", "detail": "", "extra": {}},
]


def test_history_tells_who_preempted_under_which_rule_and_checkpoint_age():
    first, second = preemptions_from_history(reversed(HISTORY))
    assert (first["preemptor"], first["rule"], first["checkpoint_age_s"]) == ("prod", "lower-priority", 80.0)
    assert (first["lost_gpu_seconds"], first["fresh_checkpoint"], first["requeued_at"], first["checkpoint_confirmed"]) == (320.0, True, 600.0, True)
    assert (second["preemptor"], second["rule"], second["fresh_checkpoint"], second["requeued_at"]) == ("owner", "reclaim-borrowed", False, None)


def test_preempted_job_back_in_the_queue():
    # Given a victim requeued as pending, with its log
    snap = snapshot(8).running(running("prod", 1000, 8)).pending(pending("sweep", 50, 8, preemptions=1)).build()
    answer = explain("sweep", snap, history=HISTORY[:5])
    # Then explain says why it waits and who preempted it, how old its checkpoint was
    assert answer["status"] == "pending" and answer["preemptions"][0]["preemptor"] == "prod"
    assert "by prod under lower-priority; checkpoint age 80 s, 320 GPU-seconds lost, stopped after a fresh checkpoint" in answer["text"]


def test_unknown_job():
    answer = explain("ghost", snapshot(8).build())
    assert answer["status"] == "unknown" and "ghost" in answer["text"]


def test_trimmed_log_still_names_the_preemptor():
    (episode,) = preemptions_from_history([{"at": 5.0, "kind": "requeued", "reason": "preempted", "extra": {"preemptor": "x", "lost_gpu_seconds": 1.0}}])
    assert episode["preemptor"] == "x" and episode["lost_gpu_seconds"] == 1.0


def test_cli_explain_from_files(tmp_path, capsys):
    # Given a snapshot, a policy and a log on disk
    snap = {
        "now": 10000,
        "pools": [{"name": "p5", "gpus": 64}],
        "running": [{"name": "a", "team": "t1", "priority": "low", "pool": "p5", "gpus": 64, "started_at": 1000, "last_checkpoint_at": 9990}],
        "pending": [{"name": "x", "team": "t2", "priority": "critical", "pool": "p5", "gpus": 32, "submitted_at": 9900}],
    }
    (tmp_path / "s.json").write_text(json.dumps(snap))
    (tmp_path / "p.json").write_text(json.dumps({"preemption_delay_s": 300}))
    (tmp_path / "h.json").write_text(json.dumps(HISTORY[:5]))
    # When explaining x, then the text names the delay and the victim
    assert main(["explain", "x", "--snapshot", str(tmp_path / "s.json"), "--policy", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "preemption-delayed" in out and "a: team t1" in out
    # And --json gives the structured answer
    assert main(["explain", "a", "--snapshot", str(tmp_path / "s.json"), "--history", str(tmp_path / "h.json"), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["running"]["preempted_now"]["preemptor"] == "x" and answer["preemptions"][0]["preemptor"] == "prod"
    # And an unknown job is an error
    assert main(["explain", "nobody", "--snapshot", str(tmp_path / "s.json")]) == 1


@settings(max_examples=150, deadline=None)
@given(rich_snapshots(), rich_policies())
def test_explain_agrees_with_the_plan_and_mutates_nothing(snap, p):
    decision = plan(snap, p, NOW)
    before = copy.deepcopy(snap)
    for job in [j.name for j in snap.pending] + [j.name for j in snap.running]:
        answer = explain_job(job, decision, snap, p, NOW)
        assert answer["text"]
        if answer["status"] == "pending":
            own = next(e for e in decision.explanations if e.job == job and e.for_job is None and e.verdict.value != "rank")
            assert answer["pending"]["reason"] == own.reason.value
        json.dumps(answer)
    assert snap == before


def test_explain_says_an_unstoppable_run_is_not_a_victim_and_why():
    # Given a pool held by an adopted run the controller may not stop, and a critical job
    snap = (
        snapshot(8)
        .running(running("adopted", 50, 8, started_at=0, stoppable=False))
        .pending(pending("critical", 1000, 8, submitted_at=1))
        .build()
    )
    # When explaining the critical job and the adopted run
    waiting, adopted = explain("critical", snap), explain("adopted", snap)
    # Then the candidate list shows it as not a victim, under its own reason, counted as
    # protected; and the run's own answer says it is protected for that reason
    candidate = _candidate(waiting, "adopted")
    assert (candidate["eligible"], candidate["reason"]) == (False, "not-stoppable")
    assert "managed tag" in candidate["detail"]
    assert "0 running job(s) it may preempt (0 GPUs); 1 protected" in waiting["pending"]["in_the_way"][-1]
    assert adopted["running"]["protected"]["reason"] == "not-stoppable"
    assert "protected: not-stoppable" in adopted["text"]


def test_explain_shows_what_was_learned_and_how_the_victim_is_stopped():
    from preemptor.core.model import PendingJob, Pool, RunningJob, Snapshot
    from preemptor.core.policy import Policy

    # Given a low job seen to save on SIGTERM holding the pool, and a critical job wanting it
    snap = Snapshot(
        pools=(Pool("p", 8),),
        running=(RunningJob("saver", "t", 50, "p", 8, started_at=0.0, declares_save_on_stop=True, saves_on_stop=True),),
        pending=(PendingJob("crit", "t", 1000, "p", 8, submitted_at=90.0),),
    )
    policy = Policy()
    # When explaining the running job
    answer = explain_job("saver", plan(snap, policy, 100.0), snap, policy, 100.0)
    # Then the learned fact and the stop mode are shown
    assert answer["running"]["learned"]["saves_on_stop"] is True
    assert answer["running"]["preempted_now"]["stop"] == "saves-on-stop"
    assert "seen to save on SIGTERM" in answer["text"] and "stopped at once (saves-on-stop)" in answer["text"]


def test_a_job_waiting_on_a_stop_that_waits_for_a_checkpoint_is_told_whether_that_wait_was_cut():
    # Given a low job being stopped whose workflow waits for a checkpoint asked 60 s ago
    late = running("late", 50, 8, started_at=NOW - 3600, stopping=True, stop_awaits_checkpoint=True, checkpoint_requested_at=NOW - 60)
    for who, priority, cut in (("crit", 1000, True), ("med", 200, False)):
        snap = snapshot(8).running(late).pending(pending(who, priority, 8, submitted_at=NOW - 10)).build()
        # When the job waiting for its GPUs asks why it waits
        answer = explain(who, snap)
        # Then it is told about that stop: cut for the critical job, kept for the medium one
        [sentence] = [s for s in answer["pending"]["in_the_way"] if s.startswith("the stop of late")]
        assert ("no longer waits for a checkpoint" in sentence) is cut
        assert sentence in answer["text"]
        # And the victim's own answer names the job it was judged for
        [considered] = explain("late", snap)["running"]["considered_for"]
        assert considered["preemptor"] == who and considered["reason"] == ("checkpoint-wait-cut" if cut else "checkpoint-wait-kept")


def test_a_checkpoint_asked_ahead_is_told_once():
    # Given a medium job within its tier's preemption delay and a low job running the
    # training helper with 1000 s at risk: the plan asks it for a checkpoint ahead
    knobs = policy(tier_preemption_delay_s={"medium": 900})
    snap = snapshot(8).running(running("at-risk", 50, 8, started_at=NOW - 1000, declares_save_on_stop=True)).pending(
        pending("med", 200, 8, submitted_at=NOW - 100)
    ).build()
    answer = explain("at-risk", snap, knobs)
    # Then its answer says so once: as the request, not again as a consideration for med
    assert answer["running"]["checkpoint_ahead"]["for"] == "med"
    assert all(c["reason"] != "checkpoint-ahead-of-preemption" for c in answer["running"]["considered_for"])
    assert answer["text"].count("likely victim of med") == 1


def test_a_tier_preemption_delay_is_told_with_what_is_left_of_it():
    # Given a medium job 100 s into its tier's 900 s preemption delay, and a low job to preempt
    knobs = policy(tier_preemption_delay_s={"medium": 900})
    snap = snapshot(8).running(running("low", 50, 8, started_at=NOW - 1000)).pending(pending("med", 200, 8, submitted_at=NOW - 100)).build()
    answer = explain("med", snap, knobs)
    # Then what is in its way is the 800 s left of its tier's delay, as its decision says
    assert "waits 800 s more" in answer["text"]
    assert "in the way: delay: preempts only after 800 s more" in answer["text"]


def test_explain_shows_a_victim_managed_spot_holds_interrupted_is_stopped_without_a_checkpoint_wait():
    from preemptor.core.model import PendingJob, Pool, RunningJob, Snapshot
    from preemptor.core.policy import Policy

    # Given a low job whose checkpoint is an hour old, held interrupted by managed spot
    # (nothing runs), and a critical job wanting its GPUs
    snap = Snapshot(
        pools=(Pool("p", 8),),
        running=(RunningJob("sweep", "t", 50, "p", 8, started_at=0.0, last_checkpoint_at=400.0, paused=True),),
        pending=(PendingJob("crit", "t", 1000, "p", 8, submitted_at=3990.0),),
    )
    policy = Policy()
    # When explaining it
    answer = explain_job("sweep", plan(snap, policy, 4000.0), snap, policy, 4000.0)
    # Then it is shown interrupted, its stop loses nothing and waits for no checkpoint
    running = answer["running"]
    assert running["spot_interrupted"] is True
    assert running["preempted_now"]["lost_gpu_seconds"] == 0
    assert running["preempted_now"]["checkpoint_fresh"] is True and running["preempted_now"]["wait_for_checkpoint"] is False
