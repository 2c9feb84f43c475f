"""A capacity pool as the operator configures it: its size, and what a job in it may run as.

The second half is the trust boundary of a submission: the training role, the output
location, the network, the encryption keys, the Batch job queue and the job definitions a
job in the pool runs with are the pool's, not the submitter's. `core.requests.admit_request`
builds the service request from them and refuses a request that tries to set them.

```json
{"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 64,
 "gpus_per_instance": 8, "role_arn": "arn:aws:iam::123456789012:role/training",
 "output_s3_uri": "s3://ml-artifacts/p5", "subnets": ["subnet-0a"],
 "security_group_ids": ["sg-0a"], "network_isolation": true, "kms_key_id": "alias/training"}
{"name": "g5", "service": "batch", "gpus": 32, "job_queue": "g5-queue",
 "job_definitions": ["eval:3", {"name": "research-train", "team": "research"}]}
```

Pure: pydantic only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SPOT = ":spot"  # an offering on managed spot: "<instance type>:spot"
# SageMaker managed spot waits for spot capacity within MaxWaitTimeInSeconds, which must be
# at least MaxRuntimeInSeconds: a spot launch gets the run time plus this much to find it.
DEFAULT_SPOT_WAIT_S = 900


# SageMaker's answer to a CreateTrainingJob over the account's quota (ResourceLimitExceeded):
# "The account-level service limit 'ml.p5.48xlarge for training job usage' is 6 Instances,
# with current utilization of 6 Instances and a request delta of 2 Instances. ..."
_QUOTA_REFUSAL = re.compile(
    r"service limit '(?P<name>(?P<type>\S+) for (?P<spot>spot )?training job usage)' is (?P<limit>\d+) Instances?"
)


@dataclass(frozen=True, slots=True)
class QuotaLimit:
    """The account's SageMaker quota of one instance type, bought one way, as a refusal told it."""

    name: str  # as Service Quotas names it: "ml.p5.48xlarge for training job usage"
    instance_type: str
    spot: bool
    instances: int

    @property
    def offering(self) -> str:
        return self.instance_type + (SPOT if self.spot else "")


def quota_limit(message: str) -> QuotaLimit | None:
    """The quota a SageMaker `ResourceLimitExceeded` message names; None for another limit
    (training jobs at once, say) or a message in another shape."""
    found = _QUOTA_REFUSAL.search(message)
    if found is None:
        return None
    return QuotaLimit(found["name"], found["type"], found["spot"] is not None, int(found["limit"]))


def quota_name(offering: str) -> str:
    """The name of the account's quota of a SageMaker offering, as Service Quotas and a
    ResourceLimitExceeded message give it (`QuotaLimit.name`)."""
    instance_type, spot = parse_offering(offering)
    return f"{instance_type} for {'spot ' if spot else ''}training job usage"


def parse_offering(offering: str) -> tuple[str, bool]:
    """(instance type, on spot?) of a SageMaker offering (a Batch pool's are its queues)."""
    return (offering[: -len(SPOT)], True) if offering.endswith(SPOT) else (offering, False)


def describe_offering(offering: str) -> str:
    """"ml.p5.48xlarge (spot)", "ml.p5.48xlarge (on-demand)": an offering as people read it."""
    instance_type, spot = parse_offering(offering)
    return f"{instance_type} ({'spot' if spot else 'on-demand'})"


