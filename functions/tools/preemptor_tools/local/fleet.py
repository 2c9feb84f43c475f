"""The simulated GPU workloads behind moto's SageMaker training jobs and Batch jobs.

Each job created through moto (with `moto_patches` installed) becomes a simulated training
process. Its workload comes from the request's environment (see "Simulated workload" in
docs/architecture.md): `PREEMPTOR_SIM_DURATION_S` seconds of work (default: endless) and a
checkpoint every `PREEMPTOR_SIM_CHECKPOINT_EVERY_S` seconds of work (default: none). Optional:
`PREEMPTOR_SIM_CHECKPOINT_ON_STOP` ("true"/"false") overrides the fleet's `checkpoint_on_stop`,
and `PREEMPTOR_CHECKPOINT_S3_URI` gives a Batch job its checkpoint location (a SageMaker job
uses `CheckpointConfig.S3Uri`).

Life of a job, all in simulated time:
- a CreateTrainingJob that would take the account's instances of a type over its quota
  (`instance_quotas`: what the pools own) is refused `ResourceLimitExceeded`, whoever asks,
  and nothing is created (`quota_refusals` records it, with the runs that held the type).
  Service Quotas lists each as the applied value of the type's quotas for training job usage
  and for spot training job usage (one quota per type here: on AWS they are two);
  `set_instance_quota` changes it (a raise granted, say).
- created/submitted: SageMaker `InProgress`/`Starting`; Batch `RUNNABLE`. A Batch job of a pool
  whose compute environments' GPUs are known (`batch_capacity`) takes them only when it
  starts, and starts only when they fit beside the pool's running jobs: otherwise it stays
  `RUNNABLE` (recorded in `quota_refusals`, once) until a job of the pool ends, as Batch
  leaves a job its compute environments have no room for, whoever submitted it.
- after the startup delay: SageMaker `InProgress`/`Training`; Batch `STARTING` then `RUNNING`.
  Work resumes from the newest complete checkpoint under the checkpoint prefix, found as the
  training helper finds it (`preemptor_training`'s S3 mirror: a step directory whose manifest
  names files that are all there); a location without one resumes from the newest plain object
  (`{"progress_s": ...}`), as a script that does not use the helper would.
- every `checkpoint_every_s` of work (at multiples of it): writes a checkpoint in the training
  helper's layout (docs/training.md), a step being a second of work:
  `<prefix>/step-<progress:012d>/state.json` (`{"progress_s", "job"}`), then that directory's
  `manifest.json`, then `<prefix>/manifest.json`, in that order, as the helper uploads. Then,
  as the helper prunes, only the `keep_checkpoints` newest it wrote (2, the helper's default)
  stay: the older ones' objects are deleted.
- a checkpoint request (`<prefix>/_preemptor/checkpoint-request.json`, `{"requested_at"}`)
  newer than the last checkpoint: a checkpoint `checkpoint_write_s` after the request (unless a
  periodic one got there first).
- work done: SageMaker `Completed`; Batch `SUCCEEDED`.
- a managed-spot interruption (`managed_spot_interrupt`) of a SageMaker spot run:
  `InProgress`/`Interrupted`, the work since its checkpoint lost and none done; when spot is
  back, `Restarting`, then `Training` from its newest checkpoint after the startup delay
  (or `Failed`/`MaxWaitTimeExceeded` once its MaxWaitTimeInSeconds ran out first).
- StopTrainingJob / TerminateJob: a job that runs the training helper (`checkpoint_on_stop`)
  writes a checkpoint on SIGTERM and exits once it is written, `checkpoint_write_s` after the
  signal, when that is within the service's grace (SageMaker 120 s, Batch 30 s by default);
  any other job, and one whose save would not finish within the grace (cut short: no
  manifest, no checkpoint), keeps working until the grace is out (SIGTERM to SIGKILL). Then
  it ends `Stopped` / `FAILED` with the terminate reason. A job that has not started yet ends
  at once.

Every status change is sent to `emit` as an EventBridge event of the real shape. Events are
queued when moto reports a change and delivered when the clock next advances (or on
`process_due()`), as EventBridge delivers after the API call has returned.

The fleet moves only when the SimClock advances: it processes every transition due up to the
new time, in time order, each with the clock pinned to the transition's own time (so S3
`LastModified` and event times are the moment it happened). It polls checkpoint requests at the
start of each advance and after every status change it emits.
"""

from __future__ import annotations

import calendar
import datetime as dt
import heapq
import itertools
import json
import math
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moto.s3.models import s3_backends

from preemptor.core.s3uri import S3Uri
from preemptor_tools.local import moto_patches
from preemptor_training.manifest import MANIFEST, FileEntry, Manifest, Reason, step_dir_name
from preemptor_training.s3 import S3Location, S3Mirror
from preemptor_tools.local.clock import SimClock
from preemptor_tools.local.hostile import ACTOR

SAGEMAKER = "sagemaker"
BATCH = "batch"

ENV_DURATION = "PREEMPTOR_SIM_DURATION_S"
ENV_CHECKPOINT_EVERY = "PREEMPTOR_SIM_CHECKPOINT_EVERY_S"
ENV_CHECKPOINT_ON_STOP = "PREEMPTOR_SIM_CHECKPOINT_ON_STOP"
ENV_CHECKPOINT_URI = "PREEMPTOR_CHECKPOINT_S3_URI"

CHECKPOINT_REQUEST_KEY = "_preemptor/checkpoint-request.json"
_BATCH_EXIT_REASON = "Essential container in task exited"
# SageMaker's answer when it cannot provision the instances (FailureReason of the job).
CAPACITY_ERROR = "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance type."
# Transitions of a job's work on its instances: dropped when an interruption took them.
_WORK = frozenset({"checkpoint", "requested_checkpoint", "complete", "start"})
SPOT_WAIT_EXCEEDED = "Training job exceeded MaxWaitTimeInSeconds provided without spot capacity"

# Fields of CreateTrainingJob that real "SageMaker Training Job State Change" events repeat.
_SAGEMAKER_DETAIL_FIELDS = (
    "HyperParameters",
    "AlgorithmSpecification",
    "RoleArn",
    "InputDataConfig",
    "OutputDataConfig",
    "ResourceConfig",
    "VpcConfig",
    "StoppingCondition",
    "CheckpointConfig",
    "Environment",
    "RetryStrategy",
)
# What the AWS sample events carry for these when the request left them out.
_SAGEMAKER_DETAIL_DEFAULTS: dict[str, Any] = {"HyperParameters": {}, "InputDataConfig": [], "VpcConfig": {}}

