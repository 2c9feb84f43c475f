"""Powertools logger, tracer and metrics shared by every function (service name from env)."""

import os

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit, single_metric

logger = Logger()
tracer = Tracer()
metrics = Metrics()


def emit_oldest_waits(oldest_wait_s: dict[str, float]) -> None:
    """`OldestPendingWaitSeconds` per tier: the high-priority-wait alarms read it.

    One EMF blob per tier (a blob carries one value per dimension). `single_metric` does
    not honour POWERTOOLS_METRICS_DISABLED, which the local runtime sets, so check it here.
    """
    if os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() == "true":
        return
    for tier, seconds in oldest_wait_s.items():
        with single_metric(
            name="OldestPendingWaitSeconds", unit=MetricUnit.Seconds, value=seconds, namespace=metrics.namespace
        ) as metric:
            metric.add_dimension(name="Tier", value=tier)


def emit_counts(name: str, dimension: str, counts: dict[str, int]) -> None:
    """One count per value of `dimension` (e.g. reconcile's repairs per `Repair` kind)."""
    if os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() == "true":
        return
    for value, count in counts.items():
        with single_metric(name=name, unit=MetricUnit.Count, value=count, namespace=metrics.namespace) as metric:
            metric.add_dimension(name=dimension, value=value)
