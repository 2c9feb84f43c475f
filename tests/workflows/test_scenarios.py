"""Scenario files replayed by the demo runner: the whole controller loop on emulated AWS."""

from __future__ import annotations

import json
import re

import pytest
from replays import GROUP, RUNS, SCENARIOS, replay
from storm.invariants import violations

from preemptor.service.actions import CAPACITY_BACKOFF_MAX_S
from preemptor_tools.local.demo import START
from preemptor_tools.local.scenario import Scenario


def _jobs(report: dict) -> dict[str, dict]:
    return {j["name"]: j for j in report["jobs"]}


def _story(name: str) -> str:
    """The replay's timeline and its failed workflow runs: what a failed bound on a wait needs
    to say (which step was late, and why)."""
    run = replay(name)
    lines = [t.render() for t in run.result.timeline]
    return "\n".join([f"{name}:", *lines, *(" | ".join(f) for f in run.failed_executions)])


# The replays are shared with test_iam (tests/replays.py): one worker, one replay each.
pytestmark = pytest.mark.xdist_group(GROUP)


@pytest.fixture
def mission():
    return replay("demo").result


def test_mission_story_exactly_one_preemption_after_a_requested_checkpoint(mission):
    report = mission.report
    assert report["preemptions"] == 1
    [p] = report["preemption_details"]
    assert p["victim"] == "experiment" and p["preemptor"] == "production-finetune"
    # Issue 10: 100 minutes of the experiment's work (512 GPUs) are in no checkpoint; it runs
    # the training helper but has never been seen to save on SIGTERM, so it is asked for a
    # checkpoint (512 x 6000 GPU-s saved outweigh 512 x 200 s expected x 1000/50), and
    # stopped once the checkpoint is confirmed
    assert p["checkpoint_confirmed_before_stop"] and p["fresh_checkpoint"]
    assert report["stops_without_fresh_checkpoint"] == 0


def test_mission_story_production_waits_only_for_checkpoint_stop_and_start(mission):
    jobs = _jobs(mission.report)
    checkpoint_bound = 60 + 30  # the helper's write after the request + one poll
    stop_bound = 120 + 30  # SageMaker's stop grace + one poll of the run state
    assert jobs["production-finetune"]["wait_s"] <= checkpoint_bound + stop_bound


def test_mission_story_experiment_is_relaunched_from_its_checkpoint_and_completes(mission):
    jobs = _jobs(mission.report)
    assert jobs["experiment"]["state"] == "Completed" and jobs["production-finetune"]["state"] == "Completed"
    assert jobs["experiment"]["incarnations"] == 2
    assert mission.report["relaunches"] == 1
    # It saved again on SIGTERM at 6,000 s of work, exited once that was written, and
    # resumed from there: nothing is lost
    resumed = [t.why for t in mission.timeline if t.job == "experiment-r2" and "resumed at progress" in t.why]
    assert resumed == ["started: InProgress/Training, resumed at progress 6000s"]
    assert jobs["experiment"]["lost_gpu_seconds"] == 0
    # and its requeue says so: the GPU-seconds counted are after a checkpoint that kept the work
    (requeued,) = [t.why for t in mission.timeline if t.job == "experiment" and t.what == "requeued"]
    assert "written 60 s after the stop signal: the work until the stop is kept" in requeued
    saved = [t for t in mission.timeline if t.job == "experiment" and t.what == "checkpoint on SIGTERM"]
    assert len(saved) == 1


