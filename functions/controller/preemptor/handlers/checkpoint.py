"""Checkpoint steps: is the newest checkpoint fresh? ask the job for a new one."""

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service import actions
from .observability import logger, metrics, tracer
from .steps import CheckCheckpoint, CheckpointStep, NoteCheckpoint, RequestCheckpoint, step_input
from .wiring import deps


@logger.inject_lambda_context(correlation_id_path="job", clear_state=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
@step_input(CheckpointStep)
def handler(step: CheckCheckpoint | RequestCheckpoint | NoteCheckpoint, context: LambdaContext) -> dict:
    """Input {"action": "check", "job", "newer_than"?, "since"?}, {"action": "request", "job",
    "reason"?, "execution"?} or {"action": "note", "job"}."""
    d = deps()
    now = clock.CLOCK.now()
    if isinstance(step, CheckCheckpoint):
        result = actions.check_checkpoint(
            store=d.store,
            checkpoints=d.checkpoints,
            policy=d.settings.policy,
            job=step.job,
            now=now,
            newer_than=step.newer_than,
            since=step.since,
        )
    elif isinstance(step, NoteCheckpoint):
        result = actions.note_newest_checkpoint(store=d.store, checkpoints=d.checkpoints, job=step.job, now=now)
    else:
        result = actions.request_checkpoint(
            store=d.store, checkpoints=d.checkpoints, job=step.job, reason=step.reason, now=now, execution=step.execution
        )
    if result.get("error"):
        # One job's checkpoint location cannot be read or written: counted, never raised.
        logger.warning("checkpoint location unavailable", extra=result)
        metrics.add_metric(name="CheckpointLocationErrors", unit=MetricUnit.Count, value=1)
    return result
