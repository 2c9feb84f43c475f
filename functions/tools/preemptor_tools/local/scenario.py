"""Demo scenarios: pools and jobs in YAML, turned into real `Job Submitted` events.

```yaml
pools:
  - {name: p5, service: sagemaker, instance_type: ml.p5.48xlarge, instances: 64, gpus_per_instance: 8}
policy: {}                     # optional: the policy knobs (see the README)
jobs:
  - {name: experiment, team: research, priority: 50, pool: p5, instances: 64,
     submit_at: 0, duration: 21600, checkpoint_every: 300}
```
Times are seconds from the start of the scenario; `priority` is 0..1000 or a tier name.
Batch pools take `gpus` per job instead of `instances`. Spot interruptions:
`interruptions: [{at: 1800, job: sweep}]` reclaims the instance under a Batch job's current
run; on a SageMaker spot pool, managed spot takes the current run's instances until spot
capacity is back `duration` seconds later (600 by default), and SageMaker restarts it;
with `until`, a job that has no run then is tried again each minute until `until`.
A team may lower a job (`lowerings: [{at, job, priority}]`) or cancel it (`cancellations:
[{at, job}]`), by the events `preemptor lower` and `preemptor cancel` put on the bus.

A hostile world (see `hostile.py`): `chaos: {seed, throttle_rate, duplicate_rate, reorder_rate,
transaction_conflict_rate, crash_rate}` and `faults: [{type: stop_denied, at, job, duration},
{type: stopped_by_hand, at, job}, {type: workflow_crash, at}, {type: capacity_error, at, pool,
duration, instance_type?, capacity_type?}, {type: spot_interruption, at, job, duration?, until?},
{type: quota_change, at, pool, instances}, {type: drain, at, pool, duration}]`. Batch pools
described by instances (`instance_type`, `instances`, `gpus_per_instance`) take `instances` on
jobs. Pools take `capacity_type: spot | on-demand` (and `on_demand_fallback: true` for a spot
pool that may fall back to on-demand), as the controller's pool configuration does.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from preemptor.config import JobDefinition, PoolConfig
from preemptor.core.jobs import SAVES_ON_STOP_LABEL
from preemptor.core.pools import fallback_onto_another_pool

ACCOUNT = "123456789012"
ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/preemptor-training"
IMAGE = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/training:latest"


class ScenarioJob(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    team: str
    priority: int | str
    pool: str
    submit_at: float = Field(ge=0)
    duration: float = Field(gt=0)
    checkpoint_every: float | None = Field(default=None, gt=0)
    instances: int | None = Field(default=None, gt=0)
    gpus: int | None = Field(default=None, gt=0)
    # "team": the team launches the run itself (a SageMaker training job, a Batch job in the
    # pool's queue), tagged with its team, priority and pool (and preemptor:managed=true: it
    # may be preempted); the controller only learns of it from its events and adopts it.
    # "controller": submitted to the bus.
    launched_by: Literal["controller", "team"] = "controller"
    # Tags a team's own run carries besides (and over) those above: a claim the platform
    # does not grant (the controller's own job tags, an unknown tier), as a team may write.
    tags: dict[str, str] = Field(default_factory=dict)
    # A team's own Batch run: the job queue of its own it is submitted to instead of the
    # pool's, on the pool's compute environment (it holds the pool's GPUs all the same).
    job_queue: str | None = Field(default=None, min_length=1)
    # A team's own run: the name its team gives it (default: `name`). Another job's name,
    # with that job's tags in `tags`, makes it a copy of that job's run to come.
    run_name: str | None = Field(default=None, min_length=1, max_length=63)
    # The job runs the training helper (preemptor_training.Checkpointer): the simulated job
    # saves on SIGTERM, and a submitted one declares it (label preemptor/saves-on-stop; an
    # adopted run declares nothing, so the controller never trusts it to).
    runs_training_helper: bool = False


# How long managed spot keeps an interrupted SageMaker run without instances, by default.
MANAGED_SPOT_OUTAGE_S = 600.0


class SpotInterruption(BaseModel):
    """At `at`, the spot capacity under `job`'s current run is taken: on a Batch pool EC2
    warns, then reclaims its instance; on a SageMaker spot pool managed spot takes its
    instances until spot capacity is back `duration` seconds later, and restarts it. With
    `until`, a job with no run to take at `at` (still waiting, between runs) is tried again
    every minute until then: spot takes the capacity under whichever run it has."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    at: float = Field(ge=0)
    job: str
    duration: float | None = Field(default=None, gt=0)  # SageMaker only (default MANAGED_SPOT_OUTAGE_S)
    until: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _until_after_at(self) -> "SpotInterruption":
        if self.until is not None and self.until < self.at:
            raise ValueError(f"interruption at {self.at}: 'until' ({self.until}) is before 'at'")
        return self


