"""The adapters under the answers real AWS gives and moto never does (issue 8, findings 4
and 6; DESIGN.md section 7): each AWS error shape becomes the domain error that tells the
caller what to do (retry, re-read, treat as gone, give up)."""

from __future__ import annotations

import boto3
import pytest
from aws_faults import SAGEMAKER_NOT_FOUND, THROTTLING, aws_says_no, error_response
from botocore.exceptions import ClientError
from botocore.retries.standard import ThrottledRetryableChecker
from moto import mock_aws

from preemptor.adapters.checkpoints import CheckpointStore
from preemptor.adapters.errors import THROTTLING_CODES, ErrorKind, classify, translate
from preemptor.adapters.runners import BatchRunner, SageMakerRunner, controller_tags
from preemptor.adapters.workflows import WorkflowStarter
from preemptor.core.errors import (
    AccessDenied,
    CheckpointLocationUnavailable,
    ConflictError,
    Retryable,
    RunNameTaken,
    ServiceJobNotFound,
    ServiceRejected,
    ServiceUnavailable,
    Throttled,
    TransactionConflict,
)
from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/training"


def _client_error(response: dict, operation: str = "Op") -> ClientError:
    return ClientError(response, operation)


# -- classification ------------------------------------------------------------------------


def test_every_throttling_code_botocore_retries_is_a_throttling_code_here():
    # Given botocore's standard retry mode's own list of throttling codes
    botocore_codes = set(ThrottledRetryableChecker._THROTTLED_ERROR_CODES)
    # Then the one list the adapters use has all of them
    assert botocore_codes <= THROTTLING_CODES


@pytest.mark.parametrize(
    "response, expected",
    [
        pytest.param(THROTTLING["dynamodb"], Throttled, id="dynamodb-throttling"),
        pytest.param(error_response("ProvisionedThroughputExceededException", "", 400), Throttled, id="dynamodb-throughput"),
        pytest.param(THROTTLING["batch"], Throttled, id="batch-too-many-requests"),
        pytest.param(THROTTLING["s3"], Throttled, id="s3-slow-down"),
        pytest.param(error_response("InternalServerError", "Internal server error", 500), ServiceUnavailable, id="dynamodb-500"),
        pytest.param(error_response("ServiceUnavailable", "", 503), ServiceUnavailable, id="service-unavailable-503"),
        pytest.param(error_response("InternalFailure", "", 500), ServiceUnavailable, id="internal-failure"),
        pytest.param(error_response("SomethingNew", "", 502), ServiceUnavailable, id="unknown-code-with-5xx-status"),
        pytest.param(error_response("ValidationException", "1 validation error detected", 400), ServiceRejected, id="validation"),
        pytest.param(error_response("ResourceLimitExceeded", "quota", 400), ServiceRejected, id="sagemaker-quota"),
        pytest.param(error_response("AccessDeniedException", "not authorized", 400), AccessDenied, id="access-denied"),
        pytest.param(error_response("ResourceNotFound", "", 400), ServiceJobNotFound, id="not-found"),
        pytest.param(error_response("ConditionalCheckFailedException", "", 400), ConflictError, id="condition-failed"),
    ],
)
def test_error_codes_become_the_domain_error_that_says_what_to_do(response, expected):
    error = translate(_client_error(response), "call")
    assert type(error) is expected
    # And retryable means exactly: throttling, 5xx, transaction conflicts
    assert isinstance(error, Retryable) == (expected in (Throttled, ServiceUnavailable, TransactionConflict))