class JobDefinition(BaseModel):
    """A Batch job definition a pool allows, exactly as requests name it (name, name:revision
    or ARN). A definition that belongs to a team (give it the team's job role) runs as it is
    for the other teams: they may submit it, but with no command, environment or parameters
    of their own, which would run as the owner's role."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=1600)
    team: str | None = None


class PoolConfig(BaseModel):
    """A capacity pool: either instances x GPUs per instance, or a GPU count; and the
    allow-list of what its jobs run as."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1)
    service: Literal["sagemaker", "batch"] = "sagemaker"
    instance_type: str | None = None
    instances: int | None = Field(default=None, gt=0)
    gpus_per_instance: int = Field(default=8, gt=0)
    gpus: int | None = Field(default=None, gt=0)
    # -- SageMaker: what CreateTrainingJob gets from the pool -----------------------------
    # None: the stack's training role (ManagedRoleArnForTraining), the only one the
    # controller's role may pass for a pool: another fails the deploy
    # (handlers/config_check.py). A team with a role of its own (PolicyConfig
    # teams.<team>.training_role_arn) runs as that one instead.
    role_arn: str | None = None
    output_s3_uri: str | None = None  # None: s3://<checkpoint bucket>/_output
    image_prefixes: tuple[str, ...] = ()  # allowed TrainingImage prefixes; empty: any image
    subnets: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    network_isolation: bool = False
    inter_container_encryption: bool = False
    kms_key_id: str | None = None  # output and volume encryption
    # Instance types a launch may fall back to when the pool's own has no capacity, in order
    # (each with the pool's gpus_per_instance: a job's GPUs do not change with the type).
    # They must be in the stack's TrainingInstanceTypes too (the IAM condition).
    fallback_instance_types: tuple[str, ...] = ()
    # What the pool's instances are bought as. A spot pool launches SageMaker managed spot
    # (EnableManagedSpotTraining, set by the pool, never by the submitter); with
    # `on_demand_fallback` a launch that found no spot capacity goes on to on-demand.
    capacity_type: Literal["on-demand", "spot"] = "on-demand"
    on_demand_fallback: bool = False
    spot_wait_s: int = Field(default=DEFAULT_SPOT_WAIT_S, gt=0, le=172_800)
    # -- Batch: what SubmitJob gets from the pool -----------------------------------------
    job_queue: str | None = None
    # Queues a launch may fall back to when the pool's own queue found no capacity (a job left
    # RUNNABLE past `runnable_timeout_s`), in order: other compute environments, e.g. on-demand
    # behind a spot queue. Their GPUs count in the pool's.
    fallback_job_queues: tuple[str, ...] = ()
    runnable_timeout_s: int = Field(default=1800, gt=0)  # RUNNABLE this long: no capacity
    job_definitions: tuple[JobDefinition, ...] = ()

    @field_validator("job_definitions", mode="before")
    @classmethod
    def _names_as_definitions(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            return tuple({"name": item} if isinstance(item, str) else item for item in value)
        return value

    @model_validator(mode="after")
    def _has_size(self) -> "PoolConfig":
        if self.gpus is None and self.instances is None:
            raise ValueError(f"pool {self.name!r} needs 'instances' or 'gpus'")
        if self.fallback_instance_types and (self.service != "sagemaker" or not self.instance_type):
            raise ValueError(f"pool {self.name!r}: 'fallback_instance_types' needs a SageMaker pool with an 'instance_type'")
        if self.fallback_job_queues and (self.service != "batch" or not self.job_queue):
            raise ValueError(f"pool {self.name!r}: 'fallback_job_queues' needs a Batch pool with a 'job_queue'")
        if self.on_demand_fallback and self.capacity_type != "spot":
            raise ValueError(f"pool {self.name!r}: 'on_demand_fallback' needs 'capacity_type: spot'")
        if self.capacity_type == "spot" and self.service == "sagemaker" and not self.instance_type:
            raise ValueError(f"pool {self.name!r}: a SageMaker spot pool needs an 'instance_type'")
        if bool(self.subnets) != bool(self.security_group_ids):
            raise ValueError(f"pool {self.name!r}: give both 'subnets' and 'security_group_ids', or neither")
        return self

    @property
    def instance_types(self) -> tuple[str, ...]:
        own = (self.instance_type,) if self.instance_type else ()
        return own + tuple(t for t in self.fallback_instance_types if t not in own)

    @property
    def offerings(self) -> tuple[str, ...]:
        """What a SageMaker launch may use, preferred first: each instance type on the pool's
        capacity type; for a spot pool with `on_demand_fallback`, then each on on-demand
        (spot on any type is cheaper than on-demand on the preferred one). Batch pools have
        none of their own (the job queue's compute environments decide): theirs are the queue,
        then its fallbacks, for a pool with fallbacks; none for one without (a launch goes
        to the queue its request names, and fewer than two offerings mean "any")."""
        if self.service != "sagemaker":
            own = (self.job_queue,) if self.job_queue else ()
            return own + tuple(q for q in self.fallback_job_queues if q not in own) if self.fallback_job_queues else ()
        types = self.instance_types
        if self.capacity_type != "spot":
            return types
        return tuple(t + SPOT for t in types) + (types if self.on_demand_fallback else ())

    @property
    def capacity_gpus(self) -> int:
        return self.gpus if self.gpus is not None else self.instances * self.gpus_per_instance

    def job_definition(self, name: str) -> JobDefinition | None:
        """The allowed job definition `name`, or None when the pool does not allow it."""
        return next((d for d in self.job_definitions if d.name == name), None)


def queue_name(queue: str) -> str:
    """A Batch job queue's name, from its name or its ARN (`...:job-queue/<name>`)."""
    return queue.rsplit("/", 1)[-1]


def pool_queues(pool: PoolConfig) -> frozenset[str]:
    """The names of a Batch pool's job queues: its own and its fallbacks."""
    return frozenset(queue_name(q) for q in (pool.job_queue, *pool.fallback_job_queues) if q)


def _own_offering(pool: PoolConfig) -> str | None:
    """What a pool counts as its own: a SageMaker pool's instance type bought its way, a
    Batch pool's job queue (by name); None for a SageMaker pool that names no type."""
    if pool.service == "batch":
        return queue_name(pool.job_queue) if pool.job_queue else None
    if not pool.instance_type:
        return None
    return pool.instance_type + (SPOT if pool.capacity_type == "spot" else "")


def fallback_onto_another_pool(pools: tuple[PoolConfig, ...] | list[PoolConfig]) -> str | None:
    """A pool that falls back onto another pool's own offering, in one line; None when none
    does. Its runs there would take what the other pool counts as its own (the account's
    instances of that type bought that way, under one quota; a job queue's compute
    environments), and the other pool's launches would meet a full quota, or wait RUNNABLE,
    with no run of its own to stop: a critical job there would wait behind the first pool's
    lowest. Two pools that own one offering split it (each counts its share, the account
    holds the sum); falling back onto an offering no pool owns takes nobody's."""
    owners: dict[tuple[str, str], list[str]] = {}
    for pool in pools:
        own = _own_offering(pool)
        if own is not None:
            owners.setdefault((pool.service, own), []).append(pool.name)
    for pool in pools:
        own = _own_offering(pool)
        fallbacks = (
            [queue_name(q) for q in pool.fallback_job_queues] if pool.service == "batch" else [o for o in pool.offerings if o != own]
        )
        for offering in fallbacks:
            others = [name for name in owners.get((pool.service, offering), ()) if name != pool.name]
            if not others:
                continue
            what = f"job queue {offering}" if pool.service == "batch" else describe_offering(offering)
            holds = "the compute environments' capacity" if pool.service == "batch" else "the account's instances"
            other = others[0]
            return (
                f"pool {pool.name!r} falls back to {what}, which is pool {other!r}'s own: {pool.name}'s runs there would take"
                f" {holds} that {other} counts as its own, and {other} could stop none of them for its jobs;"
                f" drop the fallback, or give it to one pool"
            )
    return None


def pools_running(
    pools: tuple[PoolConfig, ...] | list[PoolConfig],
    service: str,
    instance_types: tuple[str, ...] = (),
    spot: bool | None = None,
    job_queue: str | None = None,
    compute_environments: Mapping[str, frozenset[str]] | None = None,
) -> tuple[tuple[PoolConfig, ...], ...]:
    """The pools whose capacity a run of `service` may hold, by where the service runs it,
    not by what its tags say: tiers, the likeliest first, each in configuration order; none
    when it runs on no pool's capacity.

    SageMaker: the pools with every one of the run's `instance_types` that buy them the way
    it runs (with `spot` unknown, either way), its own type before a fallback type; then
    those that buy them the other way (spot and on-demand are separate quotas, but a run
    counted in the wrong one of two pools of its type is still counted, where one left out
    would oversubscribe); then those that name no instance type. A run on a type no pool
    has holds none of their GPUs.

    Batch: the pools with the run's `job_queue` among theirs; then the pools whose queues
    share a compute environment with it (a queue's capacity is its compute environments'),
    by `compute_environments` (queue name -> its compute environments' ARNs); without the
    run's queue in it (not looked up, or not found), every other Batch pool, as any may
    share one. A queue that shares none with a pool's holds none of their GPUs."""
    own = [p for p in pools if p.service == service]
    if service != "sagemaker":
        queue = queue_name(job_queue) if job_queue else None
        sure = [p for p in own if queue in pool_queues(p)]
        others = [p for p in own if p not in sure]
        if compute_environments is not None and queue in compute_environments:
            ces = compute_environments[queue]
            others = [p for p in others if any(ces & compute_environments.get(q, frozenset()) for q in pool_queues(p))]
        return tuple(t for t in (tuple(sure), tuple(others)) if t)
    wanted, first = set(instance_types), instance_types[0] if instance_types else None
    typed = sorted((p for p in own if p.instance_type and wanted <= set(p.instance_types)), key=lambda p: p.instance_type != first)

    def bought_its_way(pool: PoolConfig) -> bool:
        if spot is None:
            return True
        return pool.capacity_type == "spot" if spot else pool.capacity_type != "spot" or pool.on_demand_fallback

    tiers = (
        tuple(p for p in typed if bought_its_way(p)),
        tuple(p for p in typed if not bought_its_way(p)),
        tuple(p for p in own if not p.instance_type),
    )
    return tuple(t for t in tiers if t)
