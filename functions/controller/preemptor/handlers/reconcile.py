"""Scheduled reconcile: compare the jobs table with SageMaker and Batch and repair drift."""

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service.reconcile import reconcile
from .observability import emit_oldest_waits, logger, metrics, tracer
from .wiring import deps


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict, context: LambdaContext) -> dict:
    d = deps()
    result = reconcile(
        store=d.store,
        runners=d.runners,
        workflows=d.workflows,
        checkpoints=d.checkpoints,
        settings=d.settings,
        now=clock.CLOCK.now(),
    )
    emit_oldest_waits(result["oldest_wait_s"])
    metrics.add_metric(name="ReconcileRepairs", unit=MetricUnit.Count, value=len(result["repairs"]))
    if result["repairs"]:
        logger.warning("reconcile repaired drift", extra=result)
    return result
