"""`preemptor demo`: the controller on emulated AWS, replaying a scenario in simulated time.

The stack is template.yaml in moto (see `stack.py`), the workloads are the simulated fleet
(see `fleet.py`), and one simulated clock drives both, so a day passes in seconds. The
timeline merges what AWS reported (events) with what the controller decided (its decision
log, the same one `preemptor explain` reads).
"""

from __future__ import annotations

import bisect
import calendar
import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, TextIO

from preemptor.config import PoolConfig
from preemptor.core.events import POOL_TAG
from preemptor.core.explain import STOPPED_RUN_KINDS
from preemptor.core.model import JobState
from .alarms import WaitAlarm
from .clock import SimClock
from .fleet import FleetStop, QuotaRefusal, SimulatedFleet
from .hostile import HostileWorld, StopAttempt
from .scenario import (
    DEFAULT_SCENARIO, MANAGED_SPOT_OUTAGE_S, ROLE_ARN, CapacityError, Chaos, Drain, QuotaChange, Scenario, StoppedByHand,
    cancellation_event, local_pool, lowering_event, submission_event, team_launch_request,
)
from preemptor.service.scheduling import explain as explaining
from .stack import EmulatedStack, RoutedEvent

START = float(calendar.timegm((2026, 11, 30, 9, 0, 0)))
TICK_S = 30.0
STATE_NAMES = {
    JobState.COMPLETED: "Completed",
    JobState.FAILED: "Failed",
    JobState.CANCELLED: "Cancelled",
    JobState.PENDING: "Pending",
    JobState.ADMITTED: "Admitted",
    JobState.RUNNING: "Running",
    JobState.PREEMPTING: "Preempting",
}


@dataclass(frozen=True)
class TimelineEntry:
    at: float  # seconds since the scenario started
    source: str  # "aws" (an event), "workload" (the simulated training job) or "controller"
    job: str
    what: str
    why: str

    def render(self) -> str:
        h, rem = divmod(int(round(self.at)), 3600)
        m, s = divmod(rem, 60)
        tag = {"aws": "event ", "workload": "work  "}.get(self.source, "decide")
        return f"{h:02d}:{m:02d}:{s:02d}  {tag}  {self.job:<24} {self.what:<22} {self.why}"


@dataclass
class DemoResult:
    timeline: list[TimelineEntry] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    alerts: list[str] = field(default_factory=list)
    explanations: dict[str, str] = field(default_factory=dict)
    # What the world saw, for the invariants (tests/storm): every run the fleet ran, every
    # stop as the run saw it, every stop the controller asked for (and whether AWS refused
    # it), the runs stopped by hand, and the controller's history.
    runs: list[dict] = field(default_factory=list)
    fleet_stops: list[FleetStop] = field(default_factory=list)
    stop_attempts: list[StopAttempt] = field(default_factory=list)
    stopped_by_hand: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    quota_refusals: list[QuotaRefusal] = field(default_factory=list)  # runs the account's quota refused
    refused_launches: list[str] = field(default_factory=list)  # jobs whose team's own launch AWS refused
    # Each run a team created itself, by its id (a training job's name, a Batch job's id):
    # the scenario job it is.
    team_runs: dict[str, str] = field(default_factory=dict)
    # Each run the controller adopted (a team's own), by its id: the job it is counted as, and since when.
    adopted_runs: dict[str, tuple[str, float]] = field(default_factory=dict)
    # Each operator's drain of a pool (`drain` faults) as it landed: (pool, from, until; None
    # while still drained at the end).
    drains: list[tuple[str, float, float | None]] = field(default_factory=list)


