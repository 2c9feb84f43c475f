"""Two invocations of one launch at once: Step Functions retries the Launch task on
Lambda.ClientExecutionTimeoutException while the first invocation may still be running, so
both create the run (the second is told ResourceInUse and finds it its own) and both try to
record it. The job's run must survive, whichever records it first."""

from __future__ import annotations

import math
from typing import Callable

import boto3
import pytest
from aws_faults import THROTTLING, answer_lost_after_applied, aws_says_no, error_response
from emulation import batch_queues, emulation
from moto import mock_aws
from template_support import load_template, table_key_schema

from preemptor.adapters.runners import BatchRunner, SageMakerRunner, controller_tags
from preemptor.adapters.store import JobsStore
from preemptor.config import PoolConfig
from preemptor.core.errors import ServiceUnavailable, Throttled
from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState
from preemptor.service import actions
from preemptor.service.reconcile import STUCK_ADMISSION_S, launch_gave_up, repair_stuck_admission

REGION = "us-east-1"
REQUEST = {
    "AlgorithmSpecification": {"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1", "TrainingInputMode": "File"},
    "RoleArn": "arn:aws:iam::123456789012:role/training",
    "OutputDataConfig": {"S3OutputPath": "s3://preemptor-artifacts/out"},
    "ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100},
    "StoppingCondition": {"MaxRuntimeInSeconds": 86_400},
}
RUN_SECRET = "5e" * 32


def _copied_tags(record: JobRecord) -> dict[str, str]:
    """Every tag the controller's launch puts on the record's next run, but its token: what
    a team that read the job's earlier runs, or guessed, can copy."""
    return {k: v for k, v in controller_tags(record, "preemptor").items() if k != "preemptor:run-token"}


class _Overtaken(SageMakerRunner):
    """A runner whose launch is overtaken: before its own CreateTrainingJob goes out, the
    other invocation (`overtake`) runs its whole step; its own call is then told the name is
    in use, as SageMaker answers a second create of one name (moto would overwrite)."""

    def __init__(self, client, overtake: Callable[[], dict]):
        super().__init__(client)
        self.overtake: Callable[[], dict] | None = overtake
        self.overtaken: dict | None = None
        self.stops: list[tuple[str, str]] = []

    def launch(self, record, offering=None, offerings=()):
        if self.overtake is not None:
            overtake, self.overtake = self.overtake, None
            self.overtaken = overtake()
        with aws_says_no(self.client, "CreateTrainingJob", error_response("ResourceInUse", "Training job names must be unique within an AWS account and region", 400)):
            return super().launch(record, offering, offerings)

    def stop(self, run_id, reason):
        self.stops.append((run_id, reason))


@pytest.fixture
def world():
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name=REGION)
        dynamodb.create_table(TableName="jobs", BillingMode="PAY_PER_REQUEST", **table_key_schema())
        store = JobsStore("jobs", dynamodb)
        store.ensure_pool("p5", 64)
        record = JobRecord(
            name="train-c", team="vision", priority=100, pool="p5", service="sagemaker", gpus=8, request=REQUEST,
            checkpoint_s3_uri="s3://preemptor-checkpoints/vision/train-c", submitted_at=0.0, run_secret=RUN_SECRET,
        )
        assert store.put_new(record)
        record = store.require("train-c")
        store.transition(record, record.with_changes(status=JobState.ADMITTED, admitted_at=10.0), [JobState.PENDING], usage_delta=8, pool_limit=64)
        yield store, boto3.client("sagemaker", region_name=REGION)


def test_a_launch_overtaken_by_its_own_retry_keeps_the_run_the_retry_recorded(world):
    store, sagemaker = world
    # Given a launch whose retry, started while it still ran, creates and records the run first
    retry = lambda: actions.launch(store=store, runners={"sagemaker": SageMakerRunner(sagemaker)}, job="train-c", incarnation=1, now=20.0)
    slower = _Overtaken(sagemaker, retry)
    # When the slower invocation finds the name in use by its own run and comes to record it
    own = actions.launch(store=store, runners={"sagemaker": slower}, job="train-c", incarnation=1, now=21.0)
    # Then nothing is stopped: the run the table records is the job's run
    assert slower.stops == []
    job = store.require("train-c")
    assert (job.status, job.run_id) == (JobState.RUNNING, "train-c")
    # And both invocations answer that the job was launched on it
    assert [(r["launched"], r["run_id"]) for r in (slower.overtaken, own)] == [(True, "train-c"), (True, "train-c")]
    # And the launch is logged once
    assert [e["kind"] for e in store.history("train-c")].count("launched") == 1


