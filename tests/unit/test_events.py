"""Event parsing: every sample in events/, the quirks AWS samples carry, our own events.

All samples come through tests/eventfiles.py, the same files `sam local invoke -e` takes.
"""

from __future__ import annotations

import copy
import json
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preemptor.core.events import (
    AlarmStateChanged,
    BatchServiceJobPreemption,
    BatchServiceJobStateChanged,
    AdoptionTags,
    BatchJobStateChanged,
    BatchJobStatus,
    CheckpointWritten,
    DomainEvent,
    EventRejected,
    Ignored,
    InstanceScheduledChange,
    JobCancelled,
    JobPriorityLowered,
    JobSubmitted,
    RebalanceRecommendation,
    SpotInterruptionWarning,
    TrainingJobStateChanged,
    TrainingJobStatus,
    adoption_tags,
    load_event,
    parse_event,
    parse_timestamp,
)
from preemptor.core.errors import PreemptorError
from preemptor.core.policy import DEFAULT_TIERS, Policy
from preemptor.core.requests import Refusal, resolve_priority

from eventfiles import all_event_files, load_raw, relative_name

DOMAIN_EVENT_TYPES = typing.get_args(DomainEvent)

# ----------------------------------------------------------------- sample file names

TRAINING_2018 = (
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-training-job-state-change__382628cf.json"
)
TRAINING_EPOCH_MS_STRINGS = (
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-training-job-state-change__8a0a8aaf.json"
)
TRAINING_IN_PROGRESS_TAGGED = (
    "sagemaker/constructed__sagemaker-training-job-state-change__inprogress-tagged.json"
)
TRAINING_STOPPED_TAGGED = (
    "sagemaker/constructed__sagemaker-training-job-state-change__stopped-tagged.json"
)
ENDPOINT_EPOCH_MS_TIME = (
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-endpoint-state-change__aa5e25d9.json"
)
MODEL_PACKAGE_DUPLICATE_SOURCE = (
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-model-package-state-change__64c9ba35.json"
)
BATCH_2022 = "batch/aws-batch-user-guide__batch-job-state-change__e31f552e.json"
SPOT_DOCS_PLACEHOLDERS = (
    "ec2/amazon-ec2-user-guide__ec2-spot-instance-interruption-warning__a6e9ba68.json"
)
SPOT_NTH_AZ_ARN = (
    "ec2/aws-node-termination-handler__ec2-spot-instance-interruption-warning__ce65580d.json"
)
REBALANCE_NTH_AZ_ARN = (
    "ec2/aws-node-termination-handler__ec2-instance-rebalance-recommendation__ef2a9fe7.json"
)
SUBMITTED_SAGEMAKER = "preemptor/job-submitted-sagemaker.json"
SUBMITTED_BATCH = "preemptor/job-submitted-batch.json"
CANCELLED = "preemptor/job-cancelled.json"
LOWERED = "preemptor/job-priority-lowered.json"

# What every file in events/ must parse to: a domain event class, or the reason code of
# the EventRejected it must raise. A new sample without a row fails
# test_every_sample_has_an_expected_outcome.
EXPECTED: dict[str, type | str] = {
    # AWS Batch
    "batch/aws-batch-user-guide__batch-job-state-change__1399a7c6.json": BatchJobStateChanged,
    "batch/constructed__batch-service-job-state-change__running.json": BatchServiceJobStateChanged,
    "batch/constructed__batch-service-job-preemption-started__docs.json": BatchServiceJobPreemption,
    "batch/constructed__batch-service-job-preemption-completed__docs.json": BatchServiceJobPreemption,
    "batch/aws-batch-user-guide__batch-job-state-change__5b40fa52.json": BatchJobStateChanged,
    BATCH_2022: BatchJobStateChanged,
    "batch/constructed__batch-job-state-change__running-tagged.json": BatchJobStateChanged,
    # EC2 and Auto Scaling
    "ec2/amazon-cloudwatch-events-use__ec2-instance-state-change-notification__a1494d33.json": Ignored,
    "ec2/amazon-cloudwatch-events-use__ec2-instance-terminate-lifecycle-action__a7c62813.json": Ignored,
    "ec2/amazon-ec2-user-guide__ec2-instance-rebalance-recommendation__b45f8b2a.json": RebalanceRecommendation,
    "ec2/amazon-ec2-user-guide__ec2-instance-state-change-notification__2826aca3.json": Ignored,
    SPOT_DOCS_PLACEHOLDERS: SpotInterruptionWarning,
    "ec2/amazon-eventbridge-user-guid__ec2-instance-state-change-notification__13b8a59b.json": Ignored,
    REBALANCE_NTH_AZ_ARN: RebalanceRecommendation,
    "ec2/aws-node-termination-handler__ec2-instance-state-change-notification__6bc80ec9.json": Ignored,
    "ec2/aws-node-termination-handler__ec2-instance-terminate-lifecycle-action__e65289d0.json": Ignored,
    SPOT_NTH_AZ_ARN: SpotInterruptionWarning,
    "ec2/powertools-lambda-python__ec2-instance-state-change-notification__8a9fc173.json": Ignored,
    # Not valid JSON, as AWS published them
    "malformed/amazon-cloudwatch-events-use__aws-health-event__a61df9c6.json": "invalid-json",
    "malformed/amazon-cloudwatch-events-use__aws-health-event__cfc0b1f5.json": "invalid-json",
    "malformed/amazon-cloudwatch-events-use__aws-health-event__fe19edd6.json": "invalid-json",
    "malformed/amazon-cloudwatch-events-use__ec2-instance-terminate-lifecycle-action__f3c6070d.json": "invalid-json",
    "malformed/amazon-cloudwatch-events-use__ec2-spot-instance-interruption-warning__402f4410.json": "invalid-json",
    "malformed/amazon-sagemaker-developer-g__sagemaker-endpoint-deployment-state-change__9182cefd.json": "invalid-json",
    "malformed/amazon-sagemaker-developer-g__sagemaker-endpoint-deployment-state-change__b1ace02f.json": "invalid-json",
    # Health and CloudWatch
    "other/amazon-cloudwatch-events-use__aws-health-event__a11c106b.json": Ignored,
    "other/amazon-cloudwatch-events-use__aws-health-event__d92cc472.json": Ignored,
    "other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__06df3b84.json": AlarmStateChanged,
    "other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__3d93f584.json": AlarmStateChanged,
    "other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__d9aa1f4a.json": AlarmStateChanged,
    "other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__e5f99f07.json": AlarmStateChanged,
    "other/aws-node-termination-handler__aws-health-event__6620a964.json": InstanceScheduledChange,
    # Alarm payloads a CloudWatch alarm sends straight to Lambda: no EventBridge envelope.
    "other/powertools__cloudWatchAlarmEventCompositeMetric.json": "missing-field",
    "other/powertools__cloudWatchAlarmEventSingleMetric.json": "missing-field",
    # Ours
    CANCELLED: JobCancelled,
    LOWERED: JobPriorityLowered,
    SUBMITTED_BATCH: JobSubmitted,
    SUBMITTED_SAGEMAKER: JobSubmitted,
    # SageMaker
    "sagemaker/amazon-cloudwatch-events-use__sagemaker-hyperparameter-tuning-job-state-change__cb96b93b.json": Ignored,
    "sagemaker/amazon-cloudwatch-events-use__sagemaker-training-job-state-change__8fa4b8d7.json": TrainingJobStateChanged,
    "sagemaker/amazon-cloudwatch-events-use__sagemaker-transform-job-state-change__5f8341ce.json": Ignored,
    ENDPOINT_EPOCH_MS_TIME: Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-feature-group-state-change__feedeba0.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-hyperparameter-tuning-job-state-change__22823a8f.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-hyperparameter-tuning-job-state-change__650376ca.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-image-state-change__fd1391ce.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-image-version-state-change__36290ca8.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-model-building-pipeline-execution-status-change__70152fa5.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-model-building-pipeline-execution-step-status-change__a7d0a26a.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-model-card-state-change__03b2e6bd.json": Ignored,
    # The second "source" key (an event-pattern list pasted into the sample) wins.
    MODEL_PACKAGE_DUPLICATE_SOURCE: "bad-value",
    TRAINING_2018: TrainingJobStateChanged,
    TRAINING_EPOCH_MS_STRINGS: TrainingJobStateChanged,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-transform-job-state-change__15ba0393.json": Ignored,
    "sagemaker/amazon-sagemaker-developer-g__sagemaker-transform-job-state-change__53ff2f20.json": Ignored,
    "sagemaker/aws-docs__sagemaker-hyperpod-cluster-event__instance-capacity-failure.json": Ignored,
    TRAINING_IN_PROGRESS_TAGGED: TrainingJobStateChanged,
    TRAINING_STOPPED_TAGGED: TrainingJobStateChanged,
    "s3/constructed__s3-object-created__checkpoint.json": CheckpointWritten,
}


