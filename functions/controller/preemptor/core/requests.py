"""The job request a team submits, the priority vocabulary it uses, and the service request
the controller builds from it.

A `JobRequest` is what a `preemptor.<team>` "Job Submitted" event carries and what the CLI
builds: how important the job is, which GPU pool it runs in, and the team's part of the
SageMaker `CreateTrainingJob` or Batch `SubmitJob` call (image, hyperparameters, inputs,
instance count, job definition, command...). Who submitted it is not the request's to say:
the team comes from the event's source.

`admit_request` is the trust boundary: it builds the call the controller makes for every
incarnation, taking the training role, the output location, the network, the encryption
keys, the Batch job queue and job definition from the pool (`core.pools.PoolConfig`) and
the checkpoint prefix from the team (`s3://<bucket>/<team>/<job>`), and refuses a request
that tries to set any of them otherwise, or that misstates its GPU demand, naming the field.

Pure: stdlib, pydantic and the rest of `core` only.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
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

from preemptor.core.errors import PreemptorError
from preemptor.core.policy import DEFAULT_TIERS, MAX_PRIORITY, validate_team_name
from preemptor.core.pools import DEFAULT_SPOT_WAIT_S, PoolConfig
from preemptor.core.s3uri import S3Uri

# Teams think in tier names, the planner compares integers. The tier table is
# configuration (`Policy.tiers`), so its defaults and the upper bound live in `policy`.
MIN_PRIORITY = 0

# SageMaker training job names are at most 63 characters, start and end with a letter or
# digit (pattern ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}). Every incarnation runs as
# "<name>-r<N>", so 56 characters leave room for "-r" plus five digits of incarnation.
MAX_JOB_NAME_LENGTH = 56
_JOB_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*")
_RELAUNCH_SUFFIX = re.compile(r"-r\d+$")  # the suffix of a relaunch's run name (`JobRecord.next_run_name`)

# Keys the controller cannot run a job without. The services validate the rest when the
# job is launched; checking these at intake turns a launch failure hours later (when
# capacity frees up) into an immediate rejection.
REQUIRED_REQUEST_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "sagemaker": ("AlgorithmSpecification", "StoppingCondition"),
        "batch": ("jobDefinition",),
    }
)

# Tags under this prefix are the controller's: they say which job and incarnation a run is,
# and `preemptor:managed` is what IAM lets the controller stop.
CONTROLLER_TAG_PREFIX = "preemptor:"
# SageMaker and Batch take at most 50 tags a run; the controller adds at most this many of
# its own (`adapters.runners.controller_tags`) to the team's.
SERVICE_MAX_TAGS = 50
CONTROLLER_RUN_TAGS = 8

_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")

# Upper bounds on what a request may declare. A number the scheduler computes with must be
# finite and plausible: `restart_overhead_s=1e308` would make a job's stop too costly to ever
# be preferred to waiting on another's checkpoint. A year covers any training run; a week
# any restart.
MAX_DURATION_S = 366 * 86_400
MAX_RESTART_OVERHEAD_S = 7 * 86_400
MAX_LABELS = 50

NonEmptyStr = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
BoundedSeconds = Annotated[int, Field(strict=True, gt=0, le=MAX_DURATION_S)]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\w.:/=+@ -]+$")]
LabelValue = Annotated[str, StringConstraints(max_length=256, pattern=r"^[\w.:/=+@ -]*$")]
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
        or not name.isascii()
        or not _JOB_NAME.fullmatch(name)
    ):
        raise ValueError(
            f"name must be 1..{MAX_JOB_NAME_LENGTH} letters, digits or hyphens "
            f"starting and ending with a letter or digit, got {_shown(name)}"
        )
    return name


NOTE_MAX = 500  # characters of a note on a change: it rides in a decision-log line and a team's notice


def note_problem(note: object) -> str | None:
    """What is wrong with a note on a change (an operator's `--note`, a team's
    `detail.note`), or None: it must be one line of printable text of at most `NOTE_MAX`
    characters."""
    if not isinstance(note, str):
        return f"must be text, got {_shown(note)}"
    if len(note) > NOTE_MAX:
        return f"must be at most {NOTE_MAX} characters, got {len(note)}"
    if not note.isprintable():  # a newline, a control character
        return "must be one line of printable text"
    return None


def normalize_s3_prefix(uri: str) -> str:
    """Validate an `s3://bucket/prefix` URI and drop trailing slashes.

    A prefix is required: every object under the checkpoint prefix counts as a
    checkpoint, so a bare bucket would make the whole bucket look like checkpoints.
    Trailing slashes are dropped so that `<prefix>/_preemptor/...` is built one way only.

    Raises:
        ValueError: not an S3 URI with a bucket and a non-empty prefix.
    """
    try:
        return str(S3Uri.parse(uri))
    except ValueError:
        raise ValueError(f"checkpoint_s3_uri must look like s3://bucket/prefix, got {uri!r}") from None




class JobRequest(BaseModel):
    """A request to run one training job under the scheduler.

    Tier names in `priority` resolve against `DEFAULT_TIERS` unless the configured
    tiers are given as validation context (`context={"tiers": ...}`).

    `request` is the team's part of the service call (`CreateTrainingJob` for SageMaker,
    `SubmitJob` for Batch) without the job name, which the controller sets per
    incarnation; `admit_request` completes it from the pool. GPU demand is explicit
    (`gpus`, required for Batch) or, for SageMaker, counted from the request's instances
    (`ResourceConfig.InstanceCount` or every `InstanceGroups` entry, or `instances`) times
    the pool's GPUs per instance; a stated `gpus` or `instances` must agree with it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str
    team: str
    priority: int
    pool: NonEmptyStr
    service: Service
    gpus: PositiveInt | None = None
    instances: PositiveInt | None = None
    request: dict[str, Any]
    # The team's own prefix, s3://<checkpoint bucket>/<team>/<name>: optional, and if
    # given it must be that one (`admit_request`).
    checkpoint_s3_uri: str | None = None
    sla_s: BoundedSeconds | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)
    # Policy inputs (docs/policy.md): the job's whole work in seconds (near-completion
    # protection), the seconds a relaunch loses before useful work resumes (the stop's
    # cost), and whether it runs on spot capacity (the spot priority cap).
    expected_duration_s: BoundedSeconds | None = None
    restart_overhead_s: Annotated[float, Field(ge=0, le=MAX_RESTART_OVERHEAD_S, allow_inf_nan=False)] = 0.0
    spot: bool = False

    @field_validator("name", mode="before")
    @classmethod
    def _check_name(cls, value: object) -> str:
        name = validate_job_name(value)
        if _RELAUNCH_SUFFIX.search(name):
            # "train-r2" is the name of job "train"'s second run: two jobs would fight over it.
            raise ValueError(
                f"name must not end in -r<digits>, got {_shown(name)}: the controller names a job's relaunches <name>-r2, <name>-r3, ..."
            )
        return name

    @field_validator("team", mode="before")
    @classmethod
    def _check_team(cls, value: object) -> str:
        return validate_team_name(value)

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
    def _check_checkpoint_uri(cls, uri: str | None) -> str | None:
        return None if uri is None else normalize_s3_prefix(uri)

    @model_validator(mode="after")
    def _check_demand_shape(self) -> JobRequest:
        if self.service == "batch":
            if self.gpus is None:
                raise ValueError("gpus is required for batch jobs")
            if self.instances is not None:
                raise ValueError("instances applies to sagemaker jobs only; use gpus")
        return self


