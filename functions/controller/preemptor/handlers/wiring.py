"""Composition root of the Lambda functions: settings and clients, built once per container.

Nothing is built at import time: the first invocation builds them from the environment
that template.yaml sets, later invocations reuse them. The local runtime calls `reset()`
when it starts a new emulated stack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import boto3

from ..adapters.checkpoints import CheckpointStore
from ..adapters.instances import InstanceResolver
from ..adapters.runners import BatchRunner, Runner, SageMakerRunner
from ..adapters.store import JobsStore
from ..adapters.workflows import WorkflowStarter
from ..config import Settings


@dataclass(frozen=True)
class Deps:
    settings: Settings
    store: JobsStore
    checkpoints: CheckpointStore
    runners: dict[str, Runner]
    workflows: WorkflowStarter
    instances: InstanceResolver


@cache
def deps() -> Deps:
    settings = Settings.from_env(os.environ)
    session = boto3.session.Session()
    return Deps(
        settings=settings,
        store=JobsStore(settings.jobs_table, session.client("dynamodb")),
        checkpoints=CheckpointStore(session.client("s3")),
        runners={"sagemaker": SageMakerRunner(session.client("sagemaker")), "batch": BatchRunner(session.client("batch"))},
        workflows=WorkflowStarter(session.client("stepfunctions"), settings.workflow_arns),
        instances=InstanceResolver(session.client("ecs")),
    )


def reset() -> None:
    deps.cache_clear()
