"""Scenario files replayed by the demo runner: the whole controller loop on emulated AWS."""

from __future__ import annotations

import pytest
from replays import GROUP, SCENARIOS, replay
from storm.invariants import violations

from preemptor.service.actions import CAPACITY_BACKOFF_MAX_S
from preemptor_tools.local.scenario import Scenario


def _jobs(report: dict) -> dict[str, dict]:
    return {j["name"]: j for j in report["jobs"]}


# The replays are shared with test_iam (tests/replays.py): one worker, one replay each.
pytestmark = pytest.mark.xdist_group(GROUP)


@pytest.fixture
def mission():
    return replay("demo").result


def test_mission_story_exactly_one_preemption_after_a_confirmed_checkpoint(mission):
    report = mission.report
    assert report["preemptions"] == 1
    [p] = report["preemption_details"]
    assert p["victim"] == "experiment" and p["preemptor"] == "production-finetune"
    assert p["checkpoint_confirmed_before_stop"] and p["fresh_checkpoint"]
    assert report["stops_without_fresh_checkpoint"] == 0


def test_mission_story_production_waits_only_for_checkpoint_stop_and_start(mission):
    jobs = _jobs(mission.report)
    policy_bound = 600 + 30  # the checkpoint wait limit (default) + one poll
    stop_bound = 120 + 30  # SageMaker's stop grace + one poll of the run state
    assert jobs["production-finetune"]["wait_s"] <= policy_bound + stop_bound


def test_mission_story_experiment_resumes_from_its_checkpoint_and_completes(mission):
    jobs = _jobs(mission.report)
    assert jobs["experiment"]["state"] == "Completed" and jobs["production-finetune"]["state"] == "Completed"
    assert jobs["experiment"]["incarnations"] == 2
    assert mission.report["relaunches"] == 1
    resumed = [t for t in mission.timeline if t.job == "experiment-r2" and "resumed at progress" in t.why]
    assert resumed and "progress 0s" not in resumed[0].why
    # Lost work is at most one checkpoint interval on all 512 GPUs
    assert 0 < jobs["experiment"]["lost_gpu_seconds"] <= 300 * 512


def test_timeline_reads_in_time_order_with_reasons(mission):
    times = [t.at for t in mission.timeline]
    assert times == sorted(times)
    decisions = [t for t in mission.timeline if t.source == "controller"]
    assert all(t.why for t in decisions)
    kinds = [t.what for t in decisions if t.job == "experiment"]
    assert kinds.index("preemption-started") < kinds.index("checkpoint-confirmed") < kinds.index("stop-requested")


def test_victim_is_the_job_whose_stop_loses_least():
    report = replay("least-loss-victim").result.report
    jobs = _jobs(report)
    assert [p["victim"] for p in report["preemption_details"]] == ["sweep-b"]
    assert jobs["sweep-a"]["preemptions"] == 0
    assert all(j["state"] == "Completed" for j in jobs.values())


def test_equal_priority_never_preempts():
    report = replay("equal-priority").result.report
    jobs = _jobs(report)
    assert report["preemptions"] == 0
    # The third job waited for the first to finish (3600 s of work after it started)
    assert jobs["third"]["wait_s"] >= 3600 - 600
    assert all(j["state"] == "Completed" for j in jobs.values())


def test_cascade_victims_resume_in_priority_order_and_all_complete():
    result = replay("cascade").result
    jobs = _jobs(result.report)
    victims = [(p["victim"], p["preemptor"]) for p in result.report["preemption_details"]]
    assert victims == [("sweep", "finetune"), ("finetune", "incident-fix")]
    relaunches = [t.job for t in result.timeline if t.source == "controller" and t.what == "relaunched"]
    assert relaunches == ["finetune", "sweep"]
    assert all(j["state"] == "Completed" for j in jobs.values())


def test_batch_pool_uses_the_same_protocol():
    report = replay("batch-pool").result.report
    [p] = report["preemption_details"]
    assert p["victim"] == "batch-sweep" and p["checkpoint_confirmed_before_stop"]
    assert all(j["state"] == "Completed" for j in report["jobs"])