def _short_id(relpath: str) -> str:
    return relpath.removesuffix(".json")


MALFORMED = [name for name in EXPECTED if name.startswith("malformed/")]
_VALID_SAMPLES = [name for name, outcome in EXPECTED.items() if not isinstance(outcome, str)]


def sample(relpath: str) -> dict[str, Any]:
    """A valid sample decoded, for tests that change one thing in it."""
    return json.loads(load_raw(relpath))


_DELETE = object()


def with_detail(relpath: str, **changes: Any) -> dict[str, Any]:
    """A sample with detail keys replaced (or removed with _DELETE)."""
    event = sample(relpath)
    for key, value in changes.items():
        if value is _DELETE:
            event["detail"].pop(key, None)
        else:
            event["detail"][key] = value
    return event


def rejection(raw: Any) -> EventRejected:
    """The EventRejected that parse_event raises for `raw` (any other outcome fails)."""
    with pytest.raises(EventRejected) as caught:
        parse_event(raw)
    return caught.value


# ------------------------------------------------------------------ every sample file


def test_every_sample_has_an_expected_outcome():
    # Given the samples on disk
    on_disk = {relative_name(path) for path in all_event_files()}
    # Then each has exactly one row in the table, and no row points at a missing file
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize(
    ("relpath", "expected"),
    [pytest.param(name, outcome, id=_short_id(name)) for name, outcome in EXPECTED.items()],
)
def test_sample_parses_to_expected_outcome(relpath: str, expected: type | str):
    # Given a sample exactly as published
    raw = load_raw(relpath)
    # When it is parsed
    if isinstance(expected, str):
        # Then it is rejected with the expected reason, and nothing else escapes
        assert rejection(raw).reason == expected
    else:
        # Then it becomes the expected domain event, carrying the envelope id
        event = parse_event(raw)
        assert type(event) is expected
        assert event.event_id == json.loads(raw)["id"]


@pytest.mark.parametrize("relpath", [pytest.param(n, id=_short_id(n)) for n in MALFORMED])
@pytest.mark.parametrize("as_bytes", [pytest.param(False, id="str"), pytest.param(True, id="bytes")])
def test_malformed_sample_is_rejected_as_invalid_json_with_position(relpath: str, as_bytes: bool):
    # Given a sample that is not valid JSON, as text or as bytes
    raw: str | bytes = load_raw(relpath)
    if as_bytes:
        raw = raw.encode()
    # When it is loaded or parsed
    with pytest.raises(EventRejected) as loaded:
        load_event(raw)
    parsed = rejection(raw)
    # Then both reject it as invalid JSON and say where the error is
    for error in (loaded.value, parsed):
        assert error.reason == "invalid-json"
        assert "line" in error.detail and "column" in error.detail


# ------------------------------------------------------------------ SageMaker samples


def test_training_job_sample_fields():
    # Given the 2018 docs sample (ISO timestamps, empty tags, no checkpoint config)
    # When it is parsed
    event = parse_event(load_raw(TRAINING_2018))
    # Then the fields the scheduler needs are read from the detail
    assert event == TrainingJobStateChanged(
        event_id="844e2571-85d4-695f-b930-0153b71dcb42",
        time=1538828773.0,
        source="aws.sagemaker",
        detail_type="SageMaker Training Job State Change",
        training_job_name="89c96cc8-dded-4739-afcc-6f1dc936701d",
        status=TrainingJobStatus.COMPLETED,
        secondary_status="Completed",
        failure_reason=None,
        tags={},
        instance_type="InstanceType",
        instance_count=3,
        creation_time=1538828773.0,
        start_time=1538828773.0,
        end_time=1538828773.0,
        last_modified=1538828773.0,
        checkpoint_s3_uri=None,
    )


def test_training_job_epoch_ms_strings_become_seconds():
    # Given the 2020 docs sample whose detail times are epoch-ms strings
    # When it is parsed
    event = parse_event(load_raw(TRAINING_EPOCH_MS_STRINGS))
    # Then every time is in epoch seconds
    assert isinstance(event, TrainingJobStateChanged)
    times = (event.creation_time, event.start_time, event.end_time, event.last_modified)
    assert times == (1583831889.05,) * 4


@pytest.mark.parametrize(
    ("relpath", "status", "secondary", "end_time"),
    [
        pytest.param(TRAINING_IN_PROGRESS_TAGGED, TrainingJobStatus.IN_PROGRESS, "Training", None, id="in-progress"),
        pytest.param(TRAINING_STOPPED_TAGGED, TrainingJobStatus.STOPPED, "Stopped", 1538831100.0, id="stopped"),
    ],
)
def test_tagged_training_job_is_adoptable(relpath, status, secondary, end_time):
    # Given a training job event carrying the preemptor tags and a checkpoint config
    # When it is parsed and its tags read for adoption
    event = parse_event(load_raw(relpath))
    assert isinstance(event, TrainingJobStateChanged)
    # Then status, checkpoint location and (priority, team, pool) come through
    assert (event.status, event.secondary_status, event.end_time) == (status, secondary, end_time)
    assert event.checkpoint_s3_uri == "s3://preemptor-checkpoints/research/kmeans-1"
    assert adoption_tags(event.tags) == AdoptionTags(500, "research", "p5", None, None, managed=False)


@pytest.mark.parametrize("status", [pytest.param(s.value, id=s.value) for s in TrainingJobStatus])
def test_every_botocore_training_status_is_accepted(status: str):
    # Given a training job event with any status botocore knows (including Deleting)
    event = with_detail(TRAINING_2018, TrainingJobStatus=status)
    # When it is parsed / Then the status is kept
    assert parse_event(event).status == status