def run(
    scenario: Scenario = DEFAULT_SCENARIO,
    *,
    tick_s: float = TICK_S,
    explain: list[str] = (),
    on_stack: Callable[[EmulatedStack], None] | None = None,
    metrics: list[dict] | None = None,
) -> DemoResult:
    """Replay `scenario` on the emulated stack; returns the timeline, the report, and the
    `explain` answer for each job named in `explain`, as it stands at the end.
    `on_stack` is called with the started stack (before any event) and again at the end,
    for instruments such as the running-cost benchmark. `metrics`, when given, receives every
    EMF document the functions emit (their metrics are off otherwise)."""
    clock = SimClock(START)
    parameters = {
        "PoolsConfig": json.dumps([local_pool(p).model_dump(exclude_none=True) for p in scenario.pools]),
        "PolicyConfig": json.dumps(scenario.policy),
        # What IAM lets the controller launch (tests/unit/test_iam.py evaluates every call).
        "ManagedRoleArnForTraining": ROLE_ARN,
        "Mode": scenario.mode,
        "TrainingInstanceTypes": ",".join(
            sorted({t for p in scenario.pools if p.service == "sagemaker" for t in p.instance_types})
        ) or "ml.p5.48xlarge",
    }
    result = DemoResult()
    ids = itertools.count(1)
    hostile = (
        HostileWorld(clock, START, chaos=scenario.chaos or Chaos(), faults=list(scenario.faults))
        if scenario.hostile
        else None
    )
    with EmulatedStack(clock, parameters=parameters, hostile=hostile, metrics=metrics) as stack:
        fleet = SimulatedFleet(
            clock,
            stack.client("s3"),
            stack.emit,
            id_factory=lambda: str(uuid.uuid5(uuid.NAMESPACE_URL, f"preemptor-demo/{next(ids)}")),
            ecs_client=stack.client("ecs"),
            ec2_client=stack.client("ec2"),
            classify=pool_classifier(scenario),
            instance_quotas=instance_quotas(scenario),
            batch_capacity={p.name: local_pool(p).capacity_gpus + scenario.unpooled.get(p.name, 0) for p in scenario.pools if p.service == "batch"},
        )
        for fault in scenario.faults:
            if isinstance(fault, CapacityError):
                fleet.capacity_outage(
                    fault.pool, START + fault.at, START + fault.at + fault.duration,
                    fault.job_queue or fault.instance_type, fault.capacity_type,
                )
        if on_stack:
            on_stack(stack)
        try:
            create_batch_queues(stack, scenario)
            _replay(stack, fleet, clock, scenario, tick_s, result)
            # No workflow outlives the story (a backoff or wake-up still in its Wait would
            # go on running, and calling AWS, after the stack is gone).
            stack.drain()
        finally:
            fleet.close()
        result.timeline += [
            TimelineEntry(t - START, "workload", name, "spot warning" if what.startswith("spot") else what.split(":")[0], what)
            for t, name, what in fleet.history
            if not what.startswith("periodic") and ("checkpoint" in what or "resumed" in what or "spot" in what)
        ]
        store = stack.deps().store
        decisions = [
            TimelineEntry(e["at"] - START, "controller", e["job"], e["kind"], f"{e['reason']}: {e['detail']}")
            for e in store.all_history()
        ]
        order = {"aws": 0, "workload": 1, "controller": 2}
        result.timeline = sorted(result.timeline + decisions, key=lambda t: (round(t.at, 3), order[t.source]))
        result.report = build_report(store, scenario, refused=set(result.refused_launches))
        result.report["pools"] = [
            {"name": p.name, "capacity_gpus": p.capacity_gpus, "max_gpus_in_use": fleet.max_gpus_in_use().get(p.name, 0)}
            for p in scenario.pools
        ]
        result.runs = fleet.runs()
        result.fleet_stops = list(fleet.stops)
        result.quota_refusals = list(fleet.quota_refusals)
        result.history = store.all_history()
        result.adopted_runs = {r.run_id: (r.name, r.submitted_at) for r in store.all_jobs() if r.adopted and r.run_id}
        if hostile is not None:
            result.stop_attempts = list(hostile.stops)
            result.report["chaos"] = {
                "injected": hostile.counts(),
                "stops_refused": sum(1 for s in hostile.stops if s.refused),
                "dead_letters": len(stack.dead_letters),
                "aborted_executions": len(hostile.aborted_executions),
            }
        result.alerts = stack.alerts()
        if on_stack:
            on_stack(stack)
        d = stack.deps()
        for job in explain:
            answer = explaining(store=store, settings=d.settings, job=job, now=clock.now())
            result.explanations[job] = answer["text"]
    return result