class Lowering(BaseModel):
    """At `at`, a team puts a "Job Priority Lowered" event for `job` (`team`: the sending
    team, by default the job's own; another one is refused, as is a priority that does not
    lower the job's)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    at: float = Field(ge=0)
    job: str
    priority: int | str
    note: str = ""
    team: str | None = None


class Cancellation(BaseModel):
    """At `at`, a team puts a "Job Cancelled" event for `job` (`team`: the sending team, by
    default the job's own; another one is refused)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    at: float = Field(ge=0)
    job: str
    team: str | None = None


class Chaos(BaseModel):
    """How hostile the emulated AWS is (see `hostile.py`): rates in [0, 1), and the seed every
    draw comes from, so a scenario replays the same way each time."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int = 0
    throttle_rate: float = Field(default=0.0, ge=0, lt=1)
    duplicate_rate: float = Field(default=0.0, ge=0, lt=1)
    reorder_rate: float = Field(default=0.0, ge=0, lt=1)
    transaction_conflict_rate: float = Field(default=0.0, ge=0, lt=1)
    crash_rate: float = Field(default=0.0, ge=0, lt=1)
    index_lag_rate: float = Field(default=0.0, ge=0, lt=1)
    answer_lost_rate: float = Field(default=0.0, ge=0, lt=1)


class StopDenied(BaseModel):
    """From `at` for `duration` seconds, stopping any run of `job` fails with AccessDenied."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["stop_denied"]
    at: float = Field(ge=0)
    job: str
    duration: float = Field(gt=0)


class StoppedByHand(BaseModel):
    """At `at`, someone stops `job`'s current run outside the controller."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["stopped_by_hand"]
    at: float = Field(ge=0)
    job: str


class WorkflowCrash(BaseModel):
    """The first workflow execution to run a step after `at` dies (ABORTED) after that step."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["workflow_crash"]
    at: float = Field(ge=0)


class CapacityError(BaseModel):
    """From `at` for `duration` seconds, the service cannot provision `pool`'s instances:
    a SageMaker training job that would start there fails with FailureReason
    `CapacityError` (a managed-spot one waits for spot, then fails `MaxWaitTimeExceeded`); a
    Batch job stays RUNNABLE (in `job_queue` only, when given)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["capacity_error"]
    at: float = Field(ge=0)
    pool: str
    duration: float = Field(gt=0)
    instance_type: str | None = None  # only this instance type (a pool's fallbacks still have capacity)
    capacity_type: Literal["spot", "on-demand"] | None = None  # only spot, or only on-demand, capacity
    job_queue: str | None = None  # Batch: only this queue (a pool's fallback queues still have capacity)

    @model_validator(mode="after")
    def _one_offering(self) -> "CapacityError":
        if self.job_queue and (self.instance_type or self.capacity_type):
            raise ValueError("give 'job_queue' (a Batch pool) or 'instance_type'/'capacity_type' (SageMaker), not both")
        return self


class SpotInterruptionFault(BaseModel):
    """The same as an `interruptions:` entry: at `at`, EC2 warns that the spot instance
    under a Batch job's current run goes two minutes later, and reclaims it then; managed
    spot takes a SageMaker spot job's instances for `duration` seconds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["spot_interruption"]
    at: float = Field(ge=0)
    job: str
    duration: float | None = Field(default=None, gt=0)
    until: float | None = Field(default=None, ge=0)


class QuotaChange(BaseModel):
    """At `at`, the account's SageMaker quota of `pool`'s instance type becomes `instances`
    (an increase granted, or a cut): launches are held to it, Service Quotas lists it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["quota_change"]
    at: float = Field(ge=0)
    pool: str
    instances: int = Field(ge=0)


class Drain(BaseModel):
    """At `at`, the operator drains `pool` (`preemptor drain`: it admits nothing new and
    preempts nothing) for `duration` seconds, then undrains it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["drain"]
    at: float = Field(ge=0)
    pool: str
    duration: float = Field(gt=0)


Fault = Annotated[
    StopDenied | StoppedByHand | WorkflowCrash | CapacityError | SpotInterruptionFault | QuotaChange | Drain, Field(discriminator="type")
]


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    pools: list[PoolConfig]
    jobs: list[ScenarioJob]
    interruptions: list[SpotInterruption] = Field(default_factory=list)
    lowerings: list[Lowering] = Field(default_factory=list)
    cancellations: list[Cancellation] = Field(default_factory=list)
    chaos: Chaos | None = None
    faults: list[Fault] = Field(default_factory=list)
    policy: dict[str, Any] = Field(default_factory=dict)
    horizon: float | None = Field(default=None, gt=0)
    # The stack's Mode: in shadow mode the controller decides and records, and changes
    # nothing; the report lists what enforce mode would have done.
    mode: Literal["enforce", "shadow"] = "enforce"
    # Per pool, what the account has beyond what the pool is configured with: instances of
    # its type (SageMaker: the account's quota) or GPUs (Batch: its compute environments).
    # Runs teams launch themselves may take them, and the pool is over-full while they do;
    # the controller's own launches never add to that. Negative for a SageMaker pool: the
    # account's quota of its type is below what the pool is configured with (not raised yet).
    unpooled: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _jobs_fit_their_pools(self) -> "Scenario":
        pools = {p.name: p for p in self.pools}
        if len(pools) < len(self.pools):
            repeated = sorted({p.name for p in self.pools if [q.name for q in self.pools].count(p.name) > 1})
            raise ValueError(f"one pool per name; repeated: {', '.join(repeated)}")
        shared = fallback_onto_another_pool([local_pool(p) if p.service == "batch" else p for p in self.pools])
        if shared:
            raise ValueError(shared)
        for name, extra in self.unpooled.items():
            if name not in pools:
                raise ValueError(f"unpooled: unknown pool {name!r}")
            if pools[name].service == "sagemaker" and not (pools[name].instance_type and pools[name].instances):
                raise ValueError(f"unpooled.{name}: a SageMaker pool's are instances of its type; give the pool 'instance_type' and 'instances'")
            if extra < 0 and (pools[name].service != "sagemaker" or -extra > pools[name].instances):
                raise ValueError(
                    f"unpooled.{name}: {extra} is negative (only a SageMaker pool's may be: a quota below the pool, down to -{pools[name].instances or 0})"
                    if pools[name].service == "sagemaker" else f"unpooled.{name}: {extra} is negative"
                )
        names = set()
        # Each job queue is on one pool's compute environment: its own queues, then teams' queues.
        queue_pools = {q: p.name for p in self.pools if p.service == "batch" for q in (local_pool(p).job_queue, *p.fallback_job_queues)}
        for job in self.jobs:
            if job.name in names:
                raise ValueError(f"job name {job.name!r} appears twice")
            names.add(job.name)
            pool = pools.get(job.pool)
            if pool is None:
                raise ValueError(f"job {job.name!r} names unknown pool {job.pool!r}")
            if job.tags and job.launched_by != "team":
                raise ValueError(f"job {job.name!r}: 'tags' are a team's own run's (launched_by: team)")
            if job.run_name and job.launched_by != "team":
                raise ValueError(f"job {job.name!r}: 'run_name' is a team's own run's (launched_by: team)")
            if job.job_queue and (job.launched_by != "team" or pool.service != "batch"):
                raise ValueError(f"job {job.name!r}: 'job_queue' is a team's own Batch run's (launched_by: team, a Batch pool)")
            if job.job_queue and queue_pools.setdefault(job.job_queue, pool.name) != pool.name:
                raise ValueError(f"job {job.name!r}: job queue {job.job_queue!r} is on pool {queue_pools[job.job_queue]!r}'s compute environment")
            if pool.service == "sagemaker" and job.instances is None:
                raise ValueError(f"job {job.name!r} runs on SageMaker pool {pool.name!r}: give 'instances'")
            if pool.service == "batch" and job.gpus is None:
                if job.instances is None or pool.gpus is not None:
                    raise ValueError(
                        f"job {job.name!r} runs on Batch pool {pool.name!r}: give 'gpus' "
                        "(or 'instances', where the pool is described by instances)"
                    )
                # A pool described by instances: a job's GPUs are its instances' GPUs.
                job.gpus = job.instances * pool.gpus_per_instance
            if pool.service == "batch" and job.instances is not None and job.gpus != job.instances * pool.gpus_per_instance:
                if pool.gpus is None:
                    raise ValueError(
                        f"job {job.name!r}: gpus={job.gpus} contradicts {job.instances} instances x {pool.gpus_per_instance} GPUs"
                    )
        self.interruptions = self.interruptions + [
            SpotInterruption(at=f.at, job=f.job, duration=f.duration, until=f.until) for f in self.faults if isinstance(f, SpotInterruptionFault)
        ]
        by_name = {j.name: j for j in self.jobs}
        for cut in self.interruptions:
            job = by_name.get(cut.job)
            pool = pools[job.pool] if job is not None else None
            if pool is None or (pool.service != "batch" and pool.capacity_type != "spot"):
                raise ValueError(f"interruption at {cut.at}: {cut.job!r} is not a job of a Batch pool or of a SageMaker spot pool")
            if pool.service == "batch" and cut.duration is not None:
                raise ValueError(f"interruption at {cut.at}: 'duration' is managed spot's (a SageMaker spot pool); EC2 reclaims {cut.job!r}'s instance for good")
        for lowering in self.lowerings:
            if lowering.job not in by_name:
                raise ValueError(f"lowering at {lowering.at}: unknown job {lowering.job!r}")
        for cancel in self.cancellations:
            if cancel.job not in by_name:
                raise ValueError(f"cancellation at {cancel.at}: unknown job {cancel.job!r}")
        for fault in self.faults:
            job_name = getattr(fault, "job", None)
            if job_name is not None and job_name not in by_name:
                raise ValueError(f"{fault.type} at {fault.at}: unknown job {job_name!r}")
            if isinstance(fault, Drain) and fault.pool not in pools:
                raise ValueError(f"drain at {fault.at}: unknown pool {fault.pool!r}")
            if isinstance(fault, QuotaChange) and (
                fault.pool not in pools or pools[fault.pool].service != "sagemaker" or not pools[fault.pool].instance_type
            ):
                raise ValueError(f"quota_change at {fault.at}: {fault.pool!r} is not a SageMaker pool with an 'instance_type'")
        return self

    @property
    def hostile(self) -> bool:
        """Whether the emulated AWS says no here (any chaos or fault)."""
        return self.chaos is not None or bool(self.faults)

    @classmethod
    def load(cls, path: str | Path) -> "Scenario":
        with open(path) as f:
            return cls.model_validate(yaml.safe_load(f))

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)