@pytest.mark.parametrize(
    ("changes", "reason", "named"),
    [
        pytest.param({"TrainingJobStatus": "Running"}, "bad-value", "TrainingJobStatus", id="unknown-status"),
        pytest.param({"TrainingJobStatus": _DELETE}, "missing-field", "TrainingJobStatus", id="no-status"),
        pytest.param({"TrainingJobName": _DELETE}, "missing-field", "TrainingJobName", id="no-name"),
        pytest.param({"Tags": [{"Key": "a", "Value": "b"}]}, "bad-value", "Tags", id="tags-as-list"),
        pytest.param({"Tags": {"preemptor:priority": 500}}, "bad-value", "Tags", id="non-string-tag"),
        pytest.param({"ResourceConfig": {"InstanceCount": "3"}}, "bad-value", "InstanceCount", id="count-as-string"),
        pytest.param({"CreationTime": "last tuesday at 5"}, "bad-value", "CreationTime", id="garbage-time"),
    ],
)
def test_bad_training_job_detail_is_rejected_naming_the_field(changes, reason, named):
    # Given a training job event with one broken field
    event = with_detail(TRAINING_2018, **changes)
    # When it is parsed
    error = rejection(event)
    # Then the rejection says why and names the field
    assert error.reason == reason
    assert named in error.detail


def test_secondary_status_is_not_checked_against_a_closed_list():
    # Given a secondary status AWS may add after botocore 1.44.8
    event = with_detail(TRAINING_2018, SecondaryStatus="SomethingNew")
    # When it is parsed / Then it is kept as text rather than failing the event
    assert parse_event(event).secondary_status == "SomethingNew"


# ---------------------------------------------------------------------- Batch samples


def test_batch_job_sample_fields():
    # Given the 2022 Batch docs sample (epoch-ms createdAt, tags, no attempts yet)
    # When it is parsed
    event = parse_event(load_raw(BATCH_2022))
    # Then ids, status, tags and times (in seconds) are read
    assert isinstance(event, BatchJobStateChanged)
    assert (event.job_id, event.job_name, event.status) == (
        "4c7599ae-0a82-49aa-ba5a-4727fcce14a8",
        "event-test",
        BatchJobStatus.RUNNABLE,
    )
    assert event.job_queue.endswith(":job-queue/PexjEHappyPathCanary2JobQueue")
    assert event.created_at == 1641944200.058
    assert (event.started_at, event.stopped_at, event.status_reason) == (None, None, None)
    assert event.tags == {
        "resourceArn": "arn:aws:batch:us-east-1:123456789012:job/4c7599ae-0a82-49aa-ba5a-4727fcce14a8"
    }
    assert (event.attempts, event.container_instance_arn) == (0, None)


def test_batch_spot_reclaim_failure_fields():
    # Given a FAILED Batch event shaped like a Spot reclaim (strings observed in AWS output)
    reason = "Host EC2 (instance i-04b17daec78ef4a0b) terminated."
    event = with_detail(
        BATCH_2022,
        status="FAILED",
        statusReason=reason,
        startedAt=1641944300000,
        stoppedAt=1641944400000,
        attempts=[{"statusReason": reason}],
        container={"containerInstanceArn": "arn:aws:ecs:us-east-1:123456789012:container-instance/abc"},
    )
    # When it is parsed
    parsed = parse_event(event)
    # Then the failure, its times and the attempt count come through
    assert (parsed.status, parsed.status_reason, parsed.attempts) == (BatchJobStatus.FAILED, reason, 1)
    assert (parsed.started_at, parsed.stopped_at) == (1641944300.0, 1641944400.0)
    assert parsed.container_instance_arn.endswith("container-instance/abc")


def test_batch_service_job_status_is_not_a_job_status():
    # Given SCHEDULED, which only Batch *service* jobs have
    event = with_detail(BATCH_2022, status="SCHEDULED")
    # When it is parsed / Then it is rejected as a bad value
    assert rejection(event).reason == "bad-value"


# ------------------------------------------------------------------------ EC2 samples


def test_spot_warning_from_node_termination_handler_sample():
    # Given the NTH sample: AZ in the ARN, no account, time at the epoch
    # When it is parsed
    event = parse_event(load_raw(SPOT_NTH_AZ_ARN))
    # Then instance and action are read and 1970-01-01 is time 0, not "no time"
    assert isinstance(event, SpotInterruptionWarning)
    assert (event.instance_id, event.instance_action, event.time) == (
        "i-0b662ef9931388ba0",
        "terminate",
        0.0,
    )


def test_spot_warning_from_ec2_docs_sample_with_placeholders():
    # Given the EC2 docs sample: placeholder time, literal action "action"
    # When it is parsed
    event = parse_event(load_raw(SPOT_DOCS_PLACEHOLDERS))
    # Then the placeholder time is None and any non-empty action is accepted
    assert (event.instance_id, event.instance_action, event.time) == (
        "i-1234567890abcdef0",
        "action",
        None,
    )


@pytest.mark.parametrize(
    ("detail", "resources", "instance_id"),
    [
        pytest.param({"instance-id": "i-0b662ef9931388ba0"}, [], "i-0b662ef9931388ba0", id="detail-instance-id"),
        pytest.param({"instance_id": "i-1234567890abcdef0"}, [], "i-1234567890abcdef0", id="powertools-instance_id"),
        pytest.param({"instance-id": " i-1234567890abcdef0"}, [], "i-1234567890abcdef0", id="padded-id"),
        pytest.param({}, ["arn:aws:ec2:us-east-1b:instance/i-0b662ef9931388ba0"], "i-0b662ef9931388ba0", id="arn-with-az-no-account"),
        pytest.param({}, ["arn:aws:ec2:us-east-2:123456789012:instance/i-1234567890abcdef0"], "i-1234567890abcdef0", id="regional-arn"),
    ],
)
def test_spot_instance_id_sources(detail, resources, instance_id):
    # Given a Spot warning whose instance id is in one of the places samples put it
    event = sample(SPOT_NTH_AZ_ARN)
    event["detail"] = {**detail, "instance-action": "stop"}
    event["resources"] = resources
    # When it is parsed / Then the instance id is found
    assert parse_event(event).instance_id == instance_id


def test_rebalance_instance_id_from_arn_with_az():
    # Given the NTH rebalance sample without detail.instance-id
    event = sample(REBALANCE_NTH_AZ_ARN)
    del event["detail"]["instance-id"]
    # When it is parsed / Then the id comes from arn:aws:ec2:us-east-1b:instance/...
    assert parse_event(event) == RebalanceRecommendation(
        event_id="5d5555d5-dd55-5555-5555-5555dd55d55d",
        time=1603721654.0,
        source="aws.ec2",
        detail_type="EC2 Instance Rebalance Recommendation",
        instance_id="i-0b662ef9931388ba0",
    )


@pytest.mark.parametrize(
    ("detail", "resources", "reason"),
    [
        pytest.param({"instance-action": "terminate"}, [], "missing-field", id="no-id-anywhere"),
        pytest.param({"instance-action": "terminate"}, ["arn:aws:s3:::bucket"], "missing-field", id="non-ec2-arn"),
        pytest.param({"instance-id": "vol-123", "instance-action": "terminate"}, [], "bad-value", id="not-an-instance-id"),
        pytest.param({"instance-id": "i-0b662ef9931388ba0"}, [], "missing-field", id="no-action"),
        pytest.param({"instance-id": "i-0b662ef9931388ba0", "instance-action": ""}, [], "bad-value", id="empty-action"),
    ],
)
def test_unusable_spot_warning_is_rejected(detail, resources, reason):
    # Given a Spot warning the controller could not act on
    event = sample(SPOT_NTH_AZ_ARN)
    event["detail"], event["resources"] = detail, resources
    # When it is parsed / Then it is rejected, not guessed
    assert rejection(event).reason == reason