class Refusal(StrEnum):
    """Why a well-formed submission, cancel, priority change or adoption is refused (logged,
    counted, returned)."""

    TEAM_MISMATCH = "team-mismatch"  # the detail names a team other than the sender's source
    UNKNOWN_TEAM = "unknown-team"  # `teams` is configured and does not list the team
    ABOVE_TEAM_CEILING = "above-team-ceiling"  # priority above the team's max_priority
    UNKNOWN_POOL = "unknown-pool"
    SET_BY_POOL = "set-by-pool"  # the request sets what the pool or the controller decides
    NOT_ALLOWED = "not-allowed"  # a field, job definition or image the pool does not allow
    BAD_DEMAND = "bad-demand"  # GPUs or instances misstated, another pool's instance type
    NOT_YOUR_JOB = "not-your-job"  # a cancel or a priority change from another team
    NOT_A_LOWERING = "not-a-lowering"  # a team's priority change that does not lower: raising is the platform's
    BAD_TAG = "bad-tag"  # an adoption tag that is malformed or out of bounds
    CONTROLLER_TAGS = "controller-tags"  # a run's tags claim the controller launched it; it did not
    NAME_TAKEN = "name-taken"  # a submission named as a run a team launched outside the controller (adopted)
    WRONG_POOL = "wrong-pool"  # a run's pool tag names a pool other than the one whose capacity it runs on


