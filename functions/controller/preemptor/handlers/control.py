"""Job control steps of the workflows: launch (and giving it up), stop, run state, requeue, interrupt, spare, finish."""

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from .. import clock
from ..adapters.workflows import execution_name, settled_schedule
from ..service import actions, reconcile
from .observability import emit, logger, metrics, tracer
from .steps import ControlStep, Finish, GiveUpLaunch, Interrupt, Launch, Requeue, RunState, Spare, Stop, step_input
from .wiring import deps


@logger.inject_lambda_context(correlation_id_path="job", clear_state=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
@step_input(ControlStep)
def handler(step, context: LambdaContext) -> dict:
    """One control step (see `steps.ControlStep`); each action is idempotent."""
    d = deps()
    now = clock.CLOCK.now()
    common = {"store": d.store, "job": step.job, "incarnation": step.incarnation}
    match step:
        case Launch():
            offerings = {p.name: p.offerings for p in d.settings.pools}
            pools = {p.name: p for p in d.settings.pools}
            result = actions.launch(**common, runners=d.runners, alerts=d.alerts, offerings=offerings, pools=pools, now=now)
            if result.get("attempts"):
                metrics.add_metric(name="LaunchesRefused", unit=MetricUnit.Count, value=1)
                logger.warning("launch refused", extra=result)
            if result.get("failed"):
                metrics.add_metric(name="JobsFailedToLaunch", unit=MetricUnit.Count, value=1)
            if result.get("relaunch"):
                emit("Relaunches", 1, Pool=result["pool"])
            if result.get("reason") == "no-capacity":
                emit("CapacityWaits", 1, Pool=result["pool"])
            return result
        case GiveUpLaunch(error=error):
            offerings = {p.name: p.offerings for p in d.settings.pools}
            result = reconcile.launch_gave_up(d.store, d.runners, offerings, step.job, step.incarnation, error, now)
            if result.get("pool"):
                emit("LaunchesGivenUp", 1, Pool=result["pool"])
            return result
        case Stop(fresh=fresh, since=since):
            result = actions.stop(**common, runners=d.runners, fresh=fresh, now=now, since=since, policy=d.settings.policy)
            if result.get("stopping") and not result.get("fresh", fresh):
                metrics.add_metric(name="StopsWithoutFreshCheckpoint", unit=MetricUnit.Count, value=1)
            return result
        case RunState():
            return actions.run_state(**common, runners=d.runners)
        case Requeue(fresh=fresh, phase=phase):
            result = actions.requeue(**common, policy=d.settings.policy, fresh=fresh, phase=phase, now=now, alerts=d.alerts)
            if "lost_gpu_seconds" in result:  # requeued, or an adopted run ended
                emit("LostGpuSeconds", result["lost_gpu_seconds"], Pool=result["pool"])
            return _with_schedule(result, step, d.settings.settle_s)
        case Interrupt(reason=reason, execution=execution):
            return actions.interrupt(**common, reason=reason, now=now, execution=execution)
        case Spare(why=why, since=since):
            return actions.spare(**common, policy=d.settings.policy, why=why, now=now, since=since)
        case Finish(outcome=outcome, reason=reason):
            result = actions.finish(**common, policy=d.settings.policy, outcome=outcome, reason=reason, now=now, alerts=d.alerts)
            if result.get("reason") == "no-capacity":
                emit("CapacityWaits", 1, Pool=result["pool"])
            return _with_schedule(result, step, d.settings.settle_s)


def _with_schedule(result: dict, step: Finish | Requeue, settle_s: float) -> dict:
    """The schedule execution that plans the pool after the step (`result["schedule"]`,
    which the workflow starts when GPUs were freed): the one of the settle window the clock
    is in now that the release is written, so runs that end together (jobs of one length, a
    spot reclaim of several instances) are planned as one. Planned one by one, the first
    plans relaunch small jobs into GPUs a large one is still short of, and a later plan of
    the same moment preempts them for it."""
    if result.get("pool"):
        own = execution_name("released", step.job, str(step.incarnation))
        result["schedule"] = settled_schedule(result["pool"], clock.CLOCK.now(), settle_s, own)
    return result