def test_a_run_created_for_a_job_no_longer_admitted_is_still_withdrawn(world):
    store, sagemaker = world
    # Given a launch during which the job was released back to the queue (no run recorded)
    def release() -> dict:
        job = store.require("train-c")
        store.transition(job, job.with_changes(status=JobState.PENDING), [JobState.ADMITTED], usage_delta=-8)
        return {}

    slower = _Overtaken(sagemaker, release)
    sagemaker.create_training_job(TrainingJobName="train-c", **REQUEST, Tags=[{"Key": k, "Value": v} for k, v in _tags(store).items()])
    # When it comes to record its run
    result = actions.launch(store=store, runners={"sagemaker": slower}, job="train-c", incarnation=1, now=21.0)
    # Then that run, which nobody accounts for, is stopped
    assert result["reason"] == "job-moved"
    assert [run for run, _ in slower.stops] == ["train-c"]


def _tags(store: JobsStore) -> dict[str, str]:
    return controller_tags(store.require("train-c"))


# -- a launch that died between creating its run and recording it ---------------------------
STUCK = 10.0 + STUCK_ADMISSION_S + 1  # when reconcile finds train-c's admission stuck


def test_a_run_created_by_a_launch_that_died_before_recording_it_is_recorded_not_released(world):
    store, sagemaker = world
    # Given the launch created train-c's run, then its Lambda died before recording it
    sagemaker.create_training_job(TrainingJobName="train-c", **REQUEST, Tags=[{"Key": k, "Value": v} for k, v in _tags(store).items()])
    # When reconcile finds the admission stuck
    repair = repair_stuck_admission(store, SageMakerRunner(sagemaker), (), store.require("train-c"), STUCK)
    # Then the run is the job's: recorded as running, its GPUs still counted (released, they
    # would be admitted to another job while it runs: oversubscribed)
    assert repair["repair"] == "stuck-admission-recorded" and repair["run"] == "train-c"
    job = store.require("train-c")
    assert (job.status, job.run_id, job.run_name) == (JobState.RUNNING, "train-c", "train-c")
    assert store.pool("p5")["used_gpus"] == 8
    assert store.find_run("sagemaker", "train-c") == ("train-c", 1)
    assert [e["kind"] for e in store.history("train-c")] == ["launched"]


SAGEMAKER_OFFERINGS = ("ml.p5.48xlarge:spot", "ml.p5.48xlarge")


def test_a_run_reconcile_records_is_on_the_offering_it_was_created_on(world):
    store, sagemaker = world
    # Given a pool that launches on spot first, and a launch that created train-c's run on
    # spot and died before recording it
    SageMakerRunner(sagemaker).launch(store.require("train-c"), "ml.p5.48xlarge:spot", SAGEMAKER_OFFERINGS)
    # When reconcile finds the admission stuck and records the run
    repair_stuck_admission(store, SageMakerRunner(sagemaker), SAGEMAKER_OFFERINGS, store.require("train-c"), STUCK)
    # Then the job runs on spot as the launch would have recorded it, and its history says so
    job = store.require("train-c")
    assert job.launched_instance_type == "ml.p5.48xlarge:spot"
    assert "on ml.p5.48xlarge (spot)" in store.history("train-c")[-1]["detail"]
    # And when that run meets no capacity, spot is avoided for a while: the next launch
    # goes on demand instead of back to the offering that had none
    actions.finish(store=store, policy=None, job="train-c", incarnation=1, outcome="capacity-error", reason="InsufficientCapacity", now=STUCK + 60)
    assert store.unavailable_offerings("p5", STUCK + 61) == {"ml.p5.48xlarge:spot"}


def test_a_stuck_admission_with_no_run_goes_back_to_the_queue(world):
    store, sagemaker = world
    repair = repair_stuck_admission(store, SageMakerRunner(sagemaker), (), store.require("train-c"), STUCK)
    assert repair["repair"] == "stuck-admission-released"
    assert store.require("train-c").status is JobState.PENDING and store.pool("p5")["used_gpus"] == 0