def _replay(
    stack: EmulatedStack, fleet: SimulatedFleet, clock: SimClock, scenario: Scenario, tick_s: float, result: DemoResult
) -> None:
    bucket = stack.parameters["CheckpointBucketName"]
    submissions = sorted(scenario.jobs, key=lambda j: (j.submit_at, j.name))
    interruptions = sorted(scenario.interruptions, key=lambda i: (i.at, i.job))
    lowerings = sorted(scenario.lowerings, key=lambda lw: (lw.at, lw.job))
    cancellations = sorted(scenario.cancellations, key=lambda c: (c.at, c.job))
    teams = {j.name: j.team for j in scenario.jobs}
    pool_of = {j.name: j.pool for j in scenario.jobs}
    by_hand = sorted((f for f in scenario.faults if isinstance(f, StoppedByHand)), key=lambda f: (f.at, f.job))
    quota_changes = sorted((f for f in scenario.faults if isinstance(f, QuotaChange)), key=lambda f: (f.at, f.pool))
    # The operator's drains and undrains (`preemptor drain`), as (at, pool, drained).
    drains = sorted(
        [(f.at, f.pool, True) for f in scenario.faults if isinstance(f, Drain)]
        + [(f.at + f.duration, f.pool, False) for f in scenario.faults if isinstance(f, Drain)]
    )
    horizon = scenario.horizon or (
        max(j.submit_at for j in scenario.jobs) + 3 * sum(j.duration for j in scenario.jobs) + 3600
    )
    names = {j.name for j in scenario.jobs}

    def on_event(routed: RoutedEvent) -> None:
        entry = _event_entry(routed, routed.at - START)
        if entry:
            result.timeline.append(entry)

    store = stack.deps().store
    alarm = WaitAlarm(stack)  # CloudWatch's part: moto evaluates no alarm
    changed = True
    while True:
        elapsed = clock.now() - START
        # First, before what arrives at the same moment is routed (its workflows move time).
        while drains and drains[0][0] <= elapsed:
            _, pool_name, drained = drains.pop(0)
            spared = _drain(stack, clock, pool_name, drained)
            now = clock.now()
            if drained:
                result.drains.append((pool_name, now, None))
            else:
                result.drains = [(p, at, now if p == pool_name and until is None else until) for p, at, until in result.drains]
            why = f"preemptor {'drain' if drained else 'undrain'} {pool_name}" + (f"; spared {', '.join(spared)}" if spared else "")
            result.timeline.append(TimelineEntry(now - START, "workload", pool_name, "drained" if drained else "undrained", why))
            stack.pump(on_event)
            changed = True
        while submissions and submissions[0].submit_at <= elapsed:
            job = submissions.pop(0)
            if job.launched_by == "team":
                # Outside the controller: the team creates its run itself; the fleet's
                # events tell the controller, which adopts it.
                stack.pump(on_event)  # the submissions before it first
                pool = scenario.pool(job.pool)
                sagemaker = stack.client("sagemaker")
                try:
                    request = team_launch_request(job, pool, bucket)
                    if pool.service == "sagemaker":
                        sagemaker.create_training_job(**request)
                        result.team_runs[request["TrainingJobName"]] = job.name
                    else:
                        result.team_runs[stack.client("batch").submit_job(**request)["jobId"]] = job.name
                except sagemaker.exceptions.ClientError as e:
                    # The account's quota is full (the pool's instances are all in use): the
                    # run never exists, and the controller never hears of it.
                    result.refused_launches.append(job.name)
                    why = f"CreateTrainingJob refused: {e.response['Error']['Code']}"
                    result.timeline.append(TimelineEntry(elapsed, "workload", job.name, "refused to its team", why))
                else:
                    call = "CreateTrainingJob" if pool.service == "sagemaker" else "SubmitJob"
                    result.timeline.append(TimelineEntry(elapsed, "workload", job.name, "launched by its team", f"{call} outside the controller"))
            else:
                # Every submission due now reaches the bus at this moment (in a hostile
                # world, duplicated and delayed like any other event): `pump` routes them together.
                stack.emit(submission_event(job, scenario.pool(job.pool), bucket, clock.now(), stack.region))
            changed = True
        stack.pump(on_event)
        while by_hand and by_hand[0].at <= elapsed:
            fault = by_hand.pop(0)
            stopped = _stop_by_hand(stack, store.get(fault.job))
            result.stopped_by_hand += [stopped] if stopped else []
            why = f"stopped {stopped} outside the controller" if stopped else "no live run to stop"
            result.timeline.append(TimelineEntry(elapsed, "workload", fault.job, "stopped by hand", why))
            stack.pump(on_event)
            changed = True
        while quota_changes and quota_changes[0].at <= elapsed:
            change = quota_changes.pop(0)
            instance_type = scenario.pool(change.pool).instance_type
            fleet.set_instance_quota(instance_type, change.instances)
            why = f"the account's quota of {instance_type} is {change.instances} instances from now on"
            result.timeline.append(TimelineEntry(elapsed, "workload", change.pool, "quota changed", why))
            changed = True
        while lowerings and lowerings[0].at <= elapsed:
            lowering = lowerings.pop(0)
            team = lowering.team or teams[lowering.job]
            result.timeline.append(
                TimelineEntry(elapsed, "workload", lowering.job, f"lowered by {team}", f"to {lowering.priority}: {lowering.note or 'no note'}")
            )
            stack.emit(lowering_event(lowering, team, clock.now(), stack.region))
            stack.pump(on_event)
            changed = True
        while cancellations and cancellations[0].at <= elapsed:
            cancel = cancellations.pop(0)
            team = cancel.team or teams[cancel.job]
            result.timeline.append(TimelineEntry(elapsed, "workload", cancel.job, f"cancelled by {team}", "Job Cancelled"))
            stack.emit(cancellation_event(cancel, team, clock.now(), stack.region))
            stack.pump(on_event)
            changed = True
        while interruptions and interruptions[0].at <= elapsed:
            cut = interruptions.pop(0)
            record = store.get(cut.job)
            run = record.run_id if record and record.run_id else cut.job
            try:
                if scenario.pool(pool_of[cut.job]).service == "sagemaker":
                    fleet.managed_spot_interrupt(run, cut.duration or MANAGED_SPOT_OUTAGE_S)
                else:
                    fleet.spot_interrupt(run)
            except KeyError as e:
                if cut.until is not None and elapsed + 60 <= cut.until:
                    # No run to take yet (waiting, between runs): tried again in a minute.
                    bisect.insort(interruptions, cut.model_copy(update={"at": elapsed + 60}), key=lambda i: (i.at, i.job))
                else:
                    result.timeline.append(TimelineEntry(elapsed, "workload", cut.job, "no interruption", str(e)))
            stack.pump(on_event)
            changed = True
        # Job states change only through events, so the table needs a look only after some.
        if changed and not submissions and _all_done(stack, names):
            return
        if elapsed >= horizon:
            return
        target = clock.now() + tick_s
        for upcoming in (submissions[:1], interruptions[:1], by_hand[:1], quota_changes[:1], lowerings[:1], cancellations[:1]):
            if upcoming:
                target = min(target, START + getattr(upcoming[0], "submit_at", getattr(upcoming[0], "at", 0)))
        if drains:
            target = min(target, START + drains[0][0])
        clock.advance_to(target)
        changed = stack.pump(on_event) > 0
        changed = alarm.tick(on_event) > 0 or changed
        if stack.hostile is not None:
            # The level-triggered safety net (reconcile every few minutes) is what repairs
            # what a hostile world breaks; a calm demo reads better without its noise.
            changed = stack.fire_schedules(on_event) > 0 or changed


