"""Intake: turn one EventBridge event into a change of the jobs table and a workflow start.

Events arrive at least once and in any order. Each one is parsed (malformed or unknown
events are rejected or ignored with a reason, never raised), deduplicated by its id, and
matched to a job and incarnation; an event about an older incarnation is stale and ignored.

It is also the trust boundary. A submission, a cancel or a lowering acts for the team of its
source (`preemptor.<team>`): the team must be configured (when `teams` is), the priority
within its ceiling, and the service call is built from the pool's allow-list
(`core.requests.admit_request`); a cancel stops, and a lowering lowers (never raises), only
the team's own jobs. A run launched outside the controller is adopted only if its tags are
well-formed and within the same bounds, and is a victim only if the controller may stop it.
Every refusal is a "rejected" result whose reason starts with a stable code (a `Refusal`),
which the handler logs and counts.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..adapters.alerts import Alerts
from ..adapters.checkpoints import CONTROL_DIR, MANIFEST, CheckpointStore, in_unsealed_helper_checkpoint
from ..adapters.instances import InstanceResolver
from ..adapters.runners import Runner, may_be_own_run
from ..adapters.store import JobsStore, LogLine
from ..adapters.workflows import WorkflowStarter, execution_name, settled_schedule
from ..config import Settings
from ..core import events as ev
from ..core.errors import CheckpointLocationUnavailable, ConflictError, PreemptorError, ServiceRejected, TransactionConflict
from ..core.jobs import JobRecord, new_run_secret
from ..core.model import JobState
from ..core.policy import UNATTRIBUTED
from ..core.pools import PoolConfig, pool_queues, pools_running, queue_name
from ..core.requests import MAX_JOB_NAME_LENGTH, Refusal, RequestRefused, admit_request
from ..core.s3uri import S3Uri
from . import actions, escalation

# SageMaker managed spot, while the job is InProgress: the service restarts it by itself.
MANAGED_SPOT_PROGRESS = ("Interrupted", "Restarting")
SAGEMAKER_OUTCOMES = {"Completed": "completed", "Failed": "failed", "Stopped": "stopped"}
_NOT_IN_A_JOB_NAME = re.compile(r"[^A-Za-z0-9-]+")
# SageMaker secondary statuses of a run whose instances were provisioned.
PROVISIONED = frozenset({"Downloading", "Training"})
BATCH_OUTCOMES = {"SUCCEEDED": "completed", "FAILED": "failed"}


@dataclass(frozen=True)
class IntakeResult:
    outcome: str  # accepted | ignored | rejected | duplicate
    reason: str
    job: str | None = None
    workflow: str | None = None
    # Accepted, with one of its claims refused (a Refusal's value): a run adopted at less
    # than its tags claim (metric `RefusedClaims`).
    refused: str | None = None

    def to_dict(self) -> dict:
        out = {"outcome": self.outcome, "reason": self.reason, "job": self.job, "workflow": self.workflow}
        return {**out, "refused": self.refused} if self.refused else out

    @property
    def code(self) -> str:
        """The stable part of `reason` (before the first colon), for metrics and logs."""
        return self.reason.split(":", 1)[0]


def controllers_job(store: JobsStore, tags: dict[str, str], run_name: str | None, controller: str = "") -> JobRecord | None:
    """The job a run is of, if its tags claim the controller launched it
    (`events.launched_by_controller`) and it may have (`runners.may_be_own_run`, against
    the job its job tag names); None for any other run, whatever its tags claim."""
    if not run_name or not ev.launched_by_controller(tags, controller):
        return None
    named = tags[ev.JOB_TAG]
    try:
        ev.validate_job_name(named)
    except ValueError:
        return None  # no job is named so
    record = store.get(named)
    return record if may_be_own_run(tags, record, run_name) else None


def _run_started(event, service: str, now: float) -> float:
    """Since when an adopted run has held its GPUs and done its work, as the service's event
    (or reconcile's description standing in for it) says: a training job since its creation,
    as the controller counts its own; a Batch job since its container started (its start,
    else its creation). Never after `now`; `now` when the event says neither.

    Taken as the time the controller heard of it, a run adopted late (its events lost, found
    by reconcile ten minutes on, or its event delayed) had none of its work before then at
    risk: its stop was judged "fresh" with the work since its checkpoint thrown away, and it
    was the cheapest victim of the pool."""
    if service == "sagemaker":
        at = event.creation_time if event.creation_time is not None else event.start_time
    else:
        at = event.started_at if event.started_at is not None else event.created_at
    return now if at is None else min(at, now)


def adoption_names(run_name: str, service: str, run_id: str) -> tuple[str, ...]:
    """The names an adopted run may be counted under, in order: the run's own, where it can
    name a job; then one of its own, the run's name made a job's (letters, digits and
    hyphens, cut short) and a digest of its run id. The second is for a run whose name is
    another job's (one of the controller's, or another run's: Batch's names are not unique)
    or cannot name a job (Batch's allow underscores and 128 characters, SageMaker's 63):
    such a run is counted all the same."""
    digest = hashlib.sha256(f"{service}:{run_id}".encode()).hexdigest()[:8]
    base = _NOT_IN_A_JOB_NAME.sub("-", run_name).strip("-")[: MAX_JOB_NAME_LENGTH - len(digest) - 1].strip("-")
    own = f"{base or 'run'}-{digest}"
    try:
        return ev.validate_job_name(run_name), own
    except ValueError:
        return (own,)


class Intake:
    def __init__(
        self,
        *,
        store: JobsStore,
        workflows: WorkflowStarter,
        runners: dict[str, Runner],
        settings: Settings,
        instances: InstanceResolver | None = None,
        alerts: Alerts | None = None,
        clock: Callable[[], float] | None = None,
        checkpoints: CheckpointStore | None = None,
    ):
        # The time now, read again after a submission's record is written (`_settled`);
        # without one, the time the event's handling began.
        self.clock = clock
        self.alerts = alerts
        self.instances = instances
        self.store = store
        self.workflows = workflows
        self.runners = runners
        self.settings = settings
        self.checkpoints = checkpoints  # confirms an announced manifest's checkpoint is whole

    def handle(self, raw: object, now: float, owner: str | None = None) -> IntakeResult:
        """Handle one event once, whoever else delivers it. `owner`: the handling's claim
        token (default: one of its own); a caller that handles the same event again after a
        handling of its own died (reconcile's second look at a run) passes the same token,
        and takes its own claim back, which a release the dying handling could not write
        left behind."""
        try:
            event = ev.parse_event(raw, tiers=self.settings.policy.tiers)
        except ev.EventRejected as e:
            return IntakeResult("rejected", f"{e.reason}: {e.detail}")
        if isinstance(event, ev.Ignored):
            return IntakeResult("ignored", event.reason)
        # A claim of this handling's own: a delivery handled while another is still at it
        # (or died mid-way) raises EventInProgress, and Lambda's retry comes back for it.
        owner = owner or uuid.uuid4().hex
        if not self.store.claim_event(event.event_id, now, owner):
            return IntakeResult("duplicate", f"event {event.event_id} already handled")
        try:
            result = self._dispatch(event, now)
        except BaseException:
            try:
                self.store.release_event(event.event_id, owner)  # Lambda's retry handles it
            except PreemptorError:
                pass  # the claim ends by itself after EVENT_CLAIM_S, before Lambda's last retry
            raise
        self.store.finish_event(event.event_id, now, result.outcome)
        return result

    def _dispatch(self, event: object, now: float) -> IntakeResult:
        if isinstance(event, ev.JobSubmitted):
            return self._submitted(event, now)
        if isinstance(event, ev.JobCancelled):
            return self._cancelled(event, now)
        if isinstance(event, ev.JobPriorityLowered):
            return self._priority_lowered(event, now)
        if isinstance(event, ev.TrainingJobStateChanged):
            return self._run_changed(
                event, "sagemaker", event.training_job_name, event.status, SAGEMAKER_OUTCOMES, now
            )
        if isinstance(event, ev.BatchJobStateChanged):
            return self._run_changed(event, "batch", event.job_id, event.status, BATCH_OUTCOMES, now)
        if isinstance(event, (ev.SpotInterruptionWarning, ev.RebalanceRecommendation)):
            return self._instance_warning(event, now)
        if isinstance(event, ev.InstanceScheduledChange):
            return self._scheduled_change(event, now)
        if isinstance(event, ev.CheckpointWritten):
            return self._checkpoint_written(event, now)
        if isinstance(event, ev.AlarmStateChanged):
            return self._alarm_changed(event, now)
        if isinstance(event, ev.BatchServiceJobStateChanged):
            return self._service_job_changed(event, now)
        if isinstance(event, ev.BatchServiceJobPreemption):
            return self._service_job_preempted(event, now)
        return IntakeResult("ignored", f"no handler for {type(event).__name__}")

    def _alarm_changed(self, event: ev.AlarmStateChanged, now: float) -> IntakeResult:
        """The wait alarm went to ALARM: escalate the jobs it is about (service.escalation)."""
        if not self.settings.wait_alarm_name or event.alarm_name != self.settings.wait_alarm_name:
            return IntakeResult("ignored", f"alarm: {event.alarm_name} is not the controller's wait alarm")
        if event.state is not ev.AlarmState.ALARM:
            return IntakeResult("ignored", f"alarm: {event.alarm_name} is {event.state.value}")
        result = escalation.escalate(
            store=self.store, settings=self.settings, workflows=self.workflows, alerts=self.alerts, alarm=event.alarm_name, now=now
        )
        jobs = result["escalated"]
        return IntakeResult("accepted", f"escalated: {len(jobs)} job(s) waiting too long" + (f" ({', '.join(jobs[:5])})" if jobs else ""))

    # -- the controller's own events -----------------------------------------------------
    @staticmethod
    def _refuse(reason: str, detail: str, job: str | None = None) -> IntakeResult:
        return IntakeResult("rejected", f"{reason}: {detail}", job)

    def _team_refusal(self, team: str, priority: int) -> tuple[Refusal, str] | None:
        policy = self.settings.policy
        if not policy.team_listed(team):
            return Refusal.UNKNOWN_TEAM, f"team {team!r} is not configured"
        ceiling = policy.max_priority(team)
        if priority > ceiling:
            return Refusal.ABOVE_TEAM_CEILING, f"priority {priority} is above team {team!r}'s ceiling {ceiling}"
        return None

    def _submitted(self, event: "ev.JobSubmitted", now: float) -> IntakeResult:
        req = event.request
        priority = req.priority
        refusal = self._team_refusal(req.team, priority)
        if refusal:
            return self._refuse(*refusal, req.name)
        pool = self.settings.pool(req.pool)
        if pool is None:
            return self._refuse(Refusal.UNKNOWN_POOL, f"pool {req.pool!r} is not configured", req.name)
        try:
            admitted = admit_request(
                req,
                pool,
                checkpoint_bucket=self.settings.checkpoint_bucket,
                default_role_arn=self.settings.training_role_arn,
                max_runtime_s=self.settings.max_training_runtime_s,
                team_role_arn=self.settings.policy.training_role(req.team),
            )
        except RequestRefused as e:
            return self._refuse(e.reason, f"{e.field}: {e.detail}" if e.field else e.detail, req.name)
        record = JobRecord(
            name=req.name,
            team=req.team,
            priority=priority,
            pool=req.pool,
            service=req.service,
            gpus=admitted.gpus,
            request=admitted.request,
            checkpoint_s3_uri=admitted.checkpoint_s3_uri,
            # The time of receipt, never the event's `time`: PutEvents lets the submitter set
            # it, and an older one would buy a place in the queue, aging, and the wait alarm's
            # escalation (which lifts its victims' protections).
            submitted_at=now,
            submitted_by=event.event_id,
            run_secret=new_run_secret(),
            sla_s=req.sla_s,
            labels=dict(req.labels),
            expected_duration_s=req.expected_duration_s,
            restart_overhead_s=req.restart_overhead_s,
            spot=req.spot,
        )
        tier = self.settings.policy.tier_of(priority)
        line = LogLine(
            req.name, record.submitted_at, "submitted", "job-submitted",
            f"team {req.team}, priority {priority} ({tier}), {record.gpus} GPUs in {req.pool}", once=f"submitted#{event.event_id}",
        )
        if not self.store.put_new(record, log=line):
            existing = self.store.get(req.name)
            if existing is not None and existing.adopted:
                # Not this job submitted twice: another team's (or its own) run, launched
                # outside the controller and counted under its name. Said, not ignored.
                return self._refuse(
                    Refusal.NAME_TAKEN,
                    f"{req.name} is the name of a {existing.service} run team {existing.team!r} launched outside the controller"
                    " (adopted); submit the job under another name",
                    req.name,
                )
            if existing is None or existing.submitted_by != event.event_id:
                return IntakeResult("duplicate", f"job {req.name} was already submitted", req.name)
            # This very submission, inserted with its line by an earlier handling of the
            # event that died after the insert (or by this one, whose answer was lost and
            # resent): its alias and its plan are done now (each a no-op if done already).
            record = existing
        previous = self.store.put_checkpoint_alias(record.checkpoint_s3_uri, record.name)
        if previous not in (None, record.name):
            self._take_location(record, previous, now)
        if record.status is not JobState.PENDING:
            return IntakeResult("accepted", "job-submitted", req.name)  # planned and moved on already
        return self._settled(req.pool, event.event_id, "accepted", "job-submitted", req.name, now)

    def _take_location(self, record: JobRecord, user: str, now: float) -> None:
        """A submission's checkpoint location is the controller's to give (the team's prefix
        for that job name). The job its alias named before (`user`), an adopted run naming it
        in its own CheckpointConfig or tag, loses it: from now on its checkpoints are the
        submission's, and crediting the run with them would confirm its stop by another
        job's work (and send that job's helper its checkpoint requests). It keeps running,
        counted, with no checkpoint the controller can confirm, as an adopted run without a
        location."""
        uri = record.checkpoint_s3_uri
        for _ in range(actions.JUDGE_ATTEMPTS):
            squatter = self.store.get(user)
            if squatter is None or squatter.checkpoint_s3_uri != uri or squatter.status.is_terminal:
                return
            try:
                self._lose_location(squatter, now, f"{uri} is the checkpoint location of job {record.name}, submitted now")
            except ConflictError:
                continue  # it moved meanwhile: judged again on what is stored now
            self.store.log(
                record.name, now, "checkpoint-location-taken", "location-given-to-submission",
                f"{uri} was claimed by {squatter.name} ({'an adopted run' if squatter.adopted else 'another job'}); it is this job's",
            )
            return

    def _lose_location(self, record: JobRecord, now: float, why: str, reason: str = "location-given-to-submission") -> None:
        """`record` keeps running with no checkpoint location (one it may not have).

        Raises:
            ConflictError: the record changed since it was read.
        """
        line = LogLine(record.name, now, "checkpoint-location-lost", reason, f"{why}: no longer trusted as this run's")
        self.store.transition(record, record.with_changes(checkpoint_s3_uri="", last_checkpoint_at=None), [record.status], log=line)

    def _teams_job(self, event: "ev.JobCancelled | ev.JobPriorityLowered") -> JobRecord | IntakeResult:
        """The job a team's event names, or the answer when there is none: ignored when
        unknown, refused when another team's (`not-your-job`)."""
        record = self.store.get(event.name)
        if record is None:
            return IntakeResult("ignored", f"unknown job {event.name}", event.name)
        if record.team != event.team:
            return self._refuse(
                Refusal.NOT_YOUR_JOB, f"job {event.name} belongs to team {record.team!r}, not {event.team!r}", event.name
            )
        return record

    def _cancelled(self, event: "ev.JobCancelled", now: float) -> IntakeResult:
        record = self._teams_job(event)
        if isinstance(record, IntakeResult):
            return record
        # Honoured in every state: PENDING, ADMITTED (never launched), RUNNING and
        # PREEMPTING (stopped, never relaunched): `actions.cancel`.
        result = actions.cancel(store=self.store, runners=self.runners, job=record.name, now=now, alerts=self.alerts)
        return IntakeResult(result["outcome"], result["reason"], event.name)

    def _priority_lowered(self, event: "ev.JobPriorityLowered", now: float) -> IntakeResult:
        """A team lowers one of its own jobs' priority (Slurm's `nice` for owners): a sweep
        that is no longer urgent makes way, and may become a victim of the team's other work.
        Lowering only: a higher priority is the platform's to give (`preemptor priority`),
        as a submission's is bounded by the team's ceiling. Written as the operator's change
        is (`JobsStore.set_priority`: the `priority-changed` line and the team's notice, in
        one transaction conditional on the job as read; read again if the controller
        changed it meanwhile); the notice is published at once, and a cycle of its pool
        plans the change. A job being stopped goes on being stopped; a pending job's
        preemptions its new priority no longer permits are called off where no stop was sent
        (`actions.outranked_preemptions`)."""
        for _ in range(3):
            record = self._teams_job(event)
            if isinstance(record, IntakeResult):
                return record
            if record.status.is_terminal:
                return IntakeResult("ignored", f"job {event.name} already ended ({record.status.value})", event.name)
            was, value = record.priority, event.priority
            why = f"lowered by team {event.team}"
            if value == was:
                # A redelivery of a lowering whose first handling died before its call-off
                # (`actions.outranked_preemptions`) finishes it.
                spared = actions.outranked_preemptions(
                    store=self.store, policy=self.settings.policy, preemptor=record, why=why, now=now, alerts=self.alerts
                )
                if spared:
                    return self._settled(record.pool, event.event_id, "accepted", f"preemptions of {', '.join(spared)} called off", record.name, now)
                return IntakeResult("ignored", f"job {event.name} already has priority {value}", event.name)
            if value > was:
                return self._refuse(
                    Refusal.NOT_A_LOWERING,
                    f"team {event.team!r} may only lower job {event.name}'s priority ({was} -> {value}); "
                    "raising it is the platform's (preemptor priority)",
                    event.name,
                )
            tier = self.settings.policy.tier_of(value)
            line, notice = actions.priority_changed(record, value, tier, now, "team", why, event.note)
            try:
                changed = self.store.set_priority(record, value, line, notice)
            except ConflictError:
                continue  # the controller changed it meanwhile: read again, judge again
            actions.announce(self.store, self.alerts, notice)  # one SNS refused: reconcile publishes it
            # A preemptor lowered below its victims: the stops not sent yet are called off.
            spared = actions.outranked_preemptions(
                store=self.store, policy=self.settings.policy, preemptor=changed, why=why, now=now, alerts=self.alerts
            )
            reason = f"priority {was} -> {value}" + (f"; preemptions of {', '.join(spared)} called off" if spared else "")
            return self._settled(record.pool, event.event_id, "accepted", reason, record.name, now)
        raise TransactionConflict(f"job {event.name} kept changing while its priority was lowered")

    # -- SageMaker and Batch runs --------------------------------------------------------
    def _run_changed(self, event, service: str, run_id: str, status: str, outcomes: dict, now: float) -> IntakeResult:
        found = self.store.find_run(service, run_id)
        if found is None:
            return self._maybe_adopt(event, service, run_id, status, now)
        name, incarnation = found
        record = self.store.get(name)
        if record is None or record.incarnation != incarnation:
            return IntakeResult("ignored", f"stale: event for incarnation {incarnation} of {name}", name)
        if record.adopted and record.submitted_by == event.event_id:
            # The event that adopted it, again (its handling died after the insert).
            claims = ev.adoption_tags(event.tags or {}, tiers=self.settings.policy.tiers)
            _, claimed, refused = self._granted(claims, event.tags or {}, record.pool)
            pool = self.settings.pool(record.pool)
            demand = self._demand(event, claims, pool) if claims is not None and pool is not None else None
            if isinstance(demand, tuple):
                _, over, over_refused = self._over_capacity(*demand, pool)
                claimed, refused = claimed + over, over_refused or refused
            return self._complete_adoption(record, event.event_id, claimed, now, again=True, refused=refused)
        outcome = outcomes.get(status)
        secondary = getattr(event, "secondary_status", None)
        if outcome is None and service == "sagemaker" and secondary in MANAGED_SPOT_PROGRESS:
            return self._managed_spot(record, event, now)
        if outcome is None:
            placed = self._note_instance(event, name, incarnation, status, now)
            if status == "RUNNING" or secondary in PROVISIONED:
                # Its instances came: the service has capacity for its offering again.
                self.store.capacity_seen(record.pool, record.launched_instance_type or self.store.ANY_OFFERING)
            return IntakeResult("ignored", f"progress: {service} {run_id} is {status}{placed}", name)
        if record.status is JobState.PREEMPTING and outcome in ("stopped", "failed"):
            # Our own stop: the preemption workflow requeues the job once the stop is final.
            return IntakeResult("ignored", f"stop of a preempted run ({status})", name)
        reason = getattr(event, "failure_reason", None) or getattr(event, "status_reason", None) or status
        outcome, reason = actions.ended_outcome(service, outcome, str(reason), secondary, record.cancel_requested)
        payload = {
            "job": name,
            "incarnation": incarnation,
            "outcome": outcome,
            "reason": str(reason),
            "pool": record.pool,
        }
        arn = self.workflows.start("job_ended", execution_name(name, str(incarnation), event.event_id), payload)
        return IntakeResult("accepted", f"run ended: {outcome}", name, arn)

    def _managed_spot(self, record: JobRecord, event: "ev.TrainingJobStateChanged", now: float) -> IntakeResult:
        """SageMaker managed spot took the instances away (`Interrupted`) or is bringing the
        job back from its checkpoint (`Restarting`): accounted once, by the event's own time
        (its handling may come later), as `actions.managed_spot` says."""
        outcome, detail = actions.managed_spot(
            store=self.store, record=record, interrupted=event.secondary_status == "Interrupted",
            at=event.time if event.time is not None else now, now=now,
        )
        return IntakeResult(outcome, detail, record.name)

    def _note_instance(self, event, name: str, incarnation: int, status: str, now: float) -> str:
        """Remember the EC2 instance a running Batch job is on, for spot warnings."""
        arn = getattr(event, "container_instance_arn", None)
        if status != "RUNNING" or not arn or self.instances is None:
            return ""
        instance = self.instances.ec2_instance(arn)
        if instance is None:
            return ""
        self.store.put_instance_alias(instance, name, incarnation, now)
        self.store.log(name, now, "placed", "batch-running", f"runs on EC2 instance {instance}")
        return f" on {instance}"

    def _maybe_adopt(self, event, service: str, run_id: str, status: str, now: float) -> IntakeResult:
        running = status in ("InProgress", "RUNNING")
        tags = event.tags or {}
        controller = self.settings.controller
        other = ev.other_controller(tags, controller)
        if other is not None and other in self.settings.other_controllers:
            # A second stack's run in the account: its own controller counts it and stops it.
            return IntakeResult("ignored", f"another controller's run: {service} run {run_id} was launched by {other!r}")
        claimed_ours = ev.launched_by_controller(tags, controller)
        if controllers_job(self.store, tags, event.training_job_name if service == "sagemaker" else event.job_name, controller):
            # Our own run, whose start event beat the run alias: the launch records it (or,
            # a run of an incarnation its job has left, reconcile stops it).
            return IntakeResult("ignored", f"own run: {service} run {run_id} was launched by the controller")
        claims = ev.adoption_tags(tags, tiers=self.settings.policy.tiers)  # an unusable tag is read as absent
        if claims is None and claimed_ours:
            return self._refuse(
                Refusal.CONTROLLER_TAGS,
                f"{service} run {run_id} carries the controller's job tags, and the controller launched no such run",
            )
        if claims is None:
            return IntakeResult("ignored", f"not managed: {service} run {run_id} has no preemptor tags")
        if not running:
            return IntakeResult("ignored", f"not managed: {service} run {run_id} was not adopted (it is {status}; a run is adopted running)")
        found = self._pool_running(event, service, claims.pool)
        if isinstance(found, str):
            return self._refuse(Refusal.UNKNOWN_POOL, f"{service} run {run_id} {found}")
        pool, unsure = found
        priority, claimed, refused = self._granted(claims, tags, pool.name)
        claimed += unsure
        demand = self._demand(event, claims, pool)
        if isinstance(demand, IntakeResult):
            return demand
        gpus, over, over_refused = self._over_capacity(*demand, pool)
        claimed, refused = claimed + over, over_refused or refused
        if service == "sagemaker":
            name, checkpoint = event.training_job_name, event.checkpoint_s3_uri or ""
        else:
            name, checkpoint = event.job_name, claims.checkpoint_s3_uri or ""
        run_name, names = name, adoption_names(name, service, run_id)
        name = names[0]
        shared = ""
        if checkpoint:
            try:
                checkpoint = ev.normalize_s3_prefix(checkpoint)
            except ValueError as e:
                # A training job's own CheckpointConfig (SageMaker takes a bucket's root):
                # counted all the same, with no checkpoint the controller can confirm.
                shared, checkpoint = f"; no usable checkpoint location ({e})", ""
        if checkpoint and not self._job_shaped(checkpoint):
            # The team's root (or the bucket's) lists every job's checkpoints beneath it, and a
            # prefix inside a job's location lists that job's: either would confirm this run's
            # stop by other jobs' work.
            shared = (
                f"; its checkpoint location {checkpoint} is in the controller's checkpoint bucket but not"
                " <team>/<job> (it holds, or lies inside, the locations of jobs): not trusted as its own"
            )
            checkpoint = ""
        user = self.store.checkpoint_location_user(checkpoint, name) if checkpoint else None
        if user is not None:
            # Counted all the same (refused, its GPUs would not be), but never credited with
            # another job's checkpoints, nor sending that job's helper its requests.
            shared = f"; its checkpoint location {checkpoint} is job {user}'s: not trusted as its own"
            checkpoint = ""
        # IAM keeps the controller off any run tagged with another stack's name (its stop
        # would be refused): one claiming a stack not listed is counted, never a victim.
        stoppable = claims.managed and other is None
        started = _run_started(event, service, now)
        record = JobRecord(
            name=name,
            team=claims.team or UNATTRIBUTED,
            priority=priority,
            pool=pool.name,
            service=service,
            gpus=gpus,
            request={},
            checkpoint_s3_uri=checkpoint,
            submitted_at=now,
            submitted_by=event.event_id,
            status=JobState.RUNNING,
            run_id=run_id,
            run_name=run_name,
            started_at=started,
            first_started_at=started,
            adopted=True,
            # IAM lets the controller stop only runs tagged preemptor:managed=true.
            stoppable=stoppable,
        )
        for name in names:
            record = record.with_changes(name=name)
            if self.store.put_adopted(record, self._adopted_line(record, event.event_id, claimed + shared)):
                return self._complete_adoption(record, event.event_id, claimed + shared, now, refused=refused)
            existing = self.store.get(name)
            if existing is not None and existing.adopted and existing.submitted_by == event.event_id:
                return self._complete_adoption(existing, event.event_id, claimed + shared, now, again=True, refused=refused)  # adopted by a concurrent handling
            if existing is None or (existing.service, existing.run_id) == (service, run_id):
                break  # adopted by another event's handling (or gone meanwhile)
        return IntakeResult("duplicate", f"{service} run {run_id} already known as {record.name}", record.name)

    def _complete_adoption(
        self, record: JobRecord, event_id: str, note: str, now: float, again: bool = False, refused: str | None = None
    ) -> IntakeResult:
        """An adopted run, inserted with its `adopted` line (`_adopted_line`): its checkpoint
        location claimed; also `again` for the same event (a redelivery after a handling that
        died after the insert, `_run_changed`), which writes the line only where an insert
        left none. `note` ends the line; `refused`: the refusal of a claim of its tags it was
        adopted without (`IntakeResult.refused`)."""
        name, uri = record.name, record.checkpoint_s3_uri
        holder = self.store.claim_checkpoint_alias(uri, name) if uri else None
        if holder is not None:
            # Taken meanwhile (a submission of the job whose location it is): the run keeps its
            # GPUs counted, without the location.
            for _ in range(actions.JUDGE_ATTEMPTS):
                try:
                    self._lose_location(self.store.require(name), now, f"{uri} is held by {holder}", "location-held-by-another-job")
                    break
                except ConflictError:
                    continue
        if again and "adopted" not in {e["kind"] for e in self.store.history(name)}:
            line = self._adopted_line(record, event_id, note)
            self.store.log(line.job, line.at, line.kind, line.reason, line.detail, once=line.once)
        # A refused claim is counted by the handling that returns (the handler counts it): a
        # handling that died after the insert counted nothing, and its event's redelivery does.
        return IntakeResult("accepted", "adopted", name, refused=refused)

    @staticmethod
    def _adopted_line(record: JobRecord, event_id: str, note: str) -> LogLine:
        """The `adopted` line of a run adopted by `event_id`: what is counted where, at what
        priority, whether it may be stopped, and `note` (the claims refused)."""
        stop = "stoppable" if record.stoppable else "not stoppable"  # why not: `note` (`_granted`)
        if record.run_name and record.run_name != record.name:
            note = f"; {record.service} run {record.run_name} (its name is another job's, or names none){note}"
        return LogLine(
            record.name, record.submitted_at, "adopted", "tagged-outside-controller",
            f"{record.gpus} GPUs counted in {record.pool} at priority {record.priority}, {stop}{note}",
            once=f"adopted#{event_id}",
        )

    def _granted(self, claims: ev.AdoptionTags | None, tags: dict[str, str], pool: str) -> tuple[int | None, str, str | None]:
        """The priority an adopted run's `claims` are granted, what its line says of the
        claims refused (and, first, why it is not stoppable, when it is not for want of the
        managed tag) and the refusal's code ('' and None when none was; of several, the last
        below). `pool`: where it is counted, the pool whose capacity it runs on
        (`_pool_running`), whatever its pool tag says.

        Its GPUs are in use whatever its tags claim: a run refused for claiming too much
        would not be counted, and the pool would be oversubscribed around it. So it is
        counted at the priority the platform grants its team: its ceiling, or the lowest
        tier for a team the policy does not list; a tag that says nothing usable is read as
        absent (an unreadable priority: the lowest tier). Tags that claim the controller launched it
        (a run adopted is one it did not launch: `controllers_job`) are not believed either: the
        run is the team's, and that refusal is the one counted."""
        if claims is None:
            return None, "", None
        policy = self.settings.policy
        lowest = min(policy.tiers.values())
        granted, refused = claims.priority, None
        note = "" if claims.managed else " (no preemptor:managed=true tag)"  # why it is not stoppable
        refusal = self._team_refusal(claims.team, claims.priority) if claims.priority is not None and claims.team is not None else None
        if claims.team is None:
            # No team to grant it anything: counted as no one's, at the lowest tier.
            granted = lowest
            note += f"; counted as {UNATTRIBUTED} at the lowest tier"
            if claims.priority is not None and claims.priority != lowest:
                note += f", not its priority tag's {claims.priority}"
        elif refusal is not None:
            granted = policy.max_priority(claims.team) if policy.team_listed(claims.team) else lowest
            note += f"; its priority tag claims {claims.priority} ({refusal[0]}: {refusal[1]}), not granted"
            refused = refusal[0].value
        if claims.problems:
            # Tags it carries that say nothing usable: read as absent, the priority as the lowest.
            granted = lowest if granted is None else granted
            note += f"; {'; '.join(claims.problems)} ({Refusal.BAD_TAG}: read as absent)"
            refused = Refusal.BAD_TAG.value
        if claims.pool is not None and claims.pool != pool:
            note += f"; its pool tag names {claims.pool!r}, and it runs on pool {pool!r}'s capacity ({Refusal.WRONG_POOL}: not believed)"
            refused = Refusal.WRONG_POOL.value
        if ev.launched_by_controller(tags, self.settings.controller):
            note += (
                f"; its tags claim it is the controller's run of job {tags[ev.JOB_TAG]!r}"
                f" ({Refusal.CONTROLLER_TAGS}: the controller launched no such run), not believed"
            )
            refused = Refusal.CONTROLLER_TAGS.value
        other = ev.other_controller(tags, self.settings.controller)
        if other is not None:  # one of OtherControllers' runs is left to it (`_maybe_adopt`)
            note += (
                f"; its tags claim it is stack {other!r}'s run ({Refusal.CONTROLLER_TAGS}: no such stack among"
                " OtherControllers), not believed, and it is never a victim (IAM keeps this stack off another's runs)"
            )
            refused = Refusal.CONTROLLER_TAGS.value
        return granted, note, refused

    def _job_shaped(self, checkpoint: str) -> bool:
        """Whether an adopted run's location may be its own: anywhere outside the controller's
        checkpoint bucket (no submission's location is there), and inside it only a location
        of the shape the controller gives jobs, `<team>/<job>` (one a submission would get is
        taken back when it comes: `_take_location`), never under the controller's own `_`
        prefixes (training output: `_output/`)."""
        location = S3Uri.parse(checkpoint)
        if location.bucket != self.settings.checkpoint_bucket:
            return True
        return len(location.prefix.split("/")) == 2 and not location.prefix.startswith("_")

    def _sagemaker_demand(self, event: "ev.TrainingJobStateChanged", pool) -> "int | IntakeResult":
        """GPUs of an adopted training job, counted from its own ResourceConfig: every
        instance group in full, each instance with the pool's GPUs per instance (its types
        are the pool's: `_pool_running`)."""
        groups = event.instance_groups or ((event.instance_type, event.instance_count or 0),)
        instances = sum(count for _, count in groups)
        if instances <= 0:
            return self._refuse(Refusal.BAD_DEMAND, f"training job {event.training_job_name} states no instance count")
        return instances * pool.gpus_per_instance

    def _demand(self, event, claims: ev.AdoptionTags, pool: PoolConfig) -> "tuple[int, bool] | IntakeResult":
        """(GPUs an adopted run holds, whether only its `preemptor:gpus` tag says so), or its
        refusal. What the service says it holds is counted, never less: a training job's
        instances (`_sagemaker_demand`), a Batch container's GPU requirement (a tag is the
        submitter's word, and an understated one would oversubscribe the pool); else the
        tag; else one instance's."""
        if isinstance(event, ev.TrainingJobStateChanged):
            demand = self._sagemaker_demand(event, pool)
            return demand if isinstance(demand, IntakeResult) else (demand, False)
        if event.gpus is not None:
            return event.gpus, False
        return (claims.gpus, True) if claims.gpus is not None else (pool.gpus_per_instance, False)

    @staticmethod
    def _over_capacity(gpus: int, by_tag: bool, pool: PoolConfig) -> tuple[int, str, str | None]:
        """(GPUs counted, what the line says, the refusal's code or None) of an adopted run of
        `gpus` (`by_tag`: only its tag says so) in `pool`.

        More than the pool is configured with: what the service says it holds is counted in
        full (the account gave it those instances; the pool is over-full while it runs, and
        nothing else is admitted into it); a number only its tag states, at the pool's
        capacity, the claim refused (`bad-tag`). Before, either was refused and its GPUs
        went uncounted: the controller filled the pool around it, and its launches met the
        account's quota."""
        if gpus <= pool.capacity_gpus:
            return gpus, "", None
        if by_tag:
            note = f"; its {ev.GPUS_TAG} tag claims {gpus} GPUs, more than pool {pool.name!r} holds ({Refusal.BAD_TAG}): counted as the pool's {pool.capacity_gpus}"
            return pool.capacity_gpus, note, Refusal.BAD_TAG.value
        return gpus, f"; it holds {gpus} GPUs, more than pool {pool.name!r} is configured with ({pool.capacity_gpus}): the pool is over-full while it runs", None

    def _pool_running(self, event, service: str, tagged: str | None) -> "tuple[PoolConfig, str] | str":
        """The pool whose capacity a run a team launched holds (`pools_running`): where the
        service runs it (its instance types and whether on spot, its job queue and the queue's
        compute environments), not where its tags say; the tagged pool only among those it is
        likeliest to be on (the first tier). With what its `adopted` line says of a guess
        (a queue whose compute environments could not be read); else why it runs on none of
        the pools.

        Before, the pool tag (else the service's first pool) decided: a run tagged with
        another pool, or with none and run on a second pool's instance type or on a fallback
        type, was refused, and its GPUs, held all the same, were not counted; a Batch job in a
        queue of no pool's was counted in one, whatever compute environments it ran on."""
        unsure = ""
        if service == "sagemaker":
            groups = event.instance_groups or ((event.instance_type, event.instance_count),)
            types = tuple(dict.fromkeys(t for t, _ in groups if t))
            spot = event.spot

            def likeliest(on_spot: bool) -> list[str]:
                tiers = pools_running(self.settings.pools, service, instance_types=types, spot=on_spot)
                return [p.name for p in tiers[0]] if tiers else []

            if spot is None and likeliest(True) != likeliest(False):
                spot, unsure = self._on_spot(event.training_job_name)
            tiers = pools_running(self.settings.pools, service, instance_types=types, spot=spot)
            where = f"runs on {', '.join(types) or 'no instance type it states'}{' (spot)' if spot else ''}, which no {service} pool has"
        else:
            queue = queue_name(event.job_queue)
            environments, unsure = self._queue_environments(queue)
            tiers = pools_running(self.settings.pools, service, job_queue=queue, compute_environments=environments)
            where = f"runs in job queue {queue}, whose compute environments no {service} pool's queues use"
        if not tiers:
            return where
        return next((p for p in tiers[0] if p.name == tagged), tiers[0][0]), unsure

    def _on_spot(self, name: str) -> "tuple[bool | None, str]":
        """(Whether training job `name` runs on managed spot, what its `adopted` line says when
        that could not be read), asked of SageMaker where it decides the pool: pools of its
        instance types bought both ways (spot and on-demand are separate quotas), and an
        event that does not say (EventBridge's carries no `EnableManagedSpotTraining`; a
        maximum wait says spot, `events._on_spot`). Refused for good (denied): unknown, the
        run counted in its tagged pool among them, else the first, which the line says; a
        throttled or failed look-up fails the handling, and Lambda's retry looks again."""
        try:
            return self.runners["sagemaker"].on_spot(name), ""
        except ServiceRejected as e:
            return None, f"; whether it runs on spot could not be read ({e.code}): counted as if it ran either way"

    def _queue_environments(self, queue: str) -> "tuple[dict[str, frozenset[str]] | None, str]":
        """(The compute environments of a Batch run's job `queue` and of the pools' queues,
        what the `adopted` line says when they could not be read). Not looked up for a pool's
        own queue (that pool is where the run is counted). Batch refusing the look-up for good
        (denied, invalid) leaves the run counted as if its queue shared a pool's (`None`: the
        tagged pool, else the first Batch pool, as before), which the line says; a throttled
        or failed one fails the handling, and Lambda's retry of the event looks again."""
        queues = {q for p in self.settings.pools if p.service == "batch" for q in pool_queues(p)}
        if queue in queues:
            return None, ""
        try:
            environments = self.runners["batch"].compute_environments((queue, *sorted(queues)))
        except ServiceRejected as e:
            return None, f"; the compute environments of job queue {queue} could not be read ({e.code}): counted as if they were a pool's"
        if queue not in environments:
            return None, f"; Batch does not list job queue {queue}: counted as if its compute environments were a pool's"
        return environments, ""

    # -- EC2 warnings ---------------------------------------------------------------------
    def _instance_warning(self, event, now: float) -> IntakeResult:
        """Every run on the instance is warned (several Batch jobs may share one); a run
        that has moved on since (an older incarnation) is left alone by its workflow."""
        runs = self.store.runs_on_instance(event.instance_id) if event.instance_id else []
        if not runs:
            return IntakeResult("ignored", f"no managed run on instance {event.instance_id}")
        stop = isinstance(event, ev.SpotInterruptionWarning)
        reason = "spot-interruption" if stop else "rebalance-recommendation"
        arns = []
        for name, incarnation in runs:
            payload = {"job": name, "incarnation": incarnation, "instance_id": event.instance_id, "stop": stop, "reason": reason}
            arns.append(self.workflows.start("spot", execution_name(name, str(incarnation), event.event_id), payload))
        more = f": {', '.join(n for n, _ in runs)}" if len(runs) > 1 else ""
        return IntakeResult("accepted", f"{reason}{more}", runs[0][0], arns[0])

    def _scheduled_change(self, event: "ev.InstanceScheduledChange", now: float) -> IntakeResult:
        """AWS Health will retire, reboot or maintain instances: each job running on one is
        asked for a checkpoint now, as for a rebalance recommendation (the change comes
        days or hours ahead; the job keeps running, and a stop when it comes loses little)."""
        started = []
        for instance_id in event.instance_ids:
            for name, incarnation in self.store.runs_on_instance(instance_id):
                payload = {
                    "job": name,
                    "incarnation": incarnation,
                    "instance_id": instance_id,
                    "stop": False,
                    "reason": f"scheduled-change: {event.event_type_code}"[:200],
                }
                self.workflows.start("spot", execution_name(name, str(incarnation), event.event_id), payload)
                started.append(name)
        if not started:
            return IntakeResult("ignored", f"{event.event_type_code}: no managed run on {', '.join(event.instance_ids)}")
        return IntakeResult("accepted", f"scheduled-change: checkpoint asked of {', '.join(started)}", started[0])

    # -- Batch's own preemption of service jobs --------------------------------------------
    # The controller never submits Batch service jobs, but a team may run its SageMaker
    # training through a Batch service queue and tag the job so that the controller adopts
    # its training job (it then counts in a pool and can be a victim). When Batch's quota
    # management preempts such a service job, the training job is asked for a checkpoint
    # while it still runs, and the preemption is accounted on the job.
    def _service_job_changed(self, event: "ev.BatchServiceJobStateChanged", now: float) -> IntakeResult:
        if event.training_job is None:
            return IntakeResult("ignored", f"service job {event.service_job_id} is {event.status}: no training job yet")
        self.store.put_service_job_alias(event.service_job_id, event.training_job, now)
        return IntakeResult("accepted", f"service job {event.service_job_id} runs training job {event.training_job}")

    def _service_job_preempted(self, event: "ev.BatchServiceJobPreemption", now: float) -> IntakeResult:
        if event.phase == "started":
            training = self.store.service_job_training_job(event.service_job_id)
            found = self.store.find_run("sagemaker", training) if training else None
            if found is None:
                return IntakeResult("ignored", f"batch-preemption: service job {event.service_job_id} runs no job the controller knows")
            name, incarnation = found
            payload = {"job": name, "incarnation": incarnation, "instance_id": "", "stop": False,
                       "reason": f"batch-preemption: {event.status_reason or 'quota reclaim'}"[:200]}
            self.workflows.start("spot", execution_name(name, str(incarnation), event.event_id), payload)
            self.store.log(name, now, "batch-preempting", "batch-quota-reclaim",
                           f"Batch preempts service job {event.service_job_id}: checkpoint asked while it still runs")
            return IntakeResult("accepted", f"batch-preemption: checkpoint asked of {name}", name)
        accounted = []
        for training in event.stopped_training_jobs:
            found = self.store.find_run("sagemaker", training)
            record = self.store.get(found[0]) if found else None
            if record is None:
                continue
            since = record.last_checkpoint_at if record.last_checkpoint_at is not None else record.started_at or now
            at_risk = record.gpus * max(0.0, now - since)
            self.store.log(
                record.name, now, "batch-preempted", "batch-quota-reclaim",
                f"Batch preempted {training} ({event.preempted_attempts} preemption(s) of service job {event.service_job_id}); "
                f"about {at_risk:.0f} GPU-seconds since its last checkpoint",
                lost_gpu_seconds=at_risk, service_job=event.service_job_id,
            )
            accounted.append(record.name)
        if not accounted:
            return IntakeResult("ignored", f"batch-preemption: service job {event.service_job_id} stopped no job the controller knows")
        return IntakeResult("accepted", f"batch-preemption: accounted on {', '.join(accounted)}", accounted[0])

    def _checkpoint_written(self, event: "ev.CheckpointWritten", now: float) -> IntakeResult:
        """Keep each job's last checkpoint time current, so victims are ranked by the work
        they would really lose without listing S3 on the scheduling path."""
        if f"/{CONTROL_DIR}/" in f"/{event.key}":
            return IntakeResult("ignored", f"controller marker s3://{event.bucket}/{event.key}")
        if in_unsealed_helper_checkpoint(event.key):
            # The helper writes a checkpoint's files, then its manifest: until the manifest,
            # the files are a save in progress (or torn), never a checkpoint to stop on.
            return IntakeResult("ignored", f"file of a checkpoint not complete until its {MANIFEST}: s3://{event.bucket}/{event.key}")
        job = self.store.find_checkpoint_owner(event.bucket, event.key)
        if job is None:
            return IntakeResult("ignored", f"no job checkpoints under s3://{event.bucket}/{event.key}")
        at = event.time if event.time is not None else now
        if event.key.rsplit("/", 1)[-1] == MANIFEST and self.checkpoints is not None:
            # A manifest may arrive before the files it names (SageMaker's sync has its own
            # order): the checkpoint counts once the location says it is whole.
            record = self.store.get(job)
            if record is not None and record.checkpoint_s3_uri:
                try:
                    confirmed = self.checkpoints.newest(record.checkpoint_s3_uri)
                except CheckpointLocationUnavailable:
                    confirmed = at  # listing refused: the announcement is all there is
                if confirmed is None:
                    return IntakeResult("ignored", f"manifest s3://{event.bucket}/{event.key}: its files are not all there yet", job)
                at = confirmed  # the newest whole one: the announced one, or an older one
        self.store.note_checkpoint(job, at)
        return IntakeResult("accepted", "checkpoint-written", job)

    def _settled(self, pool: str, event_id: str, outcome: str, reason: str, job: str, now: float) -> IntakeResult:
        """Plan a submission at the end of its settle window (`settle_s`), with every job
        submitted (and every GPU freed) within it, so a burst is ranked as one and no job is
        launched only to be preempted by one submitted a second later (`settled_schedule`).
        The window is the one the clock is in after the record was written."""
        at = self.clock() if self.clock is not None else now
        start = settled_schedule(pool, at, self.settings.settle_s, execution_name("schedule", pool, event_id))
        arn = self.workflows.start("schedule", start["name"], start["input"])
        return IntakeResult(outcome, reason, job, arn)