Emit = Callable[[dict], None]


@dataclass(frozen=True)
class FleetJob:
    """What the fleet knows about one simulated job (a snapshot)."""

    service: str
    name: str
    job_id: str
    status: str
    progress_s: float
    duration_s: float
    last_checkpoint_at: float | None


@dataclass(frozen=True)
class FleetStop:
    """A stop (StopTrainingJob / TerminateJob) of a run, as the run saw it arrive."""

    run: str
    job_id: str
    at: float
    started: bool  # the run had started working
    unsaved_work_s: float  # work since its newest checkpoint (or its start): what a stop loses


@dataclass(frozen=True)
class QuotaRefusal:
    """A CreateTrainingJob the account's instance quota refused (`ResourceLimitExceeded`):
    the runs of the type that held the instances then, by job id (with their count). Also a
    Batch job left `RUNNABLE` for want of room in its pool's compute environments
    (`instance_type` "GPUs": `requested`, `quota` and `holding` in GPUs)."""

    at: float
    run: str
    tags: dict[str, str]
    instance_type: str
    requested: int
    quota: int
    holding: dict[str, int]  # by job id (a training job's is its name)
    job_id: str = ""
    by: str | None = None  # the function whose call created the run; None: a call from outside them (a team's)


# (pool, GPUs) that a run occupies, from its service and request; None if in no pool.
Classify = Callable[[str, dict], "tuple[str, int] | None"]


@dataclass
class _Job:
    service: str
    name: str
    job_id: str
    arn: str
    request: dict
    duration_s: float
    checkpoint_every_s: float | None
    checkpoint_on_stop: bool
    bucket: str | None
    prefix: str | None
    created_at: float
    start_at: float
    phase: str = "starting"  # starting | running | interrupted (managed spot) | ended
    epoch: int = 0  # bumped by each managed-spot interruption (`_Transition.epoch`)
    status: str = ""
    ended_at: float | None = None
    holding: bool = False  # counted in its pool's GPUs in use (`_occupy`)
    first_started_at: float | None = None  # when it first got its instances
    work_started_at: float | None = None
    progress_at_start: float = 0.0
    final_progress: float | None = None
    last_checkpoint_at: float | None = None
    stop_requested_at: float | None = None
    stop_reason: str | None = None
    request_etag: str | None = None
    handled_request_at: float | None = None
    instance_id: str | None = None  # Batch: the EC2 instance it runs on (spot interruptions)
    container_instance_arn: str | None = None
    pool: str | None = None
    gpus: int = 0
    checkpointed_progress: float = 0.0  # progress saved in the newest checkpoint it can resume from
    # The function whose call created it (`hostile.ACTOR`); None: a call from outside the
    # functions, a team's own run (or the harness's).
    created_by: str | None = None

    def progress(self, t: float) -> float:
        if self.final_progress is not None:
            return self.final_progress
        if self.work_started_at is None:
            return self.progress_at_start
        return min(self.duration_s, self.progress_at_start + max(0.0, t - self.work_started_at))

    def time_at_progress(self, progress: float) -> float:
        assert self.work_started_at is not None
        return self.work_started_at + (progress - self.progress_at_start)


@dataclass(order=True)
class _Transition:
    at: float
    seq: int
    job_key: str = field(compare=False)
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)
    # The job's `epoch` when scheduled: its work (checkpoints, completion) is dropped once a
    # managed-spot interruption has taken the instances it was to run on.
    epoch: int = field(compare=False, default=0)


