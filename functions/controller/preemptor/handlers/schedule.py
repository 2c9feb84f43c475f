"""Schedule workflow steps: plan a pool (under its lease), and finish the cycle."""

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service import scheduling
from .observability import emit_oldest_waits, logger, metrics, tracer
from .steps import FinishCycle, PlanCycle, step_input
from .wiring import deps


@logger.inject_lambda_context(correlation_id_path="pool", clear_state=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
@step_input(PlanCycle)
def plan(step: PlanCycle, context: LambdaContext) -> dict:
    """Input {"pool", "owner", "cycle"}; output the cycle: admissions, preemptions, waiting jobs."""
    d = deps()
    result = scheduling.plan_cycle(
        store=d.store,
        settings=d.settings,
        pool_name=step.pool,
        owner=step.owner,
        now=clock.CLOCK.now(),
        cycle=step.cycle,
    )
    logger.info("planned", extra=result.to_dict())
    emit_oldest_waits(result.oldest_wait_s)
    metrics.add_metric(name="Admissions", unit=MetricUnit.Count, value=len(result.admits))
    metrics.add_metric(name="Preemptions", unit=MetricUnit.Count, value=len(result.preemptions))
    metrics.add_metric(
        name="LostGpuSecondsPlanned",
        unit=MetricUnit.Count,
        # A retried step hands back its earlier victims without a figure: counted once.
        value=sum(p.get("lost_gpu_seconds", 0.0) for p in result.preemptions),
    )
    return result.to_dict()


@logger.inject_lambda_context(correlation_id_path="pool", clear_state=True)
@tracer.capture_lambda_handler
@step_input(FinishCycle)
def finish(step: FinishCycle, context: LambdaContext) -> dict:
    """Input {"pool", "owner"}; output {"rerun": bool}."""
    return scheduling.finish_cycle(store=deps().store, pool_name=step.pool, owner=step.owner)