def _drain(stack: EmulatedStack, clock: SimClock, pool: str, drained: bool) -> list[str]:
    """The operator drains (or undrains) `pool` as `preemptor drain` does; returns the
    victims the drain spared."""
    from preemptor_tools import ops

    from .server import stack_outputs

    target = ops.Target(stack.stack_name, stack_outputs(stack), dict(stack.parameters), stack.session, clock=clock.now)
    with stack.calls.unattributed():
        return ops.set_drained(target, pool, drained, "scenario drain")["victims_spared"]


def _stop_by_hand(stack: EmulatedStack, record) -> str | None:
    """Stop the job's current run as a person would (console, CLI): not through the controller."""
    if record is None or not record.run_id or record.status.is_terminal:
        return None
    try:
        if record.service == "sagemaker":
            stack.client("sagemaker").stop_training_job(TrainingJobName=record.run_id)
        else:
            stack.client("batch").terminate_job(jobId=record.run_id, reason="Stopped by hand")
    except stack.client("sagemaker").exceptions.ClientError:
        return None  # already ending: nothing to stop
    return record.run_name or record.run_id


def instance_quotas(scenario: Scenario) -> dict[str, int]:
    """The account's SageMaker quota per instance type: the instances its pools own, and
    those it has beyond them (`unpooled`). A run launched outside the controller into a full
    account is refused by SageMaker, as on AWS."""
    quotas: dict[str, int] = {}
    for p in scenario.pools:
        if p.service == "sagemaker" and p.instance_type and p.instances:
            quotas[p.instance_type] = quotas.get(p.instance_type, 0) + p.instances + scenario.unpooled.get(p.name, 0)
    return quotas