def test_mission_summary_counts_the_experiments_time_requeued_not_only_its_first_wait(mission):
    import io

    from preemptor_tools.local.demo import print_result

    jobs = _jobs(mission.report)
    # Its first wait was a few seconds; from its requeue to its relaunch it held no GPUs,
    # which the summary counts apart (the first wait alone said it barely waited)
    (requeued_at,) = [t.at for t in mission.timeline if t.job == "experiment" and t.what == "requeued"]
    (relaunched_at,) = [t.at for t in mission.timeline if t.job == "experiment" and t.what == "relaunched"]
    assert jobs["experiment"]["requeued_s"] == pytest.approx(relaunched_at - requeued_at)
    assert jobs["production-finetune"]["requeued_s"] == 0
    out = io.StringIO()
    print_result(mission, out)
    [line] = [x for x in out.getvalue().splitlines() if x.split()[:2] == ["experiment", "Completed"]]
    hours, rest = divmod(round(relaunched_at - requeued_at), 3600)
    assert "waited 0m0" in line and f" + {hours}h{rest // 60:02d}m{rest % 60:02d}s requeued" in line


def test_timeline_reads_in_time_order_with_reasons(mission):
    times = [t.at for t in mission.timeline]
    assert times == sorted(times)
    decisions = [t for t in mission.timeline if t.source == "controller"]
    assert all(t.why for t in decisions)
    kinds = [t.what for t in decisions if t.job == "experiment"]
    # the plan asked for a checkpoint; the check confirmed it; then the stop
    assert (
        kinds.index("preemption-started")
        < kinds.index("checkpoint-requested")
        < kinds.index("checkpoint-confirmed")
        < kinds.index("stop-requested")
    )


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


@pytest.mark.parametrize("name", [n for n in RUNS if n != "hostile-world"])
def test_no_workflow_run_fails_in_a_world_without_faults_in_the_controller(name: str):
    # Given a story whose only faults are the world's (capacity, interruptions), not injected
    # into the controller's own calls (the hostile world's are: its test checks its failures)
    failed = replay(name).failed_executions
    # Then every workflow run ended well: a failed one would be a decision nobody carried out
    # (a Wait on a fractional SecondsPath is one: Step Functions takes whole seconds only)
    assert failed == []


def test_batch_pool_uses_the_same_protocol():
    report = replay("batch-pool").result.report
    [p] = report["preemption_details"]
    assert p["victim"] == "batch-sweep" and p["checkpoint_confirmed_before_stop"]
    assert all(j["state"] == "Completed" for j in report["jobs"])


def test_a_teams_batch_job_in_a_queue_of_its_own_holds_the_pools_gpus_and_the_hotfix_preempts_around_it():
    # Given a team's evaluation submitted to its own queue on g5's compute environment
    # (batch-team-queue.yaml), a low sweep, then a critical hotfix that needs the pool
    result = replay("batch-team-queue").result
    jobs = {j["name"]: j for j in result.report["jobs"]}
    # Then the evaluation was adopted into g5 (its queue shares g5's compute environment)
    [adopted] = [t for t in result.timeline if t.job == "research-eval" and t.what == "adopted"]
    assert "16 GPUs counted in g5" in adopted.why
    # And the hotfix preempted the sweep, not the evaluation, and ran within the Batch
    # grace and a launch of arriving
    [p] = result.report["preemption_details"]
    assert p["victim"] == "batch-sweep" and p["checkpoint_confirmed_before_stop"]
    assert jobs["research-eval"]["preemptions"] == 0 and jobs["batch-hotfix"]["wait_s"] <= 60
    assert all(j["state"] == "Completed" for j in jobs.values())


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
    assert job["wait_s"] <= 120 + CAPACITY_BACKOFF_MAX_S + 60, _story("capacity-fallback")
    # And the fleet counts its run on the fallback type in the pool (the invariants read it)
    [fallback] = [r for r in result.runs if r["name"] == "incident-fix-r2"]
    assert (fallback["pool"], fallback["gpus"]) == ("p5", 64)
    assert violations(result, scenario) == []


