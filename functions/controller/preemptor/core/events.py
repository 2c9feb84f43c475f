"""Turn EventBridge events into the domain events the scheduler acts on.

`parse_event` is the one door through which outside events enter the core. It accepts
the raw JSON text (or the dict Lambda already decoded) and returns one of:

* a domain event (`TrainingJobStateChanged`, `BatchJobStateChanged`,
  `SpotInterruptionWarning`, `RebalanceRecommendation`, `JobSubmitted`, `JobCancelled`,
  `JobPriorityLowered`),
* `Ignored` for a well-formed event the controller does not act on,

or raises `EventRejected` with a short machine-readable reason. Nothing else escapes:
intake can log and count a rejection without a catch-all.

The parser is deliberately lenient where AWS's own samples disagree with each other
(time formats, where the EC2 instance id lives) and strict where a wrong guess would
make the scheduler act wrongly (job status values, our own job requests).

Our own events ("Job Submitted", "Job Cancelled", "Job Priority Lowered") come from a team:
their source is `preemptor.<team>`, and a team's principals may put events on the stack's
bus only under their own source (the `events:source` IAM condition, README). So the team is
read from the source, never from the detail: a detail whose `team` names another team is
rejected.

Pure: stdlib, pydantic and the rest of `core` only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from preemptor.core.errors import PreemptorError
from preemptor.core.policy import DEFAULT_TIERS, validate_team_name
from preemptor.core.requests import (
    JobRequest,
    Refusal,
    format_validation_errors,
    normalize_s3_prefix,
    note_problem,
    resolve_priority,
    validate_job_name,
)

# Teams send their events as `preemptor.<team>`. The bare `preemptor` of earlier versions
# said nothing about the sender and is rejected.
SOURCE_PREFIX = "preemptor."
LEGACY_SOURCE = "preemptor"

# Resource tags that let the controller adopt a job it did not launch.
PRIORITY_TAG = "preemptor:priority"
TEAM_TAG = "preemptor:team"
POOL_TAG = "preemptor:pool"
GPUS_TAG = "preemptor:gpus"  # Batch jobs: the GPUs the job holds
CHECKPOINT_TAG = "preemptor:checkpoint"  # Batch jobs: the job's checkpoint prefix
# Tags of runs the controller launched (`adapters.runners.controller_tags`): such a run is
# never adopted, even when its start event arrives before the controller recorded the run,
# where the jobs table bears the claim out (`service.intake.controllers_job`).
JOB_TAG = "preemptor:job"
INCARNATION_TAG = "preemptor:incarnation"
MANAGED_TAG = "preemptor:managed"
# The stack that launched a run: a second stack in the account leaves the first's runs alone.
CONTROLLER_TAG = "preemptor:controller"
# The run's token (`core.jobs.JobRecord.run_token_of`): without the job's secret, which only
# the jobs table holds, no one else can tag a run as an incarnation of the job.
RUN_TOKEN_TAG = "preemptor:run-token"
_GPUS_TEXT = re.compile(r"[0-9]{1,6}")
_MAX_TAG_VALUE = 256


def submission_source(team: str) -> str:
    """The EventBridge source under which `team` submits and cancels jobs."""
    return SOURCE_PREFIX + validate_team_name(team)


class TrainingJobStatus(StrEnum):
    """SageMaker `TrainingJobStatus` values (botocore 1.44.8 service model)."""

    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"
    DELETING = "Deleting"


class AlarmState(StrEnum):
    OK = "OK"
    ALARM = "ALARM"
    INSUFFICIENT_DATA = "INSUFFICIENT_DATA"


class BatchJobStatus(StrEnum):
    """AWS Batch `JobStatus` values (botocore 1.44.8 service model)."""

    SUBMITTED = "SUBMITTED"
    PENDING = "PENDING"
    RUNNABLE = "RUNNABLE"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


class EventRejected(PreemptorError):
    """An event that cannot be understood; intake logs it and drops it.

    Attributes:
        reason: short machine code for metrics and tests: "invalid-json",
            "missing-field", "bad-value", "unknown-detail-type", "bad-request",
            "bad-source" (our own event under a source that names no team),
            "team-mismatch" (a detail that names another team than its source) or
            "bad-tag" (an adoption tag out of bounds).
        detail: a human-readable explanation naming the offending field.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- models


class _Event(BaseModel):
    # strict: the parser builds these from values it already checked, so a coercion
    # here would only hide a parser bug.
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    event_id: str
    time: float | None
    source: str
    detail_type: str