# ------------------------------------------------------------------------------ time


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param("2018-10-06T12:26:13Z", 1538828773.0, id="iso-z"),
        pytest.param("2018-10-06T12:26:13", 1538828773.0, id="iso-naive-is-utc"),
        pytest.param("2023-08-04T12:56:46.138+0000", 1691153806.138, id="iso-millis-basic-offset"),
        pytest.param("2022-12-03T00:09:44.893854735Z", 1670026184.893854, id="iso-nanoseconds"),
        pytest.param(1508781340401, 1508781340.401, id="epoch-ms-int"),
        pytest.param(1592411992203.0, 1592411992.203, id="epoch-ms-float"),
        pytest.param("1583831889050", 1583831889.05, id="epoch-ms-string"),
        pytest.param("1970-01-01T00:00:00Z", 0.0, id="epoch-zero-is-a-time"),
        pytest.param("yyyy-mm-ddThh:mm:ssZ", None, id="placeholder"),
        pytest.param("Timestamp", None, id="placeholder-word"),
        pytest.param("", None, id="empty"),
        pytest.param(None, None, id="null"),
    ],
)
def test_timestamp_shapes(value, seconds):
    # Given a timestamp in one of the shapes AWS samples use
    # When it is parsed
    result = parse_timestamp(value)
    # Then it is epoch seconds, or None when it carries no time
    if seconds is None:
        assert result is None
    else:
        assert result == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("2018-13-45T00:00:00Z", id="impossible-date"),
        pytest.param("5 minutes ago", id="words-with-digits"),
        pytest.param(-1, id="negative"),
        pytest.param(10**30, id="huge"),
        pytest.param(float("nan"), id="nan"),
        pytest.param(True, id="bool"),
        pytest.param([1], id="list"),
    ],
)
def test_bad_timestamp_is_rejected_naming_the_field(value):
    # Given a value that is neither a time nor a placeholder
    # When it is parsed
    with pytest.raises(EventRejected) as caught:
        parse_timestamp(value, "detail.CreationTime")
    # Then it is a bad value of the named field
    assert caught.value.reason == "bad-value"
    assert "detail.CreationTime" in caught.value.detail


def test_envelope_time_as_epoch_ms_string():
    # Given the endpoint sample whose envelope time is "1583831889050"
    # When it is parsed / Then even the ignored event carries the time in seconds
    assert parse_event(load_raw(ENDPOINT_EPOCH_MS_TIME)).time == 1583831889.05


def test_unparseable_envelope_time_is_rejected():
    # Given an event whose envelope time has digits but is no time
    event = sample(TRAINING_2018)
    event["time"] = "2018-10-06 noon"
    # When it is parsed / Then the envelope is rejected, naming "time"
    error = rejection(event)
    assert (error.reason, error.detail.split(":")[0]) == ("bad-value", "time")


# ------------------------------------------------------------------ envelope handling


def test_duplicate_key_keeps_last_value_in_published_sample():
    # Given the model package sample, which has "source" twice: a string, then a list
    raw = load_raw(MODEL_PACKAGE_DUPLICATE_SOURCE)
    # When it is loaded
    with pytest.raises(EventRejected) as caught:
        load_event(raw)
    # Then the last value (the list) is the one checked, and it is not a valid source
    assert caught.value.reason == "bad-value"
    assert caught.value.detail == "source: expected a non-empty string, got list"


def test_duplicate_key_keeps_last_value():
    # Given JSON text with detail-type twice, the second one a Spot warning
    raw = (
        '{"id": "e1", "source": "aws.ec2", "time": "2020-10-26T14:14:14Z",'
        ' "detail-type": "EC2 Instance State-change Notification",'
        ' "detail-type": "EC2 Spot Instance Interruption Warning",'
        ' "detail": {"instance-id": "i-0b662ef9931388ba0", "instance-action": "terminate"}}'
    )
    # When it is parsed / Then the last value decides the event type
    assert isinstance(parse_event(raw), SpotInterruptionWarning)


@pytest.mark.parametrize(
    ("source", "detail_type", "reason"),
    [
        pytest.param("aws.sagemaker", "SageMaker Endpoint State Change", "not-handled: SageMaker Endpoint State Change", id="aws-unknown-type"),
        pytest.param("com.example", "Job Submitted", "not-handled: Job Submitted", id="our-type-other-source"),
        pytest.param("com.example", "EC2 Spot Instance Interruption Warning", "not-handled: EC2 Spot Instance Interruption Warning", id="custom-posing-as-spot"),
    ],
)
def test_unknown_detail_type_is_ignored(source, detail_type, reason):
    # Given a well-formed event that is not one the controller acts on
    event = sample(SPOT_NTH_AZ_ARN)
    event["source"], event["detail-type"] = source, detail_type
    # When it is parsed
    ignored = parse_event(event)
    # Then it is Ignored with a reason naming the detail-type
    assert isinstance(ignored, Ignored)
    assert ignored.reason == reason


def test_unknown_detail_type_under_our_source_is_rejected():
    # Given our own source with a detail-type we never emit (a producer typo)
    event = sample(CANCELLED)
    event["detail-type"] = "Job Canceled"
    # When it is parsed / Then it is rejected rather than silently dropped
    assert rejection(event).reason == "unknown-detail-type"


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        pytest.param("detail", _DELETE, "missing-field", id="no-detail"),
        pytest.param("id", _DELETE, "missing-field", id="no-id"),
        pytest.param("source", _DELETE, "missing-field", id="no-source"),
        pytest.param("detail-type", _DELETE, "missing-field", id="no-detail-type"),
        pytest.param("detail", "{}", "bad-value", id="detail-as-string"),
        pytest.param("detail", None, "bad-value", id="detail-null"),
        pytest.param("id", "", "bad-value", id="empty-id"),
        pytest.param("detail-type", 7, "bad-value", id="detail-type-number"),
        pytest.param("resources", "arn:aws:ec2:::instance/i-1", "bad-value", id="resources-not-list"),
        pytest.param("resources", [None], "bad-value", id="resource-not-string"),
    ],
)
def test_broken_envelope_is_rejected_naming_the_field(key, value, reason):
    # Given a Spot warning with one broken envelope field
    event = sample(SPOT_NTH_AZ_ARN)
    if value is _DELETE:
        del event[key]
    else:
        event[key] = value
    # When it is loaded and parsed
    with pytest.raises(EventRejected) as loaded:
        load_event(event)
    parsed = rejection(event)
    # Then both reject it for the same reason, naming the field
    for error in (loaded.value, parsed):
        assert error.reason == reason
        assert key in error.detail


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param("[]", id="json-array"),
        pytest.param("null", id="json-null"),
        pytest.param('"text"', id="json-string"),
        pytest.param(42, id="python-int"),
        pytest.param(["x"], id="python-list"),
    ],
)
def test_non_object_event_is_rejected(raw):
    # Given something that is not an event object / When it is parsed
    # Then it is rejected as a bad value
    assert rejection(raw).reason == "bad-value"


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param('{"id": NaN}', id="nan-constant"),
        pytest.param(b'{"id": "\xff"}', id="not-utf8"),
        pytest.param("[" * 100_000 + "]" * 100_000, id="too-deep"),
        pytest.param("", id="empty"),
    ],
)
def test_not_quite_json_is_rejected_as_invalid_json(raw):
    # Given text Python's json would choke on or wrongly accept
    # When it is parsed / Then it is invalid JSON, not some other exception
    assert rejection(raw).reason == "invalid-json"