def test_a_victim_managed_spot_holds_interrupted_is_stopped_at_once_and_loses_nothing_more():
    # Given a spot sweep whose instances managed spot takes 20 minutes after its checkpoint,
    # for half an hour, and a critical job arriving meanwhile (managed-spot-interruption.yaml)
    scenario = Scenario.load(SCENARIOS / "managed-spot-interruption.yaml")
    result = replay("managed-spot-interruption").result
    jobs = _jobs(result.report)
    sweep = [e for e in result.history if e["job"] == "sweep"]
    # Then the interruption's loss is counted once, as the fleet lost it (1,277 s of 64 GPUs)
    [interrupted] = [e for e in sweep if e["kind"] == "spot-interrupted"]
    assert interrupted["extra"]["lost_gpu_seconds"] == pytest.approx(1277 * 64, abs=64)
    # And the sweep is stopped for the critical job without a checkpoint request it could
    # not answer (no instances), its stop losing nothing more and counted as fresh
    assert "checkpoint-requested" not in [e["kind"] for e in sweep]
    [requeued] = [e for e in sweep if e["kind"] == "requeued"]
    assert requeued["extra"]["lost_gpu_seconds"] == 0
    assert jobs["sweep"]["lost_gpu_seconds"] == interrupted["extra"]["lost_gpu_seconds"]
    assert result.report["stops_without_fresh_checkpoint"] == 0
    # And the critical job waited only for the stop; both completed
    assert jobs["incident-fix"]["wait_s"] <= 60 + 30, _story("managed-spot-interruption")
    assert jobs["sweep"]["state"] == jobs["incident-fix"]["state"] == "Completed"
    assert violations(result, scenario) == []


def test_a_pool_above_the_accounts_quota_is_planned_at_the_quota_once_a_launch_meets_it():
    # Given a pool of 8 x ml.p5.48xlarge whose account quota is 6, a low sweep on 6, and a
    # critical hotfix for 2 more (quota-below-pool.yaml)
    scenario = Scenario.load(SCENARIOS / "quota-below-pool.yaml")
    run = replay("quota-below-pool")
    result, jobs = run.result, _jobs(run.result.report)
    hotfix = [e for e in result.history if e["job"] == "hotfix"]
    # Then its first launch met the quota, and its capacity wait names it and what the pool
    # is planned at from then on
    [wait] = [e for e in hotfix if e["kind"] == "capacity-wait"]
    assert "the account's quota 'ml.p5.48xlarge for training job usage' is 6 instances, below pool p5's 64 GPUs: planned at 48 GPUs" in wait["detail"]
    assert [(r.run, r.quota) for r in result.quota_refusals] == [("hotfix", 6)]
    # And the sweep was preempted for it at once (before: the hotfix "fit" in the 16 GPUs the
    # account cannot have, met the quota at each of its 24 launches, and failed 83 minutes
    # after it was submitted, the sweep never stopped)
    assert jobs["sweep"]["preemptions"] == 1
    assert jobs["hotfix"]["state"] == jobs["sweep"]["state"] == "Completed"
    assert jobs["hotfix"]["wait_s"] <= CAPACITY_BACKOFF_MAX_S, _story("quota-below-pool")
    # And the operators' alarm reads the shortfall: 16 GPUs from then on, none before
    values = [d["QuotaShortfallGpus"] for d in run.metrics if "QuotaShortfallGpus" in d]
    shortfalls = [v for value in values for v in (value if isinstance(value, list) else [value])]
    assert shortfalls[0] == 0 and 16 in shortfalls and set(shortfalls) == {0, 16}
    assert violations(result, scenario) == []


