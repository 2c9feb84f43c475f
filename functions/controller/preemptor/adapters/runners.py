"""SageMaker and AWS Batch behind one interface: launch a run, stop it, read its state.

Runs launched by the controller carry the tag `preemptor:managed=true` and the controller's
name (`preemptor:controller`, its stack's); the IAM policy lets the controller stop or
terminate only runs tagged managed, and none of another controller's.
"""

from __future__ import annotations

import copy
import hmac
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Protocol

from botocore.exceptions import ClientError, HTTPClientError, ParamValidationError

from ..core.errors import RunNameTaken, ServiceJobNotFound, ServiceRejected, ServiceUnavailable
from ..core.events import CONTROLLER_TAG, INCARNATION_TAG, JOB_TAG, MANAGED_TAG, POOL_TAG, PRIORITY_TAG, RUN_TOKEN_TAG, TEAM_TAG
from ..core.jobs import JobRecord
from ..core.pools import SPOT, parse_offering
from ..core.requests import spot_launch
from .errors import ErrorKind, classify, code_of, is_sagemaker_not_found, translate

CHECKPOINT_ENV = "PREEMPTOR_CHECKPOINT_S3_URI"


@dataclass(frozen=True, slots=True)
class LiveRun:
    """A run the service has not ended, as reconcile sees it: its id, when it was created
    (epoch seconds) and its tags (None where the service's listing carries none: SageMaker's
    tags cost a call each, and are read only for runs the table cannot place). A run
    `find_run` found also carries where it runs, as a pool's offering names it: SageMaker's
    instance type (":spot" on managed spot), Batch's queue."""

    run_id: str
    created_at: float
    arn: str = ""
    tags: dict[str, str] | None = None
    offering: str | None = None
    name: str | None = None  # Batch's job name (a training job's is its id)

    @property
    def run_name(self) -> str:
        return self.name or self.run_id


@dataclass(frozen=True, slots=True)
class RunState:
    """Where a run stands, in the controller's words: running, stopped, completed or failed."""

    phase: str
    service_status: str
    reason: str | None = None
    # SageMaker managed spot (DescribeTrainingJob's SecondaryStatusTransitions): when it
    # last took the run's instances away, and when it last restarted the run.
    spot_interrupted_at: float | None = None
    spot_restarted_at: float | None = None

    @property
    def ended(self) -> bool:
        return self.phase in ("stopped", "completed", "failed")


class Runner(Protocol):
    service: str

    def launch(self, record: JobRecord, offering: str | None = None, offerings: tuple[str, ...] = ()) -> str: ...

    def find_run(self, record: JobRecord, offerings: tuple[str, ...] = (), ended: bool = False) -> "LiveRun | None": ...

    def stop(self, run_id: str, reason: str) -> None: ...

    def state(self, run_id: str) -> RunState: ...

    def live_runs(self, job_queue: str | None) -> list[LiveRun]: ...

    def tags_of(self, run: LiveRun) -> dict[str, str]: ...

    def described(self, run: LiveRun) -> dict | None: ...


