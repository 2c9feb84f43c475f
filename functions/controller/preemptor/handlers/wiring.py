"""Composition root of the Lambda functions: settings and clients, built once per container.

Nothing is built at import time: the first invocation builds them from the environment
that template.yaml sets, later invocations reuse them. The local runtime calls `reset()`
when it starts a new emulated stack.

Every client uses botocore's `standard` retry mode: throttling, 5xx and transient
network errors are retried a few times with exponential backoff and jitter before the
adapters see them (and translate what remains, `adapters/errors.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import boto3
from botocore.config import Config

from ..adapters.alerts import Alerts
from ..adapters.checkpoints import CheckpointStore
from ..adapters.instances import InstanceResolver
from ..adapters.runners import BatchRunner, Runner, SageMakerRunner
from ..adapters.store import JobsStore
from ..adapters.workflows import WorkflowStarter
from ..config import Settings

# Standard retries: throttling and 5xx answers are retried with jittered backoff, three
# attempts in all (the client setting `max_attempts` would count retries, not attempts).
CLIENT_CONFIG = Config(retries={"mode": "standard", "total_max_attempts": 3})
# For calls that a resend could apply twice (Batch's SubmitJob: no idempotency token): one
# attempt; the caller's own retry first looks for what the lost attempt did.
NO_RETRY_CONFIG = Config(retries={"mode": "standard", "total_max_attempts": 1})


@dataclass(frozen=True)
class Deps:
    settings: Settings
    store: JobsStore
    checkpoints: CheckpointStore
    runners: dict[str, Runner]
    workflows: WorkflowStarter
    instances: InstanceResolver
    alerts: Alerts


@cache
def deps() -> Deps:
    settings = Settings.from_env(os.environ)
    session = boto3.session.Session()

    def client(service: str, config: Config = CLIENT_CONFIG):
        return session.client(service, config=config)

    return Deps(
        settings=settings,
        store=JobsStore(settings.jobs_table, client("dynamodb")),
        checkpoints=CheckpointStore(client("s3")),
        runners={"sagemaker": SageMakerRunner(client("sagemaker")), "batch": BatchRunner(client("batch"), submit_client=client("batch", NO_RETRY_CONFIG))},
        workflows=WorkflowStarter(client("stepfunctions"), settings.workflow_arns),
        instances=InstanceResolver(client("ecs")),
        alerts=Alerts(client("sns"), settings.alerts_topic_arn),
    )


def reset() -> None:
    deps.cache_clear()