def test_a_run_larger_than_the_accounts_quota_stops_nobody_until_service_quotas_lists_it_raised():
    # Given a pool of 8 x ml.p5.48xlarge whose account quota is 6 until a raise to 8 two
    # hours in, a low sweep on 6, and a critical run needing all 8 (quota-raised.yaml)
    scenario = Scenario.load(SCENARIOS / "quota-raised.yaml")
    run = replay("quota-raised")
    result, jobs = run.result, _jobs(run.result.report)
    stops = [e["at"] - START for e in result.history if e["job"] == "sweep" and e["kind"] == "stop-requested"]
    # Then the sweep was stopped once before the quota was known (the refusal told it), and
    # not again until the raise: the quota, read again at each reconcile, still left the pool
    # 48 GPUs (before: forgotten after an hour, and the sweep stopped once an hour for a
    # launch the quota refused)
    raised = 7200.0
    assert len(stops) == 2 and stops[0] < 3600 and raised <= stops[1] <= raised + 2 * 300, _story("quota-raised")
    # (the second, for the escalated run, goes without a checkpoint wait: its line says how old
    # the checkpoint it calls fresh is, and that the work since it is at stake)
    [second] = [e for e in result.history if e["job"] == "sweep" and e["kind"] == "stop-requested" and e["at"] - START >= raised]
    assert second["reason"] == "fresh-checkpoint" and re.search(r"its checkpoint is \d+ s old \(fresh: within checkpoint_max_age_s 900\)", second["detail"])
    assert [(r.run, r.quota) for r in result.quota_refusals] == [("pretrain", 6)]
    # And the run launched within two reconcile passes of the raise, and both completed
    assert jobs["pretrain"]["state"] == jobs["sweep"]["state"] == "Completed"
    assert jobs["pretrain"]["wait_s"] <= raised + 2 * 300 + 120 + 60 - 600, _story("quota-raised")
    # And the shortfall the alarm reads is 16 GPUs while the quota held, none after the raise
    values = [d["QuotaShortfallGpus"] for d in run.metrics if "QuotaShortfallGpus" in d]
    shortfalls = [v for value in values for v in (value if isinstance(value, list) else [value])]
    assert 16 in shortfalls and shortfalls[-1] == 0
    # And every read of the quota was reconcile's: a listing to find it by name, then one
    # call a pass by the code it found (not a page each of SageMaker's quotas)
    reads = [c for c in run.calls if c.api_action.startswith("service-quotas:")]
    assert {c.principal for c in reads} == {"ReconcileFunction"}
    listings = [c for c in reads if c.operation == "ListServiceQuotas"]
    by_code = [c for c in reads if c.operation == "GetServiceQuota"]
    assert listings and len(by_code) >= 10 and len(by_code) > 3 * len(listings), (len(listings), len(by_code))
    assert violations(result, scenario) == []


def test_a_spot_pool_falls_back_to_on_demand_when_spot_has_no_capacity():
    # Given a spot pool that may fall back to on-demand, waiting at most 300 s for spot, and
    # no spot capacity for two hours (spot-fallback.yaml)
    scenario = Scenario.load(SCENARIOS / "spot-fallback.yaml")
    result = replay("spot-fallback").result
    [job] = result.report["jobs"]
    launches = [t for t in result.timeline if t.source == "controller" and t.what in ("launched", "relaunched")]
    # Then the first launch went to managed spot and gave up after its spot wait
    # (MaxWaitTimeExceeded, a capacity wait, not a failure); the next one, one backoff step
    # later, went to on-demand (spot is remembered as unavailable) and the job completed
    assert ["(spot)" in t.why for t in launches] == [True, False]
    assert "(on-demand)" in launches[1].why and "nothing trained yet" in launches[1].why
    assert job["state"] == "Completed" and job["capacity_waits"] == 1 and job["relaunches"] == 1
    submitted_at, spot_wait, startup = 60.0, 300.0, 120.0
    assert job["wait_s"] <= spot_wait + CAPACITY_BACKOFF_MAX_S / 5 + startup, _story("spot-fallback")  # first backoff step: at most 60 s
    assert job["lost_gpu_seconds"] == 0
    # And its runs held GPUs for the spot run's wait (300 s) plus the on-demand run's start-up
    # and its 1,800 s of work; nothing was carried over (the spot run never trained)
    assert spot_wait + 1800 <= job["runtime_s"] <= spot_wait + 1800 + 2 * startup and job["work_carried_s"] == 0
    assert violations(result, scenario) == []