DEFAULT_SCENARIO = Scenario(
    pools=[
        PoolConfig(name="p5", service="sagemaker", instance_type="ml.p5.48xlarge", instances=64, gpus_per_instance=8)
    ],
    jobs=[
        # A research run on the whole pool that runs the training helper and checkpoints every
        # two hours; a critical fine-tune needs the pool 100 minutes in, with 100 minutes of
        # the experiment's work (512 GPUs) not yet in a checkpoint.
        ScenarioJob(
            name="experiment", team="research", priority=50, pool="p5", instances=64,
            submit_at=0, duration=6 * 3600, checkpoint_every=2 * 3600, runs_training_helper=True,
        ),
        ScenarioJob(
            name="production-finetune", team="production", priority=1000, pool="p5", instances=64,
            submit_at=6000, duration=4 * 3600, checkpoint_every=600,
        ),
    ],
)


def local_pool(pool: PoolConfig) -> PoolConfig:
    """`pool` as the emulated stack runs it: a Batch pool without an allow-list gets the job
    queue and job definition the demo creates for it (`<pool>-queue`, `<pool>-training`)."""
    if pool.service != "batch":
        return pool
    return pool.model_copy(
        update={
            "job_queue": pool.job_queue or f"{pool.name}-queue",
            "job_definitions": pool.job_definitions or (JobDefinition(name=f"{pool.name}-training"),),
        }
    )


