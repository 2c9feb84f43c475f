"""Batch: jobs that wait for the simulated fleet, and TerminateJob handed to it.

Gaps filled, each at the hook moto's Docker-free backend provides:
- `BatchSimpleBackend._mark_job_as_finished` marks every job SUCCEEDED at submission; the
  patch only registers it (moto's SUBMITTED) at the SimClock's time and tells the fleet, with
  the request it was submitted with, so the fleet moves it on (`set_batch_job_status`).
- `Job.terminate` only sets a flag that nothing reads without Docker; for a simulated job the
  patch hands the stop to the fleet (which ends it FAILED after the stop grace). moto's own
  TerminateJob/CancelJob keep their validation and their rule that CancelJob does not stop a
  job that has started.
- `Job._get_container_property("environment")` appends `AWS_BATCH_JOB_ID` to the job's own
  override list on every DescribeJobs, so the environment grows with each call; the patch
  lets it append to a copy.
- `Job._container_details` leaves out `resourceRequirements`, which AWS's DescribeJobs (and
  the state-change events, which carry the same detail) state: the job definition's, each
  type overridden by the job's `containerOverrides`. The patch adds them (a job's GPUs are
  read from there when the controller adopts it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from moto.batch.models import Job, batch_backends
from moto.batch_simple.models import BatchSimpleBackend

from ._core import _STATE, local_naive, notify, replace, subscribe

BatchJobSubmitted = Callable[[str, dict], None]
BatchJobTerminateRequested = Callable[[str, str], None]
_SUBMITTED = "batch_job_submitted"
_TERMINATE_REQUESTED = "batch_job_terminate_requested"
_TERMINAL = {"SUCCEEDED", "FAILED"}


def patch() -> None:
    replace(BatchSimpleBackend, "_mark_job_as_finished", _register_job)
    replace(Job, "terminate", _terminate)
    replace(Job, "_get_container_property", _container_property)
    replace(Job, "_container_details", _container_details)


def on_batch_job_submitted(callback: BatchJobSubmitted) -> Callable[[], None]:
    """`callback(job_id, submit_job_request)` after SubmitJob; returns unsubscribe."""
    return subscribe(_SUBMITTED, callback)


def on_batch_job_terminate_requested(callback: BatchJobTerminateRequested) -> Callable[[], None]:
    """`callback(job_id, reason)` after TerminateJob/CancelJob of a live job; returns unsubscribe."""
    return subscribe(_TERMINATE_REQUESTED, callback)


def _register_job(self: BatchSimpleBackend, include_start_attempt: bool, job: Job) -> None:
    self.backend._jobs[job.job_id] = job
    job.job_created_at = local_naive(_STATE.require_clock().now())
    job.log_stream_name = job._stream_name
    job._preemptor_simulated = True
    job._preemptor_terminate_reason = None
    if job.array_properties:
        return  # array jobs (parent and children) are not simulated
    request = {
        "jobName": job.job_name,
        "jobQueue": job.job_queue.arn,
        "jobDefinition": job.job_definition.arn,
        "containerOverrides": copy.deepcopy(job.container_overrides or {}),
        "parameters": copy.deepcopy(job.parameters or {}),
        "timeout": copy.deepcopy(job.timeout),
        "dependsOn": copy.deepcopy(job.depends_on or []),
        "tags": dict(self.backend.list_tags_for_resource(job.arn) or {}),
    }
    notify(_SUBMITTED, job.job_id, request)


_ORIGINAL_TERMINATE = Job.terminate


def _terminate(self: Job, reason: str) -> None:
    if not getattr(self, "_preemptor_simulated", False):
        _ORIGINAL_TERMINATE(self, reason)
        return
    if self.status in _TERMINAL or self._preemptor_terminate_reason is not None:
        return
    self._preemptor_terminate_reason = reason
    notify(_TERMINATE_REQUESTED, self.job_id, reason)


_ORIGINAL_GET_CONTAINER_PROPERTY = Job._get_container_property


def _container_property(self: Job, p: str, default: Any) -> Any:
    if p != "environment":
        return _ORIGINAL_GET_CONTAINER_PROPERTY(self, p, default)
    overrides = self.container_overrides
    self.container_overrides = copy.deepcopy(overrides)
    try:
        return _ORIGINAL_GET_CONTAINER_PROPERTY(self, p, default)
    finally:
        self.container_overrides = overrides


_ORIGINAL_CONTAINER_DETAILS = Job._container_details


def _container_details(self: Job) -> dict[str, Any]:
    details = _ORIGINAL_CONTAINER_DETAILS(self)
    defined = (self.job_definition.container_properties or {}).get("resourceRequirements") or []
    overridden = (self.container_overrides or {}).get("resourceRequirements") or []
    effective = {r["type"]: r for r in defined} | {r["type"]: r for r in overridden}
    if effective:
        details["resourceRequirements"] = [{"value": r["value"], "type": r["type"]} for r in effective.values()]
    return details


def _find(job_id: str) -> Job:
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
        job = _find(job_id)
        now = local_naive(_STATE.require_clock().now())
        if status in ("STARTING", "RUNNING") and job.latest_attempt is None:
            job.job_started_at = now
            job._start_attempt()
        if status in _TERMINAL:
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
    return _find(job_id).describe()
