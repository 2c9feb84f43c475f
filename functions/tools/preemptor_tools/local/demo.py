"""`preemptor demo`: the controller on emulated AWS, replaying a scenario in simulated time.

The stack is template.yaml in moto (see `stack.py`), the workloads are the simulated fleet
(see `fleet.py`), and one simulated clock drives both, so a day passes in seconds. The
timeline merges what AWS reported (events) with what the controller decided (its decision
log, the same one `preemptor explain` reads).
"""

from __future__ import annotations

import calendar
import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, TextIO

from preemptor.core.model import JobState
from .clock import SimClock
from .fleet import SimulatedFleet
from .scenario import DEFAULT_SCENARIO, Scenario, submission_event
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


def run(
    scenario: Scenario = DEFAULT_SCENARIO,
    *,
    tick_s: float = TICK_S,
    explain: list[str] = (),
    on_stack: Callable[[EmulatedStack], None] | None = None,
) -> DemoResult:
    """Replay `scenario` on the emulated stack; returns the timeline, the report, and the
    `explain` answer for each job named in `explain`, as it stands at the end.
    `on_stack` is called with the started stack (before any event) and again at the end,
    for instruments such as the running-cost benchmark."""
    clock = SimClock(START)
    parameters = {
        "PoolsConfig": json.dumps([p.model_dump(exclude_none=True) for p in scenario.pools]),
        "PolicyConfig": json.dumps(scenario.policy),
    }
    result = DemoResult()
    ids = itertools.count(1)
    with EmulatedStack(clock, parameters=parameters) as stack:
        fleet = SimulatedFleet(
            clock,
            stack.client("s3"),
            stack.emit,
            id_factory=lambda: str(uuid.uuid5(uuid.NAMESPACE_URL, f"preemptor-demo/{next(ids)}")),
            ecs_client=stack.client("ecs"),
            ec2_client=stack.client("ec2"),
        )
        if on_stack:
            on_stack(stack)
        try:
            _create_batch_queues(stack, scenario)
            _replay(stack, fleet, clock, scenario, tick_s, result)
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
        result.report = build_report(store, scenario)
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
    horizon = scenario.horizon or (
        max(j.submit_at for j in scenario.jobs) + 3 * sum(j.duration for j in scenario.jobs) + 3600
    )
    names = {j.name for j in scenario.jobs}

    def on_event(routed: RoutedEvent) -> None:
        entry = _event_entry(routed, routed.at - START)
        if entry:
            result.timeline.append(entry)

    store = stack.deps().store
    changed = True
    while True:
        elapsed = clock.now() - START
        while submissions and submissions[0].submit_at <= elapsed:
            job = submissions.pop(0)
            event = submission_event(job, scenario.pool(job.pool), bucket, clock.now(), stack.region)
            on_event(stack.put_event(event))
            stack.drain()
            changed = True
        while interruptions and interruptions[0].at <= elapsed:
            cut = interruptions.pop(0)
            record = store.get(cut.job)
            try:
                fleet.spot_interrupt(record.run_id if record and record.run_id else cut.job)
            except KeyError as e:
                result.timeline.append(TimelineEntry(elapsed, "workload", cut.job, "no interruption", str(e)))
            stack.pump(on_event)
            changed = True
        # Job states change only through events, so the table needs a look only after some.
        if changed and not submissions and _all_done(store, names):
            return
        if elapsed >= horizon:
            return
        target = clock.now() + tick_s
        for upcoming in (submissions[:1], interruptions[:1]):
            if upcoming:
                target = min(target, START + getattr(upcoming[0], "submit_at", getattr(upcoming[0], "at", 0)))
        clock.advance_to(target)
        changed = stack.pump(on_event) > 0


def _all_done(store, names: set[str]) -> bool:
    jobs = {j.name: j for j in store.all_jobs()}
    return all(n in jobs and jobs[n].status.is_terminal for n in names)


def _event_entry(routed: RoutedEvent, at: float) -> TimelineEntry | None:
    event = routed.event
    if event.get("source") == "aws.s3":
        return None  # routine: every checkpoint write (the intake notes its time)
    detail = event.get("detail", {})
    outcome = routed.results[0] if routed.results else {"outcome": "unrouted", "reason": "no rule matched"}
    if event.get("detail-type") == "Job Submitted":
        return TimelineEntry(at, "aws", detail.get("name", "?"), "Job Submitted", f"intake: {outcome['outcome']}")
    if event.get("source") == "aws.sagemaker":
        name, status = detail.get("TrainingJobName", "?"), detail.get("TrainingJobStatus")
        secondary = detail.get("SecondaryStatus")
        what = f"SageMaker {status}" + (f"/{secondary}" if secondary and secondary != status else "")
    elif event.get("source") == "aws.batch":
        name, what = detail.get("jobName", "?"), f"Batch {detail.get('status')}"
    elif event.get("source") == "aws.ec2":
        name, what = detail.get("instance-id", "?"), event.get("detail-type", "?").replace("EC2 ", "")[:22]
    else:
        name, what = event.get("detail-type", "?"), "event"
    return TimelineEntry(at, "aws", name, what, f"intake: {outcome['outcome']} ({outcome['reason']})")