def test_spot_interruption_is_traced_to_the_job_checkpointed_and_relaunched():
    report = replay("spot-interruption").result.report
    [job] = report["jobs"]
    assert job["state"] == "Completed" and job["interruptions"] == 1 and job["preemptions"] == 0
    [stop] = report["preemption_details"]
    assert stop["kind"] == "interrupted" and stop["checkpoint_confirmed_before_stop"]
    # a checkpoint written after the warning: at most the stop grace and a poll are lost
    assert job["lost_gpu_seconds"] <= 16 * 60


def test_a_capacity_error_is_waited_out_and_the_job_starts_once_capacity_returns():
    # Given SageMaker without p5 capacity for the first 15 minutes (capacity-error.yaml)
    scenario = Scenario.load(SCENARIOS / "capacity-error.yaml")
    result = replay("capacity-error").result
    [job] = result.report["jobs"]
    returns_at = 900.0
    kinds = [t.what for t in result.timeline if t.source == "controller" and t.job == "incident-fix"]
    # Then the job was never failed: each launch that met no capacity became a wait
    assert job["state"] == "Completed" and "failed" not in kinds
    assert kinds.count("capacity-wait") >= 2
    # And it started training once capacity was back, within one backoff step (the capped
    # step, plus SageMaker's start-up and the controller's one tick of event delivery)
    training = [t.at for t in result.timeline if t.source == "aws" and t.job.startswith("incident-fix") and "Training" in t.what]
    assert training and returns_at <= training[0] <= returns_at + CAPACITY_BACKOFF_MAX_S + 120 + 60
    # And the report counts its wait from submission to that start, not to a failed run
    assert job["wait_s"] >= returns_at - 120
    # And no run ran twice, nor the pool above capacity
    assert violations(result, scenario) == []


def test_the_report_counts_launches_relaunches_and_capacity_waits_per_job():
    # Given the capacity-error story (three launches met no capacity, the fourth ran)
    [job] = replay("capacity-error").result.report["jobs"]
    # Then each launch is counted, and each relaunch after a capacity wait
    assert job["capacity_waits"] >= 2
    assert job["launch_attempts"] == job["capacity_waits"] + 1
    assert job["relaunches"] == job["incarnations"] - 1


def test_a_spot_interruption_of_a_batch_job_loses_only_the_work_since_the_checkpoint_it_triggered():
    # Given a Batch pool described by instances, a job on 2 of them (8 GPUs) checkpointing
    # every 10 minutes, and a spot warning 4.5 minutes after its last periodic checkpoint
    scenario = Scenario.load(SCENARIOS / "batch-spot-fault.yaml")
    result = replay("batch-spot-fault").result
    [job] = result.report["jobs"]
    warning_at, gpus, warning_window = 2700.0, 8, 120.0
    # Then the job completes after one interruption, relaunched once
    assert job["state"] == "Completed" and job["interruptions"] == 1 and job["relaunches"] == 1
    # And it resumed from a checkpoint written after the warning (not the periodic one)
    resumed = [t for t in result.timeline if t.job == "spot-train-r2" and "resumed at progress" in t.why]
    progress = float(resumed[0].why.rsplit("resumed at progress ", 1)[1].rstrip("s"))
    started_at = 30.0  # Batch's start-up in the emulated fleet
    assert progress >= warning_at - started_at
    # And it lost at most the work between that checkpoint and the instance going away
    assert 0 < job["lost_gpu_seconds"] <= gpus * warning_window
    assert violations(result, scenario) == []


def test_a_launch_that_meets_no_capacity_falls_back_to_the_next_offering():
    # Given a pool preferring p5 with a p5e fallback, and no p5 capacity for an hour
    scenario = Scenario.load(SCENARIOS / "capacity-fallback.yaml")
    result = replay("capacity-fallback").result
    [job] = result.report["jobs"]
    launches = [t for t in result.timeline if t.source == "controller" and t.what in ("launched", "relaunched")]
    # Then the first launch went to p5 and met the CapacityError; the next one, after one
    # backoff step, went to p5e (p5 is remembered as unavailable) and the job completed
    assert [("ml.p5e.48xlarge" in t.why, "ml.p5.48xlarge" in t.why) for t in launches] == [(False, True), (True, False)]
    assert job["state"] == "Completed" and job["capacity_waits"] == 1
    assert job["wait_s"] <= 120 + CAPACITY_BACKOFF_MAX_S + 60
    assert violations(result, scenario) == []
