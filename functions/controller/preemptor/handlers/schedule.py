"""Schedule workflow steps: plan a pool (under its lease), and finish the cycle."""

import time
from collections import Counter

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..service import scheduling
from .observability import emit, emit_counts, emit_oldest_waits, logger, tracer
from .steps import FinishCycle, PlanCycle, step_input
from .wiring import deps


@logger.inject_lambda_context(correlation_id_path="pool", clear_state=True)
@tracer.capture_lambda_handler
@step_input(PlanCycle)
def plan(step: PlanCycle, context: LambdaContext) -> dict:
    """Input {"pool", "owner", "cycle"}; output the cycle: admissions, preemptions, waiting jobs."""
    d = deps()
    started = time.perf_counter()
    result = scheduling.plan_cycle(
        store=d.store,
        settings=d.settings,
        pool_name=step.pool,
        owner=step.owner,
        now=clock.CLOCK.now(),
        cycle=step.cycle,
        checkpoints=d.checkpoints,  # ahead-of-time checkpoint requests (issue 10)
        alerts=d.alerts,  # the notices of the preemptions it calls off
    )
    latency_ms = (time.perf_counter() - started) * 1000
    logger.info("planned", extra=result.to_dict())
    _emit_cycle(result, latency_ms)
    return result.to_dict()


def _emit_cycle(result: scheduling.CycleResult, latency_ms: float) -> None:
    """What the dashboard and the alarms read of one cycle of one pool."""
    pool = result.pool
    if not result.locked:
        return  # another cycle holds the pool: it reports
    emit("PlanLatency", latency_ms, MetricUnit.Milliseconds, Pool=pool)
    emit_oldest_waits(result.oldest_wait_s, Pool=pool)
    emit_counts("QueueDepth", "Tier", result.depth_by_tier, Pool=pool)
    emit("Admissions", len(result.admits), Pool=pool)
    emit("CheckpointWaitsCut", len(result.wait_cuts), Pool=pool)
    emit("PreemptionsCalledOff", len(result.called_off), Pool=pool)
    new_victims = [p for p in result.preemptions if "lost_gpu_seconds" in p]  # a retried step hands back its earlier ones
    emit_counts("Preemptions", "Reason", Counter(p.get("reason", "unknown") for p in new_victims), Pool=pool)
    # A retried step hands back its earlier victims without a figure: counted once.
    emit("LostGpuSecondsPlanned", sum(p["lost_gpu_seconds"] for p in new_victims), Pool=pool)
    for victim in new_victims:
        if "checkpoint_age_s" in victim:
            emit("CheckpointAgeAtPreemption", victim["checkpoint_age_s"], MetricUnit.Seconds, Pool=pool)
    if result.used_gpus is not None and result.capacity_gpus:
        emit("PoolUsedGpus", result.used_gpus, Pool=pool)
        emit("PoolCapacityGpus", result.capacity_gpus, Pool=pool)
        # GPUs the pool is configured for that the account's quota does not leave it (the alarm's)
        emit("QuotaShortfallGpus", result.quota_shortfall_gpus, Pool=pool)
        idle = max(0, result.capacity_gpus - result.used_gpus) if result.waiting else 0
        emit("IdleGpusWhileWaiting", idle, Pool=pool)


@logger.inject_lambda_context(correlation_id_path="pool", clear_state=True)
@tracer.capture_lambda_handler
@step_input(FinishCycle)
def finish(step: FinishCycle, context: LambdaContext) -> dict:
    """Input {"pool", "owner", "cycle"?}; output {"rerun": bool, "released": [job, ...],
    "preemptions": [victim, ...], ...}."""
    d = deps()
    return scheduling.finish_cycle(
        store=d.store, pool_name=step.pool, owner=step.owner, cycle=step.cycle, now=clock.CLOCK.now(), settings=d.settings
    )
