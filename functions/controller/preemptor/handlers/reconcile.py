"""Scheduled reconcile: compare the jobs table with SageMaker and Batch and repair drift."""

from collections import Counter

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service.reconcile import reconcile
from .observability import emit_counts, emit_oldest_waits, logger, metrics, tracer
from .wiring import deps


@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE, clear_state=True)
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
        alerts=d.alerts,
        quotas=d.quotas,
        time_left=lambda: context.get_remaining_time_in_millis() / 1000,
    )
    emit_oldest_waits(result["oldest_wait_s"])
    metrics.add_metric(name="ReconcileRepairs", unit=MetricUnit.Count, value=len(result["repairs"]))
    metrics.add_metric(name="ReconcileErrors", unit=MetricUnit.Count, value=len(result["errors"]))
    kinds = Counter(r["repair"] for r in result["repairs"])
    emit_counts("ReconcileRepairsByKind", "Repair", kinds)
    for repair in result["repairs"]:
        logger.warning("reconcile repaired drift", extra=repair)
    for error in result["errors"]:
        logger.error(f"reconcile could not check {_what(error)}", extra=error)
    return result


def _what(error: dict) -> str:
    """What an error of reconcile's is about: a job, a run, a part of its pass (of a pool, or
    of all: unknown-runs, removed-pools), a pool."""
    if "job" in error:
        return f"job {error['job']}"
    if "run" in error:
        return f"run {error['run']}"
    if error.get("pool") == "*":
        return error.get("part", "its pass")
    if "part" in error:
        return f"pool {error['pool']} ({error['part']})"
    return f"pool {error['pool']}"