class RequestRefused(PreemptorError):
    """A submission the controller will not run.

    Attributes:
        reason: the `Refusal`.
        field: the offending field's path ("request.RoleArn"), or "" for the job as a whole.
        detail: a human-readable explanation.
    """

    def __init__(self, reason: Refusal, field: str, detail: str) -> None:
        super().__init__(f"{reason.value}: {field + ': ' if field else ''}{detail}")
        self.reason = reason
        self.field = field
        self.detail = detail


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """What the controller stores for a submitted job: the complete service call (without
    the run's name and the controller's tags, which are set per incarnation), the GPUs it
    holds while it runs, and its checkpoint prefix."""

    request: dict[str, Any]
    gpus: int
    checkpoint_s3_uri: str


def checkpoint_prefix(bucket: str, team: str, job: str) -> str:
    """The checkpoint prefix of `team`'s job `job`: `s3://<bucket>/<team>/<job>`."""
    return f"s3://{bucket}/{team}/{job}"


def default_output_s3_uri(bucket: str) -> str:
    """Where a pool without `output_s3_uri` puts training output. `_output` cannot be a
    team name (`TEAM_NAME`), so it never overlaps a team's checkpoint prefixes."""
    return f"s3://{bucket}/_output"


# CreateTrainingJob members a team may set; everything else is refused. Among them, the
# ones the pool decides (role, output, network, encryption) may only repeat its value.
_SAGEMAKER_KEYS = frozenset(
    {
        "AlgorithmSpecification",
        "HyperParameters",
        "InputDataConfig",
        "ResourceConfig",
        "StoppingCondition",
        "Environment",
        "Tags",
        "CheckpointConfig",
        "EnableManagedSpotTraining",
        "RetryStrategy",
        "ExperimentConfig",
        # set by the pool:
        "RoleArn",
        "OutputDataConfig",
        "VpcConfig",
        "EnableNetworkIsolation",
        "EnableInterContainerTrafficEncryption",
    }
)
_RESOURCE_CONFIG_KEYS = frozenset(
    {"InstanceType", "InstanceCount", "InstanceGroups", "VolumeSizeInGB", "VolumeKmsKeyId", "KeepAlivePeriodInSeconds"}
)
_OUTPUT_KEYS = frozenset({"S3OutputPath", "KmsKeyId", "CompressionType"})
# SubmitJob members a team may set. Array jobs, multi-node overrides and ECS/EKS property
# overrides change how many GPUs the job holds or what runs, and fair-share fields change
# Batch's own ordering: none of them pass.
_BATCH_KEYS = frozenset(
    {"jobQueue", "jobDefinition", "containerOverrides", "parameters", "retryStrategy", "timeout", "tags"}
)
_CONTAINER_OVERRIDE_KEYS = frozenset({"command", "environment", "resourceRequirements", "vcpus", "memory"})
# SageMaker's MaxRuntimeInSeconds when a request gives none (one day).
DEFAULT_MAX_RUNTIME_S = 86_400
# The environment variable through which a Batch job learns its checkpoint prefix.
CHECKPOINT_ENV = "PREEMPTOR_CHECKPOINT_S3_URI"