def test_a_stuck_admission_whose_run_cannot_be_looked_up_keeps_its_gpus(world):
    store, sagemaker = world
    # Given SageMaker throttles the look-up of the run the launch may have created
    with aws_says_no(sagemaker, "DescribeTrainingJob", THROTTLING["sagemaker"]):
        with pytest.raises(Throttled):
            repair_stuck_admission(store, SageMakerRunner(sagemaker), (), store.require("train-c"), STUCK)
    # Then nothing is released on a guess: the job stays admitted, its GPUs counted
    assert store.require("train-c").status is JobState.ADMITTED and store.pool("p5")["used_gpus"] == 8


BATCH_QUEUES = ("g5-queue", "g5-spot")


@pytest.fixture
def batch_world():
    # The emulated stack's Batch: jobs wait for the fleet (plain moto runs them in Docker)

    with emulation() as env:
        batch_queues(env, *BATCH_QUEUES)
        record = JobRecord(
            name="train-b", team="vision", priority=100, pool="g5", service="batch", gpus=8,
            request={"jobQueue": "g5-queue", "jobDefinition": "g5-training"},
            checkpoint_s3_uri="s3://preemptor-checkpoints/vision/train-b", submitted_at=0.0, status=JobState.ADMITTED,
            run_secret=RUN_SECRET,
        )
        yield env.stack.client("batch"), record


def _live_jobs(batch) -> list[str]:
    return [
        j["jobId"] for queue in BATCH_QUEUES for status in ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING")
        for j in batch.list_jobs(jobQueue=queue, jobStatus=status)["jobSummaryList"]
    ]


def test_a_batch_launch_retried_on_another_queue_of_the_pool_takes_the_job_its_first_attempt_submitted(batch_world):
    batch, record = batch_world
    runner = BatchRunner(batch)
    # Given a first attempt that submitted to the pool's fallback queue, then died
    first = runner.launch(record, "g5-spot", BATCH_QUEUES)
    # When the retry chooses the pool's own queue (the unavailable-offerings cache moved on)
    second = runner.launch(record, "g5-queue", BATCH_QUEUES)
    # Then it found the first job, in the other queue, and submitted nothing
    assert second == first and _live_jobs(batch) == [first]


def test_a_batch_submit_is_sent_once_and_no_answer_is_retryable_after_a_look(batch_world):
    batch, record = batch_world
    # Given SubmitJob reaches Batch, which submits the job, and the answer is lost
    runner = BatchRunner(batch, submit_client=batch)
    with answer_lost_after_applied(batch, "SubmitJob") as lost:
        with pytest.raises(ServiceUnavailable):
            runner.launch(record, None, BATCH_QUEUES)
    assert len(lost) == 1 and len(_live_jobs(batch)) == 1
    # When the step is retried, Then it takes that job: one job, never two
    assert runner.launch(record, None, BATCH_QUEUES) == _live_jobs(batch)[0]
    assert len(_live_jobs(batch)) == 1


@pytest.mark.parametrize("fault", ["throttle", "answer-lost"])
def test_the_controllers_batch_submit_is_sent_again_after_a_throttle_and_never_after_a_lost_answer(fault: str):
    # botocore's own retries would resend a SubmitJob whose answer was lost: a second job.
    # A throttled SubmitJob was refused, nothing submitted: sending it again is safe
    from emulation import START

    from preemptor_tools.local.hostile import HostileWorld
    from preemptor_tools.local.scenario import Chaos

    with emulation(hostile=lambda clock: HostileWorld(clock, START)) as env:
        batch_queues(env, *BATCH_QUEUES)
        batch, world = env.stack.client("batch"), env.stack.hostile
        runner = env.stack.deps().runners["batch"]  # the functions' own clients
        kind, rate = ("throttle", "throttle_rate") if fault == "throttle" else ("answer-lost", "answer_lost_rate")
        # Given, for some seed, a launch whose first SubmitJob attempt meets the fault
        for seed in range(64):
            world.chaos = Chaos(seed=seed, **{rate: 0.5})
            before = len(world.injected)
            record = JobRecord(
                name=f"train-{seed}", team="vision", priority=100, pool="g5", service="batch", gpus=8,
                request={"jobQueue": "g5-queue", "jobDefinition": "g5-training"},
                checkpoint_s3_uri=f"s3://preemptor-checkpoints/vision/train-{seed}", submitted_at=0.0, status=JobState.ADMITTED,
            )
            with HostileWorld.acting_as("preemptor-JobControlFunction"):
                try:
                    launched: object = runner.launch(record, None, BATCH_QUEUES)
                except Exception as e:  # noqa: BLE001 - what the launch step would see
                    launched = e
            submits = [i for i in world.injected[before:] if i.kind == kind and i.detail.startswith("batch:SubmitJob")]
            if len(submits) == 1:
                break
        else:
            pytest.fail(f"no seed in 64 met one {kind} on a SubmitJob")
        world.chaos = Chaos()
        jobs = [j for q in BATCH_QUEUES for j in batch.list_jobs(jobQueue=q, filters=[{"name": "JOB_NAME", "values": [record.next_run_name]}])["jobSummaryList"]]
        # Then the throttled submit was sent again and submitted one job; the one whose answer
        # was lost was not sent again (the launch step's retry looks for it first): one job
        assert len(jobs) == 1
        if fault == "throttle":
            assert launched == jobs[0]["jobId"]
        else:
            assert isinstance(launched, ServiceUnavailable), launched
            assert runner.launch(record, None, BATCH_QUEUES) == jobs[0]["jobId"]


