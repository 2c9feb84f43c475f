"""Schedule workflow steps: plan a pool (under its lease), and finish the cycle."""

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service import scheduling
from .observability import emit_oldest_waits, logger, metrics, tracer
from .wiring import deps


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
def plan(event: dict, context: LambdaContext) -> dict:
    """Input {"pool", "owner"}; output the cycle: admissions, preemptions, waiting jobs."""
    d = deps()
    result = scheduling.plan_cycle(
        store=d.store,
        settings=d.settings,
        pool_name=event["pool"],
        owner=event["owner"],
        now=clock.CLOCK.now(),
    )
    logger.info("planned", extra=result.to_dict())
    emit_oldest_waits(result.oldest_wait_s)
    metrics.add_metric(name="Admissions", unit=MetricUnit.Count, value=len(result.admits))
    metrics.add_metric(name="Preemptions", unit=MetricUnit.Count, value=len(result.preemptions))
    metrics.add_metric(
        name="LostGpuSecondsPlanned",
        unit=MetricUnit.Count,
        value=sum(p["lost_gpu_seconds"] for p in result.preemptions),
    )
    return result.to_dict()


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler
def finish(event: dict, context: LambdaContext) -> dict:
    """Input {"pool", "owner"}; output {"rerun": bool}."""
    return scheduling.finish_cycle(store=deps().store, pool_name=event["pool"], owner=event["owner"])