def test_shadow_mode_launches_and_stops_nothing_and_reports_what_enforce_mode_would_have_done():
    # Given the research team's experiment (launched by the team itself, adopted) and a
    # critical fine-tune submitted to a controller in shadow mode (shadow-mode.yaml)
    run = replay("shadow-mode")
    report = run.result.report
    jobs = _jobs(report)
    # Then the controller launched and stopped nothing, by its log and by its AWS calls
    assert report["mode"] == "shadow" and report["controller_launches"] == report["controller_stops"] == 0
    controller = {"JobControlFunction", "IntakeFunction", "ReconcileFunction", "CheckpointFunction", "PlanFunction"}
    acted = [c.api_action for c in run.calls if c.principal in controller and c.operation in (
        "CreateTrainingJob", "StopTrainingJob", "SubmitJob", "TerminateJob")]
    assert acted == []
    # And the experiment ran to its end untouched; the fine-tune was never launched
    assert jobs["experiment"]["state"] == "Completed" and jobs["experiment"]["preemptions"] == 0
    assert jobs["production-finetune"]["state"] == "Pending" and jobs["production-finetune"]["wait_s"] is None
    # And the report lists what enforce mode would have done: preempt the experiment for
    # the fine-tune when it arrived (600 s, planned at the end of its 3 s settle window),
    # then admit the fine-tune
    would = [(w["would"], w["job"], w.get("for")) for w in report["shadow"]]
    assert would[0] == ("preempt", "experiment", "production-finetune") and report["shadow"][0]["at_s"] == 603
    assert ("admit", "production-finetune", None) in would
    # And `preemptor history` reads the same decisions from the decision log
    logged = [(e["kind"], e["job"], e["extra"].get("preemptor")) for e in run.history if e["kind"].startswith("shadow-")]
    assert {(k.removeprefix("shadow-"), j, f) for k, j, f in logged} == set(would)


@pytest.mark.parametrize(
    "tags, team",
    [({}, "research"), ({"preemptor:team": "Research Team"}, "(unattributed)")],
    ids=["", "its-team-tag-naming-no-team"],
)
def test_an_adopted_run_preempted_in_enforce_mode_is_stopped_and_left_to_its_team_to_relaunch(tags, team):
    from preemptor_tools.local import demo

    # Given the research team's own run, adopted (tagged preemptor:managed=true, so it may be
    # stopped; with a team tag that names no team, as no one's), and a critical fine-tune
    # submitted to the controller in enforce mode
    scenario = Scenario.load(SCENARIOS / "shadow-mode.yaml").model_copy(update={"mode": "enforce"})
    scenario = scenario.model_copy(
        update={"jobs": [j.model_copy(update={"tags": tags}) if j.name == "experiment" else j for j in scenario.jobs]}
    )
    result = demo.run(scenario, tick_s=60)
    jobs = _jobs(result.report)
    # Then the fine-tune preempted it and ran to its end
    assert jobs["production-finetune"]["state"] == "Completed"
    assert jobs["experiment"]["preemptions"] == 1
    # And the experiment, whose request the controller never had, was not relaunched by it
    # (a relaunch of nothing would fail in the service and block the pool): it ended, with
    # the reason, and its team was told
    assert jobs["experiment"]["state"] == "Cancelled"
    said = [t for t in result.timeline if t.source == "controller" and t.job == "experiment"]
    [ended] = [t for t in said if t.what == "preempted-not-relaunched"]
    assert "launched outside the controller" in ended.why
    assert not any(t.what == "launched" for t in said)
    notices = [json.loads(a) for a in result.alerts]
    assert ("preempted", "experiment", team) in {(n["kind"], n["job"], n["team"]) for n in notices}
    assert violations(result, scenario) == []