def test_every_client_of_the_functions_gives_a_hung_call_up_within_the_functions_time():
    # A call that hangs (no answer, the connection open) must fail while its function can
    # still act on the failure: under botocore's default timeouts (60 s to connect, 60 s to
    # read) Lambda kills the function during the first attempt, what it held left to expire
    from preemptor.handlers.wiring import attempts_end_within
    from preemptor.service.reconcile import SECOND_LOOK_WITHIN_S

    template = load_template()
    default = template["Globals"]["Function"]["Timeout"]
    shortest = min(
        r["Properties"].get("Timeout", default) for r in template["Resources"].values() if r["Type"] == "AWS::Serverless::Function"
    )
    with emulation() as env:
        deps = env.stack.deps()
        clients = [deps.store.client, deps.checkpoints.client, deps.workflows.client, deps.instances.ecs, deps.alerts.client, deps.quotas.client]
        for runner in deps.runners.values():
            clients += [runner.client, getattr(runner, "submit_client", runner.client)]
        # Then each attempt has its own short timeouts, and every attempt with its backoff
        # ends before the shortest function's timeout, with time to spare for its work
        for client in clients:
            config = client.meta.config
            assert config.connect_timeout <= 5 and config.read_timeout <= 15, client.meta.service_model.service_name
            assert attempts_end_within(config) <= 0.75 * shortest, (client.meta.service_model.service_name, attempts_end_within(config))
            # (and reconcile takes its second look at what failed only with that much time left)
            assert attempts_end_within(config) <= SECOND_LOOK_WITHIN_S


def test_a_run_name_someone_else_took_is_skipped_by_the_next_attempt(world):
    store, sagemaker = world
    # Given a training job named train-c created outside the controller (not this job's)
    sagemaker.create_training_job(TrainingJobName="train-c", **REQUEST)
    runners = {"sagemaker": SageMakerRunner(sagemaker)}
    # When train-c's launch meets the name in use (SageMaker refuses a second create of a
    # name; moto would overwrite the first)
    in_use = error_response("ResourceInUse", "Training job names must be unique within an AWS account and region", 400)
    with aws_says_no(sagemaker, "CreateTrainingJob", lambda params: in_use if params.get("TrainingJobName") == "train-c" else None):
        refused = actions.launch(store=store, runners=runners, job="train-c", incarnation=1, now=20.0)
    # Then the attempt is refused and counted, and the next one is under the next name
    assert refused["launched"] is False and refused["attempts"] == 1
    job = store.require("train-c")
    assert (job.status, job.incarnation, job.next_run_name) == (JobState.PENDING, 2, "train-c-r2")
    # And once admitted again it launches as train-c-r2, never on the other run
    store.transition(job, job.with_changes(status=JobState.ADMITTED, admitted_at=200.0), [JobState.PENDING], usage_delta=8, pool_limit=64)
    launched = actions.launch(store=store, runners=runners, job="train-c", incarnation=2, now=201.0)
    assert launched["launched"] is True and launched["run_id"] == "train-c-r2"