class SimulatedFleet:
    """Simulated SageMaker and Batch workloads driven by a SimClock (see the module docstring)."""

    def __init__(
        self,
        clock: SimClock,
        s3_client: Any,
        emit: Emit,
        *,
        sagemaker_startup_s: float = 120.0,
        batch_startup_s: float = 30.0,
        sagemaker_stop_grace_s: float = 120.0,
        batch_stop_grace_s: float = 30.0,
        checkpoint_write_s: float = 60.0,
        checkpoint_on_stop: bool = False,
        id_factory: Callable[[], str] | None = None,
        ecs_client: Any = None,
        ec2_client: Any = None,
        batch_cluster: str = "preemptor-batch",
        spot_warning_s: float = 120.0,
        s3_events: bool = True,
        classify: Classify | None = None,
        keep_checkpoints: int = 2,
        instance_quotas: dict[str, int] | None = None,
        batch_capacity: dict[str, int] | None = None,
    ) -> None:
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
        self._clock = clock
        # GPUs in use per pool, measured from runs that exist (created and not ended), not
        # from the controller's table: what the pool's owner would see.
        self._classify = classify
        self._in_use: dict[str, int] = {}
        self._max_in_use: dict[str, int] = {}
        self.stops: list[FleetStop] = []
        self._s3 = s3_client
        self._emit = emit
        self._startup_s = {SAGEMAKER: sagemaker_startup_s, BATCH: batch_startup_s}
        self._stop_grace_s = {SAGEMAKER: sagemaker_stop_grace_s, BATCH: batch_stop_grace_s}
        self._capacity_outages: list[tuple[str, str | None, str | None, float, float]] = []  # (pool, type, market, from, until)
        self._checkpoint_write_s = checkpoint_write_s
        self._checkpoint_on_stop = checkpoint_on_stop
        self._keep_checkpoints = keep_checkpoints
        # The step directories written under each location (bucket, prefix), oldest first.
        self._written: dict[tuple[str, str | None], list[str]] = {}
        self._new_id = id_factory or (lambda: str(uuid.uuid4()))
        # With ECS and EC2 clients, every Batch job runs on a simulated EC2 instance registered as an
        # ECS container instance, as in a Batch compute environment, so spot warnings can be
        # traced from the instance to the job (EC2 -> container instance -> job).
        # Checkpoint buckets send "Object Created" to EventBridge (the README's set-up step).
        self._s3_events = s3_events
        self._ecs = ecs_client if ec2_client is not None else None
        self._ec2 = ec2_client
        self._cluster = batch_cluster
        self._spot_warning_s = spot_warning_s
        self._image = None
        if self._ecs is not None:
            self._ecs.create_cluster(clusterName=batch_cluster)
            # The image the GPU instances run (moto's catalogue of AMIs is not loaded).
            self._image = ec2_client.register_image(
                Name="preemptor-emulated-gpu-node", Architecture="x86_64", RootDeviceName="/dev/xvda", VirtualizationType="hvm"
            )["ImageId"]
        # The account's SageMaker quota per instance type (instances in training jobs at
        # once): a CreateTrainingJob over it is refused, as on AWS, whoever calls.
        self._instance_quotas = dict(instance_quotas or {})
        self.quota_refusals: list[QuotaRefusal] = []
        # GPUs of each Batch pool's compute environments: its jobs start only into room, and
        # wait RUNNABLE (oldest first) for a job of the pool to end.
        self._batch_capacity = dict(batch_capacity or {})
        self._runnable: dict[str, list[_Job]] = {}
        self._lock = threading.RLock()
        self._jobs: dict[str, _Job] = {}
        self._queue: list[_Transition] = []
        self._seq = itertools.count()
        self.history: list[tuple[float, str, str]] = []
        self._unsubscribe = [
            clock.on_advance(self._on_advance),
            clock.on_due(self.next_due),
            moto_patches.check_training_job_create(self._quota_refusal),
            moto_patches.quotas_listed(self._listed_quotas),
            moto_patches.on_training_job_created(self._on_training_job_created),
            moto_patches.on_training_job_stop_requested(self._on_training_job_stop_requested),
            moto_patches.on_batch_job_submitted(self._on_batch_job_submitted),
            moto_patches.on_batch_job_terminate_requested(self._on_batch_job_terminate_requested),
        ]

    # ------------------------------------------------------------------ public

    def close(self) -> None:
        """Stop listening to the clock and to moto."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []

    def running(self) -> list[FleetJob]:
        """Jobs that hold capacity: created/submitted and not yet ended, oldest first."""
        with self._lock:
            return [self._view(job) for job in self._jobs.values() if job.phase != "ended"]

    def jobs(self) -> list[FleetJob]:
        """Every job the fleet has seen, oldest first."""
        with self._lock:
            return [self._view(job) for job in self._jobs.values()]

    def job(self, name_or_id: str) -> FleetJob:
        """The newest job whose SageMaker name, Batch job name or Batch job id matches."""
        with self._lock:
            for job in reversed(list(self._jobs.values())):
                if name_or_id in (job.name, job.job_id):
                    return self._view(job)
        raise KeyError(name_or_id)

    def spot_interrupt(self, name_or_id: str) -> str:
        """Reclaim the spot instance under a running Batch job: the EC2 Spot Instance
        Interruption Warning now, the instance gone `spot_warning_s` later (every job still
        on it then ends FAILED with "Host EC2 (instance ...) terminated."). Returns the id."""
        with self._lock:
            job = next(
                (j for j in reversed(list(self._jobs.values())) if name_or_id in (j.name, j.job_id) and j.phase != "ended"),
                None,
            )
            if job is None or job.instance_id is None:
                raise KeyError(f"no running Batch job {name_or_id!r} on a simulated instance")
            now = self._clock.now()
            self._record(now, job, f"spot interruption warning for {job.instance_id}")
            self._emit(self._spot_warning(job))
            self._schedule(now + self._spot_warning_s, job, "instance_terminated", job.instance_id)
            return job.instance_id

    def managed_spot_interrupt(self, name_or_id: str, capacity_back_s: float) -> str:
        """SageMaker managed spot takes the instances of a running spot training job away:
        it goes InProgress/Interrupted, the work since its newest checkpoint lost. When spot
        capacity is back, `capacity_back_s` later, SageMaker restarts it (InProgress/
        Restarting, then Training after the startup delay) from the newest checkpoint in its
        location, unless its MaxWaitTimeInSeconds (from its creation) runs out first: then
        it ends Failed, MaxWaitTimeExceeded. It keeps its instances' quota meanwhile (it is
        InProgress). A stop ends it at once. Returns the job's name."""
        with self._lock:
            job = next(
                (j for j in reversed(list(self._jobs.values())) if name_or_id in (j.name, j.job_id) and j.phase != "ended"),
                None,
            )
            if job is None or job.service != SAGEMAKER or not job.request.get("EnableManagedSpotTraining"):
                raise KeyError(f"no live managed-spot training job {name_or_id!r}")
            if job.phase != "running" or job.stop_requested_at is not None:
                raise KeyError(f"training job {job.name} is not training ({job.status})")
            now = self._clock.now()
            lost = job.progress(now) - job.checkpointed_progress
            job.epoch += 1
            job.phase, job.work_started_at = "interrupted", None
            job.progress_at_start = job.checkpointed_progress
            moto_patches.set_training_job_status(job.name, "InProgress", "Interrupted")
            job.status = "InProgress/Interrupted"
            self._record(now, job, f"managed spot interrupted: InProgress/Interrupted ({lost:g}s of work since its checkpoint lost)")
            self._emit(self._sagemaker_event(job))
            wait = (job.request.get("StoppingCondition") or {}).get("MaxWaitTimeInSeconds")
            deadline = job.created_at + wait if wait else math.inf
            if now + capacity_back_s < deadline:
                self._schedule(now + capacity_back_s, job, "spot_restart")
            else:
                self._schedule(max(now, deadline), job, "spot_wait_exceeded")
            return job.name

    def _spot_restart(self, job: _Job, t: float) -> bool:
        """Spot capacity is back for an interrupted job: Restarting, then (after the startup
        delay) Training from its newest checkpoint (`_start`)."""
        if job.phase != "interrupted" or job.stop_requested_at is not None:
            return False
        job.phase, job.start_at = "starting", t + self._startup_s[SAGEMAKER]
        moto_patches.set_training_job_status(job.name, "InProgress", "Restarting")
        job.status = "InProgress/Restarting"
        self._record(t, job, "managed spot restarting: InProgress/Restarting")
        self._emit(self._sagemaker_event(job))
        self._schedule(job.start_at, job, "start")
        return True

    def _spot_wait_exceeded(self, job: _Job, t: float) -> bool:
        """An interrupted job whose MaxWaitTimeInSeconds ran out before spot came back."""
        job.final_progress = job.checkpointed_progress
        job.phase, job.ended_at = "ended", t
        self._occupy(job, -1)
        moto_patches.set_training_job_status(job.name, "Failed", "MaxWaitTimeExceeded", SPOT_WAIT_EXCEEDED)
        job.status = "Failed/MaxWaitTimeExceeded"
        self._record(t, job, f"Failed: {SPOT_WAIT_EXCEEDED}")
        self._emit(self._sagemaker_event(job))
        return True

    def gpus_in_use(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_use)

    def max_gpus_in_use(self) -> dict[str, int]:
        """The most GPUs each pool ever had in use at once."""
        with self._lock:
            return dict(self._max_in_use)

    def runs(self) -> list[dict]:
        """Every run the fleet has seen: name, id, service, pool, GPUs, status, times (its
        end: None while it lives)."""
        with self._lock:
            return [
                {
                    "name": j.name, "job_id": j.job_id, "service": j.service, "pool": j.pool, "gpus": j.gpus,
                    "status": j.status, "created_at": j.created_at, "ended_at": j.ended_at, "phase": j.phase,
                    "started_at": j.first_started_at,
                    "tags": _tags(j.service, j.request),
                    "created_by": j.created_by,
                }
                for j in self._jobs.values()
            ]

    def _occupy(self, job: _Job, sign: int) -> None:
        if job.pool is None or not job.gpus or job.holding == (sign > 0):
            return
        job.holding = sign > 0
        self._in_use[job.pool] = self._in_use.get(job.pool, 0) + sign * job.gpus
        self._max_in_use[job.pool] = max(self._max_in_use.get(job.pool, 0), self._in_use[job.pool])

    def _record_stop(self, job: _Job, now: float) -> None:
        started = job.phase == "running"
        unsaved = max(0.0, job.progress(now) - job.checkpointed_progress) if started else 0.0
        self.stops.append(FleetStop(job.name, job.job_id, now, started, unsaved))

    def next_due(self) -> float | None:
        """When the fleet's next transition is due (a run starting, ending, checkpointing), or
        None: a workflow's Wait moves time no further at once (`SimClock.on_due`). Read
        without the fleet's lock, which a run being created holds while it calls the clock."""
        try:
            return self._queue[0].at
        except IndexError:
            return None

    def process_due(self) -> None:
        """Deliver everything due at the clock's current time without advancing it."""
        self._process(self._clock.now())

    def set_instance_quota(self, instance_type: str, instances: int) -> None:
        """The account's quota of `instance_type` is `instances` from now on (a raise
        granted, or a cut): launches are held to it, Service Quotas lists it."""
        with self._lock:
            self._instance_quotas[instance_type] = instances
            self.history.append((self._clock.now(), instance_type, f"quota set to {instances} instances"))

    # ------------------------------------------------------------------ moto listeners

    def _listed_quotas(self) -> dict[str, float]:
        """The applied values Service Quotas lists for the types with a quota."""
        with self._lock:
            return {
                f"{instance_type} for {usage}": float(quota)
                for instance_type, quota in self._instance_quotas.items()
                for usage in ("training job usage", "spot training job usage")
            }

    def _quota_refusal(self, name: str, request: dict) -> str | None:
        """SageMaker's `ResourceLimitExceeded` message when `request` would take the account's
        instances of a type over its quota (runs not ended hold theirs, Stopping ones too)."""
        wanted = _instances(request)
        with self._lock:
            for instance_type, requested in wanted.items():
                quota = self._instance_quotas.get(instance_type)
                if quota is None:
                    continue
                holding = {
                    j.name: n for j in self._jobs.values()
                    if j.service == SAGEMAKER and j.phase != "ended" and (n := _instances(j.request).get(instance_type, 0))
                }
                used = sum(holding.values())
                if used + requested <= quota:
                    continue
                now = self._clock.now()
                refusal = QuotaRefusal(now, name, _tags(SAGEMAKER, request), instance_type, requested, quota, holding, name, ACTOR.get())
                self.quota_refusals.append(refusal)
                self.history.append((now, name, f"refused: ResourceLimitExceeded ({used} + {requested} {instance_type} > {quota})"))
                usage = "spot training job usage" if request.get("EnableManagedSpotTraining") else "training job usage"
                return (
                    f"The account-level service limit '{instance_type} for {usage}' is {quota} Instances, "
                    f"with current utilization of {used} Instances and a request delta of {requested} Instances. "
                    "Please use AWS Service Quotas to request an increase for this quota. If AWS Service Quotas "
                    "is not available, contact AWS support to request an increase for this quota."
                )
        return None

    def _on_training_job_created(self, name: str, request: dict) -> None:
        now = self._clock.now()
        environment = request.get("Environment") or {}
        checkpoint_uri = (request.get("CheckpointConfig") or {}).get("S3Uri") or environment.get(
            ENV_CHECKPOINT_URI
        )
        description = moto_patches.get_training_job(name)
        job = self._new_job(
            SAGEMAKER, name, name, description["TrainingJobArn"], request, environment, checkpoint_uri, now
        )
        job.status = "InProgress/Starting"
        with self._lock:
            self._jobs[_key(SAGEMAKER, name)] = job
            self._occupy(job, +1)
            self._record(now, job, "created: InProgress/Starting")
            self._schedule(now, job, "emit", self._sagemaker_event(job))
            self._schedule(job.start_at, job, "start")

    def _on_training_job_stop_requested(self, name: str) -> None:
        now = self._clock.now()
        with self._lock:
            job = self._jobs.get(_key(SAGEMAKER, name))
            if job is None or job.phase == "ended":
                return
            self._record_stop(job, now)
            job.stop_requested_at = now
            job.status = "Stopping/Stopping"
            self._record(now, job, "stop requested: Stopping/Stopping")
            self._schedule(now, job, "emit", self._sagemaker_event(job))
            self._schedule_stop(job, now)

    def _on_batch_job_submitted(self, job_id: str, request: dict) -> None:
        now = self._clock.now()
        description = moto_patches.get_batch_job(job_id)
        environment = {
            item["name"]: item["value"]
            for item in (description.get("container") or {}).get("environment", [])
        }
        job = self._new_job(
            BATCH,
            request["jobName"],
            job_id,
            description["jobArn"],
            request,
            environment,
            environment.get(ENV_CHECKPOINT_URI),
            now,
        )
        with self._lock:
            self._jobs[_key(BATCH, job_id)] = job
            if job.pool not in self._batch_capacity:
                self._occupy(job, +1)  # no room known: held from its submission
            moto_patches.set_batch_job_status(job_id, "RUNNABLE")
            job.status = "RUNNABLE"
            self._record(now, job, "submitted: RUNNABLE")
            self._schedule(now, job, "emit", self._batch_event(job))
            self._schedule(job.start_at, job, "start")

    def _on_batch_job_terminate_requested(self, job_id: str, reason: str) -> None:
        now = self._clock.now()
        with self._lock:
            job = self._jobs.get(_key(BATCH, job_id))
            if job is None or job.phase == "ended":
                return
            self._record_stop(job, now)
            job.stop_requested_at = now
            job.stop_reason = reason
            self._record(now, job, f"terminate requested: {reason}")
            self._schedule_stop(job, now)

    # ------------------------------------------------------------------ scheduling

    def _new_job(
        self,
        service: str,
        name: str,
        job_id: str,
        arn: str,
        request: dict,
        environment: dict,
        checkpoint_uri: str | None,
        now: float,
    ) -> _Job:
        bucket, prefix = _split_s3_uri(checkpoint_uri) if checkpoint_uri else (None, None)
        every = _float_or_none(environment.get(ENV_CHECKPOINT_EVERY))
        duration = _float_or_none(environment.get(ENV_DURATION))
        on_stop = environment.get(ENV_CHECKPOINT_ON_STOP)
        placed = self._classify(service, request) if self._classify else None
        return _Job(
            pool=placed[0] if placed else None,
            gpus=placed[1] if placed else 0,
            service=service,
            name=name,
            job_id=job_id,
            arn=arn,
            request=request,
            duration_s=math.inf if duration is None else duration,
            checkpoint_every_s=every if every and every > 0 else None,
            checkpoint_on_stop=(
                on_stop.strip().lower() == "true" if on_stop is not None else self._checkpoint_on_stop
            ),
            bucket=bucket,
            prefix=prefix,
            created_at=now,
            start_at=now + self._startup_s[service],
            created_by=ACTOR.get(),
        )

    def _schedule(self, at: float, job: _Job, kind: str, payload: Any = None) -> None:
        heapq.heappush(
            self._queue, _Transition(at, next(self._seq), _key(job.service, job.job_id), kind, payload, job.epoch)
        )

    def _schedule_stop(self, job: _Job, now: float) -> None:
        if job.phase in ("starting", "interrupted"):
            self._schedule(now, job, "stopped")
            return
        grace = self._stop_grace_s[job.service]
        if job.checkpoint_on_stop and job.bucket is not None and self._checkpoint_write_s <= grace:
            # The training helper writes its checkpoint on SIGTERM and exits 0 once it is
            # written: the service sees the container end before the grace is out.
            self._schedule(now + self._checkpoint_write_s, job, "stop_checkpoint")
            self._schedule(now + self._checkpoint_write_s, job, "stopped")
            return
        # Otherwise it works on until the grace is out and is killed: a save on SIGTERM that
        # cannot finish within the grace is cut short, and one cut short has no manifest,
        # so no checkpoint is written.
        self._schedule(now + grace, job, "stopped")

    def _schedule_work(self, job: _Job) -> None:
        """After the job started: its next periodic checkpoint, and its completion."""
        assert job.work_started_at is not None
        if job.duration_s != math.inf:
            self._schedule(job.time_at_progress(job.duration_s), job, "complete")
        self._schedule_next_checkpoint(job, job.progress_at_start)

    def _schedule_next_checkpoint(self, job: _Job, progress: float) -> None:
        every = job.checkpoint_every_s
        if every is None or job.bucket is None:
            return
        target = (math.floor(progress / every + 1e-9) + 1) * every
        if target < job.duration_s:
            self._schedule(job.time_at_progress(target), job, "checkpoint", target)

    # ------------------------------------------------------------------ processing

    def _on_advance(self, _old: float, new: float) -> None:
        self._process(new)

    def _process(self, up_to: float) -> None:
        with self._lock:
            self._poll_checkpoint_requests()
            while self._queue and self._queue[0].at <= up_to:
                transition = heapq.heappop(self._queue)
                job = self._jobs[transition.job_key]
                with self._clock.pinned(transition.at):
                    emitted = self._apply(job, transition)
                if emitted:
                    self._poll_checkpoint_requests()

    def _apply(self, job: _Job, transition: _Transition) -> bool:
        """Carry out one transition; True if it emitted an event."""
        t, kind = transition.at, transition.kind
        if kind == "emit":
            self._emit(transition.payload)
            return True
        if job.phase == "ended":
            return False
        if transition.epoch != job.epoch and kind in _WORK:
            return False  # planned for instances a managed-spot interruption took away
        if kind == "spot_restart":
            return self._spot_restart(job, t)
        if kind == "start":
            return self._start(job, t)
        if kind == "checkpoint":
            self._write_checkpoint(job, t, "periodic checkpoint", Reason.PERIODIC)
            self._schedule_next_checkpoint(job, transition.payload)
            return False
        if kind == "requested_checkpoint":
            requested_at = transition.payload
            if job.last_checkpoint_at is None or job.last_checkpoint_at < requested_at:
                self._write_checkpoint(job, t, "requested checkpoint", Reason.REQUESTED, requested_at)
            return False
        if kind == "stop_checkpoint":
            self._write_checkpoint(job, t, "checkpoint on SIGTERM", Reason.SIGTERM)
            return False
        if kind == "complete":
            return self._end(job, t, completed=job.stop_requested_at is None)
        if kind == "stopped":
            return self._end(job, t, completed=False)
        if kind == "spot_wait_exceeded":
            if job.phase == "interrupted":
                return self._spot_wait_exceeded(job, t)
            return self._never_provisioned(job, t, "MaxWaitTimeExceeded", SPOT_WAIT_EXCEEDED)
        if kind == "instance_terminated":
            job.stop_reason = f"Host EC2 (instance {transition.payload}) terminated."
            return self._end(job, t, completed=False)
        raise ValueError(f"unknown fleet transition {kind!r}")

    def capacity_outage(
        self, pool: str, start: float, end: float, instance_type: str | None = None, capacity_type: str | None = None
    ) -> None:
        """From `start` to `end` (epoch seconds), SageMaker cannot provision `pool`'s
        instances (of `instance_type` only, and on `capacity_type` ("spot" or "on-demand")
        only, when given; for a Batch pool, `instance_type` names one of its queues). A Batch
        job stays RUNNABLE until the outage ends. An on-demand training job that would start then fails with
        SageMaker's `CapacityError`, as on AWS (created, then Failed), holding no GPU; a
        managed-spot one waits for spot capacity, and fails `MaxWaitTimeExceeded` when its
        wait (MaxWaitTimeInSeconds less MaxRuntimeInSeconds) runs out first."""
        self._capacity_outages.append((pool, instance_type, capacity_type, start, end))

    def _outage_end(self, job: _Job, t: float) -> float | None:
        """When the capacity outage that `job` meets at `t` ends; None when it meets none."""
        if job.service == SAGEMAKER:
            its_type = (job.request.get("ResourceConfig") or {}).get("InstanceType")
            market = "spot" if job.request.get("EnableManagedSpotTraining") else "on-demand"
        else:  # a Batch job: by its queue (its compute environments' capacity)
            its_type, market = str(job.request.get("jobQueue", "")).rsplit("/", 1)[-1], None
        ends = [
            b for p, k, c, a, b in self._capacity_outages
            if p == job.pool and (k is None or k == its_type) and (c is None or market is None or c == market) and a <= t < b
        ]
        return max(ends) if ends else None

    def _room_for(self, job: _Job, t: float) -> bool:
        """Whether a Batch job about to start fits in its pool's compute environments (and
        then takes its GPUs); otherwise it waits RUNNABLE for a job of the pool to end."""
        capacity = self._batch_capacity.get(job.pool or "")
        if capacity is None:
            return True
        waiting = self._runnable.setdefault(job.pool, [])
        if self._in_use.get(job.pool, 0) + job.gpus <= capacity:
            self._occupy(job, +1)
            if job in waiting:
                waiting.remove(job)
            return True
        if job not in waiting:
            holding = {j.job_id: j.gpus for j in self._jobs.values() if j.pool == job.pool and j.holding}
            refusal = QuotaRefusal(t, job.name, _tags(BATCH, job.request), "GPUs", job.gpus, capacity, holding, job.job_id, job.created_by)
            self.quota_refusals.append(refusal)
            self._record(t, job, f"RUNNABLE: no room in the compute environments ({self._in_use.get(job.pool, 0)} of {capacity} GPUs in use)")
            waiting.append(job)
        return False

    def _room_freed(self, job: _Job, t: float) -> None:
        """A job of a Batch pool ended: the jobs waiting RUNNABLE for room try again, oldest first."""
        waiting = self._runnable.get(job.pool or "", [])
        self._runnable[job.pool or ""] = [j for j in waiting if j.phase != "ended"]
        for other in self._runnable[job.pool or ""]:
            self._schedule(t, other, "start")

    def _spot_deadline(self, job: _Job) -> float | None:
        """A managed-spot job's last moment to find spot capacity; None for on-demand."""
        if not job.request.get("EnableManagedSpotTraining"):
            return None
        stopping = job.request.get("StoppingCondition") or {}
        wait = stopping.get("MaxWaitTimeInSeconds", 0) - stopping.get("MaxRuntimeInSeconds", 86_400)
        return job.created_at + max(0, wait)

    def _start(self, job: _Job, t: float) -> bool:
        if job.phase != "starting":
            return False  # started already (room freed twice for a job waiting RUNNABLE)
        if job.stop_requested_at is not None:
            return False  # the stop already ended it (scheduled at the request)
        outage_end = self._outage_end(job, t)
        deadline = self._spot_deadline(job)
        if outage_end is not None and job.service == BATCH:
            # No instances for the queue: the job stays RUNNABLE until capacity returns (or
            # someone terminates it), as Batch leaves it.
            self._schedule(outage_end, job, "start")
            return False
        if outage_end is not None and deadline is not None:
            if outage_end < deadline:
                self._record(t, job, "waiting for spot capacity")
                self._schedule(outage_end, job, "start")
                return False
            self._schedule(max(t, deadline), job, "spot_wait_exceeded")
            return False
        if outage_end is not None:
            return self._never_provisioned(job, t, "Failed", CAPACITY_ERROR)
        if job.service == BATCH and not self._room_for(job, t):
            return False
        progress, checkpoint_at = self._newest_checkpoint(job)
        job.phase = "running"
        job.work_started_at = t
        job.first_started_at = job.first_started_at or t
        job.progress_at_start = min(progress, job.duration_s)
        job.checkpointed_progress = job.progress_at_start
        if checkpoint_at is not None:
            job.last_checkpoint_at = checkpoint_at
        resumed = f", resumed at progress {job.progress_at_start:g}s" if progress else ""
        if job.service == SAGEMAKER:
            moto_patches.set_training_job_status(job.name, "InProgress", "Training")
            job.status = "InProgress/Training"
            self._record(t, job, f"started: InProgress/Training{resumed}")
            self._emit(self._sagemaker_event(job))
        else:
            self._place_on_instance(job)
            for status in ("STARTING", "RUNNING"):
                moto_patches.set_batch_job_status(job.job_id, status)
                job.status = status
                self._emit(self._batch_event(job))
            self._record(t, job, f"started: RUNNING{resumed}")
        self._schedule_work(job)
        return True

    def _never_provisioned(self, job: _Job, t: float, secondary: str, reason: str) -> bool:
        """A SageMaker job that never got its instances (or, restarting after a managed-spot
        interruption, never got them back) ends Failed, holding no GPU."""
        job.final_progress = job.progress_at_start
        job.phase, job.ended_at = "ended", t
        self._occupy(job, -1)
        moto_patches.set_training_job_status(job.name, "Failed", secondary, reason)
        job.status = f"Failed/{secondary}"
        self._record(t, job, f"Failed: {reason}")
        self._emit(self._sagemaker_event(job))
        return True

    def _end(self, job: _Job, t: float, completed: bool) -> bool:
        job.final_progress = job.progress(t)
        job.phase, job.ended_at = "ended", t
        held = job.holding
        self._occupy(job, -1)
        if held and job.service == BATCH and job.pool in self._batch_capacity:
            self._room_freed(job, t)
        if job.service == SAGEMAKER:
            status = "Completed" if completed else "Stopped"
            moto_patches.set_training_job_status(job.name, status, status)
            job.status = f"{status}/{status}"
            self._record(t, job, f"{status} at progress {job.final_progress:g}s")
            self._emit(self._sagemaker_event(job))
        else:
            status = "SUCCEEDED" if completed else "FAILED"
            reason = _BATCH_EXIT_REASON if completed else job.stop_reason
            moto_patches.set_batch_job_status(job.job_id, status, reason)
            job.status = status
            self._record(t, job, f"{status} ({reason}) at progress {job.final_progress:g}s")
            self._emit(self._batch_event(job))
        return True

    # ------------------------------------------------------------------ S3

    def _write_checkpoint(self, job: _Job, t: float, why: str, reason: Reason, requested_at: float | None = None) -> None:
        """A checkpoint as the training helper writes one: the state, then the step's
        manifest, then the location's (each put emits its own S3 event, as S3 does)."""
        if job.bucket is None:
            return
        progress = job.progress(t)
        path = step_dir_name(int(progress))
        state = f"{path}/state.json"
        body = json.dumps({"progress_s": progress, "job": job.name}).encode("utf-8")
        manifest = Manifest(
            step=int(progress), time=t, reason=reason, path=path, files=(FileEntry(state, len(body)),),
            requested_at=requested_at, save_s=self._checkpoint_write_s if reason is not Reason.PERIODIC else None,
        )
        written = [(state, body)] + [(key, manifest.encode()) for key in (f"{path}/{MANIFEST}", MANIFEST)]
        for relative, data in written:
            key = f"{job.prefix}/{relative}" if job.prefix else relative
            put = self._s3.put_object(Bucket=job.bucket, Key=key, Body=data)
            if self._s3_events:
                self._emit(self._object_created(job, key, len(data), put.get("ETag", "").strip('"')))
        job.last_checkpoint_at = t
        job.checkpointed_progress = progress
        self._record(t, job, f"{why}: {job.prefix + '/' if job.prefix else ''}{path}")
        self._prune(job.bucket, job.prefix, path)

    def _prune(self, bucket: str, prefix: str | None, path: str) -> None:
        """As the training helper prunes after a save: of the step directories written
        under the location, the `keep_checkpoints` newest stay, the older ones' objects go."""
        written = self._written.setdefault((bucket, prefix), [])
        if path in written:
            written.remove(path)  # written again (the same step after a resume): now the newest
        written.append(path)
        while len(written) > self._keep_checkpoints:
            old = written.pop(0)
            for relative in (f"{old}/state.json", f"{old}/{MANIFEST}"):
                self._s3.delete_object(Bucket=bucket, Key=f"{prefix}/{relative}" if prefix else relative)

    def _newest_checkpoint(self, job: _Job) -> tuple[float, float | None]:
        """(progress, time) of the checkpoint the job resumes from, or (0, None): the newest
        complete one in the helper's layout, else the newest plain object."""
        if job.bucket is None:
            return 0.0, None
        mirror = S3Mirror(S3Location(job.bucket, job.prefix), client=self._s3) if job.prefix else None
        complete = mirror.complete()[0] if mirror is not None else []
        if mirror is not None and complete:
            newest = complete[0]
            body = self._s3.get_object(Bucket=job.bucket, Key=mirror.location.key(newest.files[0].path))["Body"].read()
            return float(json.loads(body)["progress_s"]), newest.time
        prefix = f"{job.prefix}/" if job.prefix else ""
        plain: dict | None = None
        paginator = self._s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=job.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                relative = obj["Key"][len(prefix) :]
                if relative.startswith("_preemptor/") or relative.startswith("step-") or relative == MANIFEST:
                    continue
                if plain is None or (obj["LastModified"], obj["Key"]) > (plain["LastModified"], plain["Key"]):
                    plain = obj
        if plain is None:
            return 0.0, None
        body = self._s3.get_object(Bucket=job.bucket, Key=plain["Key"])["Body"].read()
        try:
            progress = float(json.loads(body)["progress_s"])
        except (ValueError, KeyError, TypeError):
            progress = 0.0  # not one of ours: start from scratch, as a real script would fail to
        return progress, plain["LastModified"].timestamp()

    def _poll_checkpoint_requests(self) -> None:
        for job in self._jobs.values():
            if job.phase in ("ended", "interrupted") or job.bucket is None:
                continue  # an interrupted job's helper reads the request once it runs again
            requested_at = self._read_checkpoint_request(job)
            if requested_at is None or requested_at == job.handled_request_at:
                continue
            if requested_at < job.created_at:
                # Left over from an earlier run of the job (the one that was preempted).
                job.handled_request_at = requested_at
                continue
            if job.last_checkpoint_at is not None and requested_at <= job.last_checkpoint_at:
                continue
            job.handled_request_at = requested_at
            begins = max(requested_at, job.start_at)
            self._schedule(begins + self._checkpoint_write_s, job, "requested_checkpoint", requested_at)
            self._record(requested_at, job, "checkpoint requested")

    def _read_checkpoint_request(self, job: _Job) -> float | None:
        # Read from the emulated bucket itself: the fleet looks at every live job after
        # every clock step, which through boto3 and moto's wire format cost a quarter of a
        # replay; what it reads is the same object (ETag, body, time) a job's helper reads.
        key = f"{job.prefix}/{CHECKPOINT_REQUEST_KEY}" if job.prefix else CHECKPOINT_REQUEST_KEY
        account = job.arn.split(":", 5)[4]
        stored = s3_backends[account]["global"].get_object(job.bucket, key)
        if stored is None:
            return None
        if stored.etag == job.request_etag:
            return job.handled_request_at
        job.request_etag = stored.etag
        try:
            return float(json.loads(stored.value)["requested_at"])
        except (ValueError, KeyError, TypeError):
            return float(calendar.timegm(stored.last_modified.utctimetuple()))  # as S3 reports it: whole seconds

    # ------------------------------------------------------------------ events

    def _envelope(self, job: _Job, detail_type: str, source: str, detail: dict) -> dict:
        _, _, _, region, account, _ = job.arn.split(":", 5)
        return {
            "version": "0",
            "id": self._new_id(),
            "detail-type": detail_type,
            "source": source,
            "account": account,
            "time": _iso_z(self._clock.now()),
            "region": region,
            "resources": [job.arn],
            "detail": detail,
        }

    def _sagemaker_event(self, job: _Job) -> dict:
        described = moto_patches.get_training_job(job.name)
        detail: dict[str, Any] = {
            "TrainingJobName": job.name,
            "TrainingJobArn": job.arn,
            "TrainingJobStatus": described["TrainingJobStatus"],
            "SecondaryStatus": described["SecondaryStatus"],
        }
        for name in _SAGEMAKER_DETAIL_FIELDS:
            value = job.request.get(name, _SAGEMAKER_DETAIL_DEFAULTS.get(name))
            if value is not None:
                detail[name] = json.loads(json.dumps(value))
        for name in ("CreationTime", "TrainingStartTime", "TrainingEndTime", "LastModifiedTime"):
            if described.get(name) is not None:
                detail[name] = _epoch_ms(described[name])
        detail["SecondaryStatusTransitions"] = [
            {
                key: _epoch_ms(value) if isinstance(value, dt.datetime) else value
                for key, value in transition.items()
            }
            for transition in described.get("SecondaryStatusTransitions") or []
        ]
        if described.get("FailureReason"):
            detail["FailureReason"] = described["FailureReason"]
        detail["Tags"] = {tag["Key"]: tag["Value"] for tag in job.request.get("Tags") or []}
        return self._envelope(job, "SageMaker Training Job State Change", "aws.sagemaker", detail)

    def _place_on_instance(self, job: _Job) -> None:
        if self._ecs is None:
            return
        job.instance_id = self._ec2.run_instances(
            ImageId=self._image, MinCount=1, MaxCount=1, InstanceType="g5.12xlarge",
            InstanceMarketOptions={"MarketType": "spot"},
        )["Instances"][0]["InstanceId"]
        document = json.dumps({"instanceId": job.instance_id, "region": job.arn.split(":")[3]})
        job.container_instance_arn = self._ecs.register_container_instance(
            cluster=self._cluster, instanceIdentityDocument=document
        )["containerInstance"]["containerInstanceArn"]

    def _object_created(self, job: _Job, key: str, size: int, etag: str) -> dict:
        """S3's "Object Created" event as EventBridge delivers it (detail version 0)."""
        _, _, _, region, account, _ = job.arn.split(":", 5)
        return {
            "version": "0",
            "id": self._new_id(),
            "detail-type": "Object Created",
            "source": "aws.s3",
            "account": account,
            "time": _iso_z(self._clock.now()),
            "region": region,
            "resources": [f"arn:aws:s3:::{job.bucket}"],
            "detail": {
                "version": "0",
                "bucket": {"name": job.bucket},
                "object": {"key": key, "size": size, "etag": etag, "sequencer": f"{int(self._clock.now() * 1000):016X}"},
                "request-id": self._new_id()[:16],
                "requester": account,
                "source-ip-address": "10.0.0.1",
                "reason": "PutObject",
            },
        }

    def _spot_warning(self, job: _Job) -> dict:
        """Shape of events/ec2/amazon-ec2-user-guide__ec2-spot-instance-interruption-warning__a6e9ba68.json."""
        _, _, _, region, account, _ = job.arn.split(":", 5)
        return {
            "version": "0",
            "id": self._new_id(),
            "detail-type": "EC2 Spot Instance Interruption Warning",
            "source": "aws.ec2",
            "account": account,
            "time": _iso_z(self._clock.now()),
            "region": region,
            "resources": [f"arn:aws:ec2:{region}:{account}:instance/{job.instance_id}"],
            "detail": {"instance-id": job.instance_id, "instance-action": "terminate"},
        }

    def _batch_event(self, job: _Job) -> dict:
        detail = json.loads(json.dumps(moto_patches.get_batch_job(job.job_id), default=str))
        if job.container_instance_arn:
            detail.setdefault("container", {})["containerInstanceArn"] = job.container_instance_arn
        if job.work_started_at is None:
            detail.pop("startedAt", None)  # moto reports 1970 for a job that never started
        detail.setdefault("attempts", [])
        detail.setdefault("tags", {})
        detail.setdefault("propagateTags", False)
        detail.setdefault("platformCapabilities", [])
        return self._envelope(job, "Batch Job State Change", "aws.batch", detail)

    # ------------------------------------------------------------------ misc

    def _record(self, t: float, job: _Job, what: str) -> None:
        self.history.append((t, job.name, what))

    def _view(self, job: _Job) -> FleetJob:
        return FleetJob(
            service=job.service,
            name=job.name,
            job_id=job.job_id,
            status=job.status,
            progress_s=job.progress(self._clock.now()),
            duration_s=job.duration_s,
            last_checkpoint_at=job.last_checkpoint_at,
        )