@pytest.mark.parametrize(
    "reasons, expected",
    [
        pytest.param(["TransactionConflict", "None"], ErrorKind.TRANSACTION_CONFLICT, id="conflict-is-retried"),
        pytest.param(["ConditionalCheckFailed", "None"], ErrorKind.CONDITION_FAILED, id="condition-is-judged"),
        pytest.param(["None", "ConditionalCheckFailed"], ErrorKind.CONDITION_FAILED, id="capacity-condition"),
        pytest.param(["ConditionalCheckFailed", "TransactionConflict"], ErrorKind.CONDITION_FAILED, id="condition-wins"),
        pytest.param(["ThrottlingError", "None"], ErrorKind.THROTTLED, id="throttled-item"),
        pytest.param(["ValidationError"], ErrorKind.REJECTED, id="validation"),
    ],
)
def test_a_cancelled_transaction_is_judged_by_its_cancellation_reasons(reasons, expected):
    response = error_response(
        "TransactionCanceledException", "Transaction cancelled", 400, CancellationReasons=[{"Code": r} for r in reasons]
    )
    assert classify(_client_error(response, "TransactWriteItems")) is expected


# -- SageMaker -----------------------------------------------------------------------------


def _record(name: str = "train-a", incarnation: int = 1, service: str = "sagemaker", request: dict | None = None) -> JobRecord:
    return JobRecord(
        name=name,
        team="vision",
        priority=200,
        pool="p5",
        service=service,
        gpus=8,
        request=request if request is not None else _sagemaker_request(),
        checkpoint_s3_uri=f"s3://preemptor-checkpoints/vision/{name}",
        submitted_at=0.0,
        status=JobState.ADMITTED,
        incarnation=incarnation,
    )


def _sagemaker_request() -> dict:
    return {
        "AlgorithmSpecification": {"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/t:1", "TrainingInputMode": "File"},
        "RoleArn": ROLE,
        "OutputDataConfig": {"S3OutputPath": "s3://preemptor-artifacts/out"},
        "ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100},
        "StoppingCondition": {"MaxRuntimeInSeconds": 86400},
    }


@pytest.fixture
def sagemaker():
    with mock_aws():
        yield boto3.client("sagemaker", region_name=REGION)


def test_describe_of_a_missing_training_job_in_its_real_shape_is_not_found(sagemaker):
    # Given SageMaker's real answer for a missing job: ValidationException "Requested resource not found."
    runner = SageMakerRunner(sagemaker)
    with aws_says_no(sagemaker, "DescribeTrainingJob", SAGEMAKER_NOT_FOUND):
        # When the controller reads the run's state
        with pytest.raises(ServiceJobNotFound):
            runner.state("gone-job")
    # And the emulated SageMaker's own wording of it means the same
    with pytest.raises(ServiceJobNotFound):
        runner.state("gone-job")


def test_a_validation_error_that_is_not_a_missing_job_stays_a_rejection(sagemaker):
    runner = SageMakerRunner(sagemaker)
    other = error_response("ValidationException", "1 validation error detected: Value 'x_y' at 'trainingJobName'", 400)
    with aws_says_no(sagemaker, "DescribeTrainingJob", other):
        with pytest.raises(ServiceRejected) as raised:
            runner.state("x_y")
    assert not isinstance(raised.value, ServiceJobNotFound)


def test_a_name_in_use_by_this_incarnation_is_our_own_earlier_launch(sagemaker):
    # Given an earlier attempt of this launch that created the run, then timed out
    runner = SageMakerRunner(sagemaker)
    record = _record()
    assert runner.launch(record) == "train-a"
    # When the retried launch is told the name is in use
    with aws_says_no(sagemaker, "CreateTrainingJob", error_response("ResourceInUse", "Training job names must be unique", 400)):
        name = runner.launch(record)
    # Then the existing run is taken as ours (its tags name this job and incarnation)
    assert name == "train-a"


def test_a_name_in_use_by_someone_else_is_a_terminal_conflict_not_our_run(sagemaker):
    # Given a training job of the same name created outside the controller
    sagemaker.create_training_job(TrainingJobName="train-a", **_sagemaker_request(), Tags=[{"Key": "owner", "Value": "someone"}])
    runner = SageMakerRunner(sagemaker)
    # When the controller launches its job of that name and SageMaker answers ResourceInUse
    with aws_says_no(sagemaker, "CreateTrainingJob", error_response("ResourceInUse", "Training job names must be unique", 400)):
        with pytest.raises(RunNameTaken) as raised:
            runner.launch(_record())
    # Then it is a rejection (terminal: the same name will be refused again), not a success
    assert isinstance(raised.value, ServiceRejected) and raised.value.code == "ResourceInUse"