class TrainingJobStateChanged(_Event):
    """A SageMaker training job changed status."""

    training_job_name: str
    status: TrainingJobStatus
    secondary_status: str | None
    failure_reason: str | None
    tags: dict[str, str]
    instance_type: str | None
    instance_count: int | None
    creation_time: float | None
    start_time: float | None
    end_time: float | None
    last_modified: float | None
    checkpoint_s3_uri: str | None
    # ResourceConfig.InstanceGroups (heterogeneous clusters) as (instance type, count).
    instance_groups: tuple[tuple[str, int], ...] = ()
    # Whether it runs on managed spot (`_on_spot`); None when the detail does not say.
    spot: bool | None = None


class BatchJobStateChanged(_Event):
    """An AWS Batch job changed status."""

    job_id: str
    job_name: str
    job_queue: str
    status: BatchJobStatus
    status_reason: str | None
    tags: dict[str, str]
    created_at: float | None
    started_at: float | None
    stopped_at: float | None
    container_instance_arn: str | None
    attempts: int
    # The GPUs its container requires (`container.resourceRequirements`, type GPU), as
    # Batch reports them: None when the event states none, or states them malformed.
    gpus: int | None = None


class SpotInterruptionWarning(_Event):
    """EC2 will reclaim a Spot instance in about two minutes."""

    instance_id: str
    instance_action: str


class RebalanceRecommendation(_Event):
    """EC2 signals an elevated risk of interruption for a Spot instance."""

    instance_id: str


class InstanceScheduledChange(_Event):
    """AWS Health schedules a change (retirement, maintenance, a reboot) of EC2 instances:
    the jobs on them can still checkpoint before it happens."""

    instance_ids: tuple[str, ...]
    event_type_code: str


class CheckpointWritten(_Event):
    """S3 created an object (a checkpoint, or one of the controller's markers) in a bucket
    that sends its events to EventBridge."""

    bucket: str
    key: str


class BatchServiceJobStateChanged(_Event):
    """A Batch service job (a SageMaker training job that a Batch service queue runs)
    changed state; `training_job` is its current attempt's training job, when it has one."""

    service_job_id: str
    status: str
    status_reason: str | None
    training_job: str | None


class BatchServiceJobPreemption(_Event):
    """Batch's own quota management preempts a service job (cross-share reclaim):
    `phase` "started" (the attempt is still running: it can checkpoint) or "completed"
    (with the preempted attempts' training jobs and times)."""

    phase: Literal["started", "completed"]
    service_job_id: str
    status_reason: str | None
    preempted_attempts: int
    stopped_training_jobs: tuple[str, ...]


class AlarmStateChanged(_Event):
    """A CloudWatch alarm changed state (the controller's wait alarm escalates waiting jobs)."""

    alarm_name: str
    state: AlarmState
    previous_state: AlarmState | None
    reason: str | None


class JobSubmitted(_Event):
    """A team asked the controller to run a job (our own event). `request.team` is the
    team of the source."""

    request: JobRequest


class JobCancelled(_Event):
    """A team (`team`, from the source) asked the controller to cancel a job (our own event)."""

    name: str
    team: str


class JobPriorityLowered(_Event):
    """A team (`team`, from the source) lowered one of its jobs' priority (our own event):
    a team may only lower it; raising a job is the platform's (`preemptor priority`)."""

    name: str
    team: str
    priority: int
    note: str


@dataclass(frozen=True, slots=True)
class AdoptionTags:
    """What the tags of a run launched outside the controller claim about it.

    `gpus` and `checkpoint_s3_uri` are read for Batch jobs (SageMaker events state their
    instances and checkpoint config). `managed`: the run carries `preemptor:managed=true`,
    the tag IAM lets the controller stop runs by.
    """

    priority: int | None  # None: its tag is unusable (`problems`)
    team: str | None  # None: its tag is unusable (`problems`): no team to grant it anything
    pool: str | None
    gpus: int | None
    checkpoint_s3_uri: str | None
    managed: bool
    # The tags present but unusable, each "tag <key>: <why>": read as absent.
    problems: tuple[str, ...] = ()


class Ignored(_Event):
    """A well-formed event the controller does not act on; `reason` says why."""

    reason: str