def admit_request(
    req: JobRequest,
    pool: PoolConfig,
    *,
    checkpoint_bucket: str,
    default_role_arn: str | None = None,
    max_runtime_s: int | None = None,
    team_role_arn: str | None = None,
) -> AdmittedRequest:
    """Build the service call for `req` in `pool`, or refuse it.

    The controller sets the training role (the team's own, `team_role_arn`, else the
    pool's `role_arn`, else `default_role_arn`); the pool sets the
    output location (`<output_s3_uri>/<team>/`), the VPC, network isolation,
    inter-container encryption, the KMS key, the Batch job queue; the job definition must
    be one the pool allows. A SageMaker run's `MaxRuntimeInSeconds` is always stated (the
    stack's role may create only runs that state it), at most `max_runtime_s` (the stack's
    MaxTrainingRuntimeSeconds). The checkpoint prefix is `checkpoint_prefix(bucket, team, name)`.
    A request may leave these out, or repeat exactly what the pool sets; any other value is
    refused with `Refusal.SET_BY_POOL` naming the field. GPU demand is checked against the
    pool (`Refusal.BAD_DEMAND`): a SageMaker request is counted in instances of the pool's
    instance type only, every instance group included; no job may ask for more than the
    pool holds.

    Raises:
        RequestRefused: naming the field and the reason.
    """
    if req.service != pool.service:
        raise RequestRefused(
            Refusal.BAD_DEMAND, "service", f"pool {pool.name!r} runs {pool.service} jobs, not {req.service}"
        )
    checkpoint = checkpoint_prefix(checkpoint_bucket, req.team, req.name)
    if req.checkpoint_s3_uri is not None and req.checkpoint_s3_uri != checkpoint:
        raise RequestRefused(
            Refusal.SET_BY_POOL, "checkpoint_s3_uri", f"set by the controller to the team's own prefix {checkpoint}"
        )
    if req.service == "sagemaker":
        role = team_role_arn or pool.role_arn or default_role_arn
        body, gpus = _sagemaker_request(req, pool, checkpoint, checkpoint_bucket, role, max_runtime_s)
    else:
        body, gpus = _batch_request(req, pool, checkpoint)
    if gpus > pool.capacity_gpus:
        raise RequestRefused(
            Refusal.BAD_DEMAND, "gpus", f"{gpus} GPUs is more than pool {pool.name!r} holds ({pool.capacity_gpus})"
        )
    return AdmittedRequest(body, gpus, checkpoint)


def _sagemaker_request(
    req: JobRequest, pool: PoolConfig, checkpoint: str, bucket: str, role: str | None, max_runtime_s: int | None = None
) -> tuple[dict[str, Any], int]:
    body = copy.deepcopy(req.request)
    _only_keys(body, _SAGEMAKER_KEYS, "request")
    if not role:
        raise RequestRefused(Refusal.NOT_ALLOWED, "request.RoleArn", f"team {req.team!r} and pool {pool.name!r} have no training role")
    _pool_sets(body, "RoleArn", role, "request")
    _check_image(body, pool)

    output = _object(body, "OutputDataConfig", "request")
    _only_keys(output, _OUTPUT_KEYS, "request.OutputDataConfig")
    base = (pool.output_s3_uri or default_output_s3_uri(bucket)).rstrip("/")
    wanted_output = f"{base}/{req.team}/"
    if "S3OutputPath" in output and _normalized_or_none(output["S3OutputPath"]) != wanted_output.rstrip("/"):
        raise RequestRefused(
            Refusal.SET_BY_POOL, "request.OutputDataConfig.S3OutputPath", f"set by the pool to {wanted_output}"
        )
    output["S3OutputPath"] = wanted_output
    _pool_sets(output, "KmsKeyId", pool.kms_key_id, "request.OutputDataConfig")
    body["OutputDataConfig"] = output

    vpc = {"Subnets": list(pool.subnets), "SecurityGroupIds": list(pool.security_group_ids)} if pool.subnets else None
    given_vpc = body.get("VpcConfig")
    if given_vpc is not None and (
        not isinstance(given_vpc, dict)
        or vpc is None
        or sorted(map(str, given_vpc.get("Subnets") or ())) != sorted(vpc["Subnets"])
        or sorted(map(str, given_vpc.get("SecurityGroupIds") or ())) != sorted(vpc["SecurityGroupIds"])
        or set(given_vpc) - {"Subnets", "SecurityGroupIds"}
    ):
        raise RequestRefused(Refusal.SET_BY_POOL, "request.VpcConfig", f"set by pool {pool.name!r}")
    _set_or_drop(body, "VpcConfig", vpc)
    _pool_sets(body, "EnableNetworkIsolation", pool.network_isolation or None, "request", absent_means=False)
    _pool_sets(
        body, "EnableInterContainerTrafficEncryption", pool.inter_container_encryption or None, "request",
        absent_means=False,
    )

    checkpoint_config = _object(body, "CheckpointConfig", "request")
    _only_keys(checkpoint_config, {"S3Uri", "LocalPath"}, "request.CheckpointConfig")
    if "S3Uri" in checkpoint_config and _normalized_or_none(checkpoint_config["S3Uri"]) != checkpoint:
        raise RequestRefused(
            Refusal.SET_BY_POOL, "request.CheckpointConfig.S3Uri", f"set by the controller to {checkpoint}"
        )
    checkpoint_config["S3Uri"] = checkpoint
    body["CheckpointConfig"] = checkpoint_config
    _check_user_tags(body.get("Tags"), "request.Tags", as_list=True)
    _capacity_type(body, pool, max_runtime_s)

    resources = _object(body, "ResourceConfig", "request")
    _only_keys(resources, _RESOURCE_CONFIG_KEYS, "request.ResourceConfig")
    _pool_sets(resources, "VolumeKmsKeyId", pool.kms_key_id, "request.ResourceConfig")
    instances = _count_instances(req, pool, resources)
    body["ResourceConfig"] = resources
    gpus = instances * pool.gpus_per_instance
    if req.gpus is not None and req.gpus != gpus:
        raise RequestRefused(
            Refusal.BAD_DEMAND,
            "gpus",
            f"gpus={req.gpus} contradicts {instances} x {pool.instance_type} "
            f"({pool.gpus_per_instance} GPUs each) = {gpus}",
        )
    return body, gpus