def test_the_wait_alarm_escalates_a_job_held_back_by_the_minimum_runtime():
    # Given every running job protected for an hour, and a critical job behind a sweep (escalation.yaml)
    scenario = Scenario.load(SCENARIOS / "escalation.yaml")
    result = replay("escalation").result
    jobs = _jobs(result.report)
    kinds = [(t.job, t.what) for t in result.timeline if t.source == "controller"]
    # Then, 5 minutes before the fix had waited the alarm's 10 minutes, the pool was planned
    # again (nothing else happened then: a wake-up) and the sweep asked for a checkpoint ahead
    decided = [(t.at, t.job, t.what, t.why) for t in result.timeline if t.source == "controller"]
    [ahead] = [d for d in decided if d[1] == "sweep" and d[2] == "checkpoint-requested"]
    submitted_at, threshold, lead = 600.0, 600.0, 300.0
    assert submitted_at + threshold - lead <= ahead[0] <= submitted_at + threshold - lead + 2
    assert ahead[3].startswith("checkpoint-ahead-of-preemption") and "wait alarm escalates" in ahead[3]
    # And the wait alarm's ALARM escalated it, the sweep was preempted for it although its
    # minimum runtime had not passed, at once, with the checkpoint it wrote when asked
    assert kinds.index(("sweep", "checkpoint-requested")) < kinds.index(("incident-fix", "escalated")) < kinds.index(("sweep", "preemption-started"))
    [p] = result.report["preemption_details"]
    assert (p["victim"], p["preemptor"]) == ("sweep", "incident-fix") and p["at_s"] < 3600
    assert p["fresh_checkpoint"]
    [stop] = [d for d in decided if d[1] == "sweep" and d[2] == "checkpoint-not-awaited"]
    assert stop[3].endswith("its preemptor is escalated")
    # and both completed
    assert jobs["incident-fix"]["state"] == jobs["sweep"]["state"] == "Completed"
    # (the alarm evaluates every 5 minutes: over 10 minutes is seen at 15, one period after)
    assert jobs["incident-fix"]["wait_s"] <= 15 * 60 + 300
    notices = [json.loads(a) for a in result.alerts]
    assert {(n["kind"], n["team"]) for n in notices} >= {("waiting-too-long", "production"), ("preemption-planned", "research")}
    assert violations(result, scenario) == []


def test_a_likely_victim_is_asked_for_a_checkpoint_ahead_and_the_pool_is_planned_when_the_delay_ends():
    # Given a 300 s preemption delay and a sweep running the training helper that checkpoints
    # only every 30 minutes (ahead-of-time.yaml)
    scenario = Scenario.load(SCENARIOS / "ahead-of-time.yaml")
    result = replay("ahead-of-time").result
    decided = [(t.at, t.job, t.what, t.why) for t in result.timeline if t.source == "controller"]
    submitted_at, delay, settle = 1500.0, 300.0, 3.0
    # Then the plan asked the sweep for a checkpoint when the critical job arrived (planned at
    # the end of its settle window), ahead of the preemption
    [ahead] = [d for d in decided if d[1] == "sweep" and d[2] == "checkpoint-requested"]
    assert ahead[0] == submitted_at + settle and ahead[3].startswith("checkpoint-ahead-of-preemption")
    # And the pool was planned again as the delay ran out (nothing else happened then), and preempted
    [started] = [d for d in decided if d[1] == "sweep" and d[2] == "preemption-started"]
    assert submitted_at + delay <= started[0] <= submitted_at + delay + 2
    # And the stop, at once, lost at most the work since that checkpoint (written 60 s after
    # the request) and the grace: (300 - 60 + 120) s x 64 GPUs, not the 30 minutes since the
    # last periodic one (it saves on SIGTERM too)
    [p] = result.report["preemption_details"]
    assert p["fresh_checkpoint"] and p["lost_gpu_seconds"] <= (delay - 60 + 120 + 2) * 64
    assert violations(result, scenario) == []