def test_a_training_job_a_team_created_with_the_name_and_tags_of_the_run_to_come_is_never_taken_for_it(world):
    store, sagemaker = world
    record = store.require("train-c")
    # Given a team's training job created before the launch under the name and with every
    # tag of the run the launch is about to create (before: the launch found the name "its
    # own" and took the team's run, whatever it ran and held, for the job's)
    tags = [{"Key": k, "Value": v} for k, v in _copied_tags(record).items()]
    sagemaker.create_training_job(TrainingJobName="train-c", **REQUEST, Tags=tags)
    runners = {"sagemaker": SageMakerRunner(sagemaker, "preemptor")}
    assert runners["sagemaker"].find_run(record) is None
    # When the launch meets the name in use
    in_use = error_response("ResourceInUse", "Training job names must be unique within an AWS account and region", 400)
    with aws_says_no(sagemaker, "CreateTrainingJob", lambda params: in_use if params.get("TrainingJobName") == "train-c" else None):
        refused = actions.launch(store=store, runners=runners, job="train-c", incarnation=1, now=20.0)
    # Then the name counts as taken by another run: the next attempt is the next incarnation
    assert refused["launched"] is False and "belongs to another run" in refused["error"]
    job = store.require("train-c")
    assert (job.status, job.incarnation, job.run_id) == (JobState.PENDING, 2, None)
    # And the run the controller then creates carries the token its job's secret gives it
    store.transition(job, job.with_changes(status=JobState.ADMITTED, admitted_at=200.0), [JobState.PENDING], usage_delta=8, pool_limit=64)
    launched = actions.launch(store=store, runners=runners, job="train-c", incarnation=2, now=201.0)
    assert launched["run_id"] == "train-c-r2"
    [line] = [e for e in store.history("train-c") if e["kind"] == "relaunched"]
    assert line["detail"] == "train-c-r2: a new run under the next name: an earlier one was taken by another run (nothing trained yet)"
    found = runners["sagemaker"].find_run(store.require("train-c"))
    assert found is not None and found.tags["preemptor:run-token"] == job.run_token_of(2) != job.run_token_of(1)


def test_a_batch_job_a_team_submitted_with_the_name_and_tags_of_the_run_to_come_is_never_taken_for_it(batch_world):
    batch, record = batch_world
    runner = BatchRunner(batch, controller="preemptor")
    # Given a team's job in the pool's queue under the name and with every tag of the run the
    # launch is about to submit (before: the launch's look for an earlier attempt's job
    # returned it, and submitted nothing)
    copy = batch.submit_job(jobName="train-b", jobQueue="g5-queue", jobDefinition="g5-training", tags=_copied_tags(record))["jobId"]
    # When the launch runs
    launched = runner.launch(record, None, BATCH_QUEUES)
    # Then it submitted the job's own run, with the token, and it alone is found as the job's
    assert launched != copy and sorted(_live_jobs(batch)) == sorted([copy, launched])
    found = runner.find_run(record, BATCH_QUEUES)
    assert found is not None and found.run_id == launched and found.tags["preemptor:run-token"] == record.run_token_of(1)


def test_a_batch_run_reconcile_records_in_a_fallback_queue_is_judged_by_that_queue():

    with emulation() as env:
        batch_queues(env, *BATCH_QUEUES)
        store, batch = env.store, env.stack.client("batch")
        store.ensure_pool("g5", 32)
        record = JobRecord(
            name="train-b", team="vision", priority=100, pool="g5", service="batch", gpus=8,
            request={"jobQueue": "g5-queue", "jobDefinition": "g5-training"},
            checkpoint_s3_uri="s3://preemptor-checkpoints/vision/train-b", submitted_at=0.0,
        )
        assert store.put_new(record)
        record = store.require("train-b")
        store.transition(record, record.with_changes(status=JobState.ADMITTED, admitted_at=10.0), [JobState.PENDING], usage_delta=8, pool_limit=32)
        # Given a launch that submitted to the fallback queue and died before recording it
        BatchRunner(batch).launch(store.require("train-b"), "g5-spot", BATCH_QUEUES)
        # When reconcile records the run it finds there
        repair_stuck_admission(store, BatchRunner(batch), BATCH_QUEUES, store.require("train-b"), STUCK)
        # Then the job is in that queue, as the launch would have recorded it
        job = store.require("train-b")
        assert job.launched_instance_type == "g5-spot" and "in g5-spot" in store.history("train-b")[-1]["detail"]
        # And when it never finds instances there, that queue is the one avoided, not the
        # pool's own queue it never ran in
        actions.no_capacity_in_queue(store=store, runners={"batch": BatchRunner(batch)}, record=job, reason="RUNNABLE for 900 s", now=STUCK + 900)
        assert store.unavailable_offerings("g5", STUCK + 901) == {"g5-spot"}