DomainEvent = (
    InstanceScheduledChange
    | TrainingJobStateChanged
    | BatchJobStateChanged
    | SpotInterruptionWarning
    | RebalanceRecommendation
    | CheckpointWritten
    | BatchServiceJobStateChanged
    | BatchServiceJobPreemption
    | AlarmStateChanged
    | JobSubmitted
    | JobCancelled
    | JobPriorityLowered
    | Ignored
)


# ------------------------------------------------------------------------ public API


def load_event(raw: str | bytes | bytearray | Mapping[str, Any]) -> dict[str, Any]:
    """Decode an EventBridge event and check its envelope.

    Accepts JSON text or bytes, or an already decoded dict (as Lambda passes it). A
    repeated JSON key keeps its last value, as EventBridge and most parsers do.

    Checked: `id`, `source` and `detail-type` are non-empty strings, `detail` is an
    object, `time` (if present) is a timestamp, `resources` (if present) is a list of
    strings.

    Raises:
        EventRejected: "invalid-json" (with the error position), "missing-field" or
            "bad-value".
    """
    event = _as_object(raw)
    _read_envelope(event)
    return event


def parse_event(
    raw: str | bytes | bytearray | Mapping[str, Any],
    tiers: Mapping[str, int] = DEFAULT_TIERS,
) -> DomainEvent:
    """Parse an EventBridge event into a domain event, or `Ignored`.

    `tiers` are the priority tier names a "Job Submitted" request may use (the
    configured `Policy.tiers`).

    Events are recognised by the pair (source, detail-type): only AWS can publish
    under an `aws.*` source, so a custom event cannot pose as a Spot interruption.
    Unknown detail-types from AWS are ignored (AWS adds event types all the time);
    unknown detail-types under our own sources are rejected, because they can only be
    a producer bug and ignoring one could silently drop a job submission. Our own
    events carry the sending team in their source, `preemptor.<team>`.

    Raises:
        EventRejected: the event is malformed; `reason` is one of "invalid-json",
            "missing-field", "bad-value", "unknown-detail-type", "bad-request",
            "bad-source", "team-mismatch".
    """
    envelope = _read_envelope(_as_object(raw))
    if envelope.source == LEGACY_SOURCE or envelope.source.startswith(SOURCE_PREFIX):
        return _own_event(envelope, tiers)
    parser = _PARSERS.get((envelope.source, envelope.detail_type))
    if parser is not None:
        return parser(envelope, _Fields(envelope.detail, "detail"), tiers)
    return Ignored(**envelope.common(), reason=f"not-handled: {envelope.detail_type}")


def team_of_source(source: str) -> str:
    """The team that sent an event under `source` (`preemptor.<team>`).

    Raises:
        EventRejected: "bad-source" for the bare legacy source or a malformed team.
    """
    if source == LEGACY_SOURCE:
        raise EventRejected(
            "bad-source",
            f"source {LEGACY_SOURCE!r} names no team; teams send their events as {SOURCE_PREFIX}<team>",
        )
    try:
        return validate_team_name(source.removeprefix(SOURCE_PREFIX))
    except ValueError as error:
        raise EventRejected("bad-source", f"source: {error}") from error


def launched_by_controller(tags: Mapping[str, str], controller: str = "") -> bool:
    """Whether a run's tags claim it for this controller: the job tags and
    `preemptor:managed=true` it puts on every run it launches (IAM lets it create no other),
    and its own name (`controller`, the stack's) where the run carries one (a run launched
    before controllers named themselves carries none).

    A claim only: a team can put these tags on its own run. The jobs table tells
    (`adapters.runners.may_be_own_run`)."""
    return JOB_TAG in tags and tags.get(MANAGED_TAG) == "true" and tags.get(CONTROLLER_TAG, controller) == controller


def other_controller(tags: Mapping[str, str], controller: str = "") -> str | None:
    """The name of another controller whose run this is (a second stack in the same account
    and region, whose own controller counts and stops it), or None."""
    other = tags.get(CONTROLLER_TAG)
    return other if JOB_TAG in tags and other is not None and other != controller else None