def test_load_event_returns_the_decoded_event():
    # Given a valid sample as text
    raw = load_raw(SPOT_NTH_AZ_ARN)
    # When it is loaded / Then the envelope-checked dict is returned unchanged
    assert load_event(raw) == json.loads(raw)


@pytest.mark.parametrize("relpath", [pytest.param(n, id=_short_id(n)) for n in _VALID_SAMPLES])
def test_parsing_does_not_mutate_the_input(relpath: str):
    # Given a decoded event and a deep copy of it
    event = sample(relpath)
    before = copy.deepcopy(event)
    # When it is parsed
    parse_event(event)
    # Then the caller's dict is untouched
    assert event == before


# ---------------------------------------------------------------------- our events


def test_job_submitted_sagemaker_sample():
    # Given our SageMaker submission (tier name, source preemptor.research)
    # When it is parsed
    event = parse_event(load_raw(SUBMITTED_SAGEMAKER))
    # Then the request is resolved: priority 500, the team of the source; the demand and the
    # checkpoint prefix are the pool's and the controller's to set (tests/unit/test_requests.py)
    assert isinstance(event, JobSubmitted)
    request = event.request
    assert (request.name, request.team, request.priority, request.pool, request.service) == (
        "llm-pretrain-7b",
        "research",
        500,
        "p5",
        "sagemaker",
    )
    assert (request.gpus, request.instances, request.sla_s, request.checkpoint_s3_uri) == (None, None, 86400, None)


def test_job_submitted_batch_sample():
    # Given our Batch submission (integer priority, explicit gpus)
    # When it is parsed
    request = parse_event(load_raw(SUBMITTED_BATCH)).request
    # Then gpus is the demand whatever the instance type, the team that of the source
    assert (request.priority, request.gpus, request.instances, request.team) == (200, 4, None, "platform")
    assert request.labels == {}


def test_job_cancelled_sample():
    # Given our cancel event / When it is parsed / Then it names the job and the sending team
    event = parse_event(load_raw(CANCELLED))
    assert (event.name, event.team) == ("llm-pretrain-7b", "research")


def _without_body_key(relpath: str, key: str) -> dict[str, Any]:
    body = dict(sample(relpath)["detail"]["request"])
    del body[key]
    return body


def with_source(relpath: str, source: str, **detail_changes: Any) -> dict[str, Any]:
    event = with_detail(relpath, **detail_changes) if detail_changes else sample(relpath)
    event["source"] = source
    return event


@pytest.mark.parametrize("relpath", [SUBMITTED_SAGEMAKER, CANCELLED])
def test_the_bare_preemptor_source_is_no_longer_accepted(relpath):
    # Given our own event under the old source, which says nothing about who sent it
    # (before: accepted, so any principal could submit for any team)
    error = rejection(with_source(relpath, "preemptor"))
    # Then it is rejected, saying how to send it
    assert error.reason == "bad-source" and "preemptor.<team>" in error.detail


def test_the_team_is_the_sources_not_the_details():
    # Given a submission without a team in its detail, sent as preemptor.vision
    event = with_source(SUBMITTED_SAGEMAKER, "preemptor.vision", team=_DELETE)
    # When it is parsed / Then the request is vision's
    assert parse_event(event).request.team == "vision"


@pytest.mark.parametrize("relpath", [SUBMITTED_SAGEMAKER, CANCELLED])
def test_a_detail_naming_another_team_than_the_source_is_rejected(relpath):
    # Given team intern's event whose detail claims team research
    event = with_source(relpath, "preemptor.intern", team="research")
    # When it is parsed / Then it is rejected with the reason, naming both
    error = rejection(event)
    assert error.reason == "team-mismatch"
    assert "'research'" in error.detail and "'intern'" in error.detail


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("preemptor." + "a" * 100_000 + "\x00\n", id="100k-team-with-control-chars"),
        pytest.param("preemptor.Research", id="upper-case"),
        pytest.param("preemptor.", id="empty-team"),
        pytest.param("preemptor.re search", id="space"),
        pytest.param("preemptor.-research", id="leading-hyphen"),
        pytest.param("preemptor." + "a" * 64, id="64-characters"),
    ],
)
def test_a_malformed_team_in_the_source_is_rejected_and_shortened(source):
    # Given a submission whose source names no well-formed team
    error = rejection(with_source(SUBMITTED_SAGEMAKER, source, team=_DELETE))
    # Then it is rejected with a bounded message
    assert error.reason == "bad-source" and len(error.detail) < 300


def test_an_unknown_detail_type_under_a_team_source_is_rejected():
    event = with_source(CANCELLED, "preemptor.research")
    event["detail-type"] = "Job Paused"
    assert rejection(event).reason == "unknown-detail-type"


