"""Two invocations of one launch at once: Step Functions retries the Launch task on
Lambda.ClientExecutionTimeoutException while the first invocation may still be running, so
both create the run (the second is told ResourceInUse and finds it its own) and both try to
record it. The job's run must survive, whichever records it first."""

from __future__ import annotations

from typing import Callable

import boto3
import pytest
from aws_faults import aws_says_no, error_response
from moto import mock_aws
from template_support import table_key_schema

from preemptor.adapters.runners import SageMakerRunner, controller_tags
from preemptor.adapters.store import JobsStore
from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState
from preemptor.service import actions

REGION = "us-east-1"
REQUEST = {
    "AlgorithmSpecification": {"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1", "TrainingInputMode": "File"},
    "RoleArn": "arn:aws:iam::123456789012:role/training",
    "OutputDataConfig": {"S3OutputPath": "s3://preemptor-artifacts/out"},
    "ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100},
    "StoppingCondition": {"MaxRuntimeInSeconds": 86_400},
}


class _Overtaken(SageMakerRunner):
    """A runner whose launch is overtaken: before its own CreateTrainingJob goes out, the
    other invocation (`overtake`) runs its whole step; its own call is then told the name is
    in use, as SageMaker answers a second create of one name (moto would overwrite)."""

    def __init__(self, client, overtake: Callable[[], dict]):
        super().__init__(client)
        self.overtake: Callable[[], dict] | None = overtake
        self.overtaken: dict | None = None
        self.stops: list[tuple[str, str]] = []

    def launch(self, record, offering=None):
        if self.overtake is not None:
            overtake, self.overtake = self.overtake, None
            self.overtaken = overtake()
        with aws_says_no(self.client, "CreateTrainingJob", error_response("ResourceInUse", "Training job names must be unique within an AWS account and region", 400)):
            return super().launch(record, offering)

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
            checkpoint_s3_uri="s3://preemptor-checkpoints/vision/train-c", submitted_at=0.0,
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