def adoption_tags(tags: Mapping[str, str], tiers: Mapping[str, int] = DEFAULT_TIERS) -> AdoptionTags | None:
    """Read what the preemptor tags of a run we did not launch claim about it.

    Returns None unless both `preemptor:priority` and `preemptor:team` are present:
    a run without them is not under the scheduler. `preemptor:pool`, `preemptor:gpus`
    and `preemptor:checkpoint` are optional. The priority tag is an integer or a name
    from `tiers`; the team a well-formed team name; GPUs a positive integer. A tag
    present but unusable (a malformed team, an unknown tier, a priority out of range, GPUs
    not a positive integer, a checkpoint that is not an S3 prefix, an empty pool) is read
    as absent (team, priority: None) and said in `problems`: the run's GPUs are in use
    whatever its tags say, and the intake counts it on what the platform grants. Whether
    the claims fit the configuration (the team's ceiling, the pool's capacity) is the
    intake's to check.
    """
    if PRIORITY_TAG not in tags or TEAM_TAG not in tags:
        return None
    problems: list[str] = []
    try:
        team: str | None = validate_team_name(tags[TEAM_TAG].strip())
    except ValueError as error:
        team = None
        problems.append(f"tag {TEAM_TAG}: {error}")

    def read(key: str, parse: Callable[[str], Any]) -> Any:
        if key not in tags:
            return None
        try:
            return parse(_tag_text(tags, key))
        except EventRejected as error:
            problems.append(error.detail)
        except ValueError as error:
            problems.append(f"tag {key}: {error}")
        return None

    priority = read(PRIORITY_TAG, lambda text: resolve_priority(text, tiers))
    pool = read(POOL_TAG, str)
    gpus = read(GPUS_TAG, _positive_gpus)
    checkpoint = read(CHECKPOINT_TAG, normalize_s3_prefix)
    managed = tags.get(MANAGED_TAG) == "true"
    return AdoptionTags(priority, team, pool, gpus, checkpoint, managed, tuple(problems))


def _positive_gpus(text: str) -> int:
    gpus = int(text) if _GPUS_TEXT.fullmatch(text) else 0
    if gpus <= 0:
        raise ValueError(f"expected a positive integer, got {_shown(text)}")
    return gpus