@pytest.mark.parametrize(
    ("relpath", "changes", "named"),
    [
        pytest.param(SUBMITTED_SAGEMAKER, {"priority": 2000}, "priority 2000 is out of range 0..1000", id="priority-2000"),
        pytest.param(SUBMITTED_SAGEMAKER, {"priority": "urgent"}, "unknown priority tier 'urgent'", id="unknown-tier"),
        pytest.param(SUBMITTED_SAGEMAKER, {"priority": True}, "priority", id="priority-bool"),
        pytest.param(SUBMITTED_SAGEMAKER, {"pool": _DELETE}, "pool: Field required", id="missing-pool"),
        pytest.param(SUBMITTED_SAGEMAKER, {"pool": "  "}, "pool", id="blank-pool"),
        pytest.param(SUBMITTED_SAGEMAKER, {"name": "x" * 57}, "name must be 1..56", id="name-too-long"),
        pytest.param(SUBMITTED_SAGEMAKER, {"name": "trailing-hyphen-"}, "name must be", id="name-trailing-hyphen"),
        pytest.param(SUBMITTED_SAGEMAKER, {"name": "naïve"}, "name must be", id="name-not-ascii"),
        pytest.param(SUBMITTED_SAGEMAKER, {"restart_overhead_s": 1e308}, "restart_overhead_s", id="restart-overhead-1e308"),
        pytest.param(SUBMITTED_SAGEMAKER, {"expected_duration_s": 10**12}, "expected_duration_s", id="duration-beyond-a-year"),
        pytest.param(SUBMITTED_SAGEMAKER, {"sla_s": 10**12}, "sla_s", id="sla-beyond-a-year"),
        pytest.param(SUBMITTED_SAGEMAKER, {"labels": {"owner": "a\u0000b"}}, "labels.owner", id="label-control-char"),
        pytest.param(SUBMITTED_SAGEMAKER, {"labels": {f"k{i}": "v" for i in range(51)}}, "labels", id="too-many-labels"),
        pytest.param(SUBMITTED_SAGEMAKER, {"name": "-leading-hyphen"}, "name must be", id="name-leading-hyphen"),
        pytest.param(SUBMITTED_SAGEMAKER, {"name": "under_score"}, "name must be", id="name-underscore"),
        pytest.param(SUBMITTED_SAGEMAKER, {"name": "train-r2"}, "must not end in -r<digits>", id="name-of-another-jobs-relaunch"),
        pytest.param(SUBMITTED_SAGEMAKER, {"service": "ecs"}, "service", id="unknown-service"),
        pytest.param(SUBMITTED_SAGEMAKER, {"priorty": 5}, "priorty", id="typo-field"),
        pytest.param(SUBMITTED_SAGEMAKER, {"sla_s": 0}, "sla_s", id="sla-zero"),
        pytest.param(SUBMITTED_SAGEMAKER, {"labels": {"cost": 5}}, "labels.cost", id="label-not-string"),
        pytest.param(SUBMITTED_SAGEMAKER, {"request": _without_body_key(SUBMITTED_SAGEMAKER, "StoppingCondition")}, "sagemaker request is missing StoppingCondition", id="sagemaker-body-no-stopping-condition"),
        pytest.param(SUBMITTED_SAGEMAKER, {"gpus": 0}, "gpus", id="zero-gpus"),
        pytest.param(SUBMITTED_BATCH, {"gpus": _DELETE}, "gpus is required for batch jobs", id="batch-no-gpus"),
        pytest.param(SUBMITTED_BATCH, {"gpus": "4"}, "gpus", id="batch-gpus-string"),
        pytest.param(SUBMITTED_BATCH, {"instances": 2}, "instances applies to sagemaker jobs only", id="batch-instances"),
        pytest.param(SUBMITTED_BATCH, {"checkpoint_s3_uri": "s3://bucket-only"}, "s3://bucket/prefix", id="checkpoint-bucket-only"),
        pytest.param(SUBMITTED_BATCH, {"checkpoint_s3_uri": "/local/path"}, "s3://bucket/prefix", id="checkpoint-not-s3"),
        pytest.param(SUBMITTED_BATCH, {"request": {"jobQueue": "q"}}, "batch request is missing jobDefinition", id="batch-body-no-definition"),
        pytest.param(SUBMITTED_BATCH, {"request": "SubmitJob"}, "request", id="body-not-object"),
    ],
)
def test_bad_job_submission_is_rejected_naming_the_field(relpath, changes, named):
    # Given one of our submissions with one mistake
    event = with_detail(relpath, **changes)
    # When it is parsed
    error = rejection(event)
    # Then it is a bad request whose message names the field and the problem
    assert error.reason == "bad-request"
    assert named in error.detail


def test_bad_job_submission_lists_every_field_error():
    # Given a submission with two independent mistakes
    event = with_detail(SUBMITTED_BATCH, priority=2000, pool=_DELETE)
    # When it is parsed / Then both are reported at once
    detail = rejection(event).detail
    assert "priority:" in detail and "pool:" in detail


def test_checkpoint_uri_is_normalised():
    # Given a Batch submission whose checkpoint prefix ends with a slash
    event = with_detail(SUBMITTED_BATCH, checkpoint_s3_uri="s3://preemptor-checkpoints/p/x/")
    # When it is parsed / Then the slash is dropped so "<prefix>/_preemptor/" is unambiguous
    assert parse_event(event).request.checkpoint_s3_uri == "s3://preemptor-checkpoints/p/x"


def test_job_request_is_frozen():
    # Given a parsed request / When a field is assigned / Then it is refused
    request = parse_event(load_raw(SUBMITTED_BATCH)).request
    with pytest.raises(Exception, match="frozen"):
        request.priority = 1000  # type: ignore[misc]


@pytest.mark.parametrize(
    ("detail", "reason"),
    [
        pytest.param({}, "missing-field", id="no-name"),
        pytest.param({"name": "bad name!"}, "bad-value", id="invalid-name"),
        pytest.param({"name": "job-1", "why": "x"}, "bad-value", id="unexpected-key"),
    ],
)
def test_bad_job_cancellation_is_rejected(detail, reason):
    # Given a cancel event with a bad detail
    event = sample(CANCELLED)
    event["detail"] = detail
    # When it is parsed / Then it is rejected
    assert rejection(event).reason == reason


def _lowered(detail: dict[str, Any]) -> dict[str, Any]:
    event = sample(LOWERED)
    event["detail"] = detail
    return event


def test_job_priority_lowered_sample():
    # Given our lowering event, by tier name with a note / When it is parsed
    event = parse_event(load_raw(LOWERED))
    # Then the tier is resolved, and the team is the source's
    assert (event.name, event.team, event.priority) == ("llm-pretrain-7b", "research", 50)
    assert event.note == "the paper deadline moved to next month"
    assert parse_event(_lowered({"name": "sweep-7", "priority": 120})).priority == 120


@pytest.mark.parametrize(
    ("detail", "reason"),
    [
        pytest.param({"priority": "low"}, "missing-field", id="no-name"),
        pytest.param({"name": "sweep-7"}, "missing-field", id="no-priority"),
        pytest.param({"name": "sweep-7", "priority": "lowest"}, "bad-value", id="unknown-tier"),
        pytest.param({"name": "sweep-7", "priority": 1001}, "bad-value", id="out-of-range"),
        pytest.param({"name": "sweep-7", "priority": True}, "bad-value", id="boolean"),
        pytest.param({"name": "bad name!", "priority": 50}, "bad-value", id="invalid-name"),
        pytest.param({"name": "sweep-7", "priority": 50, "pool": "p5"}, "bad-value", id="unexpected-key"),
        pytest.param({"name": "sweep-7", "priority": 50, "note": "two\nlines"}, "bad-value", id="multi-line-note"),
        pytest.param({"name": "sweep-7", "priority": 50, "note": "x" * 501}, "bad-value", id="long-note"),
        pytest.param({"name": "sweep-7", "priority": 50, "note": 7}, "bad-value", id="note-not-text"),
        pytest.param({"name": "sweep-7", "priority": 50, "team": "vision"}, Refusal.TEAM_MISMATCH.value, id="another-team"),
    ],
)
def test_bad_job_priority_lowering_is_rejected(detail, reason):
    # Given a team's lowering with a bad detail / When it is parsed / Then it is rejected, with why
    assert rejection(_lowered(detail)).reason == reason


# ----------------------------------------------------------------------- priorities


@pytest.mark.parametrize(
    ("value", "priority"),
    [
        pytest.param("critical", 1000, id="critical"),
        pytest.param("HIGH", 500, id="high-uppercase"),
        pytest.param(" Medium ", 200, id="medium-padded"),
        pytest.param("low", 50, id="low"),
        pytest.param(0, 0, id="int-min"),
        pytest.param(1000, 1000, id="int-max"),
        pytest.param("750", 750, id="numeric-string"),
    ],
)
def test_priority_resolves(value, priority):
    # Given a priority as a tier name or a number / When resolved / Then it is an int
    assert resolve_priority(value) == priority


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param(1001, "out of range 0..1000", id="above-max"),
        pytest.param(-1, "out of range 0..1000", id="negative"),
        pytest.param("urgent", "one of: critical, high, low, medium", id="unknown-tier"),
        pytest.param(True, "integer or a tier name", id="bool"),
        pytest.param(5.5, "integer or a tier name", id="float"),
        pytest.param(None, "integer or a tier name", id="none"),
    ],
)
def test_bad_priority_is_refused_with_a_clear_message(value, message):
    # Given a value that is no priority / When resolved / Then ValueError says why
    with pytest.raises(ValueError, match=message):
        resolve_priority(value)


