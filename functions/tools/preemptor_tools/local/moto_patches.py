"""Every test/demo-only patch of moto, in one place, pinned to one moto release.

moto runs our workflows, Lambda handlers, S3, SageMaker and Batch in-process, but it lacks a
few behaviours the scheduler depends on (real job lifecycles, stop/terminate, error names from
Lambda, simulated time). `install(clock, lambda_invoker)` patches them in; `uninstall()`
restores moto. Both are idempotent. Use the patches inside
`mock_aws(config=MOTO_CONFIG)`; the config matters: it selects moto's Docker-free Lambda and
Batch backends and turns on ASL execution.

What the caller must create in moto:
- Lambda: a function per handler (`create_function` with any zip and a `Handler` string);
  invoking it calls `lambda_invoker(function_name, event)` instead of running the zip.
- Batch: a compute environment, a job queue and a job definition, e.g.
  `create_compute_environment(computeEnvironmentName=..., type="UNMANAGED", state="ENABLED",
  serviceRole=<role arn>)`, `create_job_queue(jobQueueName=..., state="ENABLED", priority=1,
  computeEnvironmentOrder=[{"order": 1, "computeEnvironment": <ce arn>}])`,
  `register_job_definition(jobDefinitionName=..., type="container",
  containerProperties={"image": ..., "vcpus": 1, "memory": 512})`. Array jobs are not simulated.
- SageMaker: nothing (training jobs need only the usual CreateTrainingJob request).

Simulated time: Wait states, Retry intervals, `.sync` polling and task timeouts run on the
SimClock; S3 `LastModified` and SageMaker/Batch job times come from it.
"""

from __future__ import annotations

import calendar
import copy
import datetime as dt
import json
import logging
import threading
import time as _real_time
from collections.abc import Callable
from typing import Any

import moto

PINNED_MOTO_VERSION = "5.2.5"
if moto.__version__ != PINNED_MOTO_VERSION:
    raise RuntimeError(
        f"preemptor_tools.local.moto_patches is written against moto {PINNED_MOTO_VERSION} internals, "
        f"found moto {moto.__version__}. Install moto=={PINNED_MOTO_VERSION} "
        "(see requirements-dev.txt) or re-check every hook in this module before bumping the pin."
    )

