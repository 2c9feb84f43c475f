"""Intake: turn one EventBridge event into a change of the jobs table and a workflow start.

Events arrive at least once and in any order. Each one is parsed (malformed or unknown
events are rejected or ignored with a reason, never raised), deduplicated by its id, and
matched to a job and incarnation; an event about an older incarnation is stale and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..adapters.checkpoints import CONTROL_DIR
from ..adapters.instances import InstanceResolver
from ..adapters.runners import Runner
from ..adapters.store import JobsStore
from ..adapters.workflows import WorkflowStarter, execution_name
from ..config import Settings
from ..core import events as ev
from ..core.errors import ConflictError
from ..core.jobs import JobRecord
from ..core.model import JobState
from ..core.requests import resolve_priority

SAGEMAKER_OUTCOMES = {"Completed": "completed", "Failed": "failed", "Stopped": "stopped"}
BATCH_OUTCOMES = {"SUCCEEDED": "completed", "FAILED": "failed"}
SPOT_RECLAIM_PREFIX = "Host EC2"  # Batch statusReason when the instance went away under the job


@dataclass(frozen=True)
class IntakeResult:
    outcome: str  # accepted | ignored | rejected | duplicate
    reason: str
    job: str | None = None
    workflow: str | None = None

    def to_dict(self) -> dict:
        return {"outcome": self.outcome, "reason": self.reason, "job": self.job, "workflow": self.workflow}


MAX_EVENT_AGE_S = 3600  # the rules' MaximumEventAgeInSeconds


def _submission_time(event_time: float | None, now: float) -> float:
    """When the job was submitted: the event's time, unless it is missing, in the future, or
    older than EventBridge would still deliver (a replayed sample), then the time of receipt."""
    if event_time is None or not now - MAX_EVENT_AGE_S <= event_time <= now:
        return now
    return event_time


class Intake:
    def __init__(
        self,
        *,
        store: JobsStore,
        workflows: WorkflowStarter,
        runners: dict[str, Runner],
        settings: Settings,
        instances: InstanceResolver | None = None,
    ):
        self.instances = instances
        self.store = store
        self.workflows = workflows
        self.runners = runners
        self.settings = settings

    def handle(self, raw: object, now: float) -> IntakeResult:
        try:
            event = ev.parse_event(raw, tiers=self.settings.policy.tiers)
        except ev.EventRejected as e:
            self.store.count("rejected_events")
            return IntakeResult("rejected", f"{e.reason}: {e.detail}")
        if isinstance(event, ev.Ignored):
            return IntakeResult("ignored", event.reason)
        if self.store.event_seen(event.event_id):
            return IntakeResult("duplicate", f"event {event.event_id} already handled")
        result = self._dispatch(event, now)
        self.store.remember_event(event.event_id, now, result.outcome)
        return result

    def _dispatch(self, event: object, now: float) -> IntakeResult:
        if isinstance(event, ev.JobSubmitted):
            return self._submitted(event, now)
        if isinstance(event, ev.JobCancelled):
            return self._cancelled(event, now)
        if isinstance(event, ev.TrainingJobStateChanged):
            return self._run_changed(
                event, "sagemaker", event.training_job_name, event.status, SAGEMAKER_OUTCOMES, now
            )
        if isinstance(event, ev.BatchJobStateChanged):
            return self._run_changed(event, "batch", event.job_id, event.status, BATCH_OUTCOMES, now)
        if isinstance(event, (ev.SpotInterruptionWarning, ev.RebalanceRecommendation)):
            return self._instance_warning(event, now)
        if isinstance(event, ev.CheckpointWritten):
            return self._checkpoint_written(event, now)
        return IntakeResult("ignored", f"no handler for {type(event).__name__}")

    # -- the controller's own events -----------------------------------------------------
    def _submitted(self, event: "ev.JobSubmitted", now: float) -> IntakeResult:
        req = event.request
        pool = self.settings.pool(req.pool)
        if pool is None:
            self.store.count("rejected_events")
            return IntakeResult("rejected", f"bad-request: pool {req.pool!r} is not configured", req.name)
        priority = resolve_priority(req.priority, self.settings.policy.tiers)
        record = JobRecord(
            name=req.name,
            team=req.team,
            priority=priority,
            pool=req.pool,
            service=req.service,
            gpus=req.gpu_demand(pool.gpus_per_instance),
            request=req.request,
            checkpoint_s3_uri=req.checkpoint_s3_uri,
            submitted_at=_submission_time(event.time, now),
            sla_s=req.sla_s,
            labels=dict(req.labels),
            expected_duration_s=req.expected_duration_s,
            restart_overhead_s=req.restart_overhead_s,
            spot=req.spot,
        )
        if not self.store.put_new(record):
            existing = self.store.get(req.name)
            if existing is not None and existing.status is JobState.PENDING:
                # A redelivery after a failure between the insert and the workflow start:
                # start it now (the execution name makes a second start a no-op).
                self._schedule(req.pool, event.event_id, "duplicate", "job-already-submitted", req.name)
            return IntakeResult("duplicate", f"job {req.name} was already submitted", req.name)
        self.store.put_checkpoint_alias(record.checkpoint_s3_uri, record.name)
        tier = self.settings.policy.tier_of(priority)
        self.store.log(
            req.name, now, "submitted", "job-submitted", f"team {req.team}, priority {priority} ({tier}), {record.gpus} GPUs in {req.pool}"
        )
        return self._schedule(req.pool, event.event_id, "accepted", "job-submitted", req.name)

    def _cancelled(self, event: "ev.JobCancelled", now: float) -> IntakeResult:
        record = self.store.get(event.name)
        if record is None:
            return IntakeResult("ignored", f"unknown job {event.name}", event.name)
        if record.status is JobState.PENDING:
            try:
                self.store.transition(record, record.with_changes(status=JobState.CANCELLED, ended_at=now), [JobState.PENDING])
            except ConflictError:
                return IntakeResult("ignored", "job moved while cancelling; retry", event.name)
            self.store.log(record.name, now, "cancelled", "job-cancelled", "removed from the queue")
            return IntakeResult("accepted", "cancelled-pending", event.name)
        if record.status in (JobState.RUNNING, JobState.PREEMPTING) and record.run_id:
            self.store.transition(record, record.with_changes(cancel_requested=True), [record.status])
            self.runners[record.service].stop(record.run_id, "preemptor: cancelled")
            self.store.log(record.name, now, "cancel-requested", "job-cancelled", f"stopping {record.run_name}")
            return IntakeResult("accepted", "stopping-for-cancel", event.name)
        return IntakeResult("ignored", f"job is {record.status.value}", event.name)

    # -- SageMaker and Batch runs --------------------------------------------------------
    def _run_changed(self, event, service: str, run_id: str, status: str, outcomes: dict, now: float) -> IntakeResult:
        found = self.store.find_run(service, run_id)
        if found is None:
            return self._maybe_adopt(event, service, run_id, status, now)
        name, incarnation = found
        record = self.store.get(name)
        if record is None or record.incarnation != incarnation:
            return IntakeResult("ignored", f"stale: event for incarnation {incarnation} of {name}", name)
        outcome = outcomes.get(status)
        if outcome is None:
            placed = self._note_instance(event, name, incarnation, status, now)
            return IntakeResult("ignored", f"progress: {service} {run_id} is {status}{placed}", name)
        if record.status is JobState.PREEMPTING and outcome in ("stopped", "failed"):
            # Our own stop: the preemption workflow requeues the job once the stop is final.
            return IntakeResult("ignored", f"stop of a preempted run ({status})", name)
        reason = getattr(event, "failure_reason", None) or getattr(event, "status_reason", None) or status
        if outcome == "failed" and service == "batch" and str(reason).startswith(SPOT_RECLAIM_PREFIX):
            outcome, reason = "interrupted", f"spot reclaim: {reason}"
        if outcome == "stopped":
            outcome = "cancelled"
            reason = "cancelled" if record.cancel_requested else "stopped outside the controller"
        payload = {
            "job": name,
            "incarnation": incarnation,
            "outcome": outcome,
            "reason": str(reason),
            "pool": record.pool,
        }
        arn = self.workflows.start("job_ended", execution_name(name, str(incarnation), event.event_id), payload)
        return IntakeResult("accepted", f"run ended: {outcome}", name, arn)

    def _note_instance(self, event, name: str, incarnation: int, status: str, now: float) -> str:
        """Remember the EC2 instance a running Batch job is on, for spot warnings."""
        arn = getattr(event, "container_instance_arn", None)
        if status != "RUNNING" or not arn or self.instances is None:
            return ""
        instance = self.instances.ec2_instance(arn)
        if instance is None:
            return ""
        self.store.put_instance_alias(instance, name, incarnation)
        self.store.log(name, now, "placed", "batch-running", f"runs on EC2 instance {instance}")
        return f" on {instance}"

    def _maybe_adopt(self, event, service: str, run_id: str, status: str, now: float) -> IntakeResult:
        running = status in ("InProgress", "RUNNING")
        try:
            tags = ev.adoption_tags(event.tags or {}, tiers=self.settings.policy.tiers)
        except ev.EventRejected as e:
            self.store.count("rejected_events")
            return IntakeResult("rejected", f"{e.reason}: {e.detail}")
        if tags is None or not running:
            return IntakeResult("ignored", f"not managed: {service} run {run_id} has no preemptor tags")
        priority, team, pool_name = tags
        pool = self.settings.pool(pool_name) if pool_name else self._pool_for_service(service)
        if pool is None:
            return IntakeResult("ignored", f"not adoptable: no pool {pool_name!r} for {service} run {run_id}")
        if service == "sagemaker":
            gpus = (event.instance_count or 1) * pool.gpus_per_instance
            name = event.training_job_name
            checkpoint = event.checkpoint_s3_uri or ""
        else:
            gpus = int((event.tags or {}).get("preemptor:gpus", pool.gpus_per_instance))
            name = event.job_name
            checkpoint = (event.tags or {}).get("preemptor:checkpoint", "")
        record = JobRecord(
            name=name,
            team=team,
            priority=priority,
            pool=pool.name,
            service=service,
            gpus=gpus,
            request={},
            checkpoint_s3_uri=checkpoint,
            submitted_at=now,
            status=JobState.RUNNING,
            run_id=run_id,
            run_name=name,
            started_at=now,
            first_started_at=now,
            adopted=True,
        )
        if not self.store.put_adopted(record):
            return IntakeResult("duplicate", f"{name} already known", name)
        if checkpoint:
            self.store.put_checkpoint_alias(checkpoint, name)
        self.store.log(name, now, "adopted", "tagged-outside-controller", f"{gpus} GPUs counted in {pool.name}")
        return IntakeResult("accepted", "adopted", name)

    def _pool_for_service(self, service: str):
        return next((p for p in self.settings.pools if p.service == service), None)

    # -- EC2 warnings ---------------------------------------------------------------------
    def _instance_warning(self, event, now: float) -> IntakeResult:
        found = self.store.find_run("instance", event.instance_id) if event.instance_id else None
        if found is None:
            return IntakeResult("ignored", f"no managed run on instance {event.instance_id}")
        name, incarnation = found
        stop = isinstance(event, ev.SpotInterruptionWarning)
        payload = {
            "job": name,
            "incarnation": incarnation,
            "instance_id": event.instance_id,
            "stop": stop,
            "reason": "spot-interruption" if stop else "rebalance-recommendation",
        }
        arn = self.workflows.start("spot", execution_name(name, str(incarnation), event.event_id), payload)
        return IntakeResult("accepted", "spot-interruption" if stop else "rebalance-recommendation", name, arn)

    def _checkpoint_written(self, event: "ev.CheckpointWritten", now: float) -> IntakeResult:
        """Keep each job's last checkpoint time current, so victims are ranked by the work
        they would really lose without listing S3 on the scheduling path."""
        if f"/{CONTROL_DIR}/" in f"/{event.key}":
            return IntakeResult("ignored", f"controller marker s3://{event.bucket}/{event.key}")
        job = self.store.find_checkpoint_owner(event.bucket, event.key)
        if job is None:
            return IntakeResult("ignored", f"no job checkpoints under s3://{event.bucket}/{event.key}")
        at = event.time if event.time is not None else now
        self.store.note_checkpoint(job, at)
        return IntakeResult("accepted", "checkpoint-written", job)

    def _schedule(self, pool: str, event_id: str, outcome: str, reason: str, job: str | None) -> IntakeResult:
        arn = self.workflows.start("schedule", execution_name("schedule", pool, event_id), {"pool": pool})
        return IntakeResult(outcome, reason, job, arn)