def team_event(detail_type: str, team: str, key: str, at: float, region: str, detail: dict) -> dict:
    """An event `team` puts on the stack's bus, as EventBridge delivers it; its id is drawn
    from `key`, so a scenario replays under the same ids."""
    return {
        "version": "0",
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"preemptor-scenario/{key}")),
        "detail-type": detail_type,
        "source": f"preemptor.{team}",
        "account": ACCOUNT,
        "time": dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [],
        "detail": detail,
    }


def lowering_event(lowering: Lowering, team: str, at: float, region: str) -> dict:
    """The "Job Priority Lowered" event `team` puts on the stack's bus (`preemptor lower`)."""
    detail = {"name": lowering.job, "priority": lowering.priority} | ({"note": lowering.note} if lowering.note else {})
    return team_event("Job Priority Lowered", team, f"lower/{lowering.job}/{lowering.at}/{team}", at, region, detail)


def cancellation_event(cancel: Cancellation, team: str, at: float, region: str) -> dict:
    """The "Job Cancelled" event `team` puts on the stack's bus (`preemptor cancel`)."""
    return team_event("Job Cancelled", team, f"cancel/{cancel.job}/{cancel.at}/{team}", at, region, {"name": cancel.job})


def submission_event(job: ScenarioJob, pool: PoolConfig, bucket: str, at: float, region: str) -> dict:
    """The `Job Submitted` event a team (or `preemptor submit`) puts on the stack's bus,
    under the team's own source. What the pool decides (role, output, queue, checkpoint
    prefix under `bucket`) is left to the controller."""
    env = {"PREEMPTOR_SIM_DURATION_S": str(int(job.duration))}
    if job.checkpoint_every:
        env["PREEMPTOR_SIM_CHECKPOINT_EVERY_S"] = str(int(job.checkpoint_every))
    if job.runs_training_helper:
        env["PREEMPTOR_SIM_CHECKPOINT_ON_STOP"] = "true"
    if pool.service == "sagemaker":
        request = {
            "AlgorithmSpecification": {"TrainingImage": IMAGE, "TrainingInputMode": "File"},
            "ResourceConfig": {
                "InstanceType": pool.instance_type or "ml.p5.48xlarge",
                "InstanceCount": job.instances,
                "VolumeSizeInGB": 200,
            },
            "StoppingCondition": {"MaxRuntimeInSeconds": 5 * 24 * 3600},
            "Environment": env,
            "CheckpointConfig": {"LocalPath": "/opt/ml/checkpoints"},
        }
        size = {"instances": job.instances}
    else:
        definitions = local_pool(pool).job_definitions
        request = {
            "jobDefinition": definitions[0].name,
            "containerOverrides": {
                "environment": [{"name": k, "value": v} for k, v in env.items()],
                "resourceRequirements": [{"type": "GPU", "value": str(job.gpus)}],
            },
        }
        size = {"gpus": job.gpus}
    return team_event(
        "Job Submitted",
        job.team,
        job.name,
        at,
        region,
        {
            "name": job.name,
            "team": job.team,
            "priority": job.priority,
            "pool": job.pool,
            "service": pool.service,
            **size,
            "request": request,
            **({"labels": {SAVES_ON_STOP_LABEL: "true"}} if job.runs_training_helper else {}),
        },
    )