def parse_timestamp(value: object, where: str = "time") -> float | None:
    """Epoch seconds from any timestamp shape AWS puts in events.

    Accepted: ISO-8601 strings ("2018-10-06T12:26:13Z"; no offset means UTC), epoch
    milliseconds as a number (1508781340401) or as a string ("1583831889050").
    Returns None for null and for documentation placeholders such as
    "yyyy-mm-ddThh:mm:ssZ" (recognised by having no digit at all): they carry no time,
    and the controller uses its own clock for decisions anyway.

    Raises:
        EventRejected: "bad-value" for anything else, naming `where`.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        _bad_value(where, "expected a timestamp", value)
    if isinstance(value, int | float):
        return _from_epoch_ms(value, where)
    if not isinstance(value, str):
        _bad_value(where, "expected a timestamp", value)
    text = value.strip()
    if not any(char.isdigit() for char in text):
        return None
    if _EPOCH_MS_TEXT.fullmatch(text):
        return _from_epoch_ms(float(text), where)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        _bad_value(where, "expected ISO-8601 or epoch milliseconds", value)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


# ------------------------------------------------------------------------- internals

_EPOCH_MS_TEXT = re.compile(r"[0-9]+(\.[0-9]+)?")
# 9999-12-31T23:59:59.999Z: beyond that a "millisecond" value is not a time.
_MAX_EPOCH_MS = 253_402_300_799_999
_INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")
MAX_HEALTH_INSTANCES = 100  # instances of one AWS Health event the intake acts on
# The account is optional and the region may be an AZ: NTH samples carry
# arn:aws:ec2:us-east-1b:instance/i-0b662ef9931388ba0.
_INSTANCE_ARN = re.compile(r"arn:[^:]+:ec2:[^:]*:(?:[^:]*:)?instance/(?P<id>i-[0-9a-f]{8,17})")


_StatusT = TypeVar("_StatusT", bound=StrEnum)


@dataclass(frozen=True, slots=True)
class _Envelope:
    event_id: str
    time: float | None
    source: str
    detail_type: str
    detail: dict[str, Any]
    resources: tuple[str, ...]

    def common(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "time": self.time,
            "source": self.source,
            "detail_type": self.detail_type,
        }


def _as_object(raw: object) -> dict[str, Any]:
    if isinstance(raw, str | bytes | bytearray):
        raw = _decode_json(raw)
    if not isinstance(raw, dict):
        raise EventRejected(
            "bad-value", f"an event must be a JSON object, got {type(raw).__name__}"
        )
    return raw


def _decode_json(text: str | bytes | bytearray) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_non_json_constant)
    except json.JSONDecodeError as error:
        raise EventRejected(
            "invalid-json",
            f"{error.msg}: line {error.lineno} column {error.colno} (char {error.pos})",
        ) from error
    except UnicodeDecodeError as error:
        raise EventRejected("invalid-json", f"not UTF-8 text: {error}") from error
    except ValueError as error:  # from _reject_non_json_constant
        raise EventRejected("invalid-json", str(error)) from error
    except RecursionError as error:
        raise EventRejected("invalid-json", "nested too deeply") from error


def _reject_non_json_constant(name: str) -> NoReturn:
    # Python's json accepts NaN and Infinity; JSON does not, and no AWS service emits them.
    raise ValueError(f"{name} is not valid JSON")


def _read_envelope(event: Mapping[str, Any]) -> _Envelope:
    fields = _Fields(event, "")
    resources = fields.optional_list("resources")
    for index, item in enumerate(resources):
        if not isinstance(item, str):
            _bad_value(f"resources[{index}]", "expected a string", item)
    return _Envelope(
        event_id=fields.required_str("id"),
        time=fields.optional_time("time"),
        source=fields.required_str("source"),
        detail_type=fields.required_str("detail-type"),
        detail=fields.required_object("detail"),
        resources=tuple(resources),
    )


class _Fields:
    """Typed reads from one JSON object, with errors that name the field's path."""

    def __init__(self, data: Mapping[str, Any], path: str) -> None:
        self._data = data
        self._path = path

    def _where(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def required_str(self, key: str) -> str:
        if key not in self._data:
            raise EventRejected("missing-field", f"{self._where(key)} is missing")
        value = self._data[key]
        if not isinstance(value, str) or not value.strip():
            _bad_value(self._where(key), "expected a non-empty string", value)
        return value

    def optional_str(self, key: str) -> str | None:
        value = self._data.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            _bad_value(self._where(key), "expected a string", value)
        return value or None

    def optional_int(self, key: str) -> int | None:
        value = self._data.get(key)
        if value is None:
            return None
        # Some AWS serializers write counts as floats ("DesiredInstanceCount": 1.0).
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            _bad_value(self._where(key), "expected an integer", value)
        return value

    def get(self, key: str) -> Any:
        """The field as it is, unchecked (None when absent)."""
        return self._data.get(key)

    def optional_time(self, key: str) -> float | None:
        return parse_timestamp(self._data.get(key), self._where(key))

    def required_object(self, key: str) -> dict[str, Any]:
        if key not in self._data:
            raise EventRejected("missing-field", f"{self._where(key)} is missing")
        value = self._data[key]
        if not isinstance(value, dict):
            _bad_value(self._where(key), "expected an object", value)
        return value

    def optional_object(self, key: str) -> _Fields:
        """The nested object as `_Fields`; an empty one when absent or null."""
        value = self._data.get(key)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            _bad_value(self._where(key), "expected an object", value)
        return _Fields(value, self._where(key))

    def optional_list(self, key: str) -> list[Any]:
        value = self._data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            _bad_value(self._where(key), "expected a list", value)
        return value

    def tags(self, key: str) -> dict[str, str]:
        value = self._data.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(
            isinstance(name, str) and isinstance(text, str) for name, text in value.items()
        ):
            _bad_value(self._where(key), "expected an object of string tags", value)
        return dict(value)

    def enum(self, key: str, kind: type[_StatusT]) -> _StatusT:
        value = self.required_str(key)
        try:
            return kind(value)
        except ValueError:
            allowed = ", ".join(member.value for member in kind)
            raise EventRejected(
                "bad-value", f"{self._where(key)}: {value!r} is not one of {allowed}"
            ) from None


def _bad_value(where: str, expected: str, value: object) -> NoReturn:
    raise EventRejected("bad-value", f"{where}: {expected}, got {_shown(value)}")


def _from_epoch_ms(value: float, where: str) -> float:
    # Written as a range check so NaN, infinities and huge ints all fail it.
    if not 0 <= value <= _MAX_EPOCH_MS:
        _bad_value(where, "expected epoch milliseconds", value)
    return value / 1000.0


def _tag_text(tags: Mapping[str, str], key: str) -> str:
    value = tags[key]
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_TAG_VALUE:
        raise EventRejected(Refusal.BAD_TAG, f"tag {key}: expected 1..{_MAX_TAG_VALUE} characters, got {_shown(value)}")
    return value.strip()


def _shown(value: object) -> str:
    shown = repr(value) if isinstance(value, str | int | float | bool) else type(value).__name__
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _instance_id(detail: _Fields, resources: tuple[str, ...]) -> str:
    # Real events use "instance-id"; the Powertools sample uses "instance_id"; the
    # resources ARN is the last resort. AWS docs samples pad the id with a space.
    for key in ("instance-id", "instance_id"):
        value = detail.optional_str(key)
        if value is not None:
            instance_id = value.strip()
            if not _INSTANCE_ID.fullmatch(instance_id):
                _bad_value(f"detail.{key}", "expected an EC2 instance id", value)
            return instance_id
    for arn in resources:
        match = _INSTANCE_ARN.fullmatch(arn.strip())
        if match:
            return match["id"]
    raise EventRejected(
        "missing-field", "no instance id in detail.instance-id or in an EC2 instance ARN"
    )


# --------------------------------------------------------------- one parser per type


def _training_job(
    envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]
) -> TrainingJobStateChanged:
    resources = detail.optional_object("ResourceConfig")
    return TrainingJobStateChanged(
        **envelope.common(),
        training_job_name=detail.required_str("TrainingJobName"),
        status=detail.enum("TrainingJobStatus", TrainingJobStatus),
        # Not checked against botocore's SecondaryStatus list: AWS keeps adding values
        # (Pending, Restarting, ...) and rejecting a terminal-state event for an unknown
        # secondary status would leave the job's capacity held forever.
        secondary_status=detail.optional_str("SecondaryStatus"),
        failure_reason=detail.optional_str("FailureReason"),
        tags=detail.tags("Tags"),
        instance_type=resources.optional_str("InstanceType"),
        instance_count=resources.optional_int("InstanceCount"),
        creation_time=detail.optional_time("CreationTime"),
        start_time=detail.optional_time("TrainingStartTime"),
        end_time=detail.optional_time("TrainingEndTime"),
        last_modified=detail.optional_time("LastModifiedTime"),
        checkpoint_s3_uri=detail.optional_object("CheckpointConfig").optional_str("S3Uri"),
        instance_groups=_instance_groups(resources),
        spot=_on_spot(detail),
    )