def test_custom_tiers():
    # Given a site-specific tier table
    tiers = {**DEFAULT_TIERS, "Batch-Night": 10}
    # When a custom tier is resolved / Then it is found case-insensitively
    assert resolve_priority("batch-night", tiers) == 10


def test_configured_tiers_reach_job_submissions_and_adoption_tags():
    # Given a policy with an extra tier, and a submission and tags that use it
    policy = Policy(tiers={**DEFAULT_TIERS, "nightly": 10})
    event = with_detail(SUBMITTED_BATCH, priority="nightly")
    tags = {"preemptor:priority": "Nightly", "preemptor:team": "infra"}
    # When they are read with the configured tiers
    submitted = parse_event(event, tiers=policy.tiers)
    adopted = adoption_tags(tags, tiers=policy.tiers)
    # Then the tier resolves; with the default tiers it is refused
    assert (submitted.request.priority, adopted.priority) == (10, 10)
    assert rejection(event).reason == "bad-request"


def test_rejection_is_a_preemptor_error():
    # Given any rejection / Then workflows can catch it with the domain base class
    assert isinstance(rejection("{"), PreemptorError)


# ------------------------------------------------------------------ adoption tags


@pytest.mark.parametrize(
    ("tags", "expected"),
    [
        pytest.param({"preemptor:priority": "high", "preemptor:team": "research", "preemptor:pool": "p5"}, (500, "research", "p5"), id="all-three"),
        pytest.param({"preemptor:priority": "900", "preemptor:team": "infra"}, (900, "infra", None), id="numeric-no-pool"),
        pytest.param({"preemptor:team": "research"}, None, id="no-priority"),
        pytest.param({"preemptor:priority": "high"}, None, id="no-team"),
        pytest.param({}, None, id="no-tags"),
    ],
)
def test_adoption_tags(tags, expected):
    # Given the tags of a job the controller did not launch
    # When they are read / Then (priority, team, pool) or None (not ours to schedule)
    claims = adoption_tags(tags)
    assert (claims and (claims.priority, claims.team, claims.pool)) == expected


@pytest.mark.parametrize(
    ("extra", "gpus", "checkpoint", "managed"),
    [
        pytest.param({"preemptor:gpus": "8"}, 8, None, False, id="gpus"),
        pytest.param({"preemptor:gpus": " 16 "}, 16, None, False, id="gpus-padded"),
        pytest.param({"preemptor:checkpoint": "s3://ckpt-bucket/research/x/"}, None, "s3://ckpt-bucket/research/x", False, id="checkpoint"),
        pytest.param({"preemptor:managed": "true"}, None, None, True, id="managed"),
        pytest.param({"preemptor:managed": "yes"}, None, None, False, id="managed-only-when-true"),
    ],
)
def test_adoption_tags_read_gpus_checkpoint_and_managed(extra, gpus, checkpoint, managed):
    claims = adoption_tags({"preemptor:priority": "low", "preemptor:team": "research", **extra})
    assert (claims.gpus, claims.checkpoint_s3_uri, claims.managed) == (gpus, checkpoint, managed)


@pytest.mark.parametrize(
    "team",
    [
        pytest.param(" ", id="blank-team"),
        pytest.param("r" * 100_000 + "\x07", id="huge-team-control-char"),
        pytest.param("Research", id="upper-case-team"),
    ],
)
def test_an_unusable_team_tag_is_read_as_absent(team):
    # Given preemptor tags whose team is unusable: no team to count the run against
    # When they are read
    claims = adoption_tags({"preemptor:priority": "low", "preemptor:team": team})
    # Then no team is read, and the problem names the tag, in a bounded message (before: the
    # event was refused, and the run's GPUs, in use all the same, went uncounted)
    assert claims.team is None and claims.priority == 50
    [problem] = claims.problems
    assert problem.startswith("tag preemptor:team: ") and len(problem) < 400


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        pytest.param({"preemptor:priority": "urgent"}, "priority", id="unknown-tier"),
        pytest.param({"preemptor:priority": "2000"}, "priority", id="out-of-range"),
        pytest.param({"preemptor:priority": "9" * 300}, "priority", id="priority-longer-than-a-tag"),
        pytest.param({"preemptor:pool": ""}, "pool", id="empty-pool"),
        pytest.param({"preemptor:gpus": "eight"}, "gpus", id="gpus-eight"),
        pytest.param({"preemptor:gpus": "-512"}, "gpus", id="gpus-negative"),
        pytest.param({"preemptor:gpus": "0"}, "gpus", id="gpus-zero"),
        pytest.param({"preemptor:gpus": "1e3"}, "gpus", id="gpus-float-text"),
        pytest.param({"preemptor:gpus": "9" * 40}, "gpus", id="gpus-huge"),
        pytest.param({"preemptor:checkpoint": "/tmp/x"}, "checkpoint_s3_uri", id="checkpoint-not-s3"),
    ],
)
def test_an_unusable_adoption_tag_is_read_as_absent_and_said(extra, field):
    # Given preemptor tags of a team's run with one unusable value (before: "eight" raised
    # ValueError out of the intake, "-512" was counted as -512 GPUs; then each refused the
    # run, whose GPUs are in use all the same, and left it uncounted)
    tags = {"preemptor:priority": "low", "preemptor:team": "r", **extra}
    # When they are read
    claims = adoption_tags(tags)
    # Then that value is read as absent, and the problem is said, naming the tag, bounded
    assert getattr(claims, field) is None and claims.team == "r"
    [problem] = claims.problems
    [key] = extra
    assert problem.startswith(f"tag {key}: ") and len(problem) < 400


# ------------------------------------------------------------------------ invariants

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
_json_values = st.recursive(
    _json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)

_ENVELOPE_KEYS = ["id", "source", "detail-type", "detail", "time", "resources"]
_SOURCES_AND_TYPES = [
    ("aws.sagemaker", "SageMaker Training Job State Change"),
    ("aws.batch", "Batch Job State Change"),
    ("aws.ec2", "EC2 Spot Instance Interruption Warning"),
    ("aws.ec2", "EC2 Instance Rebalance Recommendation"),
    ("preemptor", "Job Submitted"),
    ("preemptor.research", "Job Submitted"),
    ("preemptor.research", "Job Cancelled"),
    ("preemptor.research", "Job Priority Lowered"),
    ("preemptor.research", "Job Paused"),
    ("aws.health", "AWS Health Event"),
]
# Field names the parsers read, so generated details reach past the first missing field.
_DETAIL_KEYS = [
    # SageMaker
    "TrainingJobName", "TrainingJobStatus", "SecondaryStatus", "FailureReason", "Tags",
    "ResourceConfig", "InstanceType", "InstanceCount", "CreationTime", "TrainingStartTime",
    "TrainingEndTime", "LastModifiedTime", "CheckpointConfig", "S3Uri",
    # Batch
    "jobId", "jobName", "jobQueue", "status", "statusReason", "tags", "createdAt",
    "startedAt", "stoppedAt", "container", "containerInstanceArn", "attempts",
    # EC2
    "instance-id", "instance_id", "instance-action",
    # ours
    "name", "team", "priority", "note", "pool", "service", "gpus", "instances", "request",
    "checkpoint_s3_uri", "sla_s", "labels", "AlgorithmSpecification", "RoleArn",
    "OutputDataConfig", "StoppingCondition", "jobDefinition",
]
_PLAUSIBLE_SCALARS = [
    *(status.value for status in TrainingJobStatus),
    *(status.value for status in BatchJobStatus),
    "i-0b662ef9931388ba0", "terminate", "high", "sagemaker", "batch", "s3://b-1/p",
    "2018-10-06T12:26:13Z", "1583831889050", "yyyy-mm-ddThh:mm:ssZ", "job-1",
]
_plausible_values = (
    _json_values
    | st.sampled_from(_PLAUSIBLE_SCALARS)
    | st.integers(min_value=-1, max_value=2000)
)
_details = st.recursive(
    st.dictionaries(st.sampled_from(_DETAIL_KEYS), _plausible_values, max_size=12),
    lambda children: st.dictionaries(
        st.sampled_from(_DETAIL_KEYS), children | _plausible_values, max_size=8
    ),
    max_leaves=30,
)
_REASONS = {
    "invalid-json", "missing-field", "bad-value", "unknown-detail-type", "bad-request", "bad-source", "team-mismatch",
}