def test_a_name_in_use_by_an_older_incarnation_is_not_this_launch(sagemaker):
    runner = SageMakerRunner(sagemaker)
    first = _record()
    runner.launch(first)
    # When incarnation 2's launch finds the name taken (it should be `train-a-r2`; here a
    # run of that name carries incarnation 1's tags)
    second = _record(incarnation=2)
    tags = [{"Key": k, "Value": v} for k, v in controller_tags(first).items()]
    sagemaker.create_training_job(TrainingJobName="train-a-r2", **_sagemaker_request(), Tags=tags)
    with aws_says_no(sagemaker, "CreateTrainingJob", error_response("ResourceInUse", "", 400)):
        with pytest.raises(RunNameTaken):
            runner.launch(second)


@pytest.mark.parametrize(
    "response, expected",
    [
        pytest.param(error_response("InternalFailure", "", 500), ServiceUnavailable, id="5xx-is-retryable"),
        pytest.param(THROTTLING["sagemaker"], Throttled, id="throttling-is-retryable"),
        pytest.param(error_response("ResourceLimitExceeded", "account quota", 400), ServiceRejected, id="quota-is-a-rejection"),
    ],
)
def test_create_training_job_errors(sagemaker, response, expected):
    with aws_says_no(sagemaker, "CreateTrainingJob", response):
        with pytest.raises(expected):
            SageMakerRunner(sagemaker).launch(_record())


def test_a_request_botocore_refuses_to_send_is_a_rejection_not_a_crash(sagemaker):
    # Given a request missing what CreateTrainingJob requires (botocore checks it against
    # the API model and raises before anything is sent)
    broken = {k: v for k, v in _sagemaker_request().items() if k != "RoleArn"}
    # Then the launch is refused for good (counted, backed off, then failed with the
    # reason), never an unknown error that fails the workflow step again and again
    with pytest.raises(ServiceRejected) as refused:
        SageMakerRunner(sagemaker).launch(_record(request=broken))
    assert refused.value.code == "ParamValidation" and "RoleArn" in str(refused.value)
    assert sagemaker.list_training_jobs()["TrainingJobSummaries"] == []


def test_a_denied_stop_is_access_denied(sagemaker):
    # Given a run the controller may not stop (IAM: only runs tagged preemptor:managed=true)
    sagemaker.create_training_job(TrainingJobName="adopted", **_sagemaker_request())
    denied = error_response("AccessDeniedException", "User is not authorized to perform: sagemaker:StopTrainingJob", 400)
    with aws_says_no(sagemaker, "StopTrainingJob", denied):
        with pytest.raises(AccessDenied):
            SageMakerRunner(sagemaker).stop("adopted", "preemptor: preempted")


# -- Batch ---------------------------------------------------------------------------------


@pytest.fixture
def batch():
    with mock_aws():
        yield boto3.client("batch", region_name=REGION)


def test_batch_describe_of_an_unknown_job_is_not_found(batch):
    # Batch answers a job id it does not know with an empty list, not an error
    with pytest.raises(ServiceJobNotFound):
        BatchRunner(batch).state("00000000-0000-0000-0000-000000000000")


def test_batch_throttling_is_retryable(batch):
    with aws_says_no(batch, "DescribeJobs", THROTTLING["batch"]):
        with pytest.raises(Throttled):
            BatchRunner(batch).state("some-job")