def pool_classifier(scenario: Scenario):
    """(pool, GPUs) of a run from what it asked the service for: a SageMaker run by its
    instance type (a pool's own, else a pool's fallback: the one its pool tag names among
    those listing it, else the first) and count, a Batch run by its job queue and GPU
    resource requirement."""
    sagemaker = {p.instance_type: p for p in scenario.pools if p.service == "sagemaker" and p.instance_type}
    fallbacks: dict[str, list[PoolConfig]] = {}
    for p in scenario.pools:
        for t in p.fallback_instance_types if p.service == "sagemaker" else ():
            fallbacks.setdefault(t, []).append(p)
    batch = {
        queue: p
        for p in scenario.pools
        if p.service == "batch"
        for queue in (local_pool(p).job_queue, *p.fallback_job_queues)
    }
    # A team's own queue is on its pool's compute environment (`create_batch_queues`).
    by_name = {p.name: p for p in scenario.pools}
    batch.update({j.job_queue: by_name[j.pool] for j in scenario.jobs if j.job_queue})

    def classify(service: str, request: dict) -> tuple[str, int] | None:
        if service == "sagemaker":
            config = request.get("ResourceConfig") or {}
            pool = sagemaker.get(config.get("InstanceType"))
            if pool is None and config.get("InstanceType") in fallbacks:
                listing = fallbacks[config["InstanceType"]]
                tagged = {t.get("Key"): t.get("Value") for t in request.get("Tags") or []}.get(POOL_TAG)
                pool = next((p for p in listing if p.name == tagged), listing[0])
            if pool is None:
                return None
            return pool.name, int(config.get("InstanceCount") or 0) * pool.gpus_per_instance
        queue = str(request.get("jobQueue", "")).rsplit("/", 1)[-1]
        pool = batch.get(queue)
        if pool is None:
            return None
        requirements = (request.get("containerOverrides") or {}).get("resourceRequirements") or []
        gpus = sum(int(r.get("value", 0)) for r in requirements if r.get("type") == "GPU")
        return pool.name, gpus

    return classify


def _all_done(stack: EmulatedStack, names: set[str]) -> bool:
    jobs = {j.name: j for j in stack.jobs()}
    return all(n in jobs and jobs[n].status.is_terminal for n in names)


def _event_entry(routed: RoutedEvent, at: float) -> TimelineEntry | None:
    event = routed.event
    if event.get("source") in ("aws.s3", "aws.events"):
        return None  # routine: every checkpoint write (the intake notes its time), every reconcile
    detail = event.get("detail", {})
    outcome = routed.results[0] if routed.results else {"outcome": "unrouted", "reason": "no rule matched"}
    if event.get("detail-type") == "Job Submitted":
        return TimelineEntry(at, "aws", detail.get("name", "?"), "Job Submitted", f"intake: {outcome['outcome']}")
    if event.get("detail-type") == "Job Cancelled":
        return TimelineEntry(at, "aws", detail.get("name", "?"), "Job Cancelled", f"intake: {outcome['outcome']} ({outcome['reason']})")
    if event.get("detail-type") == "Job Priority Lowered":
        return TimelineEntry(at, "aws", detail.get("name", "?"), "Priority Lowered", f"intake: {outcome['outcome']} ({outcome['reason']})")
    if event.get("source") == "aws.sagemaker":
        name, status = detail.get("TrainingJobName", "?"), detail.get("TrainingJobStatus")
        secondary = detail.get("SecondaryStatus")
        what = f"SageMaker {status}" + (f"/{secondary}" if secondary and secondary != status else "")
    elif event.get("source") == "aws.batch":
        name, what = detail.get("jobName", "?"), f"Batch {detail.get('status')}"
    elif event.get("source") == "aws.cloudwatch":
        name, what = detail.get("alarmName", "?"), f"Alarm {(detail.get('state') or {}).get('value')}"
    elif event.get("source") == "aws.ec2":
        name, what = detail.get("instance-id", "?"), event.get("detail-type", "?").replace("EC2 ", "")[:22]
    else:
        name, what = event.get("detail-type", "?"), "event"
    return TimelineEntry(at, "aws", name, what, f"intake: {outcome['outcome']} ({outcome['reason']})")


