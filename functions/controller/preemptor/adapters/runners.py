"""SageMaker and AWS Batch behind one interface: launch a run, stop it, read its state.

Runs launched by the controller carry the tag `preemptor:managed=true`; the IAM policy lets
the controller stop or terminate only runs with that tag.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

from botocore.exceptions import ClientError

from ..core.errors import ServiceJobNotFound, ServiceRejected, Throttled
from ..core.jobs import JobRecord

MANAGED_TAG = "preemptor:managed"
CHECKPOINT_ENV = "PREEMPTOR_CHECKPOINT_S3_URI"
_THROTTLING = {"ThrottlingException", "TooManyRequestsException", "Throttling"}


@dataclass(frozen=True, slots=True)
class RunState:
    """Where a run stands, in the controller's words: running, stopped, completed or failed."""

    phase: str
    service_status: str
    reason: str | None = None

    @property
    def ended(self) -> bool:
        return self.phase in ("stopped", "completed", "failed")


class Runner(Protocol):
    service: str

    def launch(self, record: JobRecord) -> str: ...

    def stop(self, run_id: str, reason: str) -> None: ...

    def state(self, run_id: str) -> RunState: ...


def controller_tags(record: JobRecord) -> dict[str, str]:
    return {
        MANAGED_TAG: "true",
        "preemptor:job": record.name,
        "preemptor:incarnation": str(record.incarnation),
        "preemptor:team": record.team,
        "preemptor:priority": str(record.priority),
        "preemptor:pool": record.pool,
    }


def _code(error: ClientError) -> str:
    return error.response.get("Error", {}).get("Code", "")


def _translate(error: ClientError, what: str) -> Exception:
    code = _code(error)
    if code in _THROTTLING:
        return Throttled(f"{what}: {code}")
    if code in ("ResourceNotFound", "ResourceNotFoundException"):
        return ServiceJobNotFound(f"{what}: {code}")
    return ServiceRejected(f"{what}: {code}: {error.response.get('Error', {}).get('Message', '')}")


class SageMakerRunner:
    """Plain SageMaker training jobs. The run id is the training job name."""

    service = "sagemaker"
    _PHASES = {
        "InProgress": "running",
        "Stopping": "running",
        "Stopped": "stopped",
        "Completed": "completed",
        "Failed": "failed",
    }

    def __init__(self, client: Any):
        self.client = client

    def launch(self, record: JobRecord) -> str:
        """Create the training job of the record's current incarnation (idempotent by name)."""
        request = copy.deepcopy(record.request)
        name = record.next_run_name
        request["TrainingJobName"] = name
        checkpoint = dict(request.get("CheckpointConfig") or {})
        checkpoint["S3Uri"] = record.checkpoint_s3_uri
        request["CheckpointConfig"] = checkpoint
        tags = {t["Key"]: t["Value"] for t in request.get("Tags", [])}
        tags.update(controller_tags(record))
        request["Tags"] = [{"Key": k, "Value": v} for k, v in sorted(tags.items())]
        try:
            self.client.create_training_job(**request)
        except ClientError as e:
            if _code(e) == "ResourceInUse":
                return name  # this incarnation was already created by an earlier attempt
            raise _translate(e, f"CreateTrainingJob {name}") from e
        return name

    def stop(self, run_id: str, reason: str) -> None:
        """Ask SageMaker to stop the job (SIGTERM, ~120 s grace). Stopping twice is harmless."""
        try:
            self.client.stop_training_job(TrainingJobName=run_id)
        except ClientError as e:
            if _code(e) == "ValidationException" and self.state(run_id).phase != "running":
                return  # already stopping or ended
            raise _translate(e, f"StopTrainingJob {run_id}") from e

    def state(self, run_id: str) -> RunState:
        try:
            job = self.client.describe_training_job(TrainingJobName=run_id)
        except ClientError as e:
            raise _translate(e, f"DescribeTrainingJob {run_id}") from e
        status = job["TrainingJobStatus"]
        return RunState(self._PHASES.get(status, "running"), status, job.get("FailureReason"))


class BatchRunner:
    """AWS Batch container jobs. The run id is the Batch job id."""

    service = "batch"
    _PHASES = {"SUCCEEDED": "completed", "FAILED": "failed"}

    def __init__(self, client: Any):
        self.client = client

    def launch(self, record: JobRecord) -> str:
        """Submit the job of the record's current incarnation.

        Batch job names are not unique, so a retry first looks for a live job of the same
        name in the queue and returns it instead of submitting a second one.
        """
        request = copy.deepcopy(record.request)
        name = record.next_run_name
        existing = self._find_live(request["jobQueue"], name)
        if existing:
            return existing
        request["jobName"] = name
        # The training helper finds its checkpoint location (and the request marker) here.
        overrides = request.setdefault("containerOverrides", {})
        env = [e for e in overrides.get("environment", []) if e.get("name") != CHECKPOINT_ENV]
        env.append({"name": CHECKPOINT_ENV, "value": record.checkpoint_s3_uri})
        overrides["environment"] = env
        request["tags"] = {**request.get("tags", {}), **controller_tags(record)}
        request["propagateTags"] = True
        try:
            return self.client.submit_job(**request)["jobId"]
        except ClientError as e:
            raise _translate(e, f"SubmitJob {name}") from e

    def _find_live(self, queue: str, name: str) -> str | None:
        try:
            out = self.client.list_jobs(jobQueue=queue, filters=[{"name": "JOB_NAME", "values": [name]}])
        except ClientError as e:
            raise _translate(e, f"ListJobs {name}") from e
        for job in out.get("jobSummaryList", []):
            if job.get("status") not in ("SUCCEEDED", "FAILED"):
                return job["jobId"]
        return None

    def stop(self, run_id: str, reason: str) -> None:
        """Terminate the job (SIGTERM, SIGKILL ~30 s later). Terminating twice is harmless."""
        try:
            self.client.terminate_job(jobId=run_id, reason=reason[:255])
        except ClientError as e:
            raise _translate(e, f"TerminateJob {run_id}") from e

    def state(self, run_id: str) -> RunState:
        try:
            jobs = self.client.describe_jobs(jobs=[run_id]).get("jobs", [])
        except ClientError as e:
            raise _translate(e, f"DescribeJobs {run_id}") from e
        if not jobs:
            raise ServiceJobNotFound(f"DescribeJobs {run_id}: no such job")
        status = jobs[0]["status"]
        return RunState(self._PHASES.get(status, "running"), status, jobs[0].get("statusReason"))