def test_a_batch_job_that_moves_on_between_two_status_listings_is_one_live_run(batch):
    from botocore.stub import Stubber

    # Given a job listed RUNNABLE, then (started meanwhile) RUNNING as the next listings ran
    listed = {"RUNNABLE": ["job-a"], "RUNNING": ["job-a", "job-b"]}
    summary = lambda i: {"jobId": i, "jobName": i}  # noqa: E731
    with Stubber(batch) as stub:
        for status in BatchRunner._LIVE:
            stub.add_response(
                "list_jobs", {"jobSummaryList": [summary(i) for i in listed.get(status, [])]}, {"jobQueue": "q", "jobStatus": status}
            )
        described = [
            {"jobId": i, "jobName": i, "jobArn": f"arn:{i}", "jobQueue": "q", "status": "RUNNING", "jobDefinition": "d", "createdAt": 1000, "startedAt": 1000}
            for i in ("job-a", "job-b")
        ]
        # Then it is described once (the stub asserts the ids asked for), and is one run
        stub.add_response("describe_jobs", {"jobs": described}, {"jobs": ["job-a", "job-b"]})
        runs = BatchRunner(batch).live_runs("q")
        stub.assert_no_pending_responses()
    assert [r.run_id for r in runs] == ["job-a", "job-b"]


# -- S3 checkpoints --------------------------------------------------------------------------


@pytest.fixture
def s3():
    with mock_aws():
        client = boto3.client("s3", region_name=REGION)
        client.create_bucket(Bucket="preemptor-checkpoints")
        yield client


def test_a_checkpoint_location_in_a_bucket_that_does_not_exist_is_that_jobs_problem(s3):
    # When the newest checkpoint is read from a bucket that does not exist (NoSuchBucket)
    with pytest.raises(CheckpointLocationUnavailable) as raised:
        CheckpointStore(s3).newest("s3://no-such-bucket-anywhere/team/job")
    # Then the error is typed, with the AWS code as its reason
    assert raised.value.code == "NoSuchBucket"


def test_a_checkpoint_location_the_controller_may_not_list_is_that_jobs_problem(s3):
    denied = error_response("AccessDenied", "Access Denied", 403)
    with aws_says_no(s3, "ListObjectsV2", denied):
        with pytest.raises(CheckpointLocationUnavailable) as raised:
            CheckpointStore(s3).newest("s3://preemptor-checkpoints/team/job")
    assert raised.value.code == "AccessDenied"


def test_a_checkpoint_request_to_a_denied_location_is_that_jobs_problem(s3):
    with aws_says_no(s3, "PutObject", error_response("AccessDenied", "Access Denied", 403)):
        with pytest.raises(CheckpointLocationUnavailable):
            CheckpointStore(s3).request("s3://preemptor-checkpoints/team/job", 100.0, "preemption")


def test_s3_slow_down_stays_retryable(s3):
    with aws_says_no(s3, "ListObjectsV2", THROTTLING["s3"]):
        with pytest.raises(Throttled):
            CheckpointStore(s3).newest("s3://preemptor-checkpoints/team/job")


def test_an_invalid_checkpoint_uri_is_that_jobs_problem(s3):
    with pytest.raises(CheckpointLocationUnavailable):
        CheckpointStore(s3).newest("not-a-uri")


# -- Step Functions --------------------------------------------------------------------------


def test_starting_an_execution_that_already_ran_is_a_no_op_and_throttling_is_retryable():
    with mock_aws():
        sfn = boto3.client("stepfunctions", region_name=REGION)
        starter = WorkflowStarter(sfn, {"schedule": "arn:aws:states:us-east-1:123456789012:stateMachine:s"})
        exists = error_response("ExecutionAlreadyExists", "Execution Already Exists", 400)
        with aws_says_no(sfn, "StartExecution", exists):
            assert starter.start("schedule", "n", {}) is None
        with aws_says_no(sfn, "StartExecution", error_response("ThrottlingException", "Rate exceeded", 400)):
            with pytest.raises(Throttled):
                starter.start("schedule", "n", {})