def _create_batch_queues(stack: EmulatedStack, scenario: Scenario) -> None:
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
        batch.create_job_queue(
            jobQueueName=f"{pool.name}-queue",
            state="ENABLED",
            priority=1,
            computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce}],
        )
        batch.register_job_definition(
            jobDefinitionName=f"{pool.name}-training",
            type="container",
            containerProperties={"image": "training:latest", "vcpus": 8, "memory": 65536},
        )


def build_report(store, scenario: Scenario) -> dict:
    """The summary: per job wait, preemptions and lost work; totals; checkpoint discipline.

    `preemptions` counts stops for another job; stops before a spot instance goes away are
    `interruptions`. Lost work counts both.
    """
    records = {r.name: r for r in store.all_jobs()}
    history = store.all_history()
    requeues = [e for e in history if e["kind"] == "requeued"]
    jobs = []
    for spec in scenario.jobs:
        r = records.get(spec.name)
        if r is None:
            jobs.append(
                {"name": spec.name, "state": "Rejected", "wait_s": None, "preemptions": 0, "interruptions": 0, "lost_gpu_seconds": 0.0}
            )
            continue
        wait = None if r.first_started_at is None else round(r.first_started_at - r.submitted_at, 3)
        mine = [e for e in requeues if e["job"] == r.name]
        jobs.append(
            {
                "name": r.name,
                "team": r.team,
                "priority": r.priority,
                "state": STATE_NAMES[r.status],
                "wait_s": wait,
                "preemptions": sum(1 for e in mine if e["reason"] == "preempted"),
                "interruptions": sum(1 for e in mine if e["reason"] == "interrupted"),
                "lost_gpu_seconds": round(r.lost_gpu_seconds, 3),
                "incarnations": r.incarnation,
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
    return {
        "jobs": jobs,
        "preemptions": sum(j["preemptions"] for j in jobs),
        "interruptions": sum(j["interruptions"] for j in jobs),
        "relaunches": sum(1 for e in history if e["kind"] == "relaunched"),
        "lost_gpu_seconds": round(sum(j["lost_gpu_seconds"] for j in jobs), 3),
        "stops_without_fresh_checkpoint": sum(r.stops_without_fresh_checkpoint for r in records.values()),
        "preemption_details": details,
    }


def print_result(result: DemoResult, out: TextIO) -> None:
    if result.timeline:
        out.write("Timeline (simulated time since the first submission)\n")
        out.write(f"{'time':<8}  {'':6}  {'job':<24} {'what':<22} why\n")
        for entry in result.timeline:
            out.write(entry.render() + "\n")
        out.write("\n")
    report = result.report
    out.write("Summary\n")
    for job in report["jobs"]:
        wait = "never started" if job["wait_s"] is None else f"waited {_duration(job['wait_s'])}"
        out.write(
            f"  {job['name']:<24} {job['state']:<10} {wait:<22} preempted {job['preemptions']}x, "
            + (f"interrupted {job['interruptions']}x, " if job["interruptions"] else "")
            + f"lost {job['lost_gpu_seconds']:,.0f} GPU-seconds\n"
        )
    out.write(
        f"  preemptions: {report['preemptions']}, spot interruptions: {report['interruptions']}, "
        f"relaunches: {report['relaunches']}, "
        f"lost work: {report['lost_gpu_seconds']:,.0f} GPU-seconds "
        f"({report['lost_gpu_seconds'] / 3600:,.1f} GPU-hours), "
        f"stops without a fresh checkpoint: {report['stops_without_fresh_checkpoint']}\n"
    )
    for p in report["preemption_details"]:
        check = "checkpoint confirmed before the stop" if p["checkpoint_confirmed_before_stop"] else "NO fresh checkpoint"
        why = f"preempted for {p['preemptor']}" if p["kind"] == "preempted" else "stopped before its spot instance went away"
        out.write(f"  {p['victim']} {why} at {_duration(p['at_s'])}: {check}\n")
    out.write(f"  alerts published: {len(result.alerts)}\n")
    for job, text in result.explanations.items():
        out.write(f"\nexplain {job}\n{text}\n")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