def test_a_team_lowers_its_own_sweep_for_its_eval_and_nobody_else_may():
    run = replay("team-lowering")
    scenario = Scenario.load(SCENARIOS / "team-lowering.yaml")
    # Then the other team's lowering and the team's raise were refused, each with its code
    refused = [t.why for t in run.result.timeline if t.what == "Priority Lowered" and "rejected" in t.why]
    assert len(refused) == 2
    assert "not-your-job: job sweep belongs to team 'research', not 'vision'" in refused[0]
    assert "not-a-lowering" in refused[1]
    # And the team's own lowering is the one change in the sweep's log, by the team, with its note
    [change] = [e for e in run.history if e["kind"] == "priority-changed"]
    assert (change["job"], change["reason"], change["extra"]) == ("sweep", "team", {"from": 500, "to": 50})
    assert "the eval comes first" in change["detail"]
    # And the eval then preempted the sweep (it could not before: the sweep was high), which
    # resumed from its checkpoint; both completed
    [p] = run.result.report["preemption_details"]
    assert (p["victim"], p["preemptor"]) == ("sweep", "eval") and p["checkpoint_confirmed_before_stop"]
    assert all(j["state"] == "Completed" for j in run.result.report["jobs"])
    assert violations(run.result, scenario) == []


def test_a_teams_own_run_claiming_more_than_its_ceiling_is_counted_at_it_and_one_into_a_full_pool_is_refused():
    from preemptor_tools.local import demo

    # Given research (at most "low") launching its own run tagged "critical", a high and a
    # medium job submitted to the controller, and applied launching its own run once the pool
    # is full (team-launches.yaml)
    scenario = Scenario.load(SCENARIOS / "team-launches.yaml")
    result = demo.run(scenario, tick_s=60)
    jobs = _jobs(result.report)
    # Then research's run was adopted at low, its GPUs counted, the claim said
    [adopted] = [e for e in result.history if e["job"] == "tagged-critical" and e["kind"] == "adopted"]
    assert "at priority 50" in adopted["detail"] and "its priority tag claims 1000 (above-team-ceiling" in adopted["detail"]
    # And, at low, it is the one the medium fine-tune preempted (not the high evaluation)
    assert jobs["tagged-critical"]["preemptions"] == 1 and jobs["nightly-eval"]["preemptions"] == 0
    # (running since SageMaker created it, it never waited for the controller, nor was it
    # requeued: it ran from its adoption to its stop; before, its whole run was "requeued")
    assert (jobs["tagged-critical"]["wait_s"], jobs["tagged-critical"]["requeued_s"]) == (0, 0)
    assert jobs["prod-finetune"]["state"] == jobs["nightly-eval"]["state"] == "Completed"
    # And applied's own run into the full pool never existed: SageMaker refused it
    assert jobs["applied-own-run"]["state"] == "Refused by AWS"
    assert [(r.run, r.requested, r.quota) for r in result.quota_refusals] == [("applied-own-run", 2, 8)]
    assert max(p["max_gpus_in_use"] for p in result.report["pools"]) <= 64
    assert violations(result, scenario) == []


