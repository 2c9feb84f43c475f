"""Powertools logger, tracer and metrics shared by every function (service name from env).

The metrics (namespace Preemptor) and their dimensions are a contract with template.yaml:
its alarms and its dashboard read them with Metrics Insights queries, and
tests/unit/test_dashboard.py checks every metric they name against what the functions
emitted in the scenario replays.
"""

import os

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit, single_metric

logger = Logger()
tracer = Tracer()
metrics = Metrics()


def _disabled() -> bool:
    # `single_metric` does not honour POWERTOOLS_METRICS_DISABLED (the local runtime sets it).
    return os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() == "true"


def emit(name: str, value: float, unit: MetricUnit = MetricUnit.Count, **dimensions: str) -> None:
    """One value of `name` with its own dimensions (one EMF blob: a blob carries one value
    per dimension set)."""
    if _disabled():
        return
    with single_metric(name=name, unit=unit, value=value, namespace=metrics.namespace) as metric:
        for key, dimension in dimensions.items():
            metric.add_dimension(name=key, value=str(dimension))


def emit_oldest_waits(oldest_wait_s: dict[str, float], **dimensions: str) -> None:
    """`OldestPendingWaitSeconds` per tier (and `dimensions`, e.g. the pool): the wait alarm
    reads it for the tiers it watches."""
    for tier, seconds in oldest_wait_s.items():
        emit("OldestPendingWaitSeconds", seconds, MetricUnit.Seconds, Tier=tier, **dimensions)


def emit_counts(name: str, dimension: str, counts: dict[str, int], **dimensions: str) -> None:
    """One count per value of `dimension` (e.g. reconcile's repairs per `Repair` kind)."""
    for value, count in counts.items():
        emit(name, count, MetricUnit.Count, **{dimension: value}, **dimensions)