def create_batch_queues(stack: EmulatedStack, scenario: Scenario) -> None:
    batch = stack.client("batch")
    batch_pools = [p for p in scenario.pools if p.service == "batch"]
    if not batch_pools:
        return
    role = stack.client("iam").create_role(
        RoleName="preemptor-local-batch",
        AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": []}),
    )["Role"]["Arn"]
    for pool in batch_pools:
        ce = batch.create_compute_environment(
            computeEnvironmentName=f"{pool.name}-ce", type="UNMANAGED", state="ENABLED", serviceRole=role
        )["computeEnvironmentArn"]
        teams = sorted({j.job_queue for j in scenario.jobs if j.pool == pool.name and j.job_queue})
        for queue in dict.fromkeys((local_pool(pool).job_queue, *pool.fallback_job_queues, *teams)):
            batch.create_job_queue(
                jobQueueName=queue, state="ENABLED", priority=1, computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce}]
            )
        batch.register_job_definition(
            jobDefinitionName=f"{pool.name}-training",
            type="container",
            containerProperties={"image": "training:latest", "vcpus": 8, "memory": 65536},
        )


def build_report(store, scenario: Scenario, refused: set[str] = frozenset()) -> dict:
    """The summary: per job wait, preemptions and lost work; totals; checkpoint discipline.

    `preemptions` counts stops for another job; stops before a spot instance goes away are
    `interruptions`. Lost work counts both. A job the controller has no record of was
    rejected, or is one of `refused`: its team launched it itself and AWS refused the launch.
    """
    records = {r.name: r for r in store.all_jobs()}
    adopted = {r.run_name: r for r in records.values() if r.adopted}
    history = store.all_history()
    requeues = [e for e in history if e["kind"] in STOPPED_RUN_KINDS]
    jobs = []
    for spec in scenario.jobs:
        # A team's own run is counted under its own name, or, where that is a job's, one
        # of its own (`<name>-<digest>`).
        r = adopted.get(spec.run_name or spec.name) if spec.launched_by == "team" else records.get(spec.name)
        if r is None:
            jobs.append(
                {"name": spec.name, "state": "Refused by AWS" if spec.name in refused else "Rejected", "wait_s": None, "preemptions": 0, "interruptions": 0, "lost_gpu_seconds": 0.0}
            )
            continue
        # An adopted run started before the controller heard of it (`submitted_at`): it never
        # waited for the controller.
        wait = None if r.first_started_at is None else round(max(0.0, r.first_started_at - r.submitted_at), 3)
        mine = [e for e in requeues if e["job"] == r.name]
        own = [e for e in history if e["job"] == r.name]
        kinds = [e["kind"] for e in own]
        refused_at_create = sum(
            1 for e in own if e["kind"] == "launch-failed" or (e["kind"] == "capacity-wait" and not e["extra"].get("run_created", True))
        )
        jobs.append(
            {
                "name": r.name,
                "team": r.team,
                "priority": r.priority,
                "state": STATE_NAMES[r.status],
                "adopted_at": r.submitted_at if r.adopted else None,  # a run its team launched, counted from then
                "wait_s": wait,
                "preemptions": sum(1 for e in mine if e["reason"] == "preempted"),
                # Stops before a spot instance goes away, and SageMaker managed-spot interruptions
                # (and Batch's own preemptions of a service job whose training job it adopted)
                "interruptions": sum(1 for e in mine if e["reason"] == "interrupted") + kinds.count("spot-interrupted")
                + kinds.count("batch-preempted"),
                "lost_gpu_seconds": round(r.lost_gpu_seconds, 3),
                "incarnations": r.incarnation,
                # Runs created (first launch and relaunches) plus launches the service refused.
                "relaunches": kinds.count("relaunched"),
                "launch_attempts": kinds.count("launched") + kinds.count("relaunched") + refused_at_create,
                "capacity_waits": kinds.count("capacity-wait"),
                # Across its incarnations: the time its runs held GPUs, and the work its
                # checkpoints carried from one incarnation to the next.
                "runtime_s": round(_runtime_s(own, r), 3),
                "work_carried_s": round(r.work_done_s, 3),
                # After its first start, the time it held no GPUs (requeued after a stop,
                # waiting to relaunch), for a job that ended; `wait_s` is the first wait only.
                "requeued_s": _requeued_s(own, r),
            }
        )
    details = []
    for entry in requeues:
        earlier = [e for e in history if e["job"] == entry["job"] and e["at"] <= entry["at"]]
        stop = next((e for e in reversed(earlier) if e["kind"] == "stop-requested"), None)
        confirmed = next((e for e in reversed(earlier) if e["kind"] == "checkpoint-confirmed"), None)
        details.append(
            {
                "victim": entry["job"],
                "preemptor": entry["extra"].get("preemptor"),
                "kind": entry["reason"],
                "at_s": round(entry["at"] - START, 3),
                "checkpoint_confirmed_before_stop": bool(confirmed and stop and confirmed["at"] <= stop["at"]),
                "fresh_checkpoint": entry["extra"].get("fresh_checkpoint"),
                "lost_gpu_seconds": round(entry["extra"].get("lost_gpu_seconds", 0.0), 3),
            }
        )
    shadow, seen = [], set()
    for e in history:
        if e["kind"] in ("shadow-admit", "shadow-preempt"):
            key = (e["kind"], e["job"], e["extra"].get("preemptor"))
            if key not in seen:
                seen.add(key)
                item = {"at_s": round(e["at"] - START, 3), "would": e["kind"].removeprefix("shadow-"), "job": e["job"], "reason": e["reason"]}
                if e["extra"].get("preemptor"):
                    item |= {"for": e["extra"]["preemptor"], "lost_gpu_seconds": round(e["extra"].get("lost_gpu_seconds", 0.0), 3)}
                shadow.append(item)
    return {
        "mode": scenario.mode,
        # What the controller itself did: in shadow mode, nothing (its would-be decisions are `shadow`)
        "controller_launches": sum(1 for e in history if e["kind"] in ("launched", "relaunched")),
        "controller_stops": sum(1 for e in history if e["kind"] == "stop-requested"),
        "shadow": shadow,
        "jobs": jobs,
        "preemptions": sum(j["preemptions"] for j in jobs),
        "interruptions": sum(j["interruptions"] for j in jobs),
        "relaunches": sum(1 for e in history if e["kind"] == "relaunched"),
        "lost_gpu_seconds": round(sum(j["lost_gpu_seconds"] for j in jobs), 3),
        "stops_without_fresh_checkpoint": sum(r.stops_without_fresh_checkpoint for r in records.values()),
        "preemption_details": details,
        "stuck": [
            {"name": r.name, "state": STATE_NAMES[r.status], "reason": _last_reason(r, history)}
            for r in sorted(records.values(), key=lambda r: r.name)
            if not r.status.is_terminal
        ],
    }