def test_a_batch_run_of_a_dead_launch_that_already_ended_is_recorded_not_run_again():

    from preemptor_tools.local.moto_patches import set_batch_job_status

    with emulation() as env:
        batch_queues(env, *BATCH_QUEUES)
        store, batch = env.store, env.stack.client("batch")
        store.ensure_pool("g5", 32)
        record = JobRecord(
            name="train-b", team="vision", priority=100, pool="g5", service="batch", gpus=8,
            request={"jobQueue": "g5-queue", "jobDefinition": "g5-training"},
            checkpoint_s3_uri="s3://preemptor-checkpoints/vision/train-b", submitted_at=0.0,
        )
        assert store.put_new(record)
        record = store.require("train-b")
        store.transition(record, record.with_changes(status=JobState.ADMITTED, admitted_at=10.0), [JobState.PENDING], usage_delta=8, pool_limit=32)
        # Given a launch that submitted to the fallback queue and died; the job then ran and
        # succeeded (its end event was its own run's, which the intake leaves to the launch)
        run = BatchRunner(batch).launch(store.require("train-b"), "g5-spot", BATCH_QUEUES)
        set_batch_job_status(run, "RUNNING")
        set_batch_job_status(run, "SUCCEEDED")
        # When reconcile finds the admission stuck
        repair = repair_stuck_admission(store, BatchRunner(batch), BATCH_QUEUES, store.require("train-b"), STUCK)
        # Then that job is recorded as the job's run (its end next), not released to run again
        assert repair["repair"] == "stuck-admission-recorded" and repair["run"] == run
        assert store.require("train-b").status is JobState.RUNNING
        assert len(_live_jobs(batch)) == 0


# -- a launch step that gave up -------------------------------------------------------------


def test_launches_given_up_in_a_row_back_off_longer_each_time_up_to_a_bound_and_a_launch_forgets_them(world):
    store, sagemaker = world
    runners = {"sagemaker": SageMakerRunner(sagemaker)}
    waits = []
    for n in range(1, 7):
        # Given the job admitted again, and its launch step given up once more (no run created)
        if n > 1:
            job = store.require("train-c")
            store.transition(job, job.with_changes(status=JobState.ADMITTED, admitted_at=1000.0 * n), [JobState.PENDING], usage_delta=8, pool_limit=64)
        result = launch_gave_up(store, runners, {}, "train-c", 1, "Throttled", 1000.0 * n + 5)
        # Then it is back in the queue, its GPUs released, behind a backoff
        job = store.require("train-c")
        assert result["released"] and job.status is JobState.PENDING and job.launches_given_up == n
        assert store.pool("p5")["used_gpus"] == 0 and job.last_launch_error == "Throttled"
        assert result["wait_s"] == math.ceil(job.not_before - (1000.0 * n + 5))
        waits.append(job.not_before - (1000.0 * n + 5))
    # And the backoff doubles (60 s x 2^(n-1), plus up to as much again) up to the fourth
    assert 60 <= waits[0] <= 120 and 480 <= waits[3] <= 960
    assert all(a < b for a, b in zip(waits[:4], waits[1:4]))
    assert waits[4:] == pytest.approx([actions.gave_up_backoff_s("train-c", 4)] * 2)
    # And a launch that goes through forgets them
    job = store.require("train-c")
    store.transition(job, job.with_changes(status=JobState.ADMITTED, admitted_at=9000.0), [JobState.PENDING], usage_delta=8, pool_limit=64)
    assert actions.launch(store=store, runners=runners, job="train-c", incarnation=1, now=9001.0)["launched"]
    assert store.require("train-c").launches_given_up == 0


def test_a_launch_given_up_after_the_job_moved_on_leaves_it_alone(world):
    store, sagemaker = world
    runners = {"sagemaker": SageMakerRunner(sagemaker)}
    # Given the launch was recorded meanwhile (a retry of the step that overlapped it)
    assert actions.launch(store=store, runners=runners, job="train-c", incarnation=1, now=20.0)["launched"]
    # When the give-up step of the older attempt runs, and again for an older incarnation
    assert launch_gave_up(store, runners, {}, "train-c", 1, "Lambda.Unknown", 60.0) == {"released": False, "reason": "not-admitted"}
    assert launch_gave_up(store, runners, {}, "train-c", 2, "Lambda.Unknown", 60.0)["reason"] == "not-admitted"
    # Then the running job is untouched
    job = store.require("train-c")
    assert job.status is JobState.RUNNING and job.launches_given_up == 0 and store.pool("p5")["used_gpus"] == 8


