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
Batch pools take `gpus` per job instead of `instances`, and may list spot interruptions:
`interruptions: [{at: 1800, job: sweep}]` reclaims the instance under the job's current run.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from preemptor.config import PoolConfig

ACCOUNT = "123456789012"
ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/preemptor-training"
IMAGE = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/training:latest"


class ScenarioJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    team: str
    priority: int | str
    pool: str
    submit_at: float = Field(ge=0)
    duration: float = Field(gt=0)
    checkpoint_every: float | None = Field(default=None, gt=0)
    instances: int | None = Field(default=None, gt=0)
    gpus: int | None = Field(default=None, gt=0)


class SpotInterruption(BaseModel):
    """Reclaim the spot instance under `job`'s current run at `at` (Batch pools only)."""

    model_config = ConfigDict(extra="forbid")

    at: float = Field(ge=0)
    job: str


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: list[PoolConfig]
    jobs: list[ScenarioJob]
    interruptions: list[SpotInterruption] = Field(default_factory=list)
    policy: dict[str, Any] = Field(default_factory=dict)
    horizon: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _jobs_fit_their_pools(self) -> "Scenario":
        pools = {p.name: p for p in self.pools}
        names = set()
        for job in self.jobs:
            if job.name in names:
                raise ValueError(f"job name {job.name!r} appears twice")
            names.add(job.name)
            pool = pools.get(job.pool)
            if pool is None:
                raise ValueError(f"job {job.name!r} names unknown pool {job.pool!r}")
            if pool.service == "sagemaker" and job.instances is None:
                raise ValueError(f"job {job.name!r} runs on SageMaker pool {pool.name!r}: give 'instances'")
            if pool.service == "batch" and job.gpus is None:
                raise ValueError(f"job {job.name!r} runs on Batch pool {pool.name!r}: give 'gpus'")
        by_name = {j.name: j for j in self.jobs}
        for cut in self.interruptions:
            job = by_name.get(cut.job)
            if job is None or pools[job.pool].service != "batch":
                raise ValueError(f"interruption at {cut.at}: {cut.job!r} is not a job of a Batch pool")
        return self

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
        ScenarioJob(
            name="experiment", team="research", priority=50, pool="p5", instances=64,
            submit_at=0, duration=6 * 3600, checkpoint_every=300,
        ),
        ScenarioJob(
            name="production-finetune", team="production", priority=1000, pool="p5", instances=64,
            submit_at=120, duration=4 * 3600, checkpoint_every=600,
        ),
    ],
)


def submission_event(job: ScenarioJob, pool: PoolConfig, bucket: str, at: float, region: str) -> dict:
    """The `Job Submitted` event a user (or `preemptor submit`) would put on the bus."""
    env = {"PREEMPTOR_SIM_DURATION_S": str(int(job.duration))}
    if job.checkpoint_every:
        env["PREEMPTOR_SIM_CHECKPOINT_EVERY_S"] = str(int(job.checkpoint_every))
    checkpoint_uri = f"s3://{bucket}/checkpoints/{job.name}"
    if pool.service == "sagemaker":
        request = {
            "AlgorithmSpecification": {"TrainingImage": IMAGE, "TrainingInputMode": "File"},
            "RoleArn": ROLE_ARN,
            "ResourceConfig": {
                "InstanceType": pool.instance_type or "ml.p5.48xlarge",
                "InstanceCount": job.instances,
                "VolumeSizeInGB": 200,
            },
            "OutputDataConfig": {"S3OutputPath": f"s3://{bucket}/output/{job.name}"},
            "StoppingCondition": {"MaxRuntimeInSeconds": 5 * 24 * 3600},
            "Environment": env,
            "CheckpointConfig": {"S3Uri": checkpoint_uri, "LocalPath": "/opt/ml/checkpoints"},
        }
        size = {"instances": job.instances}
    else:
        request = {
            "jobQueue": f"{pool.name}-queue",
            "jobDefinition": f"{pool.name}-training",
            "containerOverrides": {"environment": [{"name": k, "value": v} for k, v in env.items()]},
        }
        size = {"gpus": job.gpus}
    return {
        "version": "0",
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"preemptor-scenario/{job.name}")),
        "detail-type": "Job Submitted",
        "source": "preemptor",
        "account": ACCOUNT,
        "time": dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [],
        "detail": {
            "name": job.name,
            "team": job.team,
            "priority": job.priority,
            "pool": job.pool,
            "service": pool.service,
            **size,
            "request": request,
            "checkpoint_s3_uri": checkpoint_uri,
        },
    }