def _capacity_type(body: dict[str, Any], pool: PoolConfig, max_runtime_s: int | None = None) -> None:
    """Spot or on-demand is the pool's (`capacity_type`): a spot pool's jobs run on managed
    spot, waiting for spot capacity up to `spot_wait_s` beyond their run time.

    The run time is stated even when the team left it to SageMaker's default: the stack's
    role may create a training job only with `sagemaker:MaxRuntimeInSeconds` in the request,
    at most MaxTrainingRuntimeSeconds (`max_runtime_s`); a run time above that is refused
    here, with the reason, instead of being denied at every launch."""
    spot = pool.capacity_type == "spot"
    _pool_sets(body, "EnableManagedSpotTraining", True if spot else None, "request", absent_means=False)
    stopping = _object(body, "StoppingCondition", "request")
    runtime = stopping.get("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME_S)
    if not isinstance(runtime, int) or isinstance(runtime, bool) or runtime <= 0:
        raise RequestRefused(Refusal.NOT_ALLOWED, "request.StoppingCondition.MaxRuntimeInSeconds", "expected a positive integer")
    if max_runtime_s is not None and runtime > max_runtime_s:
        stated = "" if "MaxRuntimeInSeconds" in stopping else " (SageMaker's default, as the request gives none)"
        raise RequestRefused(
            Refusal.NOT_ALLOWED,
            "request.StoppingCondition.MaxRuntimeInSeconds",
            f"{runtime} s{stated} is more than this stack lets a training job run ({max_runtime_s} s, MaxTrainingRuntimeSeconds)",
        )
    stopping["MaxRuntimeInSeconds"] = runtime
    _pool_sets(stopping, "MaxWaitTimeInSeconds", runtime + pool.spot_wait_s if spot else None, "request.StoppingCondition")
    body["StoppingCondition"] = stopping


def spot_launch(request: dict[str, Any], spot: bool, spot_wait_s: int = DEFAULT_SPOT_WAIT_S) -> dict[str, Any]:
    """`request` (an admitted CreateTrainingJob) bought as spot or on-demand: the launch of a
    fallback offering of another capacity type than the pool's."""
    out = copy.deepcopy(request)
    stopping = dict(out.get("StoppingCondition") or {})
    if spot:
        out["EnableManagedSpotTraining"] = True
        stopping.setdefault("MaxWaitTimeInSeconds", stopping.get("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME_S) + spot_wait_s)
    else:
        out.pop("EnableManagedSpotTraining", None)
        stopping.pop("MaxWaitTimeInSeconds", None)
    if stopping:
        out["StoppingCondition"] = stopping
    return out


def _count_instances(req: JobRequest, pool: PoolConfig, resources: dict[str, Any]) -> int:
    """Instances of the pool's type the job holds; fills in `InstanceType`/`InstanceCount`
    when the request states only `instances`."""
    if not pool.instance_type:
        raise RequestRefused(Refusal.NOT_ALLOWED, "pool", f"pool {pool.name!r} has no instance_type configured")
    where = "request.ResourceConfig"
    groups = resources.get("InstanceGroups")
    if groups is not None:
        if "InstanceType" in resources or "InstanceCount" in resources:
            raise RequestRefused(
                Refusal.BAD_DEMAND, where, "give InstanceGroups or InstanceType/InstanceCount, not both"
            )
        if not isinstance(groups, list) or not groups:
            raise RequestRefused(Refusal.BAD_DEMAND, f"{where}.InstanceGroups", "expected a non-empty list")
        total = 0
        for index, group in enumerate(groups):
            at = f"{where}.InstanceGroups[{index}]"
            if not isinstance(group, dict):
                raise RequestRefused(Refusal.BAD_DEMAND, at, "expected an object")
            _check_instance_type(group.get("InstanceType"), pool, f"{at}.InstanceType")
            total += _positive_count(group.get("InstanceCount"), f"{at}.InstanceCount")
    else:
        if "InstanceType" in resources:
            _check_instance_type(resources["InstanceType"], pool, f"{where}.InstanceType")
        resources["InstanceType"] = pool.instance_type
        if "InstanceCount" in resources:
            total = _positive_count(resources["InstanceCount"], f"{where}.InstanceCount")
        elif req.instances is not None:
            total = req.instances
        elif req.gpus is not None and req.gpus % pool.gpus_per_instance == 0:
            total = req.gpus // pool.gpus_per_instance
        else:
            raise RequestRefused(
                Refusal.BAD_DEMAND,
                f"{where}.InstanceCount",
                f"required (or `instances`, or `gpus` as a multiple of {pool.gpus_per_instance})",
            )
        resources["InstanceCount"] = total
    if req.instances is not None and req.instances != total:
        raise RequestRefused(
            Refusal.BAD_DEMAND, "instances", f"instances={req.instances} contradicts the {total} the request runs"
        )
    return total


def _check_instance_type(value: object, pool: PoolConfig, where: str) -> None:
    if value != pool.instance_type:
        raise RequestRefused(
            Refusal.BAD_DEMAND, where, f"{_shown(value)} is not pool {pool.name!r}'s instance type {pool.instance_type}"
        )


def _positive_count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 100_000:
        raise RequestRefused(Refusal.BAD_DEMAND, where, f"expected a positive integer, got {_shown(value)}")
    return value


def _check_image(body: dict[str, Any], pool: PoolConfig) -> None:
    spec = _object(body, "AlgorithmSpecification", "request")
    if not pool.image_prefixes:
        return
    image = spec.get("TrainingImage")
    if not isinstance(image, str) or not image.startswith(pool.image_prefixes):
        raise RequestRefused(
            Refusal.NOT_ALLOWED,
            "request.AlgorithmSpecification.TrainingImage",
            f"{_shown(image)} is not an image pool {pool.name!r} allows",
        )


def _batch_request(req: JobRequest, pool: PoolConfig, checkpoint: str) -> tuple[dict[str, Any], int]:
    body = copy.deepcopy(req.request)
    _only_keys(body, _BATCH_KEYS, "request")
    if not pool.job_queue:
        raise RequestRefused(Refusal.NOT_ALLOWED, "request.jobQueue", f"pool {pool.name!r} has no job_queue")
    _pool_sets(body, "jobQueue", pool.job_queue, "request")
    name = body.get("jobDefinition")
    definition = pool.job_definition(name) if isinstance(name, str) else None
    if definition is None:
        allowed = ", ".join(d.name for d in pool.job_definitions) or "none"
        raise RequestRefused(
            Refusal.NOT_ALLOWED,
            "request.jobDefinition",
            f"{_shown(name)} is not a job definition pool {pool.name!r} allows (allowed: {allowed})",
        )
    overrides = _object(body, "containerOverrides", "request")
    _only_keys(overrides, _CONTAINER_OVERRIDE_KEYS, "request.containerOverrides")
    if definition.team is not None and definition.team != req.team:
        # Another team's definition runs as its owner's job role: whatever reaches its
        # program (its command, its environment, the parameters its command takes) would
        # steer that role. Another team runs it as it is.
        steering = (
            ("containerOverrides.command", "command" in overrides),
            ("containerOverrides.environment", bool(overrides.get("environment"))),
            ("parameters", bool(body.get("parameters"))),
        )
        for field, given in steering:
            if given:
                raise RequestRefused(
                    Refusal.NOT_ALLOWED,
                    f"request.{field}",
                    f"job definition {definition.name!r} belongs to team {definition.team!r}: another team runs it "
                    f"as it is, with no command, environment or parameters of its own (they would run as "
                    f"{definition.team!r}'s job role)",
                )
    environment = overrides.get("environment", [])
    if not isinstance(environment, list) or not all(isinstance(e, dict) for e in environment):
        raise RequestRefused(Refusal.NOT_ALLOWED, "request.containerOverrides.environment", "expected a list of objects")
    if any(e.get("name") == CHECKPOINT_ENV for e in environment):
        raise RequestRefused(
            Refusal.SET_BY_POOL, f"request.containerOverrides.environment.{CHECKPOINT_ENV}", "set by the controller"
        )
    environment = [*environment, {"name": CHECKPOINT_ENV, "value": checkpoint}]
    overrides["environment"] = environment
    overrides["resourceRequirements"] = _gpu_requirement(overrides.get("resourceRequirements"), req.gpus)
    body["containerOverrides"] = overrides
    _check_user_tags(body.get("tags"), "request.tags", as_list=False)
    return body, req.gpus


def _gpu_requirement(requirements: object, gpus: int) -> list[dict[str, str]]:
    """The container's resource requirements with exactly `gpus` GPUs: the job then holds
    the GPUs the pool counts for it, whatever its job definition says."""
    where = "request.containerOverrides.resourceRequirements"
    if requirements is None:
        requirements = []
    if not isinstance(requirements, list) or not all(isinstance(r, dict) for r in requirements):
        raise RequestRefused(Refusal.BAD_DEMAND, where, "expected a list of objects")
    for item in requirements:
        if item.get("type") == "GPU" and str(item.get("value")) != str(gpus):
            raise RequestRefused(
                Refusal.BAD_DEMAND, where, f"GPU {_shown(item.get('value'))} contradicts gpus={gpus}"
            )
    return [*(r for r in requirements if r.get("type") != "GPU"), {"type": "GPU", "value": str(gpus)}]


def _only_keys(body: Mapping[str, Any], allowed: frozenset[str] | set[str], where: str) -> None:
    unknown = sorted(str(key) for key in body if key not in allowed)
    if unknown:
        raise RequestRefused(
            Refusal.NOT_ALLOWED, f"{where}.{unknown[0]}", "not a field the controller passes on"
            + (f" (also: {', '.join(unknown[1:])})" if len(unknown) > 1 else "")
        )


def _object(body: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestRefused(Refusal.NOT_ALLOWED, f"{where}.{key}", f"expected an object, got {_shown(value)}")
    return dict(value)


def _pool_sets(
    body: dict[str, Any], key: str, value: Any, where: str, *, absent_means: Any = None
) -> None:
    """`body[key]` becomes the pool's `value` (or goes, when the pool sets none); a request
    that gave another value is refused. `absent_means`: the value the service assumes when
    the key is left out (False for a flag), which a request may also spell out."""
    if key in body and body[key] != value and not (value is None and body[key] == absent_means):
        raise RequestRefused(Refusal.SET_BY_POOL, f"{where}.{key}", "set by the pool")
    _set_or_drop(body, key, value)


def _set_or_drop(body: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        body.pop(key, None)
    else:
        body[key] = value


def _check_user_tags(tags: object, where: str, *, as_list: bool) -> None:
    if tags is None:
        return
    if as_list:
        if not isinstance(tags, list) or not all(isinstance(t, dict) for t in tags):
            raise RequestRefused(Refusal.NOT_ALLOWED, where, "expected a list of {Key, Value}")
        keys = [t.get("Key") for t in tags]
    else:
        if not isinstance(tags, dict):
            raise RequestRefused(Refusal.NOT_ALLOWED, where, "expected an object of tags")
        keys = list(tags)
    ours = sorted(str(k) for k in keys if str(k).startswith(CONTROLLER_TAG_PREFIX))
    if ours:
        raise RequestRefused(Refusal.SET_BY_POOL, f"{where}.{ours[0]}", "preemptor:* tags are set by the controller")
    room = SERVICE_MAX_TAGS - CONTROLLER_RUN_TAGS
    if len(keys) > room:
        # Else every launch would be refused (ValidationException) until the job failed.
        raise RequestRefused(
            Refusal.NOT_ALLOWED, where,
            f"{len(keys)} tags; a run takes at most {SERVICE_MAX_TAGS} and the controller adds {CONTROLLER_RUN_TAGS}: at most {room}",
        )


def _shown(value: object) -> str:
    text = repr(value) if isinstance(value, str | int | float | bool) or value is None else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


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