def _on_spot(detail: _Fields) -> bool | None:
    """Whether a training job runs on managed spot, read leniently (None: not said, or said
    malformed; never a reason to refuse the event): `EnableManagedSpotTraining` where the
    detail states it (DescribeTrainingJob does), else True where its StoppingCondition has
    a MaxWaitTimeInSeconds, which SageMaker accepts only with managed spot ("Invalid
    MaxWaitTimeInSeconds. It is only supported when EnableManagedSpotTraining is set to
    true"). EventBridge's state-change event carries the StoppingCondition, not the flag."""
    flag = detail.get("EnableManagedSpotTraining")
    if isinstance(flag, bool):
        return flag
    stopping = detail.get("StoppingCondition")
    wait = stopping.get("MaxWaitTimeInSeconds") if isinstance(stopping, dict) else None
    return True if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > 0 else None


def _instance_groups(resources: _Fields) -> tuple[tuple[str, int], ...]:
    groups = []
    for index, item in enumerate(resources.optional_list("InstanceGroups")):
        if not isinstance(item, dict):
            _bad_value(f"detail.ResourceConfig.InstanceGroups[{index}]", "expected an object", item)
        group = _Fields(item, f"detail.ResourceConfig.InstanceGroups[{index}]")
        groups.append((group.required_str("InstanceType"), group.optional_int("InstanceCount") or 0))
    return tuple(groups)


def _batch_job(
    envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]
) -> BatchJobStateChanged:
    return BatchJobStateChanged(
        **envelope.common(),
        job_id=detail.required_str("jobId"),
        job_name=detail.required_str("jobName"),
        job_queue=detail.required_str("jobQueue"),
        status=detail.enum("status", BatchJobStatus),
        status_reason=detail.optional_str("statusReason"),
        tags=detail.tags("tags"),
        created_at=detail.optional_time("createdAt"),
        started_at=detail.optional_time("startedAt"),
        stopped_at=detail.optional_time("stoppedAt"),
        container_instance_arn=detail.optional_object("container").optional_str(
            "containerInstanceArn"
        ),
        attempts=len(detail.optional_list("attempts")),
        gpus=_required_gpus(detail.optional_object("container").optional_list("resourceRequirements")),
    )