def _quota_refused(limit: int, quota: str = "ml.p5.48xlarge for training job usage") -> dict:
    return error_response(
        "ResourceLimitExceeded",
        f"The account-level service limit '{quota}' is {limit} Instances, with current utilization of {limit} Instances and a "
        "request delta of 1 Instances. Please use AWS Service Quotas to request an increase for this quota.",
        400,
    )


P5_POOL = PoolConfig(name="p5", instance_type="ml.p5.48xlarge", instances=8, gpus_per_instance=8)


@pytest.mark.parametrize(
    "pool, refusal, planned_at",
    [
        (P5_POOL, _quota_refused(6), 48),
        # A pool sized in GPUs of its instance type
        (P5_POOL.model_copy(update={"instances": None, "gpus": 64}), _quota_refused(6), 48),
        # A quota that covers the pool: runs outside it hold the rest, nothing to learn
        (P5_POOL, _quota_refused(8), 64),
        # Another offering of the pool may have the room: the refused one is only avoided
        (P5_POOL.model_copy(update={"fallback_instance_types": ("ml.p5e.48xlarge",)}), _quota_refused(6), 64),
        # The spot pool's own quota is the spot one
        (P5_POOL.model_copy(update={"capacity_type": "spot"}), _quota_refused(6), 64),
        (P5_POOL.model_copy(update={"capacity_type": "spot"}), _quota_refused(6, "ml.p5.48xlarge for spot training job usage"), 48),
        # Another limit: nothing to learn of the pool
        (P5_POOL, error_response("ResourceLimitExceeded", "The account-level service limit 'Number of training jobs' is 10", 400), 64),
    ],
    ids=["below-the-pool", "below-a-pool-of-gpus", "covering-the-pool", "pool-with-a-fallback", "on-demand-quota-of-a-spot-pool", "spot-quota-of-a-spot-pool", "another-limit"],
)
def test_a_launch_over_a_quota_below_the_pool_plans_the_pool_at_the_quota_for_a_while(world, pool, refusal, planned_at):
    store, sagemaker = world
    runners = {"sagemaker": SageMakerRunner(sagemaker)}
    # When train-c's launch is refused by the account's quota
    with aws_says_no(sagemaker, "CreateTrainingJob", refusal):
        refused = actions.launch(store=store, runners=runners, job="train-c", incarnation=1, now=20.0, pools={"p5": pool})
    # Then it waits for capacity, and the pool is planned at what the quota leaves it (when
    # it is the pool's own offering's, and below the pool), for QUOTA_MEMORY_S only
    assert refused["launched"] is False and refused["reason"] == "no-capacity"
    item = store.pool("p5")
    assert store.quota_capacity_gpus(item, pool.capacity_gpus, 21.0) == planned_at
    assert store.quota_capacity_gpus(item, pool.capacity_gpus, 20.0 + actions.QUOTA_MEMORY_S) == 64
    assert bool(refused.get("quota_shortfall")) is (planned_at < 64)
    [wait] = [e for e in store.history("train-c") if e["kind"] == "capacity-wait"]
    assert ("below pool p5's 64 GPUs: planned at 48 GPUs" in wait["detail"]) is (planned_at < 64)


def test_a_quota_below_the_pool_that_could_not_be_written_leaves_the_launch_a_capacity_wait(world):
    store, sagemaker = world
    runners = {"sagemaker": SageMakerRunner(sagemaker)}
    dynamodb = store.client
    # When the launch meets a quota below the pool, and DynamoDB throttles the write of it
    with aws_says_no(sagemaker, "CreateTrainingJob", _quota_refused(6)), aws_says_no(
        dynamodb, "UpdateItem", lambda params: THROTTLING["dynamodb"] if ":cap" in params.get("ExpressionAttributeValues", {}) else None
    ):
        refused = actions.launch(store=store, runners=runners, job="train-c", incarnation=1, now=20.0, pools={"p5": P5_POOL})
    # Then the job waits for capacity all the same (the next refusal tells the quota again)
    assert refused["launched"] is False and refused["reason"] == "no-capacity" and "quota_shortfall" not in refused
    assert store.require("train-c").status is JobState.PENDING
    assert store.quota_capacity_gpus(store.pool("p5"), 64, 21.0) == 64
