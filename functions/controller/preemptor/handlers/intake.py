"""EventBridge → intake: SageMaker/Batch state changes, EC2 warnings, submissions, cancels.

Never raises for a bad event: a malformed or unknown event is logged with its reason and
counted (metric `RejectedEvents`), so EventBridge does not retry it into a storm; a claim
accepted only in part (a run's priority tag above its team's ceiling) is counted too
(`RefusedClaims`). Raises for an event another handling still holds (`EventInProgress`)
or a failed one: Lambda retries the delivery, then sends it to the dead-letter queue.
"""

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..core.errors import EventInProgress
from ..service.intake import Intake
from .observability import emit, logger, metrics, tracer
from .wiring import deps


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict, context: LambdaContext) -> dict:
    d = deps()
    intake = Intake(
        store=d.store, workflows=d.workflows, runners=d.runners, settings=d.settings, instances=d.instances, alerts=d.alerts,
        clock=clock.CLOCK.now, checkpoints=d.checkpoints,
    )
    try:
        result = intake.handle(event, clock.CLOCK.now())
    except EventInProgress as e:
        # Not a duplicate yet: the other handling may die. Failing this delivery makes Lambda
        # retry it after the claim ends (then the event is handled, or found done).
        logger.warning("event held by another handling: retried later", extra={"event_id": _event_id(event), "reason": str(e)})
        metrics.add_metric(name="EventsInProgress", unit=MetricUnit.Count, value=1)
        raise
    if result.job:
        logger.set_correlation_id(result.job)
    if result.outcome == "rejected":
        logger.warning("event rejected", extra={"reason": result.reason, "event_id": _event_id(event)})
        metrics.add_metric(name="RejectedEvents", unit=MetricUnit.Count, value=1)
        emit("RejectedEventsByReason", 1, Reason=result.code)
    else:
        logger.info("event handled", extra=result.to_dict())
    if result.refused:
        # Accepted without what its tags claimed beyond the platform's grant (an adopted run
        # counted at its team's ceiling): the claim is refused, and counted.
        logger.warning("claim refused", extra={"reason": result.refused, "job": result.job, "event_id": _event_id(event)})
        emit("RefusedClaims", 1, Reason=result.refused)
    if result.code == "escalated":
        emit("Escalations", 1)
    return result.to_dict()


def _event_id(event: object) -> str | None:
    return event.get("id") if isinstance(event, dict) else None