def _assert_parses_or_rejects(raw: Any) -> None:
    """parse_event returns a domain event or Ignored, or raises EventRejected: nothing else."""
    try:
        result = parse_event(raw)
    except EventRejected as error:
        assert error.reason in _REASONS
    else:
        assert isinstance(result, DOMAIN_EVENT_TYPES)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_ENVELOPE_KEYS) | st.text(max_size=10), _json_values))
def test_any_json_object_parses_or_is_rejected(event):
    # Given any JSON-ish dict
    # When parsed / Then a domain event, Ignored, or EventRejected
    _assert_parses_or_rejects(event)


@settings(max_examples=500, deadline=None)
@given(
    source_and_type=st.sampled_from(_SOURCES_AND_TYPES),
    detail=_details,
    time=st.none() | _json_values | st.sampled_from(["2018-10-06T12:26:13Z", 1508781340401]),
    resources=st.lists(
        st.just("arn:aws:ec2:us-east-1b:instance/i-0b662ef9931388ba0") | _json_values,
        max_size=2,
    ),
)
def test_any_detail_for_a_known_type_parses_or_is_rejected(source_and_type, detail, time, resources):
    # Given a well-formed envelope of a type we handle, with an arbitrary detail
    source, detail_type = source_and_type
    event = {
        "id": "e",
        "source": source,
        "detail-type": detail_type,
        "detail": detail,
        "time": time,
        "resources": resources,
    }
    # When parsed / Then a domain event, Ignored, or EventRejected
    _assert_parses_or_rejects(event)


@settings(max_examples=300, deadline=None)
@given(relpath=st.sampled_from(_VALID_SAMPLES), data=st.data())
def test_real_sample_with_one_field_replaced_parses_or_is_rejected(relpath, data):
    # Given a real sample with one detail field replaced by arbitrary JSON
    event = sample(relpath)
    key = data.draw(st.sampled_from(sorted(event["detail"]) or ["x"]), label="key")
    event["detail"][key] = data.draw(_json_values, label="value")
    # When parsed / Then a domain event, Ignored, or EventRejected
    _assert_parses_or_rejects(event)


@settings(max_examples=200, deadline=None)
@given(st.text() | st.binary())
def test_any_text_parses_or_is_rejected(raw):
    # Given arbitrary text or bytes
    # When parsed / Then only EventRejected can escape
    _assert_parses_or_rejects(raw)


def test_s3_object_created_names_bucket_and_key():
    event = parse_event(load_raw("s3/constructed__s3-object-created__checkpoint.json"))
    assert isinstance(event, CheckpointWritten)
    assert event.bucket == "preemptor-checkpoints"
    assert event.key == "research/llm-pretrain-7b/step-001200/model.safetensors"
    assert event.time == parse_timestamp("2025-03-10T09:30:00Z")


def test_an_ec2_scheduled_change_names_its_instances_and_other_health_events_are_ignored():
    # Given AWS Health's samples: a scheduled maintenance of an EC2 host, an EC2 issue, and
    # an issue of another service
    scheduled = parse_event(load_event(sample("other/aws-node-termination-handler__aws-health-event__6620a964.json")))
    issue = parse_event(load_event(sample("other/amazon-cloudwatch-events-use__aws-health-event__d92cc472.json")))
    elb = parse_event(load_event(sample("other/amazon-cloudwatch-events-use__aws-health-event__a11c106b.json")))
    # Then the scheduled change names the affected instance, the others say why they are ignored
    assert isinstance(scheduled, InstanceScheduledChange)
    assert scheduled.instance_ids == ("i-12345678",)
    assert scheduled.event_type_code == "AWS_EC2_DEDICATED_HOST_NETWORK_MAINTENANCE_SCHEDULED"
    assert isinstance(issue, Ignored) and "not an EC2 scheduled change" in issue.reason
    assert isinstance(elb, Ignored) and "ELASTICLOADBALANCING" in elb.reason


def test_an_alarm_state_change_names_the_alarm_its_state_and_why():
    event = parse_event(json.loads(load_raw("other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__06df3b84.json")))
    assert isinstance(event, AlarmStateChanged)
    assert (event.alarm_name, event.state.value, event.previous_state.value) == ("ServerCpuTooHigh", "ALARM", "OK")
    assert event.reason.startswith("Threshold Crossed")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param({"state": {"value": "ON_FIRE"}}, "bad-value", id="unknown-state"),
        pytest.param({"state": None}, "missing-field", id="no-state"),
        pytest.param({"alarmName": None}, "missing-field", id="no-name"),
        pytest.param({"previousState": {"value": 7}}, "bad-value", id="bad-previous"),
    ],
)
def test_a_malformed_alarm_state_change_is_refused_with_the_reason(change, reason):
    raw = json.loads(load_raw("other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__06df3b84.json"))
    for key, value in change.items():
        if value is None:
            raw["detail"].pop(key)
        else:
            raw["detail"][key] = value
    with pytest.raises(EventRejected) as refused:
        parse_event(raw)
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    "flag, stopping, spot",
    [
        (True, _DELETE, True), (False, _DELETE, False), (_DELETE, _DELETE, None), (None, None, None), ("true", _DELETE, None), (1, _DELETE, None),
        # EventBridge's event carries no flag, but the StoppingCondition: a maximum wait is
        # accepted only with managed spot
        (_DELETE, {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}, True),
        (_DELETE, {"MaxRuntimeInSeconds": 3600}, None),
        (_DELETE, {"MaxWaitTimeInSeconds": "7200"}, None), (_DELETE, "7200", None), (_DELETE, {"MaxWaitTimeInSeconds": True}, None),
        (False, {"MaxWaitTimeInSeconds": 7200}, False),
    ],
)
def test_whether_a_training_job_runs_on_managed_spot_is_read_leniently(flag, stopping, spot):
    # Given a training job's event that says it runs on managed spot, or not, or says it
    # malformed (a terminal event refused for that would leave its capacity held)
    event = parse_event(with_detail(TRAINING_IN_PROGRESS_TAGGED, EnableManagedSpotTraining=flag, StoppingCondition=stopping))
    # Then only what is well formed is believed, and the event is never refused for it
    assert event.spot is spot
