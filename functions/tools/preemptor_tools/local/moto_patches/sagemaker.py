"""SageMaker: training jobs that live, and StopTrainingJob.

Gaps filled:
- moto stamps SageMaker objects with the wall clock (`utcnow`): the SimClock instead.
- moto's CreateTrainingJob marks the job `Completed` at once and drops `Environment` and
  `RetryStrategy`; the patch keeps them and starts the job `InProgress`/`Starting`, and tells
  the simulated fleet, which moves it on (`set_training_job_status`).
- moto's CreateTrainingJob silently replaces a job of the same name; AWS answers
  `ResourceInUse` (names are unique per account and region), so a launch retried after it
  succeeded cannot start a second run here either.
- moto enforces no account quota: CreateTrainingJob over the account's limit for an instance
  type is `ResourceLimitExceeded` on AWS, before any job exists. The simulated fleet holds
  the limits (`check_training_job_create`); the patch answers with the error it names.
- moto has no StopTrainingJob at all (backend nor response): `InProgress` -> `Stopping`, the
  fleet ends it `Stopped` after the grace; a missing job or a job in another status is a
  `ValidationException`, as on AWS.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from moto.core.responses import EmptyResult
from moto.sagemaker import models as sagemaker_models
from moto.sagemaker.exceptions import ResourceInUseException, SagemakerClientError, ValidationError
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

from ._core import _STATE, listeners, notify, replace, sim_utcnow, subscribe, utc_naive

TrainingJobCreated = Callable[[str, dict], None]
TrainingJobStopRequested = Callable[[str], None]
# Before CreateTrainingJob: the refusal of the account's quota (a message), or None.
TrainingJobCreateCheck = Callable[[str, dict], "str | None"]
_CREATE_CHECK = "training_job_create_check"
_CREATED = "training_job_created"
_STOP_REQUESTED = "training_job_stop_requested"
_TERMINAL = {"Completed", "Failed", "Stopped"}


def patch() -> None:
    replace(sagemaker_models, "utcnow", sim_utcnow)
    replace(SageMakerResponse, "create_training_job", _create_training_job)
    replace(SageMakerModelBackend, "stop_training_job", _backend_stop_training_job)
    replace(SageMakerResponse, "stop_training_job", _stop_training_job)


def on_training_job_created(callback: TrainingJobCreated) -> Callable[[], None]:
    """`callback(name, create_training_job_request)` after CreateTrainingJob; returns unsubscribe."""
    return subscribe(_CREATED, callback)


def check_training_job_create(check: TrainingJobCreateCheck) -> Callable[[], None]:
    """`check(name, request)` before CreateTrainingJob creates anything: a message it returns
    is the call's `ResourceLimitExceeded` answer; returns unsubscribe."""
    return subscribe(_CREATE_CHECK, check)


class ResourceLimitExceeded(SagemakerClientError):
    """SageMaker's answer to a request over an account-level service quota (HTTP 400)."""

    code = "ResourceLimitExceeded"

    def __init__(self, message: str):
        super().__init__(message)


def on_training_job_stop_requested(callback: TrainingJobStopRequested) -> Callable[[], None]:
    """`callback(name)` after a successful StopTrainingJob; returns unsubscribe."""
    return subscribe(_STOP_REQUESTED, callback)


_ORIGINAL_CREATE_TRAINING_JOB = SageMakerResponse.create_training_job


def _create_training_job(self: SageMakerResponse) -> Any:
    request = copy.deepcopy(dict(self.params))
    name = request["TrainingJobName"]
    existing = self.sagemaker_backend.training_jobs.get(name)
    if existing is not None:
        raise ResourceInUseException(
            message=f"Training job names must be unique within an AWS account and region, and a training job "
            f"with this name already exists ({existing.arn})"
        )
    for check in listeners(_CREATE_CHECK):
        refusal = check(name, request)
        if refusal:
            raise ResourceLimitExceeded(refusal)
    result = _ORIGINAL_CREATE_TRAINING_JOB(self)
    job = self.sagemaker_backend.training_jobs[name]
    now = utc_naive(_STATE.require_clock().now())
    job.environment = copy.deepcopy(request.get("Environment")) or None
    job.retry_strategy = copy.deepcopy(request.get("RetryStrategy")) or None
    job.training_job_status = "InProgress"
    job.secondary_status = "Starting"
    job.failure_reason = None
    job.creation_time = job.last_modified_time = now
    job.training_start_time = None
    job.training_end_time = None
    job.final_metric_data_list = None
    job.secondary_status_transitions = [
        {"Status": "Starting", "StartTime": now, "StatusMessage": "Launching requested ML instances"}
    ]
    notify(_CREATED, name, request)
    return result


def _backend_stop_training_job(self: SageMakerModelBackend, training_job_name: str) -> None:
    job = self.training_jobs.get(training_job_name)
    if job is None:
        arn = sagemaker_models.FakeTrainingJob.arn_formatter(training_job_name, self.account_id, self.region_name)
        raise ValidationError(message=f"Could not find training job '{arn}'.")
    if job.training_job_status != "InProgress":
        raise ValidationError(
            message=f"The request was rejected because the training job is in status {job.training_job_status}."
        )
    _set_fields(job, "Stopping", "Stopping", None)
    notify(_STOP_REQUESTED, training_job_name)


def _stop_training_job(self: SageMakerResponse) -> Any:
    self.sagemaker_backend.stop_training_job(self._get_param("TrainingJobName"))
    return EmptyResult()


def _find(name: str) -> Any:
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


def _set_fields(job: Any, status: str, secondary_status: str, failure_reason: str | None) -> None:
    now = utc_naive(_STATE.require_clock().now())
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
    if status in _TERMINAL:
        job.training_end_time = now
        transitions = job.secondary_status_transitions or []
        if transitions and "EndTime" not in transitions[-1]:
            transitions[-1]["EndTime"] = now
    job.training_job_status = status
    job.secondary_status = secondary_status
    job.last_modified_time = now
    if failure_reason is not None:
        job.failure_reason = failure_reason


def set_training_job_status(name: str, status: str, secondary_status: str, failure_reason: str | None = None) -> None:
    """Move a moto training job to `status`/`secondary_status` at the SimClock's time.

    Used by the simulated fleet; keeps TrainingStartTime/TrainingEndTime/LastModifiedTime and
    SecondaryStatusTransitions consistent, as DescribeTrainingJob shows them on AWS.
    """
    with _STATE.lock:
        _set_fields(_find(name), status, secondary_status, failure_reason)


def get_training_job(name: str) -> dict:
    """DescribeTrainingJob's view of a moto training job (for the fleet and tests)."""
    return _find(name).response_object


def training_job_tags(name: str) -> dict[str, str]:
    """The tags of a moto training job (the hostile emulator's IAM check reads them)."""
    return {tag["Key"]: tag["Value"] for tag in _find(name).tags or []}
