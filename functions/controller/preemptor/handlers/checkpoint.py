"""Checkpoint steps: is the newest checkpoint fresh? ask the job for a new one."""

from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service import actions
from .observability import logger, tracer
from .wiring import deps


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler
def handler(event: dict, context: LambdaContext) -> dict:
    """Input {"action": "check" | "request", "job", "reason"?, "newer_than"?}."""
    d = deps()
    logger.set_correlation_id(event["job"])
    now = clock.CLOCK.now()
    if event["action"] == "check":
        return actions.check_checkpoint(
            store=d.store,
            checkpoints=d.checkpoints,
            policy=d.settings.policy,
            job=event["job"],
            now=now,
            newer_than=event.get("newer_than"),
        )
    if event["action"] == "request":
        return actions.request_checkpoint(
            store=d.store, checkpoints=d.checkpoints, job=event["job"], reason=event.get("reason", "preemption"), now=now
        )
    raise ValueError(f"unknown checkpoint action {event['action']!r}")
