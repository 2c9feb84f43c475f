"""Job control steps of the workflows: launch, stop, run state, requeue, spare, finish."""

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service import actions
from .observability import logger, metrics, tracer
from .wiring import deps


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict, context: LambdaContext) -> dict:
    """Input {"action", "job", "incarnation", ...}; each action is idempotent."""
    d = deps()
    action, job, incarnation = event["action"], event["job"], int(event["incarnation"])
    logger.set_correlation_id(job)
    now = clock.CLOCK.now()
    if action == "launch":
        return actions.launch(store=d.store, runners=d.runners, job=job, incarnation=incarnation, now=now)
    if action == "stop":
        fresh = bool(event.get("fresh", True))
        if not fresh:
            metrics.add_metric(name="StopsWithoutFreshCheckpoint", unit=MetricUnit.Count, value=1)
        return actions.stop(store=d.store, runners=d.runners, job=job, incarnation=incarnation, fresh=fresh, now=now)
    if action == "state":
        return actions.run_state(store=d.store, runners=d.runners, job=job, incarnation=incarnation)
    if action == "requeue":
        result = actions.requeue(
            store=d.store,
            policy=d.settings.policy,
            job=job,
            incarnation=incarnation,
            fresh=bool(event.get("fresh", True)),
            phase=event.get("phase", "stopped"),
            now=now,
        )
        if result.get("requeued"):
            metrics.add_metric(name="LostGpuSeconds", unit=MetricUnit.Count, value=result["lost_gpu_seconds"])
        return result
    if action == "interrupt":
        return actions.interrupt(store=d.store, job=job, incarnation=incarnation, reason=event["reason"], now=now)
    if action == "spare":
        return actions.spare(store=d.store, policy=d.settings.policy, job=job, incarnation=incarnation, now=now)
    if action == "finish":
        return actions.finish(
            store=d.store,
            policy=d.settings.policy,
            job=job, incarnation=incarnation, outcome=event["outcome"], reason=event["reason"], now=now
        )
    raise ValueError(f"unknown control action {action!r}")
