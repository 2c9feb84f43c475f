"""The emulated stack for tests: template.yaml in moto, the simulated fleet, one clock."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from preemptor.config import PoolConfig
from preemptor.core.jobs import JobRecord
from preemptor_tools.local.clock import SimClock
from preemptor_tools.local.demo import START
from preemptor_tools.local import moto_patches
from preemptor_tools.local.fleet import SimulatedFleet
from preemptor_tools.local.scenario import ROLE_ARN, ScenarioJob, local_pool, submission_event
from preemptor_tools.local.stack import EmulatedStack, RoutedEvent

P5 = PoolConfig(name="p5", service="sagemaker", instance_type="ml.p5.48xlarge", instances=8, gpus_per_instance=8)
G5 = PoolConfig(name="g5", service="batch", gpus=32)


@dataclass
class Emulation:
    stack: EmulatedStack
    clock: SimClock
    fleet: SimulatedFleet
    pools: list[PoolConfig]

    @property
    def store(self):
        return self.stack.deps().store

    @property
    def elapsed(self) -> float:
        return self.clock.now() - START

    def operator(self):
        """What the CLI's commands act on (`preemptor_tools.ops.Target`): this stack, on its clock."""
        from preemptor_tools import ops
        from preemptor_tools.local import server

        stack = self.stack
        return ops.Target(stack.stack_name, server.stack_outputs(stack), dict(stack.parameters), stack.session, clock=self.clock.now)

    def submit(self, **job) -> dict:
        """Submit a job (ScenarioJob fields; submit_at defaults to now) through the bus."""
        routed = self.submit_nowait(**job)
        self.stack.drain()
        return routed.results[0]

    def submit_nowait(self, **job) -> RoutedEvent:
        """`submit` without waiting for the workflows it starts (e.g. from inside a step of
        another workflow, which `drain` would wait for)."""
        job.setdefault("submit_at", self.elapsed)
        spec = ScenarioJob(**job)
        pool = next(p for p in self.pools if p.name == spec.pool)
        event = submission_event(spec, pool, self.stack.parameters["CheckpointBucketName"], self.clock.now(), self.stack.region)
        return self.stack.put_event(event)

    def put(self, event: dict) -> RoutedEvent:
        routed = self.stack.put_event(event)
        self.stack.drain()
        return routed

    def advance(self, seconds: float, step: float = 30.0) -> None:
        """Let simulated time pass, routing every event the fleet emits on the way."""
        end = self.clock.now() + seconds
        while self.clock.now() < end:
            self.clock.advance_to(min(end, self.clock.now() + step))
            self.stack.pump()

    def job(self, name: str) -> JobRecord:
        return self.store.require(name)

    def kinds(self, name: str) -> list[str]:
        return [e["kind"] for e in self.store.history(name)]

    def states_visited(self, execution_arn: str) -> list[str]:
        sfn = self.stack.client("stepfunctions")
        events = sfn.get_execution_history(executionArn=execution_arn, maxResults=1000)["events"]
        return [e["stateEnteredEventDetails"]["name"] for e in events if "stateEnteredEventDetails" in e]

    def executions(self, logical: str) -> list[dict]:
        return self.stack.executions(logical)


@contextmanager
def emulation(
    pools: list[PoolConfig] = (P5,),
    policy: dict | None = None,
    hostile: Any = None,
    metrics: list[dict] | None = None,
    parameters: dict[str, str] | None = None,
    **fleet_options,
) -> Iterator[Emulation]:
    """The stack and a fleet on one clock; `hostile(clock)` builds a HostileWorld for it;
    `metrics`, when given, receives every EMF document the functions print; `parameters`,
    more of the template's parameters."""
    clock = SimClock(START)
    parameters = {
        "PoolsConfig": json.dumps([local_pool(p).model_dump(exclude_none=True) for p in pools]),
        "PolicyConfig": json.dumps(policy or {}),
        **(parameters or {}),
    }
    world = hostile(clock) if hostile is not None else None
    with EmulatedStack(clock, parameters=parameters, hostile=world, metrics=metrics) as stack:
        fleet_options.setdefault("ecs_client", stack.client("ecs"))
        fleet_options.setdefault("ec2_client", stack.client("ec2"))
        fleet = SimulatedFleet(clock, stack.client("s3"), stack.emit, **fleet_options)
        try:
            yield Emulation(stack, clock, fleet, list(pools))
        finally:
            fleet.close()


def team_training_job(env: Emulation, name: str, tags: dict[str, str] | None = None, instances: int = 2, spot: bool = False) -> None:
    """A SageMaker training job a team creates itself, outside the controller, on
    `instances` ml.p5.48xlarge (on managed spot with `spot`), tagged with `tags`."""
    env.stack.client("sagemaker").create_training_job(
        TrainingJobName=name,
        AlgorithmSpecification={"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1", "TrainingInputMode": "File"},
        RoleArn=ROLE_ARN,
        OutputDataConfig={"S3OutputPath": "s3://research-output/out"},
        ResourceConfig={"InstanceType": "ml.p5.48xlarge", "InstanceCount": instances, "VolumeSizeInGB": 100},
        StoppingCondition={"MaxRuntimeInSeconds": 86_400, **({"MaxWaitTimeInSeconds": 90_000} if spot else {})},
        EnableManagedSpotTraining=spot,
        Tags=[{"Key": k, "Value": v} for k, v in (tags or {}).items()],
    )


def batch_queues(env: Emulation, *queues: str) -> None:
    """Batch job queues (g5-queue unless named) on one unmanaged compute environment, and
    the g5-training job definition: the emulated fleet runs what is submitted to them."""
    batch, iam = env.stack.client("batch"), env.stack.client("iam")
    role = iam.create_role(RoleName="batch", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    ce = batch.create_compute_environment(
        computeEnvironmentName="g5-ce", type="UNMANAGED", state="ENABLED", serviceRole=role
    )["computeEnvironmentArn"]
    for queue in queues or ("g5-queue",):
        batch.create_job_queue(
            jobQueueName=queue, state="ENABLED", priority=1, computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce}]
        )
    batch.register_job_definition(
        jobDefinitionName="g5-training", type="container", containerProperties={"image": "x", "vcpus": 1, "memory": 512}
    )


@contextmanager
def when_a_step_returns(env: Emulation, execution: str, state: str, act) -> Iterator[list[float]]:
    """Call `act()` once, as an execution whose ARN contains `execution` returns from its
    Lambda task `state`, and let the workflows it starts finish before that execution goes
    on (its Wait states move the clock at once, so it would otherwise race through its
    polls). Yields the list of the times `act` ran at."""
    done: list[float] = []

    def returned(execution_arn: str, name: str) -> None:
        if name == state and not done and execution in execution_arn:
            done.append(env.clock.now())
            act()
            env.stack.drain(but=execution_arn)

    unsubscribe = moto_patches.on_lambda_task_returned(returned)
    try:
        yield done
    finally:
        unsubscribe()
