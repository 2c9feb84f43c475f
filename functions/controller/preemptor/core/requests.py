"""The job request a team submits, and the priority vocabulary it uses.

A `JobRequest` is what the `preemptor` "Job Submitted" event carries and what the
CLI builds: who owns the job, how important it is, which GPU pool it runs in, and the
untouched body of the SageMaker `CreateTrainingJob` or Batch `SubmitJob` call the
controller makes for every incarnation of the job.

Pure: stdlib, pydantic and the rest of `core` only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from preemptor.core.policy import DEFAULT_TIERS, MAX_PRIORITY

# Teams think in tier names, the planner compares integers. The tier table is
# configuration (`Policy.tiers`), so its defaults and the upper bound live in `policy`.
MIN_PRIORITY = 0

# SageMaker training job names are at most 63 characters and must start with a letter or
# digit (pattern ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}). Every incarnation runs as
# "<name>-r<N>", so 56 characters leave room for "-r" plus five digits of incarnation.
MAX_JOB_NAME_LENGTH = 56
_JOB_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9-]*")

# Keys the controller cannot run a job without. The services validate the rest when the
# job is launched; checking these at intake turns a launch failure hours later (when
# capacity frees up) into an immediate rejection.
REQUIRED_REQUEST_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "sagemaker": (
            "AlgorithmSpecification",
            "RoleArn",
            "ResourceConfig",
            "OutputDataConfig",
            "StoppingCondition",
        ),
        "batch": ("jobQueue", "jobDefinition"),
    }
)

_S3_PREFIX = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<key>.+)")
_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")

NonEmptyStr = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
Service = Literal["sagemaker", "batch"]


def resolve_priority(value: object, tiers: Mapping[str, int] = DEFAULT_TIERS) -> int:
    """Turn a priority given as an integer, a numeric string or a tier name into an int.

    Tier names match case-insensitively. Numeric strings are accepted because priorities
    also arrive as resource tag values, which are always strings.

    Raises:
        ValueError: the value is not an integer in 0..1000 or a known tier name.
    """
    if isinstance(value, bool):
        # bool is an int subclass; `"priority": true` is a mistake, not priority 1.
        raise ValueError(f"priority must be an integer or a tier name, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if _INTEGER.fullmatch(text):
            return _check_priority_range(int(text))
        by_name = {name.lower(): level for name, level in tiers.items()}
        if text.lower() in by_name:
            return _check_priority_range(by_name[text.lower()])
        known = ", ".join(sorted(by_name))
        raise ValueError(
            f"unknown priority tier {value!r}; use an integer "
            f"{MIN_PRIORITY}..{MAX_PRIORITY} or one of: {known}"
        )
    if isinstance(value, int):
        return _check_priority_range(value)
    raise ValueError(
        f"priority must be an integer or a tier name, got {type(value).__name__}"
    )


def _check_priority_range(priority: int) -> int:
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"priority {priority} is out of range {MIN_PRIORITY}..{MAX_PRIORITY}"
        )
    return priority


def validate_job_name(name: object) -> str:
    """Check that `name` can name a job (and, with a "-r<N>" suffix, a SageMaker job).

    Raises:
        ValueError: the name is not 1..56 letters, digits and hyphens starting with a
            letter or digit.
    """
    if (
        not isinstance(name, str)
        or len(name) > MAX_JOB_NAME_LENGTH
        or not _JOB_NAME.fullmatch(name)
    ):
        raise ValueError(
            f"name must be 1..{MAX_JOB_NAME_LENGTH} letters, digits or hyphens "
            f"starting with a letter or digit, got {name!r}"
        )
    return name


def normalize_s3_prefix(uri: str) -> str:
    """Validate an `s3://bucket/prefix` URI and drop trailing slashes.

    A prefix is required: every object under the checkpoint prefix counts as a
    checkpoint, so a bare bucket would make the whole bucket look like checkpoints.
    Trailing slashes are dropped so that `<prefix>/_preemptor/...` is built one way only.

    Raises:
        ValueError: not an S3 URI with a bucket and a non-empty prefix.
    """
    match = _S3_PREFIX.fullmatch(uri.strip())
    key = match["key"].rstrip("/") if match else ""
    if not key:
        raise ValueError(f"checkpoint_s3_uri must look like s3://bucket/prefix, got {uri!r}")
    return f"s3://{match['bucket']}/{key}"


class JobRequest(BaseModel):
    """A request to run one training job under the scheduler.

    Tier names in `priority` resolve against `DEFAULT_TIERS` unless the configured
    tiers are given as validation context (`context={"tiers": ...}`).

    `request` is the body of the service call (`CreateTrainingJob` for SageMaker,
    `SubmitJob` for Batch) without the job name, which the controller sets per
    incarnation. GPU demand is explicit (`gpus`) or, for SageMaker, counted in
    instances (`instances`, defaulting to `ResourceConfig.InstanceCount`), because the
    GPUs per instance type are known to the pool configuration, not to the request.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    team: NonEmptyStr
    priority: int
    pool: NonEmptyStr
    service: Service
    gpus: PositiveInt | None = None
    instances: PositiveInt | None = None
    request: dict[str, Any]
    checkpoint_s3_uri: str
    sla_s: PositiveInt | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    # Policy inputs (docs/policy.md): the job's whole work in seconds (near-completion
    # protection), the seconds a relaunch loses before useful work resumes (victim
    # choice), and whether it runs on spot capacity (the spot priority cap).
    expected_duration_s: PositiveInt | None = None
    restart_overhead_s: Annotated[float, Field(ge=0)] = 0.0
    spot: bool = False

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_sagemaker_request(cls, data: Any) -> Any:
        # Fill in what a SageMaker request already says, so users state it once. Only
        # well-typed values are copied: a bad value stays in `request` and must not be
        # reported as an error in a field the user never wrote.
        if not isinstance(data, dict) or data.get("service") != "sagemaker":
            return data
        body = data.get("request")
        if not isinstance(body, dict):
            return data
        filled = dict(data)
        checkpoint = _nested(body, "CheckpointConfig", "S3Uri")
        if "checkpoint_s3_uri" not in filled and isinstance(checkpoint, str):
            filled["checkpoint_s3_uri"] = checkpoint
        count = _nested(body, "ResourceConfig", "InstanceCount")
        if (
            "instances" not in filled
            and "gpus" not in filled
            and isinstance(count, int)
            and not isinstance(count, bool)
        ):
            filled["instances"] = count
        return filled

    @field_validator("name", mode="before")
    @classmethod
    def _check_name(cls, value: object) -> str:
        return validate_job_name(value)

    @field_validator("priority", mode="before")
    @classmethod
    def _resolve_priority(cls, value: object, info: ValidationInfo) -> int:
        # Callers pass the configured tiers as validation context:
        # JobRequest.model_validate(data, context={"tiers": policy.tiers}).
        tiers = (info.context or {}).get("tiers", DEFAULT_TIERS)
        return resolve_priority(value, tiers)

    @field_validator("request")
    @classmethod
    def _check_request_keys(cls, body: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        service = info.data.get("service")  # absent when `service` itself was invalid
        missing = [key for key in REQUIRED_REQUEST_KEYS.get(service, ()) if key not in body]
        if missing:
            raise ValueError(f"{service} request is missing {', '.join(missing)}")
        return body

    @field_validator("checkpoint_s3_uri")
    @classmethod
    def _check_checkpoint_uri(cls, uri: str) -> str:
        return normalize_s3_prefix(uri)

    @model_validator(mode="after")
    def _check_demand_and_consistency(self) -> JobRequest:
        if self.service == "batch":
            if self.gpus is None:
                raise ValueError("gpus is required for batch jobs")
            if self.instances is not None:
                raise ValueError("instances applies to sagemaker jobs only; use gpus")
            return self
        if self.gpus is None and self.instances is None:
            raise ValueError(
                "sagemaker jobs need gpus, instances or request.ResourceConfig.InstanceCount"
            )
        count = _nested(self.request, "ResourceConfig", "InstanceCount")
        if self.instances is not None and isinstance(count, int) and count != self.instances:
            # The job would hold a different number of instances than the pool accounts for.
            raise ValueError(
                f"instances={self.instances} contradicts "
                f"request.ResourceConfig.InstanceCount={count}"
            )
        declared = _nested(self.request, "CheckpointConfig", "S3Uri")
        if declared is not None and _normalized_or_none(declared) != self.checkpoint_s3_uri:
            # The controller would watch (and ask for checkpoints in) a place the job
            # never writes to, and every preemption would lose all progress.
            raise ValueError(
                f"checkpoint_s3_uri {self.checkpoint_s3_uri!r} differs from "
                f"request.CheckpointConfig.S3Uri {declared!r}"
            )
        return self

    def gpu_demand(self, gpus_per_instance: int) -> int:
        """GPUs this job holds while it runs.

        An explicit `gpus` wins; otherwise `instances * gpus_per_instance`, where the
        caller knows the GPUs per instance of the job's pool.

        Raises:
            ValueError: `gpus_per_instance` is not a positive integer when it is needed.
        """
        if self.gpus is not None:
            return self.gpus
        if isinstance(gpus_per_instance, bool) or not (
            isinstance(gpus_per_instance, int) and gpus_per_instance > 0
        ):
            raise ValueError(
                f"gpus_per_instance must be a positive integer, got {gpus_per_instance!r}"
            )
        if self.instances is None:
            # Only reachable for a model built without validation (model_construct).
            raise ValueError(f"job {self.name!r} states neither gpus nor instances")
        return self.instances * gpus_per_instance


def format_validation_errors(error: ValidationError) -> str:
    """One line per field error, `field.path: message`, for rejection messages and logs."""
    lines = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"]) or "job"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {message}")
    return "; ".join(lines)


def _nested(body: Mapping[str, Any], *keys: str) -> Any:
    value: Any = body
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _normalized_or_none(uri: object) -> str | None:
    if not isinstance(uri, str):
        return None
    try:
        return normalize_s3_prefix(uri)
    except ValueError:
        return None