def _instances(request: dict) -> dict[str, int]:
    """Instances per type a CreateTrainingJob request asks for (instance groups in full)."""
    config = request.get("ResourceConfig") or {}
    groups = config.get("InstanceGroups") or [config]
    out: dict[str, int] = {}
    for group in groups:
        kind = group.get("InstanceType")
        if kind:
            out[kind] = out.get(kind, 0) + int(group.get("InstanceCount") or 0)
    return out


def _tags(service: str, request: dict) -> dict[str, str]:
    if service == SAGEMAKER:
        return {t["Key"]: t["Value"] for t in request.get("Tags") or []}
    return dict(request.get("tags") or {})


def _key(service: str, job_id: str) -> str:
    return f"{service}:{job_id}"


def _split_s3_uri(uri: str) -> tuple[str, str]:
    location = S3Uri.parse(uri, require_prefix=False)
    return location.bucket, location.prefix


def _float_or_none(value: Any) -> float | None:
    if value is None or value == "":
        return None
    return float(value)


def _iso_z(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch_ms(value: dt.datetime) -> int:
    """moto's SageMaker keeps naive UTC datetimes; boto3 returns aware ones."""
    if value.tzinfo is None:
        return calendar.timegm(value.timetuple()) * 1000 + value.microsecond // 1000
    return int(round(value.timestamp() * 1000))
