"""`core.progress`: checkpoint freshness and lost work, the one rule of the planner, the
workflows and the simulator."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import running
from preemptor.core.progress import at_risk_since, is_fresh, lost_gpu_seconds, saved_in_run_s, stop_loss, work_at_risk_s

NOW = 10_000.0


@pytest.mark.parametrize(
    "checkpoint_at, run_started_at, at_risk",
    [
        pytest.param(9_000.0, 5_000.0, 1_000.0, id="checkpoint-in-this-run"),
        # Relaunched at 9,800 from a checkpoint of 1,000: only the 200 s since the run
        # started are at risk, however old the checkpoint.
        pytest.param(1_000.0, 9_800.0, 200.0, id="relaunched-from-an-old-checkpoint"),
        pytest.param(None, 9_500.0, 500.0, id="no-checkpoint-yet"),
        pytest.param(9_000.0, None, 1_000.0, id="run-start-unknown"),
        pytest.param(None, None, 0.0, id="nothing-known"),
        pytest.param(10_500.0, 0.0, 0.0, id="checkpoint-after-now-risks-nothing"),
    ],
)
def test_work_at_risk_counts_from_the_later_of_checkpoint_and_run_start(checkpoint_at, run_started_at, at_risk):
    # Given a run's start and newest checkpoint; When asking what a stop now throws away
    # Then it is the time since the later of the two, never negative
    assert work_at_risk_s(checkpoint_at, run_started_at, NOW) == at_risk
    assert lost_gpu_seconds(8, checkpoint_at, run_started_at, NOW) == 8 * at_risk


@pytest.mark.parametrize(
    "checkpoint_at, run_started_at, fresh",
    [
        pytest.param(9_200.0, 0.0, True, id="800s-old-is-fresh"),
        pytest.param(9_000.0, 0.0, False, id="1000s-old-is-not"),
        pytest.param(1_000.0, 9_800.0, True, id="relaunched-run-counts-from-its-start"),
        pytest.param(None, 9_800.0, False, id="no-checkpoint-is-never-fresh"),
    ],
)
def test_freshness_is_the_work_at_risk_within_the_limit(checkpoint_at, run_started_at, fresh):
    # Given the default 900 s limit; When checking; Then a checkpoint is fresh when the work
    # at risk since it is within the limit, and a job that never wrote one is always asked
    assert is_fresh(checkpoint_at, run_started_at, NOW, 900.0) is fresh


def test_the_planner_counts_lost_work_with_the_same_rule():
    # Given a relaunched victim whose newest checkpoint predates its run
    victim = running("v", 50, 8, started_at=9_800.0, last_checkpoint_at=1_000.0)
    # When the planner asks what stopping it loses; Then it is the shared rule's answer
    assert victim.lost_gpu_seconds(NOW) == lost_gpu_seconds(8, 1_000.0, 9_800.0, NOW) == 8 * 200.0


def test_saved_work_is_what_the_run_checkpointed():
    # Given a run started at 5,000; Then its newest checkpoint keeps the work since then
    assert saved_in_run_s(9_000.0, 5_000.0) == 4_000.0
    assert saved_in_run_s(1_000.0, 5_000.0) == 0.0  # a checkpoint of an earlier run
    assert saved_in_run_s(None, 5_000.0) == 0.0


def test_stop_loss_splits_a_stopped_run_by_cause():
    # Given a run started at 1,000 that reloads for 300 s, checkpoints at 2,000, is signalled
    # at 2,500 and released at 2,620
    loss = stop_loss(run_started_at=1_000.0, work_started_at=1_300.0, checkpoint_at=2_000.0, signal_at=2_500.0, released_at=2_620.0)
    # Then it lost 500 s of work, 120 s of grace and the 300 s reload
    assert (loss.progress_s, loss.grace_s, loss.overhead_s, loss.total_s) == (500.0, 120.0, 300.0, 920.0)


def test_a_run_stopped_while_reloading_loses_only_the_reload_so_far():
    # Given a run signalled 100 s into its 300 s reload, resuming from an earlier run's checkpoint
    loss = stop_loss(run_started_at=1_000.0, work_started_at=1_300.0, checkpoint_at=500.0, signal_at=1_100.0, released_at=1_220.0)
    # Then no work is lost, only the 100 s of reload and the grace
    assert (loss.progress_s, loss.grace_s, loss.overhead_s) == (0.0, 120.0, 100.0)


@given(
    start=st.floats(0, 1e6),
    overhead=st.floats(0, 1e3),
    worked=st.floats(0, 1e5),
    checkpoint_back=st.floats(0, 2e5),
    grace=st.floats(0, 300),
)
def test_stop_loss_agrees_with_the_workflows_lost_work(start, overhead, worked, checkpoint_back, grace):
    # Given any run signalled after its reload, with its checkpoint anywhere before the signal
    work_start = start + overhead
    signal = work_start + worked
    checkpoint = signal - checkpoint_back
    loss = stop_loss(run_started_at=start, work_started_at=work_start, checkpoint_at=checkpoint, signal_at=signal, released_at=signal + grace)
    # Then the work and grace it lost are what the workflow counts at the release, from the
    # start of the work, and the reload is on top
    assert loss.progress_s + loss.grace_s == pytest.approx(work_at_risk_s(checkpoint, work_start, signal + grace), abs=1e-6)
    assert loss.overhead_s == pytest.approx(overhead, abs=1e-6)


_EDGES = [None, 0.0, -0.0, 1.0, 100.5, 1e9, float("inf"), -float("inf"), float("nan")]


@pytest.mark.parametrize("last", _EDGES)
@pytest.mark.parametrize("started", _EDGES)
def test_work_at_risk_inline_is_the_rule_it_inlines(last, started):
    # `work_at_risk_s` inlines `at_risk_since` and two maxes for speed: it must give what
    # they give, edge values included (equal times, signed zeros, infinities, NaN)
    for now in [v for v in _EDGES if v is not None]:
        since = at_risk_since(last, started)
        expected = 0.0 if since is None else max(0.0, now - since)
        got = work_at_risk_s(last, started, now)
        assert got == expected or (math.isnan(got) and math.isnan(expected))
        assert math.copysign(1.0, got) == math.copysign(1.0, expected)


@pytest.mark.parametrize("last", _EDGES)
@pytest.mark.parametrize("saves", [False, True])
def test_stop_figures_are_the_rules_they_combine(last, saves):
    # `RunningJob.stop_figures` gives the planner five figures of a stop in one call: each
    # must be what its own rule gives, edge values included (compared by repr: NaN, -0.0)
    for started in [v for v in _EDGES if v is not None]:
        v = running("v", gpus=8, started_at=started, last_checkpoint_at=last, saves_on_stop=saves, preemptions=2, restart_overhead_s=120.0)
        for now in [t for t in _EDGES if t is not None]:
            expected = (
                v.checkpoint_age_s(now),
                v.work_at_risk_s(now),
                v.lost_gpu_seconds(now),
                is_fresh(last, started, now, 900.0),
                v.stop_cost_gpu_seconds(now),
            )
            assert repr(v.stop_figures(now, 900.0)) == repr(expected)


@pytest.mark.parametrize("last", [None, 100.0, 5000.0])
def test_a_run_managed_spot_holds_interrupted_risks_nothing_and_is_fresh(last):
    # A run managed spot holds interrupted runs nothing: a stop loses no work, and a
    # checkpoint it could not write is not waited for; after its restart only the work
    # since the later of its checkpoint and the restart is at risk
    paused = running("v", gpus=8, started_at=0.0, last_checkpoint_at=last, paused=True, restart_overhead_s=120.0)
    age, at_risk, lost, fresh, cost = paused.stop_figures(9000.0, 900.0)
    assert (at_risk, lost, fresh, cost) == (0.0, 0.0, True, 8 * 120.0)
    assert paused.work_at_risk_s(9000.0) == 0.0
    restarted = running("v", gpus=8, started_at=0.0, last_checkpoint_at=last, work_since=6000.0)
    assert restarted.work_at_risk_s(9000.0) == 9000.0 - max(last or 0.0, 6000.0)
    assert restarted.stop_figures(9000.0, 900.0)[1] == restarted.work_at_risk_s(9000.0)


def test_the_time_managed_spot_holds_a_run_interrupted_is_no_work_done():
    # Given a run of 10,000 s of work, started at 0, interrupted at 3,000 s
    job = _spot_job(expected_duration_s=10_000.0, spot_interruptions=[3000.0], spot_interrupted_at=3000.0)
    # While held interrupted: 3,000 s worked, whatever the time
    held = job.as_running()
    assert (held.worked_s(6000.0), held.remaining_s(6000.0), held.progress_at(6000.0)) == (3000.0, 7000.0, 0.3)
    # Restarted at 5,000 s: the 2,000 s pause is not work (it counted as work before)
    back = job.with_changes(spot_resumed_at=5000.0).as_running()
    assert (back.worked_s(7000.0), back.remaining_s(7000.0), back.progress_at(7000.0)) == (5000.0, 5000.0, 0.5)
    # A run never interrupted works all its time
    plain = _spot_job(expected_duration_s=10_000.0).as_running()
    assert (plain.worked_s(7000.0), plain.remaining_s(7000.0)) == (7000.0, 3000.0)


def _spot_job(**changes) -> "JobRecord":
    from preemptor.core.jobs import JobRecord
    from preemptor.core.model import JobState

    return JobRecord(
        name="v", team="t", priority=50, pool="p5", service="sagemaker", gpus=8, request={}, checkpoint_s3_uri="s3://b/v",
        submitted_at=0.0, status=JobState.RUNNING, started_at=0.0, **changes,
    )


@pytest.mark.parametrize(
    "changes, at, counted",
    [
        # Told again, by its event's time or by its transition's (seconds apart): the same one
        ({"spot_interruptions": [1000.0], "spot_interrupted_at": 1000.0}, 1004.0, True),
        ({"spot_interruptions": [1000.0], "spot_interrupted_at": 1000.0}, 996.0, True),
        # A restart seen between them: another one
        ({"spot_interruptions": [1000.0], "spot_interrupted_at": 1000.0, "spot_resumed_at": 1100.0}, 1250.0, False),
        # An older one, delivered after a newer was counted (the list keeps them all)
        ({"spot_interruptions": [1000.0, 4000.0], "spot_interrupted_at": 4000.0, "spot_resumed_at": 4600.0}, 1000.0, True),
        # Far apart: another one
        ({"spot_interruptions": [1000.0], "spot_interrupted_at": 1000.0, "spot_resumed_at": 1600.0}, 5000.0, False),
        # A job stored before the list existed: its last counted interruption is its time
        ({"spot_interrupted_at": 1000.0}, 1010.0, True),
    ],
    ids=["later-telling", "earlier-telling", "after-a-restart", "older-redelivered", "far-apart", "stored-before-the-list"],
)
def test_a_managed_spot_interruption_is_counted_once_however_it_is_told(changes, at, counted):
    assert _spot_job(**changes).spot_interruption_counted(at) is counted


@pytest.mark.parametrize(
    "changes, at, seen",
    [
        ({"spot_resumed_at": 2000.0}, 2003.0, True),  # told again, a moment later
        ({"spot_resumed_at": 2000.0}, 1500.0, True),  # an older restart
        # Held interrupted since before it: the restart that ends the pause, however close
        ({"spot_resumed_at": 2000.0, "spot_interrupted_at": 2100.0, "spot_interruptions": [2100.0]}, 2200.0, False),
        ({}, 2000.0, False),
    ],
    ids=["later-telling", "older", "ends-the-pause", "first"],
)
def test_a_managed_spot_restart_is_seen_once_and_never_kept_from_ending_a_pause(changes, at, seen):
    assert _spot_job(**changes).spot_restart_seen(at) is seen