def _required_gpus(requirements: list[Any]) -> int | None:
    """The GPU count of a Batch container's resource requirements (a string, as Batch sends
    it); None if there is none or it is not a positive whole number."""
    for item in requirements:
        if isinstance(item, dict) and item.get("type") == "GPU":
            value = item.get("value")
            if isinstance(value, str) and value.isascii() and value.isdigit() and 0 < int(value) <= 100_000:
                return int(value)
            return None
    return None


def _spot_interruption(
    envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]
) -> SpotInterruptionWarning:
    return SpotInterruptionWarning(
        **envelope.common(),
        instance_id=_instance_id(detail, envelope.resources),
        # terminate / stop / hibernate in practice; the EC2 docs sample says "action",
        # and the warning means the same thing for us whatever the action.
        instance_action=detail.required_str("instance-action"),
    )


def _rebalance(
    envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]
) -> RebalanceRecommendation:
    return RebalanceRecommendation(
        **envelope.common(), instance_id=_instance_id(detail, envelope.resources)
    )


def _health_event(envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]) -> InstanceScheduledChange | Ignored:
    """Only EC2's scheduled changes concern a job (its instance will be retired, rebooted or
    maintained); issues and account notifications are ignored with the reason. The
    instances are the affected entities that are instance ids, else the event's resources."""
    service = detail.optional_str("service") or ""
    category = detail.optional_str("eventTypeCategory") or ""
    code = detail.optional_str("eventTypeCode") or ""
    if service != "EC2" or category != "scheduledChange":
        return Ignored(**envelope.common(), reason=f"health event {code or '?'} ({category or '?'}) of {service or '?'}: not an EC2 scheduled change")
    entities = [e.get("entityValue") for e in detail.optional_list("affectedEntities") if isinstance(e, dict)]
    candidates = [str(v).strip() for v in entities if isinstance(v, str)] or [r.strip() for r in envelope.resources]
    # Bounded: each instance may start a workflow; a Health event names a handful of them.
    instances = tuple(dict.fromkeys(v for v in candidates if _INSTANCE_ID.fullmatch(v)))[:MAX_HEALTH_INSTANCES]
    if not instances:
        return Ignored(**envelope.common(), reason=f"health event {code}: names no EC2 instance")
    return InstanceScheduledChange(**envelope.common(), instance_ids=instances, event_type_code=code)


def _object_created(envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]) -> CheckpointWritten:
    return CheckpointWritten(
        **envelope.common(),
        bucket=detail.optional_object("bucket").required_str("name"),
        key=detail.optional_object("object").required_str("key"),
    )


def _training_job_of(attempt: object) -> str | None:
    """The training job name of a service job attempt (`serviceResourceId` TrainingJobArn)."""
    if not isinstance(attempt, dict):
        return None
    resource = attempt.get("serviceResourceId")
    if not isinstance(resource, dict) or resource.get("name") != "TrainingJobArn" or not isinstance(resource.get("value"), str):
        return None
    return resource["value"].rsplit("/", 1)[-1] or None


def _service_job_id(arn: str) -> str:
    if ":service-job/" not in arn:
        raise EventRejected("bad-value", f"{_shown(arn)} is not a Batch service job ARN")
    return arn.rsplit("/", 1)[-1]


def _service_job_state(envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]) -> BatchServiceJobStateChanged:
    attempts = detail.optional_list("attempts")
    return BatchServiceJobStateChanged(
        **envelope.common(),
        service_job_id=_service_job_id(detail.required_str("jobArn")),
        status=detail.required_str("status"),
        status_reason=detail.optional_str("statusReason"),
        training_job=_training_job_of(attempts[-1]) if attempts else None,
    )


def _service_job_preemption(phase: Literal["started", "completed"]):
    def parse(envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]) -> BatchServiceJobPreemption:
        summary = detail.optional_object("preemptionSummary")
        recent = summary.optional_list("recentPreemptedAttempts")
        count = summary.optional_int("preemptedAttemptCount")
        return BatchServiceJobPreemption(
            **envelope.common(),
            phase=phase,
            service_job_id=_service_job_id(detail.required_str("preemptedJobArn")),
            status_reason=detail.optional_str("statusReason"),
            preempted_attempts=count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else len(recent),
            stopped_training_jobs=tuple(t for t in (_training_job_of(a) for a in recent[:100]) if t),
        )

    return parse