_RUN_STARTS = ("launched", "relaunched", "adopted")
_RUN_ENDS = (*STOPPED_RUN_KINDS, "capacity-wait", "completed", "failed", "cancelled")


def _runtime_s(own: list[dict], record) -> float:
    """Seconds the job's runs held their GPUs, summed over its incarnations, from its decision
    log (a run starts when it is launched, ends when it is requeued, waits for capacity or
    ends); a run still going counts up to its record's last change."""
    total, started = 0.0, None
    for e in own:
        if e["kind"] in _RUN_STARTS:
            started = e["at"]
        elif e["kind"] in _RUN_ENDS and started is not None:
            total += e["at"] - started
            started = None
    if started is not None and record.ended_at is not None:
        total += record.ended_at - started
    return total


def _requeued_s(own: list[dict], record) -> float | None:
    """Seconds an ended job held no GPUs between its first start and its end (None for a job
    that never started or has not ended)."""
    if record.first_started_at is None or record.ended_at is None:
        return None
    # The log tells an adopted run's time from its adoption on (its run began before).
    first = max(record.first_started_at, record.submitted_at) if record.adopted else record.first_started_at
    return round(max(0.0, record.ended_at - first - _runtime_s(own, record)), 3)


def _last_reason(record, history: list[dict]) -> str | None:
    """Why a job is where it is: its outcome reason, else its newest decision's reason."""
    if record.outcome_reason:
        return record.outcome_reason
    mine = [e for e in history if e["job"] == record.name and e.get("reason")]
    return mine[-1]["reason"] if mine else None