@pytest.mark.parametrize("tagged", ["p5", "retired-pool"], ids=["tagged-with-the-other-pool", "tagged-with-no-pool"])
def test_a_teams_run_on_the_second_pools_instances_is_counted_there_and_its_jobs_launch_within_the_quota(tagged):
    from preemptor_tools.local import demo

    # Given two pools of the account's whole quota, p5 (8 x ml.p5.48xlarge) and p4 (4 x
    # ml.p4d.24xlarge), and a team's own low run of 2 p4 instances (tagged managed) whose pool
    # tag names p5 (or a pool that is no more); then, while it runs, two medium jobs of the
    # controller's for p4's 4 instances
    team_run = {"name": "teams-p4-run", "team": "research", "priority": "low", "pool": "p4", "instances": 2, "submit_at": 0,
                "duration": 3600, "launched_by": "team", "tags": {"preemptor:pool": tagged}}
    scenario = Scenario.model_validate(
        {
            "pools": [
                {"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 8, "gpus_per_instance": 8},
                {"name": "p4", "service": "sagemaker", "instance_type": "ml.p4d.24xlarge", "instances": 4, "gpus_per_instance": 8},
            ],
            "jobs": [
                team_run,
                {"name": "eval-a", "team": "applied", "priority": "medium", "pool": "p4", "instances": 2, "submit_at": 900, "duration": 1200},
                {"name": "eval-b", "team": "applied", "priority": "medium", "pool": "p4", "instances": 2, "submit_at": 900, "duration": 1200},
            ],
            "horizon": 7200,
        }
    )
    result = demo.run(scenario, tick_s=60)
    # Then the team's run is counted in p4, where it runs (before: refused, bad-demand or
    # unknown-pool, its 16 GPUs not counted; the controller launched both evals into p4's 4
    # instances, and the account's quota refused the second's launches, ResourceLimitExceeded,
    # one after another for as long as the team's run held its instances)
    [adopted] = [e for e in result.history if e["kind"] == "adopted"]
    assert adopted["detail"].startswith("16 GPUs counted in p4")
    assert f"its pool tag names {tagged!r}, and it runs on pool 'p4''s capacity (wrong-pool: not believed)" in adopted["detail"]
    assert result.quota_refusals == []
    # And one eval ran at once; the other preempted the team's run for its 2 instances, then
    # ran in them
    jobs = _jobs(result.report)
    assert jobs["eval-a"]["state"] == jobs["eval-b"]["state"] == "Completed"
    assert jobs["teams-p4-run"]["preemptions"] == 1
    [stopped] = [t for t in result.timeline if t.source == "controller" and t.job == "teams-p4-run" and t.what == "stop-requested"]
    assert "preempted by eval-" in stopped.why
    assert violations(result, scenario) == []


@pytest.mark.parametrize("until", [None, 3600], ids=["at-its-time-only", "until-it-runs"])
def test_a_spot_interruption_of_a_job_still_waiting_takes_its_run_once_it_has_one_when_told_until(until):
    from preemptor_tools.local import demo

    # Given a spot pool held by one job for 20 minutes, a second job waiting behind it, and
    # managed spot taking the second's instances 10 minutes in (it is still waiting then)
    scenario = Scenario.model_validate(
        {
            "pools": [{"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 8,
                       "gpus_per_instance": 8, "capacity_type": "spot"}],
            "jobs": [
                {"name": "first", "team": "a", "priority": "medium", "pool": "p5", "instances": 8, "submit_at": 0, "duration": 1200},
                {"name": "second", "team": "a", "priority": "medium", "pool": "p5", "instances": 8, "submit_at": 60, "duration": 1800,
                 "checkpoint_every": 300},
            ],
            "interruptions": [{"at": 600, "job": "second", "duration": 600, **({"until": until} if until else {})}],
            "horizon": 7200,
        }
    )
    result = demo.run(scenario, tick_s=60)
    # Then, at its time only, there is no run to take: nothing is interrupted
    interrupted = [e for e in result.history if e["job"] == "second" and e["kind"] == "spot-interrupted"]
    if until is None:
        assert not interrupted and [t.what for t in result.timeline if t.job == "second" and t.source == "workload"] == ["no interruption"]
        return
    # And told to wait until it runs, spot takes its run's instances a minute or so after
    # it started training, SageMaker restarts it, and the job still completes
    assert len(interrupted) == 1
    mine = [t for t in result.timeline if t.job == "second"]
    trained = next(t.at for t in mine if t.what == "SageMaker InProgress/Training")
    [taken] = [t.at for t in mine if t.what == "managed spot interrupted"]
    assert trained <= taken <= trained + 60
    assert _jobs(result.report)["second"]["state"] == "Completed" and _jobs(result.report)["second"]["interruptions"] == 1
    assert violations(result, scenario) == []