def _json_times(value: Any) -> Any:
    """`value` with every datetime an ISO-8601 string, as events carry them."""
    if isinstance(value, dict):
        return {k: _json_times(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_times(v) for v in value]
    return value.isoformat() if isinstance(value, datetime) else value


def controller_tags(record: JobRecord, controller: str = "") -> dict[str, str]:
    tags = {
        MANAGED_TAG: "true",
        JOB_TAG: record.name,
        INCARNATION_TAG: str(record.incarnation),
        TEAM_TAG: record.team,
        PRIORITY_TAG: str(record.priority),
        POOL_TAG: record.pool,
    }
    token = record.run_token_of(record.incarnation)
    if token:
        tags[RUN_TOKEN_TAG] = token
    return {**tags, CONTROLLER_TAG: controller} if controller else tags


def bears_run_token(tags: dict[str, str], record: JobRecord, incarnation: int) -> bool:
    """Whether a run's tags carry the token of the job's `incarnation` (always, for a job
    stored before tokens: it has none to check). Compared as bytes: a tag may hold any
    letters, and `compare_digest` refuses non-ASCII text (a TypeError, not a mismatch)."""
    expected = record.run_token_of(incarnation)
    if expected is None:
        return True
    found = tags.get(RUN_TOKEN_TAG)
    return isinstance(found, str) and hmac.compare_digest(found.encode(), expected.encode())


def is_own_run(tags: dict[str, str], record: JobRecord, controller: str = "") -> bool:
    """Does a run with these tags belong to this incarnation of this job (of this
    controller: another stack's job of the same name is not this one)? Its name and tags
    can be copied by anyone who may create runs; its token only by the controller."""
    return (
        tags.get(JOB_TAG) == record.name
        and tags.get(INCARNATION_TAG) == str(record.incarnation)
        and tags.get(CONTROLLER_TAG, controller) == controller
        and bears_run_token(tags, record, record.incarnation)
    )


def may_be_own_run(tags: dict[str, str], record: JobRecord | None, run_name: str) -> bool:
    """Whether a run whose tags claim it for the controller (`events.launched_by_controller`)
    can be one it launched for `record`, the job its job tag names: the controller writes a
    job before it launches any run of it and names each incarnation's run after the job, so
    the job exists, of the tagged team, at or past the tagged incarnation, and the run bears
    that incarnation's name and token (`bears_run_token`). A team that puts the controller's
    tags on a run of its own, even a copy of a run of the job (its name and tags), fails
    one of these: it cannot make the token of an incarnation the controller has not
    launched yet, and a copy of a launched run's is under a name that run holds (SageMaker)
    or one reconcile finds twice (Batch)."""
    if record is None or tags.get(TEAM_TAG) != record.team:
        return False
    try:
        incarnation = int(tags.get(INCARNATION_TAG, ""))
    except ValueError:
        return False
    return (
        1 <= incarnation <= record.incarnation
        and run_name == record.run_name_of(incarnation)
        and bears_run_token(tags, record, incarnation)
    )


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

    def __init__(self, client: Any, controller: str = ""):
        self.client = client
        self.controller = controller  # the name its runs carry (`controller_tags`)

    def launch(self, record: JobRecord, offering: str | None = None, offerings: tuple[str, ...] = ()) -> str:
        """Create the training job of the record's current incarnation (idempotent by name),
        on `offering` when given (one of the pool's: an instance type, on spot or on-demand)."""
        request = copy.deepcopy(record.request)
        name = record.next_run_name
        request["TrainingJobName"] = name
        if offering:
            instance_type, spot = parse_offering(offering)
            request = spot_launch(request, spot)
            if "ResourceConfig" in request:
                request["ResourceConfig"] = {**request["ResourceConfig"], "InstanceType": instance_type}
        checkpoint = dict(request.get("CheckpointConfig") or {})
        checkpoint["S3Uri"] = record.checkpoint_s3_uri
        request["CheckpointConfig"] = checkpoint
        tags = {t["Key"]: t["Value"] for t in request.get("Tags", [])}
        tags.update(controller_tags(record, self.controller))
        request["Tags"] = [{"Key": k, "Value": v} for k, v in sorted(tags.items())]
        try:
            self.client.create_training_job(**request)
        except ParamValidationError as e:
            # Refused before it was sent (botocore checks the request against the API model):
            # the same request can never succeed, like a service's ValidationException.
            raise ServiceRejected(f"CreateTrainingJob {name}: {e}", "ParamValidation") from e
        except HTTPClientError as e:
            # No answer after botocore's retries: the retry of the step finds out (by name).
            raise ServiceUnavailable(f"CreateTrainingJob {name}: no answer ({type(e).__name__})") from e
        except ClientError as e:
            if classify(e) is ErrorKind.ALREADY_EXISTS and self.find_run(record) is not None:
                return name  # this incarnation was already created by an earlier attempt
            if classify(e) is ErrorKind.ALREADY_EXISTS:
                raise RunNameTaken(f"CreateTrainingJob {name}: the name belongs to another run", code_of(e)) from e
            raise translate(e, f"CreateTrainingJob {name}") from e
        return name

    def find_run(self, record: JobRecord, offerings: tuple[str, ...] = (), ended: bool = False) -> LiveRun | None:
        """The training job of the record's current incarnation, if one was created, in
        whatever state, `ended` or not (the name is the incarnation's, and SageMaker never
        gives it twice: a run that ended is still this incarnation's). A name in use is this
        incarnation's only if the run carries its tags."""
        name = record.next_run_name
        try:
            described = self.client.describe_training_job(TrainingJobName=name)
            tags = {t["Key"]: t["Value"] for t in self._all_tags(described["TrainingJobArn"])}
        except ClientError as e:
            if is_sagemaker_not_found(e):
                return None
            raise translate(e, f"DescribeTrainingJob {name}") from e
        if not is_own_run(tags, record, self.controller):
            return None
        instance_type = (described.get("ResourceConfig") or {}).get("InstanceType")
        offering = None if not instance_type else instance_type + (SPOT if described.get("EnableManagedSpotTraining") else "")
        return LiveRun(name, described["CreationTime"].timestamp(), described["TrainingJobArn"], tags, offering)

    def _all_tags(self, arn: str) -> list[dict]:
        return [t for page in self.client.get_paginator("list_tags").paginate(ResourceArn=arn) for t in page.get("Tags", [])]

    def stop(self, run_id: str, reason: str) -> None:
        """Ask SageMaker to stop the job (SIGTERM, ~120 s grace). Stopping twice is harmless."""
        try:
            self.client.stop_training_job(TrainingJobName=run_id)
        except ClientError as e:
            if is_sagemaker_not_found(e):
                raise ServiceJobNotFound(f"StopTrainingJob {run_id}: no such training job") from e
            if code_of(e) == "ValidationException":
                state = self.state(run_id)
                if state.service_status == "Stopping" or state.phase != "running":
                    return  # already stopping or ended (SageMaker refuses a stop in those states)
            raise translate(e, f"StopTrainingJob {run_id}") from e

    def state(self, run_id: str) -> RunState:
        try:
            job = self.client.describe_training_job(TrainingJobName=run_id)
        except ClientError as e:
            if is_sagemaker_not_found(e):
                raise ServiceJobNotFound(f"DescribeTrainingJob {run_id}: no such training job") from e
            raise translate(e, f"DescribeTrainingJob {run_id}") from e
        status = job["TrainingJobStatus"]
        transitions = job.get("SecondaryStatusTransitions") or []

        def latest(secondary: str) -> float | None:
            return max((t["StartTime"].timestamp() for t in transitions if t.get("Status") == secondary and t.get("StartTime")), default=None)

        return RunState(
            self._PHASES.get(status, "running"), status, job.get("FailureReason"),
            spot_interrupted_at=latest("Interrupted"),
            spot_restarted_at=latest("Restarting"),
        )

    def live_runs(self, job_queue: str | None = None) -> list[LiveRun]:
        """Every training job in progress in the account and region (a Stopping one is
        already going away, and SageMaker refuses to stop it again)."""
        out = []
        try:
            for status in ("InProgress",):
                for page in self.client.get_paginator("list_training_jobs").paginate(StatusEquals=status):
                    for job in page.get("TrainingJobSummaries", []):
                        out.append(LiveRun(job["TrainingJobName"], job["CreationTime"].timestamp(), job["TrainingJobArn"]))
        except ClientError as e:
            raise translate(e, "ListTrainingJobs") from e
        return out

    def on_spot(self, name: str) -> bool | None:
        """Whether training job `name` runs on managed spot (DescribeTrainingJob's
        `EnableManagedSpotTraining`: the state-change event does not carry it); None when
        SageMaker no longer knows the job."""
        try:
            job = self.client.describe_training_job(TrainingJobName=name)
        except ClientError as e:
            if is_sagemaker_not_found(e):
                return None
            raise translate(e, f"DescribeTrainingJob {name}") from e
        return job.get("EnableManagedSpotTraining") is True

    def described(self, run: LiveRun) -> dict | None:
        """The training job as its state-change event's `detail` carries it (DescribeTrainingJob,
        with its tags as a map); None when SageMaker no longer knows it."""
        try:
            job = self.client.describe_training_job(TrainingJobName=run.run_id)
        except ClientError as e:
            if is_sagemaker_not_found(e):
                return None
            raise translate(e, f"DescribeTrainingJob {run.run_id}") from e
        job.pop("ResponseMetadata", None)
        return {**_json_times(job), "Tags": self.tags_of(run)}

    def tags_of(self, run: LiveRun) -> dict[str, str]:
        if run.tags is not None:
            return run.tags
        try:
            return {t["Key"]: t["Value"] for t in self._all_tags(run.arn)}
        except ClientError as e:
            if is_sagemaker_not_found(e):
                return {}
            raise translate(e, f"ListTags {run.run_id}") from e


class BatchRunner:
    """AWS Batch container jobs. The run id is the Batch job id."""

    service = "batch"
    _PHASES = {"SUCCEEDED": "completed", "FAILED": "failed"}

    def __init__(self, client: Any, submit_client: Any = None, controller: str = ""):
        self.client = client
        self.controller = controller  # the name its runs carry (`controller_tags`)
        # SubmitJob has no idempotency token: a resend by botocore's own retries after a
        # lost answer would submit a second job. Sent again only after a throttle
        # (`wiring.resent_only_when_throttled`: Batch refused it, nothing was submitted);
        # after anything else the launch step's retry looks for the first one (`find_run`)
        # before it submits again.
        self.submit_client = submit_client if submit_client is not None else client

    def launch(self, record: JobRecord, offering: str | None = None, offerings: tuple[str, ...] = ()) -> str:
        """Submit the job of the record's current incarnation (the queue decides instances),
        to `offering` when given (one of the pool's queues, `offerings`).

        Batch job names are not unique, so a retry first looks for a live job of the same
        name carrying this incarnation's tags in any of the pool's queues (an earlier attempt
        may have sent it to another), and returns it instead of submitting a second one. No
        answer at all (a timeout, a reset connection) is `ServiceUnavailable`: retried, after
        that look.
        """
        request = copy.deepcopy(record.request)
        if offering:
            request["jobQueue"] = offering  # a fallback queue of the pool
        name = record.next_run_name
        existing = self.find_run(record, (request["jobQueue"], *offerings))
        if existing:
            return existing.run_id
        request["jobName"] = name
        # The training helper finds its checkpoint location (and the request marker) here.
        overrides = request.setdefault("containerOverrides", {})
        env = [e for e in overrides.get("environment", []) if e.get("name") != CHECKPOINT_ENV]
        env.append({"name": CHECKPOINT_ENV, "value": record.checkpoint_s3_uri})
        overrides["environment"] = env
        request["tags"] = {**request.get("tags", {}), **controller_tags(record, self.controller)}
        request["propagateTags"] = True
        try:
            return self.submit_client.submit_job(**request)["jobId"]
        except ParamValidationError as e:
            raise ServiceRejected(f"SubmitJob {name}: {e}", "ParamValidation") from e
        except HTTPClientError as e:
            raise ServiceUnavailable(f"SubmitJob {name}: no answer ({type(e).__name__}): it may have been submitted") from e
        except ClientError as e:
            raise translate(e, f"SubmitJob {name}") from e

    def find_run(self, record: JobRecord, offerings: tuple[str, ...] = (), ended: bool = False) -> LiveRun | None:
        """The live job of the record's current incarnation in its request's queue or any of
        `offerings` (the pool's queues), if one was submitted; with `ended`, also one that
        has ended (a live one first): reconcile records it, and then its end."""
        queues = dict.fromkeys(q for q in (record.request.get("jobQueue"), *offerings) if q)
        for live_only in (True, False) if ended else (True,):
            for queue in queues:
                found = self._find_live(queue, record.next_run_name, record, live_only)
                if found is not None:
                    return found
        return None

    def _find_live(self, queue: str, name: str, record: JobRecord, live_only: bool = True) -> LiveRun | None:
        try:
            live = [
                job["jobId"]
                for page in self.client.get_paginator("list_jobs").paginate(
                    jobQueue=queue, filters=[{"name": "JOB_NAME", "values": [name]}]
                )
                for job in page.get("jobSummaryList", [])
                if not live_only or job.get("status") not in ("SUCCEEDED", "FAILED")
            ]
            if not live:
                return None
            described = self.client.describe_jobs(jobs=live[:100]).get("jobs", [])
        except ClientError as e:
            raise translate(e, f"ListJobs {name}") from e
        return next(
            (
                LiveRun(j["jobId"], j.get("createdAt", 0) / 1000.0, j.get("jobArn", ""), j.get("tags") or {}, queue)
                for j in described
                if is_own_run(j.get("tags") or {}, record, self.controller)
            ),
            None,
        )

    def stop(self, run_id: str, reason: str) -> None:
        """Terminate the job (SIGTERM, SIGKILL ~30 s later). Terminating twice is harmless."""
        try:
            self.client.terminate_job(jobId=run_id, reason=reason[:255])
        except ClientError as e:
            raise translate(e, f"TerminateJob {run_id}") from e

    _LIVE = ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING")

    def live_runs(self, job_queue: str | None) -> list[LiveRun]:
        """Every job of the pool's queue that has not ended, with its tags (DescribeJobs
        carries them, 100 jobs a call). Listed status by status in the order a job moves
        through them: one that moves on between two listings is listed twice (once here),
        never missed."""
        if not job_queue:
            return []
        try:
            ids = list(
                dict.fromkeys(
                    job["jobId"]
                    for status in self._LIVE
                    for page in self.client.get_paginator("list_jobs").paginate(jobQueue=job_queue, jobStatus=status)
                    for job in page.get("jobSummaryList", [])
                )
            )
            described = [j for i in range(0, len(ids), 100) for j in self.client.describe_jobs(jobs=ids[i : i + 100]).get("jobs", [])]
        except ClientError as e:
            raise translate(e, f"ListJobs {job_queue}") from e
        return [
            LiveRun(j["jobId"], j.get("createdAt", 0) / 1000.0, j.get("jobArn", ""), j.get("tags") or {}, name=j.get("jobName"))
            for j in described
        ]

    def compute_environments(self, queues: Iterable[str] | None = None) -> dict[str, frozenset[str]]:
        """The compute environments each job queue places its jobs on (DescribeJobQueues),
        by queue name: of `queues` (names or ARNs; a queue Batch does not know is left out),
        else of every queue of the account and region. A queue's capacity is its compute
        environments': queues that share one share its instances."""
        names = None if queues is None else list(dict.fromkeys(queues))
        try:
            batches = [None] if names is None else [names[i : i + 100] for i in range(0, len(names), 100)]
            found = [
                queue
                for batch in batches
                for page in self.client.get_paginator("describe_job_queues").paginate(**({} if batch is None else {"jobQueues": batch}))
                for queue in page.get("jobQueues", [])
            ]
        except ClientError as e:
            raise translate(e, "DescribeJobQueues") from e
        return {
            q["jobQueueName"]: frozenset(e["computeEnvironment"] for e in q.get("computeEnvironmentOrder") or [] if e.get("computeEnvironment"))
            for q in found
            if q.get("jobQueueName")
        }

    def tags_of(self, run: LiveRun) -> dict[str, str]:
        return run.tags or {}

    def described(self, run: LiveRun) -> dict | None:
        """The job as its state-change event's `detail` carries it (DescribeJobs, tags
        included); None when Batch no longer knows it."""
        try:
            jobs = self.client.describe_jobs(jobs=[run.run_id]).get("jobs", [])
        except ClientError as e:
            raise translate(e, f"DescribeJobs {run.run_id}") from e
        return _json_times(jobs[0]) if jobs else None

    def state(self, run_id: str) -> RunState:
        try:
            jobs = self.client.describe_jobs(jobs=[run_id]).get("jobs", [])
        except ClientError as e:
            raise translate(e, f"DescribeJobs {run_id}") from e
        if not jobs:  # Batch answers a job it does not know with an empty list, not an error
            raise ServiceJobNotFound(f"DescribeJobs {run_id}: no such job")
        status = jobs[0]["status"]
        return RunState(self._PHASES.get(status, "running"), status, jobs[0].get("statusReason"))