def print_result(result: DemoResult, out: TextIO) -> None:
    if result.timeline:
        out.write("Timeline (simulated time since the first submission)\n")
        out.write(f"{'time':<8}  {'':6}  {'job':<24} {'what':<22} why\n")
        for entry in result.timeline:
            out.write(entry.render() + "\n")
        out.write("\n")
    report = result.report
    out.write("Summary\n")
    waits = [_waits(job) for job in report["jobs"]]
    width = max([22, *map(len, waits)])
    for job, wait in zip(report["jobs"], waits):
        out.write(
            f"  {job['name']:<24} {job['state']:<10} {wait:<{width}} preempted {job['preemptions']}x, "
            + (f"interrupted {job['interruptions']}x, " if job["interruptions"] else "")
            + f"lost {job['lost_gpu_seconds']:,.0f} GPU-seconds\n"
        )
    out.write(
        f"  preemptions: {report['preemptions']}, spot interruptions: {report['interruptions']}, "
        f"relaunches: {report['relaunches']}, "
        f"GPU time lost since the checkpoints the runs resume from (relaunches, managed-spot restarts): {report['lost_gpu_seconds']:,.0f} GPU-seconds "
        f"({report['lost_gpu_seconds'] / 3600:,.1f} GPU-hours; the requeue lines say whether it is work to redo), "
        f"stops without a fresh checkpoint: {report['stops_without_fresh_checkpoint']}\n"
    )
    for p in report["preemption_details"]:
        check = (
            "checkpoint confirmed before the stop" if p["checkpoint_confirmed_before_stop"]
            else "stopped at once, its last checkpoint fresh" if p["fresh_checkpoint"]
            else "NO fresh checkpoint"
        )
        why = f"preempted for {p['preemptor']}" if p["kind"] == "preempted" else "stopped before its spot instance went away"
        # "Fresh" is the policy's bound (checkpoint_max_age_s): the work since it may still be lost.
        lost = f", {p['lost_gpu_seconds']:,.0f} GPU-seconds lost" if p["lost_gpu_seconds"] else ""
        out.write(f"  {p['victim']} {why} at {_duration(p['at_s'])}: {check}{lost}\n")
    if report.get("mode") == "shadow":
        out.write(
            f"  shadow mode: the controller launched {report['controller_launches']} and stopped "
            f"{report['controller_stops']} jobs; enforce mode would have:\n"
        )
        for w in report["shadow"]:
            what = f"preempted {w['job']} for {w['for']} (losing {w['lost_gpu_seconds']:,.0f} GPU-seconds)" if w["would"] == "preempt" else f"admitted {w['job']}"
            out.write(f"    at {_duration(w['at_s'])}: {what} [{w['reason']}]\n")
    for pool in report.get("pools", []):
        out.write(
            f"  pool {pool['name']}: at most {pool['max_gpus_in_use']} of {pool['capacity_gpus']} GPUs in use "
            "(measured on the simulated fleet)\n"
        )
    for job in report.get("stuck", []):
        out.write(f"  stuck: {job['name']} {job['state']} ({job['reason'] or 'no reason recorded'})\n")
    if "chaos" in report:
        chaos = report["chaos"]
        injected = ", ".join(f"{k} {v}" for k, v in chaos["injected"].items()) or "nothing"
        out.write(
            f"  hostile world: injected {injected}; stops refused {chaos['stops_refused']}, "
            f"dead-lettered events {chaos['dead_letters']}, executions aborted {chaos['aborted_executions']}\n"
        )
    out.write(f"  alerts published: {len(result.alerts)}\n")
    for job, text in result.explanations.items():
        out.write(f"\nexplain {job}\n{text}\n")


def _waits(job: dict) -> str:
    """A job's wait for its first start, and the time it spent requeued after it."""
    if job["wait_s"] is None:
        return "never started"
    wait = f"waited {_duration(job['wait_s'])}"
    return f"{wait} + {_duration(job['requeued_s'])} requeued" if job.get("requeued_s") else wait


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
