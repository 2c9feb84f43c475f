"""Level-triggered safety net: repair what missed events, failed workflows or manual actions
left behind. Runs on a schedule.

Every repair is one `Repair` kind (a stable string): it is written to the decision log of
the job it concerns (pool-level repairs have no job: they are in the result, which the
handler logs and counts per kind). One job's failure (a checkpoint location that does not
exist, a run the service refuses to describe) is recorded as an error of that job and the
run goes on with the others.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from ..adapters.alerts import Alerts
from ..adapters.checkpoints import CheckpointStore
from ..adapters.errors import NO_ANSWER
from ..adapters.quotas import AccountQuotas
from ..adapters.runners import BatchRunner, Runner, RunState
from ..adapters.store import JobsStore, LogLine
from ..adapters.workflows import WorkflowStarter, execution_name
from ..config import Settings
from ..core import events as ev
from ..core.errors import ConflictError, PreemptorError, ServiceJobNotFound
from ..core.model import JobState
from ..core.pools import describe_offering, queue_name, quota_name
from . import actions
from .intake import Intake, controllers_job
from .scheduling import LEASE_TTL_S, oldest_wait_by_tier, preemption_names

STUCK_ADMISSION_S = 30 * 60  # the launch step retries for minutes, not half an hour
# A plan step's retries and the start of its victims' workflows take a few minutes at most.
PREEMPT_START_GRACE_S = 5 * 60
PREEMPT_WORKFLOW_ATTEMPTS = 3  # a victim's preempt workflow, started again after it failed
STOP_TIMED_OUT = "StopTimedOut"  # the preempt workflow's error when the run outlived its stop wait
UNKNOWN_RUN_GRACE_S = 10 * 60  # a run younger than this may be a launch still being recorded
# Reconcile takes its second look at what failed (a job's check, a queue's listing, a run's
# check) only with this much of the invocation left: the longest one call may take through
# its retries (`wiring.attempts_end_within`).
SECOND_LOOK_WITHIN_S = 45.0
# Beyond the policy's checkpoint and stop waits, what a preemption may take in retries with
# backoff (six attempts of at most 60 s per step) before it counts as stuck.
PREEMPTION_SLACK_S = 15 * 60
# Ended runs folded per pool and run (the rest at the next run, five minutes later).
FOLDS_PER_RUN = 200
# A notice's writer publishes it right after its change: one older than this was not.
NOTICE_GRACE_S = 60
NOTICES_PER_RUN = 200
# A quota below a pool is noted for actions.QUOTA_MEMORY_S; each pass reads it again, and
# renews the note when it would end before the pass after next (or its value changed).
QUOTA_RENEW_WITHIN_S = 15 * 60


class Repair(StrEnum):
    """What reconcile repaired (the metric's `Repair` dimension, the decision log's reason)."""

    MISSED_END = "missed-end"  # the run ended and no event told us: outcome recorded, GPUs freed
    MISSED_SPOT_INTERRUPTION = "missed-spot-interruption"  # managed spot took its instances, untold: its loss counted
    MISSED_SPOT_RESTART = "missed-spot-restart"  # managed spot restarted it, untold: its work at risk again
    STUCK_ADMISSION_RELEASED = "stuck-admission-released"  # admitted, never launched: back in the queue
    STUCK_ADMISSION_RECORDED = "stuck-admission-recorded"  # launched, never recorded: its run recorded
    STUCK_PREEMPTION_REQUEUED = "stuck-preemption-requeued"  # stopped, never requeued
    PREEMPTION_STARTED = "preemption-workflow-started"  # marked a victim, its workflow never started
    PREEMPTION_RESTARTED = "preemption-workflow-restarted"  # its workflow failed: started again
    STUCK_PREEMPTION_SPARED = "stuck-preemption-spared"  # still running past every wait: left running
    POOL_NOT_CONFIGURED = "pool-not-configured"  # its pool left the configuration: kept pending
    ORPHANED_LEASE_CLEARED = "orphaned-lease-cleared"  # a holder died with the pool's lease
    USAGE_RECOUNTED = "usage-recounted"  # the pool's used GPUs drifted from its holders
    UNKNOWN_RUN_STOPPED = "unknown-run-stopped"  # a managed run no job accounts for: stopped
    RUN_ADOPTED = "run-adopted"  # a team's tagged run whose events never came: adopted, counted
    STUCK_RUNNABLE_REQUEUED = "stuck-runnable-requeued"  # a Batch run found no capacity: a capacity wait
    NOTICE_PUBLISHED = "notice-published"  # a team's notice its writer did not publish
    QUOTA_RAISED = "quota-raised"  # the quota a launch met covers the pool now: planned at its size again
    QUOTA_CHANGED = "quota-changed"  # the quota a launch met is another value, still below the pool
    QUOTA_FORGOTTEN = "quota-forgotten"  # a quota no longer of the pool's offering


class QuotaNotListed(PreemptorError):
    """Service Quotas lists no applied value of the quota a launch met."""


# Repairs that free or take no capacity by themselves (a missed end does when it releases).
_NOTHING_TO_PLAN = frozenset({Repair.MISSED_END.value, Repair.MISSED_SPOT_INTERRUPTION.value, Repair.MISSED_SPOT_RESTART.value})


def reconcile(
    *,
    store: JobsStore,
    runners: dict[str, Runner],
    workflows: WorkflowStarter,
    checkpoints: CheckpointStore,
    settings: Settings,
    now: float,
    alerts: Alerts | None = None,
    quotas: AccountQuotas | None = None,
    time_left: Callable[[], float] = lambda: float("inf"),
) -> dict:
    """Repair every configured pool, then the jobs of pools that left the configuration.
    `alerts`: the topic the notices their writers did not publish go to; `quotas`: where the
    quotas a launch met are read again (`_reread_quota`); `time_left`: the seconds left to
    the invocation (the Lambda context's).

    Returns {"repairs": [...], "errors": [...], "oldest_wait_s": {tier: s}}: each repair
    with its `repair` kind, each error with the job and the error's type.
    """
    repairs: list[dict] = []
    errors: list[dict] = []
    oldest: dict[str, float] = {}
    for pool in settings.pools:
        try:
            _reconcile_pool(store, runners, workflows, checkpoints, settings, pool, now, repairs, errors, oldest, alerts, quotas, time_left)
        except Exception as error:  # noqa: BLE001 - one pool's failure (throttled, say) never stops the others
            errors.append({"pool": pool.name, "error": type(error).__name__, "detail": str(error)[:500]})
    try:
        # A run this pass has just stopped is still live for a while (its grace): not unknown.
        stopped = {r["run_id"] for r in repairs if r.get("repair") == Repair.STUCK_RUNNABLE_REQUEUED.value and r.get("run_id")}
        adopt = _adopter(store, runners, workflows, checkpoints, settings, alerts, now)
        repairs += _stop_unknown_runs(store, runners, settings, now, errors, stopped, adopt, time_left)
    except Exception as error:  # noqa: BLE001 - retried at the next run
        errors.append({"pool": "*", "part": "unknown-runs", "error": type(error).__name__, "detail": str(error)[:500]})
    configured = {p.name for p in settings.pools}
    try:
        for name in sorted(store.known_pools() - configured):
            repairs += _keep_waiting_for_a_removed_pool(store, settings, name, now)
            # What the pool's last jobs left to be done after them still is: the ends of
            # their runs are folded, the notices their writers did not publish published.
            _fold_ended_runs(store, settings, name)
            repairs += _publish_notices(store, alerts, name, now)
    except Exception as error:  # noqa: BLE001 - retried at the next run
        errors.append({"pool": "*", "part": "removed-pools", "error": type(error).__name__, "detail": str(error)[:500]})
    return {"repairs": repairs, "errors": errors, "oldest_wait_s": oldest}


def _reconcile_pool(
    store, runners, workflows, checkpoints, settings, pool, now, repairs, errors, oldest, alerts, quotas=None, time_left=lambda: float("inf")
) -> None:
    """One pool: its registration, an orphaned lease, the quota a launch met, every active
    job's run, the fold of ended runs into the teams' usage, the notices their writers did
    not publish, the usage recount, and a schedule when anything changed or work waits.

    Each part goes on when another fails (a throttled write of the pool's registration must
    not leave a stuck preemption unrepaired for another five minutes): its error is recorded
    with the part's name, and the next run tries it again. A queue that could not be read is
    planned anyway (a cycle with nothing to do costs one plan)."""

    def part(name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - one part's failure never skips the others
            errors.append({"pool": pool.name, "part": name, "error": type(error).__name__, "detail": str(error)[:500]})
            return None

    part("registration", lambda: (store.ensure_pool(pool.name, pool.capacity_gpus), store.register_pool(pool.name)))
    cleared = part("lease", lambda: store.clear_expired_lease(pool.name, now))
    if cleared:
        repairs.append({"pool": pool.name, "repair": Repair.ORPHANED_LEASE_CLEARED.value, "holder": cleared})
    schedule = False
    if quotas is not None and pool.service == "sagemaker":
        quota = part("quota", lambda: _reread_quota(store, quotas, pool, now))
        if quota:
            repairs.append(quota)
            schedule = quota["repair"] != Repair.QUOTA_CHANGED.value or quota["gpus"] > quota["was_gpus"]

    def check(record, said: list[dict]) -> bool:
        """Repair the job's run (`_check_run`), or refresh its checkpoint; False when it failed
        (the error in `said`)."""
        nonlocal schedule
        try:
            found = _check_run(store, runners, workflows, settings, record, now)
            if not found and record.status is JobState.RUNNING and record.checkpoint_s3_uri:
                _refresh_checkpoint(store, checkpoints, record)
        except Exception as error:  # noqa: BLE001 - the safety net goes on with the other jobs
            said.append({"job": record.name, "pool": pool.name, "error": type(error).__name__, "detail": str(error)[:500]})
            return False
        for repair in found:
            repairs.append(repair)
            schedule = schedule or repair["repair"] not in _NOTHING_TO_PLAN or repair.get("released", False)
            if repair.get("wait_s"):
                # A capacity wait: plan the pool again once its backoff is over.
                part("backoff", lambda: workflows.start(
                    "schedule", execution_name("backoff", record.name, f"{int(now)}"), {"pool": pool.name, "wait_s": repair["wait_s"]}
                ))
        return True

    # A job whose check failed gets a second look at the end of the jobs, read again (its
    # first look may have changed it), as the scan for unknown runs does: a run's end whose
    # event was lost is otherwise told 5 minutes later at best.
    failed: list[dict] = []
    again = [record.name for record in part("jobs", lambda: store.active(pool.name)) or () if not check(record, failed)]
    if again and time_left() < SECOND_LOOK_WITHIN_S:
        errors += failed  # too little time left: the next pass's
    elif again:
        for name in again:
            record = part("jobs", lambda: store.get(name))
            if record is not None and record.pool == pool.name and record.status.holds_capacity:
                check(record, errors)
    part("fold", lambda: _fold_ended_runs(store, settings, pool.name))
    repairs += part("notices", lambda: _publish_notices(store, alerts, pool.name, now)) or []
    recount = part("recount", lambda: _recount_usage(store, pool.name, now)) or {}
    if recount.get("repair"):
        repairs.append(recount)
    pending = part("queue", lambda: store.pending(pool.name, settings.pending_window))
    for tier, wait in oldest_wait_by_tier(pending or [], settings.policy, now).items():
        oldest[tier] = max(oldest.get(tier, 0.0), wait)
    if pending is None or pending or schedule or recount.get("rerun"):
        part("schedule", lambda: workflows.start("schedule", execution_name("reconcile", pool.name, f"{int(now)}"), {"pool": pool.name}))


def _reread_quota(store: JobsStore, quotas: AccountQuotas, pool, now: float) -> dict | None:
    """The quota a launch of `pool` met, below the pool (`actions._learn_quota`), read again
    from Service Quotas by the name the refusal gave it.

    Forgetting it after its memory alone would plan the pool at its configured size while
    the account still cannot have it: a job larger than the quota would preempt the pool's
    work for GPUs it cannot launch into, once an hour, as long as it waits. So:
    - raised to cover the pool: forgotten (planned at its size again; the pool is planned);
    - still below: noted again, for another memory, when the note would end before the pass
      after next or the value changed (a write to the pool item cancels an admission under
      way: not at every pass);
    - not listed, or not readable (QuotaNotListed, or the call's error, is the pass's error):
      kept at the value last known, noted again before its memory ends (forgotten unread, it
      brought that hourly churn back for as long as the quota could not be read); the
      `quota-below-pool` alarm stays on, and an operator who had it raised says so
      (`ops.quota_raised`, `preemptor quota-raised`);
    - no longer the quota of the pool's offering (its configuration changed): forgotten.
    Returns the repair, or None when there was nothing to do."""
    noted = store.noted_quota(pool.name)
    if noted is None:
        return None
    name, was = noted["quota"], noted["gpus"]
    repair = {"pool": pool.name, "quota": name, "was_gpus": was}
    if len(pool.offerings) != 1 or quota_name(pool.offerings[0]) != name:
        store.forget_quota(pool.name, noted)
        return {**repair, "repair": Repair.QUOTA_FORGOTTEN.value, "gpus": pool.capacity_gpus, "why": "not the quota of the pool's offering"}
    try:
        value = quotas.applied("sagemaker", name)
        if value is None:
            raise QuotaNotListed(f"Service Quotas lists no applied value of '{name}'")
    except PreemptorError:
        if noted["until"] - now <= QUOTA_RENEW_WITHIN_S:
            # Kept at what was last known, unless forgotten (or noted again) since it was read
            store.note_quota(pool.name, was, now + actions.QUOTA_MEMORY_S, name, over=noted)
        raise
    instances = int(value)
    gpus = instances * pool.gpus_per_instance
    if gpus >= pool.capacity_gpus:
        if not store.forget_quota(pool.name, noted):
            return None  # a launch noted it again meanwhile: the newer word stands
        return {**repair, "repair": Repair.QUOTA_RAISED.value, "gpus": pool.capacity_gpus, "instances": instances}
    if gpus == was and noted["until"] - now > QUOTA_RENEW_WITHIN_S:
        return None
    if not store.note_quota(pool.name, gpus, now + actions.QUOTA_MEMORY_S, name, over=noted):
        return None  # forgotten (the operator's word) or noted again meanwhile: that stands
    if gpus == was:
        return None  # the same quota, remembered longer: nothing repaired
    return {**repair, "repair": Repair.QUOTA_CHANGED.value, "gpus": gpus, "instances": instances}


def _stop_unknown_runs(
    store: JobsStore,
    runners: dict[str, Runner],
    settings: Settings,
    now: float,
    errors: list[dict],
    stopped: set[str] = frozenset(),
    adopt: Callable[[str, Any], dict | None] | None = None,
    time_left: Callable[[], float] = lambda: float("inf"),
) -> list[dict]:
    """Stop every live run the controller launched that no job accounts for; adopt (with
    `adopt`) every run a team launched and tagged whose events never reached the intake.

    Such a run holds GPUs the pools do not count (a launch whose record was lost, a run of
    an incarnation the job has left behind, a job that ended or was never stored): left
    alone, the pool is oversubscribed. A run is accounted for when it is its job's current
    run (a RUNNING or PREEMPTING job of the same incarnation and run id), or a run of the
    job's current incarnation that the job will take up (ADMITTED or PENDING: the launch
    finds it by name or tags and uses it instead of starting another). Runs younger than
    UNKNOWN_RUN_GRACE_S are left to the launch recording them (or, a team's, to its events);
    runs without the managed tag are not the controller's to stop (IAM would refuse it), nor
    a team's own run, managed tag or not: that is adopted, as its events would have. Tags
    are read only for runs the table cannot place.

    Batch runs are listed in the pools' queues and in every queue that shares a compute
    environment with one (`_sharing_queues`): a team's run there holds the pool's GPUs.
    """
    queues: dict[str, set[str | None]] = {}
    for pool in settings.pools:
        if pool.service == "batch":
            queues.setdefault(pool.service, set()).update([pool.job_queue, *pool.fallback_job_queues])
        else:
            queues.setdefault(pool.service, set()).add(None)
    # A look-up, a queue's listing or a run's check that fails is tried once more at the
    # end of the pass, after the others: a throttled or unanswered call is most often
    # answered a moment later, and what is left to the next pass goes uncounted 5 minutes
    # more. Under the sweep's chaos a team's lost Batch run took up to 7 passes to adopt,
    # and once 14 (batch knobs seed 1165): a pass's look at it is ~6 calls for its queue and
    # ~8 for the run, any of which may fail. One queue refused never ends the scan of the
    # others (it did: knobs seed batch 1478).
    own_batch = frozenset(queues.get("batch", ()))
    sharing = "batch" in queues and adopt is not None  # the queues sharing the pools' compute environments are still to find
    repairs: list[dict] = []
    listing = [(service, queue) for service, service_queues in sorted(queues.items()) for queue in sorted(service_queues, key=str)]
    checking: list[tuple[str, Any]] = []
    failed: list[dict] = []  # the first round's errors: the pass's own unless tried again
    for last in (False, True):
        if last and (listing or checking or sharing) and time_left() < SECOND_LOOK_WITHIN_S:
            errors += failed  # too little time left for a second look: the next pass's
            break
        said = errors if last else failed
        if sharing:
            shared = _sharing_queues(runners["batch"], own_batch, said)
            sharing = shared is None
            listing += [("batch", queue) for queue in sorted(shared or ())]
        unlisted = []
        for service, queue in listing:
            try:
                runs = runners[service].live_runs(queue)
            except Exception as error:  # noqa: BLE001 - one queue's listing never stops the scan
                unlisted.append((service, queue))
                said.append({"pool": "*", "part": "unknown-runs", "queue": queue or service, "error": type(error).__name__, "detail": str(error)[:500]})
                continue
            checking += [(service, run) for run in runs if now - run.created_at >= UNKNOWN_RUN_GRACE_S and run.run_id not in stopped]
        checking = _check_live_runs(store, runners, settings, now, said, checking, adopt, repairs)
        listing = unlisted
    return repairs


def _check_live_runs(
    store: JobsStore,
    runners: dict[str, Runner],
    settings: Settings,
    now: float,
    errors: list[dict],
    runs: list[tuple[str, Any]],
    adopt: Callable[[str, Any], dict | None] | None,
    repairs: list[dict],
) -> list[tuple[str, Any]]:
    """`_check_live_run` each of `runs` ((service, run) pairs), adding its repair to
    `repairs`; returns the runs whose check failed, each said in `errors`."""
    failed = []
    for service, run in runs:
        try:
            repair = _check_live_run(store, runners[service], service, run, now, settings.controller, adopt, settings.other_controllers)
        except Exception as error:  # noqa: BLE001 - one run's failure never stops the scan
            failed.append((service, run))
            errors.append({"run": run.run_id, "error": type(error).__name__, "detail": str(error)[:500]})
            continue
        if repair:
            repairs.append(repair)
    return failed


def _sharing_queues(runner: BatchRunner, own: frozenset[str | None], errors: list[dict]) -> set[str] | None:
    """The job queues of the account, other than the pools' (`own`), that share a compute
    environment with one of them; None when Batch refuses the look-up (said in `errors`:
    the pools' own queues are scanned all the same)."""
    try:
        environments = runner.compute_environments()
    except PreemptorError as error:
        errors.append({"run": "", "error": type(error).__name__, "detail": f"job queues sharing the pools' compute environments: {error}"[:500]})
        return None
    names = {queue_name(q) for q in own if q}
    shared = frozenset().union(*(environments.get(q, frozenset()) for q in names))
    return {q for q, ces in environments.items() if q not in names and ces & shared}


def _check_live_run(
    store: JobsStore,
    runner: Runner,
    service: str,
    run,
    now: float,
    controller: str = "",
    adopt: Callable[[str, Any], dict | None] | None = None,
    others: frozenset[str] = frozenset(),
) -> dict | None:
    known = store.find_run(service, run.run_id)
    if known:
        record = store.get(known[0])
        if record and record.incarnation == known[1] and record.run_id == run.run_id and record.status.holds_capacity:
            return None
    tags = runner.tags_of(run)
    if ev.other_controller(tags, controller) in others:
        return None  # a second stack's run (OtherControllers): its own controller accounts for it (and IAM keeps ours off it)
    claimed = ev.launched_by_controller(tags, controller)
    record = controllers_job(store, tags, run.run_name, controller)  # None: not a run the controller launched
    if record is None:
        # A team's own run (the controller launched no such run, whatever its tags claim):
        # never stopped as unknown. Known (adopted) or not the scheduler's (no preemptor
        # tags), it is left alone; otherwise its events never came, and it is adopted as
        # they would have. Only a run whose tags claim it is the controller's, and let no
        # one adopt it, is stopped (it is tagged managed), as a run of the controller's that
        # no job accounts for would be.
        adoptable = {ev.PRIORITY_TAG, ev.TEAM_TAG} <= set(tags)
        if adoptable and not known and adopt is not None:
            return adopt(service, run)
        if adoptable or not claimed:
            return None
        why = "the controller launched no such run"
    else:
        if tags.get(ev.INCARNATION_TAG) == str(record.incarnation):
            if record.status in (JobState.ADMITTED, JobState.PENDING):
                return None  # its launch takes this run up
            if record.run_id == run.run_id and record.status.holds_capacity:
                return None
        why = f"its job {record.name} is {record.status.value} on incarnation {record.incarnation}"
    try:
        runner.stop(run.run_id, "preemptor: reconcile: no job accounts for this run")
    except ServiceJobNotFound:
        return None  # ended meanwhile
    kind = Repair.UNKNOWN_RUN_STOPPED
    if record is not None:
        store.log(record.name, now, "unknown-run-stopped", kind.value, f"run {run.run_id} stopped: {why}", run=run.run_id)
    return {"pool": record.pool if record else tags.get(ev.POOL_TAG, ""), "repair": kind.value, "run": run.run_id, "job": tags.get(ev.JOB_TAG), "why": why}


def _fold_ended_runs(store: JobsStore, settings: Settings, pool: str) -> int:
    """Fold the pool's ended runs into their teams' usage, oldest end first, each exactly
    once whoever else folds (`store.fold_ended_run`). Until then the planner adds them as it
    reads (`store.team_usage`): this keeps what it reads to a few items. Returns how many."""
    half_life = settings.policy.for_pool(pool).fair_share.half_life_s
    return sum(store.fold_ended_run(run, half_life) for run in store.ended_runs(pool)[:FOLDS_PER_RUN])


def _publish_notices(store: JobsStore, alerts: Alerts | None, pool: str, now: float) -> list[dict]:
    """Forget the pool's notices their writers published; publish, then forget, those they
    did not (SNS refused them, or the function died after the change) once `NOTICE_GRACE_S`
    old, so as not to race a writer about to publish its own."""
    published = []
    for notice, sent in store.notices(pool)[:NOTICES_PER_RUN]:
        if not sent:
            if alerts is None or now - notice.at < NOTICE_GRACE_S or not alerts.send(notice):
                continue
            published.append({"pool": pool, "repair": Repair.NOTICE_PUBLISHED.value, "job": notice.job, "kind": notice.kind})
        store.forget_notice(notice)
    return published


def _recount_usage(store: JobsStore, pool: str, now: float) -> dict:
    """Recount the pool's usage under its lease (no admission can run meanwhile), from
    consistent reads, written only on a condition on what was observed (`store.recount_usage`).
    A plan that holds the lease is left alone: the recount waits for the next run."""
    owner = execution_name("reconcile", pool, f"{int(now)}")
    try:
        taken = store.acquire_lease(pool, owner, now, LEASE_TTL_S)
    except Exception:
        # It may be ours all the same (taken, and the answer and its read-back lost): given
        # back, or the pool waits for the lease to expire, every plan told that it is held.
        # The error reported is the taking's, whatever the giving back meets.
        with contextlib.suppress(Exception):
            store.release_lease(pool, owner)
        raise
    if not taken:
        return {"pool": pool, "recount": "pool-busy"}
    try:
        result = store.recount_usage(pool, now)
    finally:
        rerun = store.release_lease(pool, owner)
    out = {"pool": pool, "recount": result.reason, "rerun": rerun}
    if result.applied:
        out.update({"repair": Repair.USAGE_RECOUNTED.value, "from": result.stored, "to": result.counted})
    return out


def _refresh_checkpoint(store: JobsStore, checkpoints: CheckpointStore, record) -> None:
    """The safety net for S3 events that did not arrive (bucket not sending them to EventBridge)."""
    newest = checkpoints.newest(record.checkpoint_s3_uri)
    if newest is not None and (record.last_checkpoint_at is None or newest > record.last_checkpoint_at):
        store.note_checkpoint(record.name, newest)


def repair_stuck_admission(store: JobsStore, runner: Runner, offerings: tuple[str, ...], record, now: float) -> dict | None:
    """An admitted job whose launch never got recorded (its workflow died). If the launch
    created the run before it died, that run is the job's: recorded as running, its GPUs
    still counted (released, they would be given to others while it runs). Otherwise the job
    goes back to the queue. A run that already ended is recorded too (the next look records
    its end): released, the job would run its work again. A look-up AWS refuses (throttled,
    denied) raises: the job stays admitted, its GPUs counted, until a look-up can tell."""
    if record.status is not JobState.ADMITTED or now - (record.admitted_at or now) < STUCK_ADMISSION_S:
        return None
    return settle_admission(store, runner, offerings, record, now)


def settle_admission(
    store: JobsStore, runner: Runner, offerings: tuple[str, ...], record, now: float, gave_up: str | None = None, wait_s: float = 0.0
) -> dict | None:
    """An admitted job whose launch is over without being recorded: the run it created is
    recorded (`_record_found_run`), else the job goes back to the queue. `gave_up`: why the
    launch step gave up (its error), when it did: the job then waits until `now + wait_s`,
    so that the same trouble is not met again at once.
    Returns the repair, None when the job moved meanwhile. A look-up AWS refuses raises:
    the job stays admitted, its GPUs counted, until a look-up can tell."""
    run = runner.find_run(record, offerings, ended=True)
    if run is not None:
        return _record_found_run(store, record, run, offerings, now)
    changes: dict = {"status": JobState.PENDING, "admitted_at": None}
    if gave_up is not None:
        changes.update(not_before=now + wait_s, launches_given_up=record.launches_given_up + 1, last_launch_error=gave_up)
    kind = Repair.STUCK_ADMISSION_RELEASED
    if gave_up is not None:
        detail = f"its launch gave up ({gave_up}); back in the queue in {wait_s:.0f} s"
    else:
        detail = "admitted but never launched; back in the queue"
    line = LogLine(record.name, now, "admission-released", "launch-gave-up" if gave_up is not None else kind.value, detail)
    try:
        store.transition(record, record.with_changes(**changes), [JobState.ADMITTED], usage_delta=-record.gpus, log=line)
    except ConflictError:
        return None
    out = {"job": record.name, "pool": record.pool, "repair": kind.value}
    # Whole seconds, rounded up, for the workflow's wake-up (a Wait state's SecondsPath).
    return {**out, "not_before": now + wait_s, "wait_s": math.ceil(wait_s)} if gave_up is not None else out


def launch_gave_up(
    store: JobsStore, runners: dict[str, Runner], offerings: dict[str, tuple[str, ...]], job: str, incarnation: int, error: str, now: float
) -> dict:
    """The schedule workflow's launch step gave up (throttling, 5xx or a dying Lambda through
    every retry): the admission is settled now rather than by reconcile half an hour later
    (`settle_admission`), the job queued again after `actions.gave_up_backoff_s`. A job that
    is no longer this incarnation's admission (launched, cancelled, requeued) is left alone."""
    record = store.require(job)
    if record.incarnation != incarnation or record.status is not JobState.ADMITTED:
        return {"released": False, "reason": "not-admitted"}
    wait = actions.gave_up_backoff_s(record.name, record.launches_given_up + 1)
    runner, pool_offerings = runners[record.service], offerings.get(record.pool, ())
    repair = settle_admission(store, runner, pool_offerings, record, now, gave_up=error, wait_s=wait)
    if repair is None:
        return {"released": False, "reason": "conflict"}
    return {"released": repair["repair"] == Repair.STUCK_ADMISSION_RELEASED.value, **repair}


def _record_found_run(store: JobsStore, record, run, offerings: tuple[str, ...], now: float) -> dict | None:
    """Recorded as the launch would have: on the offering the run is on when the pool
    chooses among several (a run that meets no capacity there marks it unavailable, and a
    Batch run stuck RUNNABLE is judged by its own queue)."""
    offering = run.offering if len(offerings) > 1 and run.offering in offerings else None
    new = actions.running_on(record, run.run_id, min(run.created_at, now) if run.created_at else now, offering)
    kind = Repair.STUCK_ADMISSION_RECORDED
    where = "" if not run.offering else f" in {run.offering}" if record.service == "batch" else f" on {describe_offering(run.offering)}"
    line = LogLine(
        record.name, now, "relaunched" if record.incarnation > 1 else "launched", kind.value,
        f"{new.run_name} was created by a launch that died before recording it; found in {record.service}{where} and recorded",
        {"run": run.run_id, "instance_type": offering},
    )
    try:
        store.transition(record, new, [JobState.ADMITTED], alias=True, log=line)
    except ConflictError:
        return None  # it moved meanwhile: judged on the next run
    return {"job": record.name, "pool": record.pool, "repair": kind.value, "run": run.run_id}


def preemption_deadline_s(settings: Settings, pool: str) -> float:
    """How long a preemption may take before reconcile calls it stuck: the policy's
    checkpoint wait and stop wait, plus the steps' retries."""
    knobs = settings.policy.for_pool(pool)
    return knobs.checkpoint_wait_max_s + knobs.stop_wait_max_s + PREEMPTION_SLACK_S


# The state-change event a run's description stands in for, per service.
_STATE_CHANGE = {"sagemaker": ("aws.sagemaker", "SageMaker Training Job State Change"), "batch": ("aws.batch", "Batch Job State Change")}


def _adopter(store, runners, workflows, checkpoints, settings, alerts, now: float) -> Callable[[str, Any], dict | None]:
    """Adopts a live run a team launched and tagged whose events never reached the intake
    (all dead-lettered, or lost): its description goes through the intake as the event it
    stands in for (its id names the run and its status, so a later pass meets a status it
    has not seen: a Batch run adopted once RUNNING), so it is judged as its event would
    have been (the tags' claims, its demand, its checkpoint location)."""
    intake = Intake(
        store=store, workflows=workflows, runners=runners, settings=settings, alerts=alerts, clock=lambda: now, checkpoints=checkpoints
    )
    # One claim token for the pass: the second look at a run whose first adoption died (its
    # claim's release refused too) takes that claim back instead of meeting EventInProgress.
    owner = uuid.uuid4().hex

    def adopt(service: str, run) -> dict | None:
        detail = runners[service].described(run)
        if detail is None:
            return None  # gone meanwhile
        status = detail.get("TrainingJobStatus") or detail.get("status") or ""
        source, detail_type = _STATE_CHANGE[service]
        event = {
            "version": "0", "id": f"reconcile-{service}-{run.run_id}-{status}", "detail-type": detail_type, "source": source,
            "account": "", "time": None, "region": "", "resources": [run.arn] if run.arn else [], "detail": detail,
        }
        result = intake.handle(event, now, owner)
        if result.reason != "adopted":
            return None  # not running yet, refused (its tags unreadable) or adopted meanwhile
        found = store.get(result.job) if result.job else None
        if found is not None and found.status is JobState.RUNNING and found.checkpoint_s3_uri:
            # Adopted late, it has run a while: its newest checkpoint is read now, not at the
            # next pass (until then its plan counted all its work since its start at risk)
            # (S3 refused it, or did not answer: the next pass's refresh reads it)
            with contextlib.suppress(PreemptorError, *NO_ANSWER):
                _refresh_checkpoint(store, checkpoints, found)
        return {
            "pool": found.pool if found else "", "repair": Repair.RUN_ADOPTED.value, "run": run.run_id, "job": result.job,
            **({"refused": result.refused} if result.refused else {}),
        }

    return adopt


def _check_run(store: JobsStore, runners: dict[str, Runner], workflows: WorkflowStarter, settings: Settings, record, now: float) -> list[dict]:
    if not record.run_id:
        pool = settings.pool(record.pool)
        repair = repair_stuck_admission(store, runners[record.service], pool.offerings if pool else (), record, now)
        return [repair] if repair else []
    try:
        state = runners[record.service].state(record.run_id)
    except ServiceJobNotFound:
        state = None
    alive = state is not None and not state.ended
    told = _missed_managed_spot(store, record, state, now) if alive else []
    if told:
        record = store.get(record.name)
        if record is None or record.run_id != told[0]["run_id"] or record.status.is_terminal:
            return told  # moved meanwhile: judged at the next run
    repair = _judge_run(store, runners, workflows, settings, record, state, alive, now)
    return told + ([repair] if repair else [])


def _missed_managed_spot(store: JobsStore, record, state: RunState, now: float) -> list[dict]:
    """SageMaker managed spot's changes of a live run whose events never came (dead-lettered,
    say), as DescribeTrainingJob tells them: the last interruption and the last restart,
    oldest first, each accounted as its event would have (`actions.managed_spot`, which adds
    nothing for one already told). Without it a missed restart would hold the run paused
    while it trains: stopped as if nothing were at risk, its work since the restart lost
    without the checkpoint the policy demands."""
    changes = sorted(
        (at, interrupted) for at, interrupted in ((state.spot_interrupted_at, True), (state.spot_restarted_at, False))
        if at is not None and record.started_at is not None and at >= record.started_at
    )
    told, run_id = [], record.run_id
    for at, interrupted in changes:
        outcome, _ = actions.managed_spot(
            store=store, record=record, interrupted=interrupted, at=at, now=now, told_by=" (reconcile: its event never came)"
        )
        if outcome != "accepted":
            continue
        kind = Repair.MISSED_SPOT_INTERRUPTION if interrupted else Repair.MISSED_SPOT_RESTART
        told.append({"job": record.name, "pool": record.pool, "repair": kind.value, "run_id": run_id, "at": at})
        record = store.get(record.name)
        if record is None or record.run_id != run_id:
            break  # the job left the run these changes are of
    return told


def _judge_run(
    store: JobsStore, runners: dict[str, Runner], workflows: WorkflowStarter, settings: Settings, record, state: RunState | None, alive: bool,
    now: float,
) -> dict | None:
    if record.status is JobState.PREEMPTING:
        if now - (record.preempting_since or now) < preemption_deadline_s(settings, record.pool):
            return _start_orphaned_preemption(store, workflows, settings, record, now)  # None: its execution is on it
        if alive:
            return _spare_stuck_victim(store, settings, record, now)
        result = actions.requeue(
            store=store, policy=settings.policy, job=record.name, incarnation=record.incarnation, fresh=False, phase="stopped", now=now
        )
        return {"job": record.name, "pool": record.pool, "repair": Repair.STUCK_PREEMPTION_REQUEUED.value, **result}
    if alive and record.status is JobState.RUNNING and state.service_status in BATCH_WAITING:
        return _check_runnable(store, runners, settings, record, state.service_status, now)
    if alive:
        return None
    if state is None:
        outcome, reason = "failed", "reconcile: run not found"
    else:
        # As the end event would have told it: a spot reclaim requeues, no capacity waits.
        outcome, why = actions.ended_outcome(record.service, state.phase, state.reason or state.service_status, None, record.cancel_requested)
        reason = f"reconcile: missed end event ({state.service_status}: {why})"
    result = actions.finish(store=store, policy=settings.policy, job=record.name, incarnation=record.incarnation, outcome=outcome, reason=reason, now=now)
    return {"job": record.name, "pool": record.pool, "repair": Repair.MISSED_END.value, **result}


# Batch statuses of a job that has not found its instances yet.
BATCH_WAITING = ("SUBMITTED", "PENDING", "RUNNABLE")


def _check_runnable(store: JobsStore, runners: dict[str, Runner], settings: Settings, record, status: str, now: float) -> dict | None:
    """A Batch run still waiting for instances past its pool's `runnable_timeout_s` met no
    capacity: it is terminated and the job waits out a backoff, then launches again (on the
    pool's next queue, when it has fallbacks: the queue is remembered as unavailable)."""
    pool = settings.pool(record.pool)
    waited = now - (record.started_at or now)
    if pool is None or waited < pool.runnable_timeout_s or record.adopted:
        # An adopted run back in its queue (Batch's next attempt) is its team's: the
        # controller holds no request to launch it again, and terminates none of it.
        return None
    queue = record.launched_instance_type or pool.job_queue
    store.log(
        record.name, now, "stuck-runnable", Repair.STUCK_RUNNABLE_REQUEUED.value,
        f"run {record.run_id} still {status} after {waited:.0f} s in {queue} (limit {pool.runnable_timeout_s} s): terminated",
    )
    result = actions.no_capacity_in_queue(store=store, runners=runners, record=record, reason=f"{status} for {waited:.0f} s in {queue}", now=now)
    return {"job": record.name, "pool": record.pool, "repair": Repair.STUCK_RUNNABLE_REQUEUED.value, "run_id": record.run_id, **result}


def _start_orphaned_preemption(store: JobsStore, workflows: WorkflowStarter, settings: Settings, record, now: float) -> dict | None:
    """A victim whose preempt workflow is not on it would hold its GPUs, and its preemptor
    waiting, until the preemption deadline (40 minutes with the default waits): its plan
    step failed for good after marking it (the workflow never started), or the workflow
    failed (its retries of a step ran out). Past PREEMPT_START_GRACE_S the workflow is
    started, under the name the plan gave it, or after a failed one under the next of
    PREEMPT_WORKFLOW_ATTEMPTS names; then the deadline's repair is all there is. A workflow
    that failed because the run outlived its stop wait is not started again (the stop would
    be waited out again): the deadline spares the victim."""
    if record.preempted_by in (None, actions.SPOT_INTERRUPTION) or record.preempting_since is None:
        return None  # a spot interruption's own workflow stops it
    if now - record.preempting_since < PREEMPT_START_GRACE_S:
        return None
    first, then = preemption_names(record.name, record.incarnation, record.preempting_since)
    names = [first] + [execution_name(first, f"a{n}") for n in range(2, PREEMPT_WORKFLOW_ATTEMPTS + 1)]
    for attempt, execution in enumerate(names, start=1):
        found = workflows.status("preempt", execution)
        if found is None:
            break
        status, error = found
        if status not in ("FAILED", "TIMED_OUT", "ABORTED") or error == STOP_TIMED_OUT:
            # On it; or ended without freeing it; or the stop it sent never took effect,
            # which a new attempt would wait out again: the deadline's repair spares it.
            return None
    else:
        return None
    payload = {
        "victim": {
            "job": record.name,
            "incarnation": record.incarnation,
            "preemptor": record.preempted_by,
            "reason": "preemption",
            "since": record.preempting_since,  # which preemption its steps act for (`actions.stop`)
        },
        "settings": settings.policy.workflow_settings(record.pool),
        "pool": record.pool,
        "then": then,
    }
    if workflows.start("preempt", execution, payload) is None:
        return None
    kind = Repair.PREEMPTION_STARTED if attempt == 1 else Repair.PREEMPTION_RESTARTED
    why = "its preempt workflow had not started" if attempt == 1 else f"its preempt workflow failed ({names[attempt - 2]})"
    store.log(record.name, now, "preemption-resumed", kind.value, f"{why}: started as {execution}")
    return {"job": record.name, "pool": record.pool, "repair": kind.value, "execution": execution}


def _spare_stuck_victim(store: JobsStore, settings: Settings, record, now: float) -> dict | None:
    """A victim still running past every wait: its stop was refused (IAM, a service error)
    or never took effect, and its preempt execution gave up. It goes back to RUNNING,
    protected from being chosen again for one more preemption deadline, so that the
    preemptor is planned again (another victim, or this one once protected no more, when
    the stop may succeed) instead of waiting for capacity that never frees. Having stopped
    nothing, its preemption leaves the pool's preemption budget, as a spared victim's does
    (`actions.spare`)."""
    protect_s = preemption_deadline_s(settings, record.pool)
    kind = Repair.STUCK_PREEMPTION_SPARED
    since = now - (record.preempting_since or now)
    line = LogLine(
        record.name, now, "preemption-abandoned", kind.value,
        f"still running {since:.0f} s after it was chosen for {record.preempted_by} (its stop was refused or never took "
        f"effect); left running, protected for {protect_s:.0f} s",
        {"preemptor": record.preempted_by},
    )
    lines = [line]
    if record.preempted_by and record.preempted_by != actions.SPOT_INTERRUPTION:
        lines.append(
            LogLine(
                record.preempted_by, now, "victim-not-stopped", kind.value,
                f"waits: its victim {record.name} could not be stopped; the pool is planned again", {"victim": record.name},
            )
        )
    try:
        store.transition(
            record,
            # The stop it may have been sent belongs to this preemption, which is over: a
            # later one starts with no signal sent and no "stop at once".
            record.left_running(spared_until=now + protect_s),
            expect=[JobState.PREEMPTING],
            log=tuple(lines),
            called_off=True,  # it stopped nothing: out of the pool's preemption budget
        )
    except ConflictError:
        return None
    return {"job": record.name, "pool": record.pool, "repair": kind.value, "preemptor": record.preempted_by}


def _keep_waiting_for_a_removed_pool(store: JobsStore, settings: Settings, pool: str, now: float) -> list[dict]:
    """Jobs of a pool that left the configuration stay PENDING, with the reason in their
    decision log (once) and on the pool's wait reasons (what `explain` shows).

    Failing them would be irreversible for what is often a configuration mistake; kept,
    they are scheduled again as soon as the pool is configured again, and an operator who
    removed the pool for good cancels them. Running jobs are left alone: they end as usual.
    """
    repairs = []
    waiting = []
    detail = f"pool {pool} is not in the configuration; waits until it is configured again (or is cancelled)"
    for record in store.pending(pool, settings.pending_window):
        waiting.append({"job": record.name, "reason": Repair.POOL_NOT_CONFIGURED.value, "detail": detail})
        history = store.history(record.name)
        if history and history[-1]["kind"] == "pool-not-configured":
            continue
        store.log(record.name, now, "pool-not-configured", Repair.POOL_NOT_CONFIGURED.value, detail)
        repairs.append({"job": record.name, "pool": pool, "repair": Repair.POOL_NOT_CONFIGURED.value})
    if waiting:
        store.remember_waits(pool, waiting, now)
    return repairs