def _alarm_state_change(envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int]) -> AlarmStateChanged:
    state = detail.optional_object("state")
    previous = detail.optional_object("previousState").optional_str("value")
    try:
        previous_state = AlarmState(previous) if previous is not None else None
    except ValueError as error:
        raise EventRejected("bad-value", f"detail.previousState.value {_shown(previous)} is not an alarm state") from error
    return AlarmStateChanged(
        **envelope.common(),
        alarm_name=detail.required_str("alarmName"),
        state=state.enum("value", AlarmState),
        previous_state=previous_state,
        reason=(state.optional_str("reason") or "")[:500] or None,
    )


def _own_event(envelope: _Envelope, tiers: Mapping[str, int]) -> DomainEvent:
    team = team_of_source(envelope.source)
    parser = _OWN_PARSERS.get(envelope.detail_type)
    if parser is None:
        raise EventRejected(
            "unknown-detail-type", f"source {envelope.source!r} has no detail-type {envelope.detail_type!r}"
        )
    claimed = envelope.detail.get("team", team)
    if claimed != team:
        raise EventRejected(
            Refusal.TEAM_MISMATCH,
            f"detail.team {_shown(claimed)} is not the sending team {team!r} (source {envelope.source})",
        )
    return parser(envelope, _Fields(envelope.detail, "detail"), tiers, team)


def _job_submitted(
    envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int], team: str
) -> JobSubmitted:
    try:
        request = JobRequest.model_validate({**envelope.detail, "team": team}, context={"tiers": tiers})
    except ValidationError as error:
        raise EventRejected("bad-request", format_validation_errors(error)) from error
    return JobSubmitted(**envelope.common(), request=request)


def _named_job(envelope: _Envelope, detail: _Fields, keys: tuple[str, ...]) -> str:
    """The job a team's event about one of its jobs names (`detail.name`); `keys` are the
    detail's keys besides `name` and `team`, any other is refused."""
    unexpected = sorted(str(key) for key in envelope.detail if key not in ("name", "team", *keys))
    if unexpected:
        raise EventRejected("bad-value", f"detail: unexpected keys {', '.join(unexpected)}")
    name = detail.required_str("name")
    try:
        validate_job_name(name)
    except ValueError as error:
        raise EventRejected("bad-value", f"detail.name: {error}") from error
    return name


def _job_cancelled(
    envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int], team: str
) -> JobCancelled:
    return JobCancelled(**envelope.common(), name=_named_job(envelope, detail, ()), team=team)


def _job_priority_lowered(
    envelope: _Envelope, detail: _Fields, tiers: Mapping[str, int], team: str
) -> JobPriorityLowered:
    name = _named_job(envelope, detail, ("priority", "note"))
    if "priority" not in envelope.detail:
        raise EventRejected("missing-field", "detail.priority is missing")
    try:
        priority = resolve_priority(envelope.detail["priority"], tiers)
    except ValueError as error:
        raise EventRejected("bad-value", f"detail.priority: {error}") from error
    note = envelope.detail.get("note", "")
    problem = note_problem(note)
    if problem:
        raise EventRejected("bad-value", f"detail.note {problem}")
    return JobPriorityLowered(**envelope.common(), name=name, team=team, priority=priority, note=note)


# Our own events, by detail-type under any `preemptor.<team>` source; they get the team.
_OWN_PARSERS: Mapping[str, Callable[[_Envelope, _Fields, Mapping[str, int], str], DomainEvent]] = {
    "Job Submitted": _job_submitted,
    "Job Cancelled": _job_cancelled,
    "Job Priority Lowered": _job_priority_lowered,
}

# Every parser takes the tiers so the table stays uniform; none of AWS's events use them.
_PARSERS: Mapping[
    tuple[str, str], Callable[[_Envelope, _Fields, Mapping[str, int]], DomainEvent]
] = {
    ("aws.sagemaker", "SageMaker Training Job State Change"): _training_job,
    ("aws.batch", "Batch Job State Change"): _batch_job,
    ("aws.ec2", "EC2 Spot Instance Interruption Warning"): _spot_interruption,
    ("aws.ec2", "EC2 Instance Rebalance Recommendation"): _rebalance,
    ("aws.s3", "Object Created"): _object_created,
    ("aws.health", "AWS Health Event"): _health_event,
    ("aws.cloudwatch", "CloudWatch Alarm State Change"): _alarm_state_change,
    ("aws.batch", "Batch Service Job State Change"): _service_job_state,
    ("aws.batch", "Batch Service Job Preemption Started"): _service_job_preemption("started"),
    ("aws.batch", "Batch Service Job Preemption Completed"): _service_job_preemption("completed"),
}