def team_launch_request(job: ScenarioJob, pool: PoolConfig, bucket: str) -> dict:
    """The call a team makes itself, outside the controller (SageMaker's CreateTrainingJob,
    Batch's SubmitJob into the pool's queue, or its `job_queue`): its run is tagged so that the controller adopts
    it (team, priority, pool, and preemptor:managed, which lets the controller stop it, and
    the job's own `tags` over them), with its checkpoints under the team's prefix."""
    request = submission_event(job, pool, bucket, 0.0, "us-east-1")["detail"]["request"]
    checkpoint = f"s3://{bucket}/{job.team}/{job.name}"
    tags = {
        "preemptor:team": job.team,
        "preemptor:priority": str(job.priority),
        "preemptor:pool": job.pool,
        "preemptor:managed": "true",
        **({} if pool.service == "sagemaker" else {"preemptor:checkpoint": checkpoint}),
        **job.tags,
    }
    if pool.service != "sagemaker":
        overrides = request["containerOverrides"]
        environment = [*overrides["environment"], {"name": "PREEMPTOR_CHECKPOINT_S3_URI", "value": checkpoint}]
        return {
            **request,
            "jobName": job.run_name or job.name,
            "jobQueue": job.job_queue or local_pool(pool).job_queue,
            "containerOverrides": {**overrides, "environment": environment},
            "tags": tags,
            "propagateTags": True,
        }
    return {
        **request,
        "TrainingJobName": job.run_name or job.name,
        "RoleArn": ROLE_ARN,
        "OutputDataConfig": {"S3OutputPath": f"s3://{bucket}/_output/{job.team}/"},
        "CheckpointConfig": {**request["CheckpointConfig"], "S3Uri": checkpoint},
        "Tags": [{"Key": key, "Value": value} for key, value in tags.items()],
    }
