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
from ..adapters.errors import THROTTLING_CODES
from ..adapters.instances import InstanceResolver
from ..adapters.quotas import AccountQuotas
from ..adapters.runners import BatchRunner, Runner, SageMakerRunner
from ..adapters.store import JobsStore
from ..adapters.workflows import WorkflowStarter
from ..config import Settings

# A call that hangs must fail within the function's own time (60 s, template.yaml), where
# its caller can still act on it: botocore's defaults (60 s to connect, 60 s to read) let
# Lambda kill the function during its first attempt, and what the function held (an
# event's claim, a pool's lease) waited for its expiry. Every call the controller makes
# answers in well under a second (an item, a page, a small object, a create or a stop), so
# each attempt gets 2 s to connect and 8 s to read: three attempts and their backoff end
# inside 45 s (`attempts_end_within`, held by a test to the smallest function timeout).
CONNECT_TIMEOUT_S = 2
READ_TIMEOUT_S = 8
# Standard retries: throttling, 5xx answers and lost connections are retried with jittered
# backoff, three attempts in all (the client setting `max_attempts` would count retries,
# not attempts).
CLIENT_CONFIG = Config(
    retries={"mode": "standard", "total_max_attempts": 3}, connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S
)
# botocore's standard mode waits at most min(2 ** (n - 1), 20) s after the n-th failed
# attempt, and up to 5 s more where the answer asks for it (`x-amz-retry-after`).
_MAX_BACKOFF_S, _RETRY_AFTER_MAX_S = 20.0, 5.0


def resent_only_when_throttled(client, operation: str):
    """`client`, whose `operation` botocore sends again only after a throttle: for a call
    that a resend could apply twice (Batch's SubmitJob has no idempotency token). A lost
    answer, a 5xx, anything else is the caller's, whose own retry first looks for what the
    attempt may have done; a throttled attempt was refused, not carried out."""

    def needs_retry(response=None, caught_exception=None, **_):
        code = response[1].get("Error", {}).get("Code") if caught_exception is None and response is not None else None
        throttled = code in THROTTLING_CODES  # refused, not carried out: safe to send again
        return None if throttled else False  # None: the standard handler decides, and backs off

    service = client.meta.service_model.service_id.hyphenize()
    client.meta.events.register_first(f"needs-retry.{service}.{operation}", needs_retry)
    return client


def attempts_end_within(config: Config) -> float:
    """The longest a call made with `config` can take: each attempt's connect and read
    timeouts, and the longest wait before each retry."""
    attempts = int(config.retries["total_max_attempts"])
    waits = sum(min(2.0 ** (failed - 1), _MAX_BACKOFF_S) + _RETRY_AFTER_MAX_S for failed in range(1, attempts))
    return attempts * (config.connect_timeout + config.read_timeout) + waits


@dataclass(frozen=True)
class Deps:
    settings: Settings
    store: JobsStore
    checkpoints: CheckpointStore
    runners: dict[str, Runner]
    workflows: WorkflowStarter
    instances: InstanceResolver
    alerts: Alerts
    quotas: AccountQuotas


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
        runners={
            "sagemaker": SageMakerRunner(client("sagemaker"), controller=settings.controller),
            "batch": BatchRunner(
                client("batch"), submit_client=resent_only_when_throttled(client("batch"), "SubmitJob"), controller=settings.controller
            ),
        },
        workflows=WorkflowStarter(client("stepfunctions"), settings.workflow_arns),
        instances=InstanceResolver(client("ecs")),
        alerts=Alerts(client("sns"), settings.alerts_topic_arn),
        quotas=AccountQuotas(lambda: client("service-quotas")),
    )


def reset() -> None:
    deps.cache_clear()