import botocore.session  # noqa: E402
from botocore import xform_name  # noqa: E402
from botocore.exceptions import UnknownServiceError  # noqa: E402
from botocore.model import ListShape, MapShape, Shape, StringShape, StructureShape  # noqa: E402
from botocore.response import StreamingBody  # noqa: E402
from moto.awslambda_simple.models import LambdaSimpleBackend  # noqa: E402
from moto.batch.models import BatchBackend, Job, batch_backends  # noqa: E402
from moto.batch.exceptions import ClientException  # noqa: E402
from moto.batch_simple.models import BatchSimpleBackend  # noqa: E402
from moto.core.responses import EmptyResult  # noqa: E402
from moto.s3 import models as s3_models  # noqa: E402
from moto.sagemaker import models as sagemaker_models  # noqa: E402
from moto.sagemaker.exceptions import ValidationError  # noqa: E402
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends  # noqa: E402
from moto.sagemaker.responses import SageMakerResponse  # noqa: E402
from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (  # noqa: E402
    FailureEventException,
)
from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl  # noqa: E402
from moto.stepfunctions.parser.asl.component.state.exec import execute_state  # noqa: E402
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (  # noqa: E402
    state_task_service_callback,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service import (  # noqa: E402
    StateTaskService,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_aws_sdk import (  # noqa: E402
    StateTaskServiceAwsSdk,
)
from moto.stepfunctions.parser.asl.component.state.wait.wait_function.timestamp import (  # noqa: E402
    Timestamp,
)
from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import (  # noqa: E402
    WaitFunction,
)
from moto.stepfunctions.parser.asl.eval.callback import callback as sfn_callback  # noqa: E402
from moto.stepfunctions.parser.asl.utils.encoding import to_json_str  # noqa: E402

from preemptor_tools.local.clock import SimClock  # noqa: E402

LOG = logging.getLogger(__name__)

# The mock_aws config the patches are written for.
MOTO_CONFIG: dict[str, Any] = {
    "stepfunctions": {"execute_state_machine": True},
    "lambda": {"use_docker": False},
    "batch": {"use_docker": False},
}

# Simulated seconds a `.sync` integration waits between two polls of the job it started.
SYNC_POLL_SIM_S = 10.0
# Real seconds between checks of the simulated clock while a task with a timeout runs.
_TIMEOUT_POLL_REAL_S = 0.02

LambdaInvoker = Callable[[str, dict], Any]
TrainingJobCreated = Callable[[str, dict], None]
TrainingJobStopRequested = Callable[[str], None]
BatchJobSubmitted = Callable[[str, dict], None]
BatchJobTerminateRequested = Callable[[str, str], None]

_SAGEMAKER_TERMINAL = {"Completed", "Failed", "Stopped"}
_BATCH_TERMINAL = {"SUCCEEDED", "FAILED"}


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.clock: SimClock | None = None
        self.lambda_invoker: LambdaInvoker | None = None
        self.originals: list[tuple[Any, str, Any]] = []
        self.training_job_created: list[TrainingJobCreated] = []
        self.training_job_stop_requested: list[TrainingJobStopRequested] = []
        self.batch_job_submitted: list[BatchJobSubmitted] = []
        self.batch_job_terminate_requested: list[BatchJobTerminateRequested] = []
        self.logger_levels: dict[str, int] = {}

    @property
    def installed(self) -> bool:
        return bool(self.originals)

    def require_clock(self) -> SimClock:
        if self.clock is None:
            raise RuntimeError("preemptor_tools.local.moto_patches.install() has not been called")
        return self.clock


_STATE = _State()


# --------------------------------------------------------------------------- install / uninstall


def install(clock: SimClock, lambda_invoker: LambdaInvoker) -> None:
    """Patch moto for the local runtime. Calling it again only swaps the clock and invoker."""
    with _STATE.lock:
        _STATE.clock = clock
        _STATE.lambda_invoker = lambda_invoker
        if _STATE.installed:
            return
        _patch_lambda()
        _patch_stepfunctions_time()
        _patch_stepfunctions_service_tasks()
        _patch_sagemaker()
        _patch_batch()
        _patch_s3()
        _quiet_moto_logging()


def uninstall() -> None:
    """Restore moto as it was before `install` and forget listeners, clock and invoker."""
    with _STATE.lock:
        for owner, name, original in reversed(_STATE.originals):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _STATE.originals.clear()
        for logger_name, level in _STATE.logger_levels.items():
            logging.getLogger(logger_name).setLevel(level)
        _STATE.logger_levels.clear()
        _STATE.training_job_created.clear()
        _STATE.training_job_stop_requested.clear()
        _STATE.batch_job_submitted.clear()
        _STATE.batch_job_terminate_requested.clear()
        _STATE.clock = None
        _STATE.lambda_invoker = None


def is_installed() -> bool:
    return _STATE.installed


_MISSING = object()


def _replace(owner: Any, name: str, value: Any) -> None:
    _STATE.originals.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


def _subscribe(registry: list, callback: Callable) -> Callable[[], None]:
    with _STATE.lock:
        registry.append(callback)

    def unsubscribe() -> None:
        with _STATE.lock:
            if callback in registry:
                registry.remove(callback)

    return unsubscribe


def on_training_job_created(callback: TrainingJobCreated) -> Callable[[], None]:
    """`callback(name, create_training_job_request)` after CreateTrainingJob; returns unsubscribe."""
    return _subscribe(_STATE.training_job_created, callback)


def on_training_job_stop_requested(callback: TrainingJobStopRequested) -> Callable[[], None]:
    """`callback(name)` after a successful StopTrainingJob; returns unsubscribe."""
    return _subscribe(_STATE.training_job_stop_requested, callback)


def on_batch_job_submitted(callback: BatchJobSubmitted) -> Callable[[], None]:
    """`callback(job_id, submit_job_request)` after SubmitJob; returns unsubscribe."""
    return _subscribe(_STATE.batch_job_submitted, callback)


def on_batch_job_terminate_requested(callback: BatchJobTerminateRequested) -> Callable[[], None]:
    """`callback(job_id, reason)` after TerminateJob/CancelJob of a live job; returns unsubscribe."""
    return _subscribe(_STATE.batch_job_terminate_requested, callback)


def _notify(registry: list, *args: Any) -> None:
    with _STATE.lock:
        callbacks = list(registry)
    for callback in callbacks:
        callback(*args)


# --------------------------------------------------------------------------- time helpers


def _utc_naive(t: float) -> dt.datetime:
    """moto's S3 and SageMaker models keep naive UTC datetimes (moto.core.utils.utcnow)."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).replace(tzinfo=None)


def _local_naive(t: float) -> dt.datetime:
    """moto's Batch models keep naive local datetimes (datetime.now) and call .timestamp()."""
    return dt.datetime.fromtimestamp(t)


def _sim_utcnow() -> dt.datetime:
    return _utc_naive(_STATE.require_clock().now())


class _SimTime:
    """Stands in for the `time` module inside one moto module: `sleep` advances the SimClock."""

    def __init__(self, sleep_seconds: Callable[[float], float]) -> None:
        self._sleep_seconds = sleep_seconds

    def sleep(self, seconds: float) -> None:
        _STATE.require_clock().advance(self._sleep_seconds(seconds))

    def __getattr__(self, name: str) -> Any:
        return getattr(_real_time, name)


class _SimTimeoutEvent(threading.Event):
    """An Event whose `wait(timeout)` times out `timeout` simulated seconds after it was armed.

    It is armed when created (moto creates these when a task starts) and again on `clear()`
    (a heartbeat re-arms it). moto's real-time bound stays too, so a task that is truly stuck
    still times out; a task that finishes returns at once either way.
    """

    def __init__(self) -> None:
        super().__init__()
        self._armed_at = _STATE.clock.now() if _STATE.clock is not None else None

    def clear(self) -> None:
        super().clear()
        if _STATE.clock is not None:
            self._armed_at = _STATE.clock.now()

    def wait(self, timeout: float | None = None) -> bool:
        clock = _STATE.clock
        if timeout is None or clock is None:
            return super().wait(timeout)
        armed_at = self._armed_at if self._armed_at is not None else clock.now()
        sim_deadline = armed_at + timeout
        real_deadline = _real_time.monotonic() + timeout
        while True:
            if super().wait(_TIMEOUT_POLL_REAL_S):
                return True
            if clock.now() >= sim_deadline or _real_time.monotonic() >= real_deadline:
                return self.is_set()


class _ThreadingWithSimEvents:
    """Stands in for the `threading` module inside moto's ExecutionState (task timeouts)."""

    Event = _SimTimeoutEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


# --------------------------------------------------------------------------- a. Lambda


def _patch_lambda() -> None:
    # moto's Docker-free Lambda returns a canned payload; we run the handler in-process instead.
    _replace(LambdaSimpleBackend, "invoke", _lambda_invoke)


def _lambda_invoke(
    self: LambdaSimpleBackend,
    function_name: str,
    qualifier: str | None,
    body: Any,
    headers: Any,
    response_headers: Any,
) -> bytes:
    function = self.get_function(function_name, qualifier)  # unknown function -> 404 as on AWS
    event = json.loads(body) if body else {}
    invoker = _STATE.lambda_invoker
    if invoker is None:
        raise RuntimeError("moto_patches.install() has not been called: no lambda_invoker")
    try:
        result = invoker(function.function_name, event)
    except Exception as error:  # noqa: BLE001 - a handler error is the function's response
        LOG.info("Lambda %s raised %s: %s", function.function_name, type(error).__name__, error)
        # What the Python runtime returns; Step Functions names the States error after errorType.
        response_headers["x-amz-function-error"] = "Unhandled"
        return json.dumps(
            {"errorMessage": str(error), "errorType": type(error).__name__, "stackTrace": []}
        ).encode()
    return json.dumps(result).encode()


# --------------------------------------------------------------------------- b. Step Functions time


def _patch_stepfunctions_time() -> None:
    # moto's Wait blocks on a real Event for N seconds; we advance the SimClock instead.
    _replace(WaitFunction, "_eval_body", _wait_eval_body)
    # moto's Retry does time.sleep(interval); we advance the SimClock by the interval instead.
    _replace(retrier_decl, "time", _SimTime(lambda seconds: seconds))
    # moto's .sync integrations poll every 0.5 real seconds; each poll advances simulated time.
    _replace(state_task_service_callback, "time", _SimTime(lambda _seconds: SYNC_POLL_SIM_S))
    # moto times tasks out (TimeoutSeconds) on a real Event; count the timeout in simulated time.
    _replace(execute_state, "threading", _ThreadingWithSimEvents())
    # moto's waitForTaskToken/heartbeat waits are real Events too; same treatment.
    _replace(sfn_callback, "Event", _SimTimeoutEvent)


def _wait_eval_body(self: WaitFunction, env: Any) -> None:
    clock = _STATE.require_clock()
    started = clock.now()
    if isinstance(self, Timestamp):  # Timestamp and TimestampPath: wait until that instant
        clock.advance_to(_timestamp_target(self, env))
        return
    seconds = self._get_wait_seconds(env=env)
    if seconds > 0:
        clock.advance_to(started + seconds)


def _timestamp_target(wait: Timestamp, env: Any) -> float:
    wait.string.eval(env=env)
    timestamp_str: str = env.stack.pop()
    parsed = Timestamp._from_timestamp_string(timestamp=timestamp_str)
    if parsed is None:
        raise FailureEventException(wait._create_failure_event(env, timestamp_str))
    return float(calendar.timegm(parsed.timetuple()))


# --------------------------------------------------------------------------- g. service tasks

_BOTOCORE_SESSION = botocore.session.get_session()
_SERVICE_MODELS: dict[str, Any] = {}
_SERVICE_MODELS_LOCK = threading.Lock()


def _service_model(service_name: str) -> Any | None:
    """botocore's model of a service (cached), or None if botocore does not know it."""
    with _SERVICE_MODELS_LOCK:
        if service_name not in _SERVICE_MODELS:
            try:
                _SERVICE_MODELS[service_name] = _BOTOCORE_SESSION.get_service_model(service_name)
            except UnknownServiceError:
                _SERVICE_MODELS[service_name] = None
        return _SERVICE_MODELS[service_name]


def _operation_model(service_name: str, action: str) -> Any | None:
    model = _service_model(service_name)
    if model is None:
        return None
    wanted = xform_name(action)
    for operation_name in model.operation_names:
        if xform_name(operation_name) == wanted:
            return model.operation_model(operation_name)
    return None


def _patch_stepfunctions_service_tasks() -> None:
    # moto's StateTaskService leaves parameters PascalCase as written in ASL; botocore wants the
    # API's own casing (stateMachineArn, jobName), so states:/batch:/aws-sdk: tasks fail. Map them
    # through the botocore shapes like AWS does, and PascalCase the response keys back.
    _replace(StateTaskService, "_normalise_parameters", _normalise_parameters)
    _replace(StateTaskService, "_normalise_response", _normalise_response)
    # moto names aws-sdk errors after the lower-case service ("sagemaker.sagemakerException");
    # AWS uses the SDK's PascalCase service name ("SageMaker.SageMakerException").
    _replace(
        StateTaskServiceAwsSdk, "_normalise_service_error_name", staticmethod(_sdk_error_service_name)
    )


# AWS's names where they differ from the botocore service id made PascalCase.
_SDK_ERROR_SERVICE_NAMES = {
    "dynamodb": "DynamoDb",
    "sfn": "Sfn",
    "stepfunctions": "Sfn",
    "states": "Sfn",
}


def _sdk_error_service_name(service_name: str) -> str:
    known = _SDK_ERROR_SERVICE_NAMES.get(service_name.lower())
    if known is not None:
        return known
    model = _service_model(service_name)
    if model is None:
        return service_name
    return "".join(
        word if any(c.islower() for c in word) else word.capitalize()
        for word in str(model.service_id).split()
    )


def _normalise_parameters(
    self: StateTaskService,
    parameters: dict,
    boto_service_name: str | None = None,
    service_action_name: str | None = None,
) -> None:
    operation = _operation_model(
        self._get_boto_service_name(boto_service_name),
        service_action_name or self.resource.api_action,
    )
    if operation is not None and operation.input_shape is not None:
        _to_boto_structure(parameters, operation.input_shape)


def _normalise_response(
    self: StateTaskService,
    response: Any,
    boto_service_name: str | None = None,
    service_action_name: str | None = None,
) -> None:
    operation = _operation_model(
        self._get_boto_service_name(boto_service_name),
        service_action_name or self.resource.api_action,
    )
    if operation is not None and operation.output_shape is not None:
        _from_boto_structure(response, operation.output_shape)
    _timestamps_to_iso(response)


def _timestamps_to_iso(value: Any) -> None:
    """botocore returns datetimes, which moto cannot json.dumps into the execution output."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in list(items):
        if isinstance(item, (dt.datetime, dt.date)):
            value[key] = item.isoformat()
        else:
            _timestamps_to_iso(item)


def _to_boto_structure(parameters: Any, shape: Shape) -> None:
    if not isinstance(parameters, dict) or not isinstance(shape, StructureShape):
        return
    members = {xform_name(name): (name, member) for name, member in shape.members.items()}
    for key in list(parameters):
        bound = members.get(xform_name(key))
        if bound is None:
            continue
        member_name, member_shape = bound
        parameters[member_name] = _to_boto_value(parameters.pop(key), member_shape)


def _to_boto_value(value: Any, shape: Shape) -> Any:
    if isinstance(shape, StructureShape):
        _to_boto_structure(value, shape)
    elif isinstance(shape, ListShape) and isinstance(value, list):
        return [_to_boto_value(item, shape.member) for item in value]
    elif isinstance(shape, MapShape) and isinstance(value, dict):
        return {key: _to_boto_value(item, shape.value) for key, item in value.items()}
    elif isinstance(shape, StringShape) and not isinstance(value, str):
        return to_json_str(value)
    elif shape.type_name == "blob" and not isinstance(value, bytes):
        text = value if isinstance(value, str) else to_json_str(value, separators=(",", ":"))
        return text.encode("utf-8")
    return value


def _from_boto_structure(response: Any, shape: Shape) -> None:
    if not isinstance(response, dict) or not isinstance(shape, StructureShape):
        return
    for key in list(response):
        member = shape.members.get(key)
        if member is None:
            continue
        value = response.pop(key)
        if isinstance(value, StreamingBody):
            value = value.read().decode("utf-8")
        _from_boto_value(value, member)
        response[key[:1].upper() + key[1:]] = value


def _from_boto_value(value: Any, shape: Shape) -> None:
    if isinstance(shape, StructureShape):
        _from_boto_structure(value, shape)
    elif isinstance(shape, ListShape) and isinstance(value, list):
        for item in value:
            _from_boto_value(item, shape.member)
    elif isinstance(shape, MapShape) and isinstance(value, dict):
        for item in value.values():
            _from_boto_value(item, shape.value)


# --------------------------------------------------------------------------- c. SageMaker


def _patch_sagemaker() -> None:
    # moto stamps SageMaker objects with the wall clock; use the SimClock.
    _replace(sagemaker_models, "utcnow", _sim_utcnow)
    # moto marks training jobs Completed at creation and drops Environment; start them InProgress.
    _replace(SageMakerResponse, "create_training_job", _sagemaker_create_training_job)
    # moto has no StopTrainingJob at all (backend nor response).
    _replace(SageMakerModelBackend, "stop_training_job", _sagemaker_backend_stop_training_job)
    _replace(SageMakerResponse, "stop_training_job", _sagemaker_stop_training_job)


_ORIGINAL_CREATE_TRAINING_JOB = SageMakerResponse.create_training_job


def _sagemaker_create_training_job(self: SageMakerResponse) -> Any:
    request = copy.deepcopy(dict(self.params))
    result = _ORIGINAL_CREATE_TRAINING_JOB(self)
    name = request["TrainingJobName"]
    job = self.sagemaker_backend.training_jobs[name]
    now = _STATE.require_clock().now()
    job.environment = copy.deepcopy(request.get("Environment")) or None
    job.retry_strategy = copy.deepcopy(request.get("RetryStrategy")) or None
    job.training_job_status = "InProgress"
    job.secondary_status = "Starting"
    job.failure_reason = None
    job.creation_time = job.last_modified_time = _utc_naive(now)
    job.training_start_time = None
    job.training_end_time = None
    job.final_metric_data_list = None
    job.secondary_status_transitions = [
        {
            "Status": "Starting",
            "StartTime": _utc_naive(now),
            "StatusMessage": "Launching requested ML instances",
        }
    ]
    _notify(_STATE.training_job_created, name, request)
    return result


def _sagemaker_backend_stop_training_job(self: SageMakerModelBackend, training_job_name: str) -> None:
    job = self.training_jobs.get(training_job_name)
    if job is None:
        arn = sagemaker_models.FakeTrainingJob.arn_formatter(
            training_job_name, self.account_id, self.region_name
        )
        raise ValidationError(message=f"Could not find training job '{arn}'.")
    if job.training_job_status != "InProgress":
        raise ValidationError(
            message=(
                f"The request was rejected because the training job is in status "
                f"{job.training_job_status}."
            )
        )
    _set_training_job_fields(job, "Stopping", "Stopping", None)
    _notify(_STATE.training_job_stop_requested, training_job_name)


def _sagemaker_stop_training_job(self: SageMakerResponse) -> Any:
    self.sagemaker_backend.stop_training_job(self._get_param("TrainingJobName"))
    return EmptyResult()


def _find_training_job(name: str) -> Any:
    for account_backends in list(sagemaker_backends.values()):
        for backend in list(account_backends.values()):
            job = backend.training_jobs.get(name)
            if job is not None:
                return job
    raise KeyError(f"no SageMaker training job named {name!r} in moto")


_SECONDARY_STATUS_MESSAGES = {
    "Starting": "Launching requested ML instances",
    "Downloading": "Downloading input data",
    "Training": "Training image download completed. Training in progress.",
    "Uploading": "Uploading generated training model",
    "Stopping": "Stopping the training job",
    "Stopped": "Training job stopped",
    "Completed": "Training job completed",
    "Failed": "Training job failed",
}


def _set_training_job_fields(
    job: Any, status: str, secondary_status: str, failure_reason: str | None
) -> None:
    now = _utc_naive(_STATE.require_clock().now())
    if secondary_status != job.secondary_status:
        transitions = job.secondary_status_transitions or []
        if transitions and "EndTime" not in transitions[-1]:
            transitions[-1]["EndTime"] = now
        transitions.append(
            {
                "Status": secondary_status,
                "StartTime": now,
                "StatusMessage": _SECONDARY_STATUS_MESSAGES.get(secondary_status, secondary_status),
            }
        )
        job.secondary_status_transitions = transitions
    if secondary_status == "Training" and job.training_start_time is None:
        job.training_start_time = now
    if status in _SAGEMAKER_TERMINAL:
        job.training_end_time = now
        transitions = job.secondary_status_transitions or []
        if transitions and "EndTime" not in transitions[-1]:
            transitions[-1]["EndTime"] = now
    job.training_job_status = status
    job.secondary_status = secondary_status
    job.last_modified_time = now
    if failure_reason is not None:
        job.failure_reason = failure_reason


def set_training_job_status(
    name: str, status: str, secondary_status: str, failure_reason: str | None = None
) -> None:
    """Move a moto training job to `status`/`secondary_status` at the SimClock's time.

    Used by the simulated fleet; keeps TrainingStartTime/TrainingEndTime/LastModifiedTime and
    SecondaryStatusTransitions consistent, as DescribeTrainingJob shows them on AWS.
    """
    with _STATE.lock:
        _set_training_job_fields(_find_training_job(name), status, secondary_status, failure_reason)


def get_training_job(name: str) -> dict:
    """DescribeTrainingJob's view of a moto training job (for the fleet and tests)."""
    return _find_training_job(name).response_object


# --------------------------------------------------------------------------- d. Batch


def _patch_batch() -> None:
    # moto's Docker-free Batch finishes every job at submission; keep it SUBMITTED for the fleet.
    _replace(BatchSimpleBackend, "_mark_job_as_finished", _batch_register_job)
    # ... and tell the fleet about it, with the request it was submitted with.
    _replace(BatchSimpleBackend, "submit_job", _batch_submit_job)
    # moto's TerminateJob only sets a flag nobody reads without Docker; hand it to the fleet.
    _replace(BatchBackend, "terminate_job", _batch_terminate_job)
    _replace(BatchBackend, "cancel_job", _batch_cancel_job)
    # moto appends AWS_BATCH_JOB_ID to the job's own override list on every DescribeJobs.
    _replace(Job, "_get_container_property", _batch_container_property)


_ORIGINAL_SUBMIT_JOB = BatchSimpleBackend.submit_job
_ORIGINAL_TERMINATE_JOB = BatchBackend.terminate_job
_ORIGINAL_CANCEL_JOB = BatchBackend.cancel_job
_ORIGINAL_GET_CONTAINER_PROPERTY = Job._get_container_property


def _batch_container_property(self: Job, p: str, default: Any) -> Any:
    if p != "environment":
        return _ORIGINAL_GET_CONTAINER_PROPERTY(self, p, default)
    overrides = self.container_overrides
    self.container_overrides = copy.deepcopy(overrides)
    try:
        return _ORIGINAL_GET_CONTAINER_PROPERTY(self, p, default)
    finally:
        self.container_overrides = overrides


def _batch_register_job(self: BatchSimpleBackend, include_start_attempt: bool, job: Job) -> None:
    self.backend._jobs[job.job_id] = job
    job.job_created_at = _local_naive(_STATE.require_clock().now())
    job.log_stream_name = job._stream_name
    job._preemptor_simulated = True
    job._preemptor_terminate_reason = None


def _batch_submit_job(
    self: BatchSimpleBackend, job_name: str, job_def_id: str, job_queue: str, **kwargs: Any
) -> tuple[str, str, str]:
    name, job_id, arn = _ORIGINAL_SUBMIT_JOB(self, job_name, job_def_id, job_queue, **kwargs)
    job = self.backend._jobs[job_id]
    request = {
        "jobName": job_name,
        "jobQueue": job.job_queue.arn,
        "jobDefinition": job.job_definition.arn,
        "containerOverrides": copy.deepcopy(kwargs.get("container_overrides") or {}),
        "parameters": copy.deepcopy(kwargs.get("parameters") or {}),
        "tags": copy.deepcopy(kwargs.get("tags") or {}),
        "timeout": copy.deepcopy(kwargs.get("timeout")),
        "dependsOn": copy.deepcopy(kwargs.get("depends_on") or []),
    }
    if not job.array_properties.get("size"):
        _notify(_STATE.batch_job_submitted, job_id, request)
    return name, job_id, arn


def _batch_validate(job_id: str, reason: str, what: str) -> None:
    if job_id == "":
        raise ClientException(f"'jobId' is a required field (cannot be {what} empty string)")
    if reason == "":
        raise ClientException(f"'reason' is a required field (cannot be {what} empty string)")


def _batch_stop_request(self: BatchBackend, job_id: str, reason: str) -> bool:
    """Hand a stop of a simulated job to the fleet; False if the job is not simulated."""
    job = self.get_job_by_id(job_id)
    if job is None or not getattr(job, "_preemptor_simulated", False):
        return False
    if job.status in _BATCH_TERMINAL or job._preemptor_terminate_reason is not None:
        return True
    job._preemptor_terminate_reason = reason
    _notify(_STATE.batch_job_terminate_requested, job.job_id, reason)
    return True


def _batch_terminate_job(self: BatchBackend, job_id: str, reason: str) -> None:
    _batch_validate(job_id, reason, "a")
    if not _batch_stop_request(self, job_id, reason):
        _ORIGINAL_TERMINATE_JOB(self, job_id, reason)


def _batch_cancel_job(self: BatchBackend, job_id: str, reason: str) -> None:
    _batch_validate(job_id, reason, "an")
    job = self.get_job_by_id(job_id)
    started = job is not None and job.status not in ("SUBMITTED", "PENDING", "RUNNABLE")
    if started and getattr(job, "_preemptor_simulated", False):
        return  # as on AWS, CancelJob does not stop a job that has started
    if not _batch_stop_request(self, job_id, reason):
        _ORIGINAL_CANCEL_JOB(self, job_id, reason)


def _find_batch_job(job_id: str) -> Job:
    for account_backends in list(batch_backends.values()):
        for backend in list(account_backends.values()):
            job = backend.get_job_by_id(job_id)
            if job is not None:
                return job
    raise KeyError(f"no Batch job {job_id!r} in moto")


def set_batch_job_status(job_id: str, status: str, reason: str | None = None) -> None:
    """Move a moto Batch job to `status` at the SimClock's time (the fleet calls this).

    RUNNING starts an attempt; SUCCEEDED/FAILED stop it with `reason` as statusReason (exit
    code 0, resp. 143 = SIGTERM for a terminated job, 1 otherwise).
    """
    with _STATE.lock:
        job = _find_batch_job(job_id)
        now = _local_naive(_STATE.require_clock().now())
        if status in ("STARTING", "RUNNING") and job.latest_attempt is None:
            job.job_started_at = now
            job._start_attempt()
        if status in _BATCH_TERMINAL:
            if job.latest_attempt is None and status == "SUCCEEDED":
                job.job_started_at = now
                job._start_attempt()
            job.job_stopped = True
            job.job_stopped_at = now
            job.job_stopped_reason = reason
            terminated = job._preemptor_terminate_reason is not None
            job.exit_code = 0 if status == "SUCCEEDED" else (143 if terminated else 1)
            if job.latest_attempt is not None:
                job._stop_attempt()
                job.latest_attempt["statusReason"] = reason or "Essential container in task exited"
                job.latest_attempt["container"]["exitCode"] = job.exit_code
        job.status = status


def get_batch_job(job_id: str) -> dict:
    """DescribeJobs' view of a moto Batch job (for the fleet and tests)."""
    return _find_batch_job(job_id).describe()


# --------------------------------------------------------------------------- e. S3


def _patch_s3() -> None:
    # moto stamps S3 objects (LastModified) with the wall clock; use the SimClock, which the
    # fleet pins to a transition's own time while it writes a checkpoint.
    _replace(s3_models, "utcnow", _sim_utcnow)


# --------------------------------------------------------------------------- f. logging

_QUIET_LOGGERS = {
    "moto": logging.WARNING,
    "moto.stepfunctions": logging.WARNING,
    # logs every failing ASL component with repr() of the whole state tree at ERROR, once per
    # nesting level; the failure is in the execution history anyway.
    "moto.stepfunctions.parser.asl.component.eval_component": logging.CRITICAL,
}


def _quiet_moto_logging() -> None:
    # moto logs whole objects (ASL programs, requests) at DEBUG and every caught task error at ERROR.
    for name, level in _QUIET_LOGGERS.items():
        logger = logging.getLogger(name)
        _STATE.logger_levels[name] = logger.level
        logger.setLevel(level)
