"""A job as the controller keeps it, across all its incarnations (runs)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field, replace

from .model import JobState, PendingJob, RunningJob
from .progress import is_fresh

SPOT_INTERRUPTION = "spot-interruption"  # `preempted_by` of a job stopped for its instance
# Two tellings of one managed-spot change (its event's time, and the time DescribeTrainingJob's
# SecondaryStatusTransitions give it, read by reconcile) are at most this far apart; two
# changes of one kind are further apart (an interruption waits for the restart before it,
# and a restart for its spot capacity).
SAME_SPOT_CHANGE_S = 300.0
SPOT_TIMES_KEPT = 20  # managed-spot interruption times a job keeps (`spot_interruptions`)


# The label by which a job declares that it saves a checkpoint on SIGTERM within the grace
# (the training helper, preemptor_training.Checkpointer, does).
SAVES_ON_STOP_LABEL = "preemptor/saves-on-stop"

RUN_TOKEN_CHARS = 32  # hex digits of a run's token: 128 bits


def new_run_secret() -> str:
    """A job's run secret (`JobRecord.run_secret`): 256 random bits."""
    return secrets.token_hex(32)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job: what was asked for, where it stands, and what preemption has cost it.

    `incarnation` counts runs: 1 for the first launch, 2 after the first relaunch, ...
    `run_id` identifies the current run in its service (SageMaker training job name, or
    Batch job id) once launched.
    """

    name: str
    team: str
    priority: int
    pool: str
    service: str  # "sagemaker" | "batch"
    gpus: int
    request: dict
    checkpoint_s3_uri: str
    submitted_at: float
    status: JobState = JobState.PENDING
    incarnation: int = 1
    run_name: str | None = None
    run_id: str | None = None
    started_at: float | None = None
    first_started_at: float | None = None
    ended_at: float | None = None
    last_checkpoint_at: float | None = None
    preemptions: int = 0
    lost_gpu_seconds: float = 0.0
    stops_without_fresh_checkpoint: int = 0
    preempted_by: str | None = None
    preempting_since: float | None = None
    cancel_requested: bool = False
    adopted: bool = False
    outcome_reason: str | None = None
    sla_s: int | None = None
    labels: dict = field(default_factory=dict)
    # Inputs of the policy engine (docs/policy.md). `work_done_s`: work saved in
    # checkpoints by earlier incarnations; `pending_since`: when it last became pending
    # (set on requeue; the preemption delay counts from it).
    expected_duration_s: float | None = None
    restart_overhead_s: float = 0.0
    spot: bool = False
    work_done_s: float = 0.0
    pending_since: float | None = None
    # Set by the controller: when capacity was reserved, and how long a spared victim is
    # protected from being chosen again.
    admitted_at: float | None = None
    spared_until: float | None = None
    nominated_at: float | None = None  # victims were last chosen for it (capacity handover)
    guaranteed: bool = False  # admitted by the starvation guard: never a victim
    # False for an adopted run without the preemptor:managed=true tag: IAM lets the
    # controller stop only tagged runs, so it holds capacity but is never a victim.
    stoppable: bool = True
    # The scheduling cycle (execution name and cycle number) that admitted it or chose it
    # as a victim, or the spot execution that took it for its instance: a retried step
    # returns what it already did.
    decided_by: str | None = None
    # Optimistic concurrency: bumped by every transition and cancel request; a transition
    # is written only if the stored version is still the one it was decided on.
    version: int = 0
    # Launches the service refused for good (validation, quota, a taken name): the job is
    # retried after `not_before` (backoff), and failed after MAX_LAUNCH_ATTEMPTS.
    launch_attempts: int = 0
    # Launch steps that gave up in a row (their retries of throttling, 5xx or a dying Lambda
    # spent): the job goes back to the queue, each time after a longer backoff.
    launches_given_up: int = 0
    not_before: float | None = None
    last_launch_error: str | None = None
    cancel_requested_at: float | None = None
    # Launches that met no capacity (SageMaker CapacityError, ResourceLimitExceeded): the
    # job waits for capacity (backoff until `not_before`), failed after MAX_CAPACITY_RETRIES.
    capacity_retries: int = 0
    launched_instance_type: str | None = None  # the offering the current run was created on
    # What the controller learned of the job (service.learning). `saved_on_stop`: after its
    # last stop a checkpoint appeared during the grace (it saves on SIGTERM); trusted only
    # with the declaration `SAVES_ON_STOP_LABEL`. `ignored_checkpoint_request`: its last
    # checkpoint request was not honoured in time. `stop_at_once`: the plan that chose it
    # as a victim said to stop it without asking for a checkpoint, or a later plan cut
    # its checkpoint wait short (the workflow's next check stops it).
    saved_on_stop: bool = False
    ignored_checkpoint_request: bool = False
    checkpoint_requested_at: float | None = None
    # The workflow execution that asked for it (None: the schedule step, ahead of a
    # preemption): a retried request step answers with the request its first attempt made.
    checkpoint_request_by: str | None = None
    stop_signal_at: float | None = None
    # Whether its checkpoint was fresh as that stop went out (`JobsStore.claim_stop`).
    stop_fresh: bool | None = None
    stop_at_once: bool = False
    # Why the plan said so (`Preemption.stop`, a `Reason` value), for the decision log.
    stop_reason: str | None = None
    # When the wait alarm escalated it (service.escalation): its preemptions ignore the soft
    # protections of their victims until it is admitted.
    escalated_at: float | None = None
    # The id of the event that submitted it: a redelivery of that event (its first handling
    # died after the insert, or the insert's answer was lost) completes the submission
    # instead of calling it a duplicate.
    submitted_by: str | None = None
    # Drawn at submission (`new_run_secret`) and kept in the jobs table, which no team can
    # read: each run the controller launches carries a token derived from it
    # (`run_token_of`), so a run a team creates with this job's name and tags is not taken
    # for it. None for a job stored before it existed (its runs are known by name and tags).
    run_secret: str | None = None
    # When the SageMaker managed-spot interruptions whose lost work was added to
    # `lost_gpu_seconds` happened (the newest SPOT_TIMES_KEPT, oldest first): one told
    # again, by a redelivered event or by reconcile's reading of the training job, adds
    # nothing again (`SAME_SPOT_CHANGE_S`).
    spot_interruptions: list = field(default_factory=list)
    # When SageMaker managed spot last took the current run's instances away, and when it
    # last restarted the run (the events' times): while it is interrupted nothing runs, so
    # nothing is at risk (`spot_paused`); once restarted, only the work since the later of
    # its checkpoint and the restart is (`work_started_at`).
    spot_interrupted_at: float | None = None
    spot_resumed_at: float | None = None

    def backing_off(self, now: float) -> bool:
        """A pending job whose last launch was refused waits until `not_before`."""
        return self.not_before is not None and now < self.not_before

    @property
    def next_run_name(self) -> str:
        """Service job name of the current incarnation: `name`, then `name-r2`, `name-r3`..."""
        return self.run_name_of(self.incarnation)

    def run_name_of(self, incarnation: int) -> str:
        """Service job name of an incarnation of the job."""
        return self.name if incarnation == 1 else f"{self.name}-r{incarnation}"

    def run_token_of(self, incarnation: int) -> str | None:
        """The token the run of an incarnation carries (`RUN_TOKEN_TAG`): an HMAC of the job's
        name and the incarnation under `run_secret`. A run's tags show its own token only,
        from which the next incarnation's cannot be told. None without a secret."""
        if not self.run_secret:
            return None
        message = f"{self.name}#{incarnation}".encode()
        return hmac.new(self.run_secret.encode(), message, hashlib.sha256).hexdigest()[:RUN_TOKEN_CHARS]

    def waiting_since(self) -> float:
        """When its current wait began: when it last became pending (a requeued job's wait
        starts again at its requeue), else its submission."""
        return self.submitted_at if self.pending_since is None else self.pending_since

    def as_pending(self, escalates_after_s: float | None = None) -> PendingJob:
        """The job as the planner sees it; `escalates_after_s`: the wait after which the
        wait alarm escalates it (its tier is watched), None when it never does."""
        escalated = self.escalated_at is not None and self.escalated_at >= self.waiting_since()
        return PendingJob(
            name=self.name,
            team=self.team,
            priority=self.priority,
            pool=self.pool,
            gpus=self.gpus,
            submitted_at=self.submitted_at,
            preemptions=self.preemptions,
            sla_s=self.sla_s,
            spot=self.spot,
            expected_duration_s=self.expected_duration_s,
            restart_overhead_s=self.restart_overhead_s,
            pending_since=self.pending_since,
            nominated_at=self.nominated_at,
            # Escalated while it waits now (a later requeue starts a new wait).
            escalated=escalated,
            # The alarm's metric is the current wait (`service.escalation`): a requeued job's
            # time running is not time waiting.
            escalates_at=None if escalated or escalates_after_s is None else self.waiting_since() + escalates_after_s,
        )

    def as_running(self) -> RunningJob:
        started = self.started_at if self.started_at is not None else self.submitted_at
        return RunningJob(
            name=self.name,
            team=self.team,
            priority=self.priority,
            pool=self.pool,
            gpus=self.gpus,
            started_at=started,
            submitted_at=self.submitted_at,
            last_checkpoint_at=self.last_checkpoint_at,
            preemptions=self.preemptions,
            stopping=self.status is JobState.PREEMPTING,
            sla_s=self.sla_s,
            spot=self.spot,
            expected_duration_s=self.expected_duration_s,
            work_done_s=self.work_done_s,
            restart_overhead_s=self.restart_overhead_s,
            spared_until=self.spared_until,
            guaranteed=self.guaranteed,
            stoppable=self.stoppable,
            declares_save_on_stop=self.declares_save_on_stop,
            saves_on_stop=self.saved_on_stop and self.declares_save_on_stop,
            ignored_checkpoint_request=self.ignored_checkpoint_request,
            checkpoint_requested_at=self.checkpoint_requested_at,
            stop_awaits_checkpoint=self.awaits_checkpoint,
            preempted_for=self.preempted_for,
            paused=self.spot_paused,
            work_since=self.work_started_at if self.work_started_at != self.started_at else None,
            paused_at=self.spot_interrupted_at if self.spot_paused else None,
            idle_s=self.spot_idle_s,
        )

    @property
    def preempted_for(self) -> str | None:
        """The pending job it is being stopped for while its stop is not sent (a plan may
        still call the preemption off): None when it is not being preempted, its stop is
        claimed, or it is stopped for its spot instance or for a cancel."""
        if self.status is not JobState.PREEMPTING or self.cancel_requested or self.preempted_by == SPOT_INTERRUPTION:
            return None
        if self.stop_signal_at is not None and self.stop_signal_at >= (self.preempting_since or 0.0):
            return None  # its stop is claimed (`JobsStore.claim_stop`): on its way
        return self.preempted_by

    @property
    def awaits_checkpoint(self) -> bool:
        """Being stopped, its preemption workflow asked for a checkpoint and waits for it:
        no stop signal yet, none said to go at once (a later plan may cut the wait short,
        `Decision.wait_cuts`)."""
        return (
            self.status is JobState.PREEMPTING
            and self.stop_signal_at is None
            and not self.stop_at_once
            and self.preempting_since is not None
            and self.asked_for_this_stop
        )

    @property
    def asked_for_this_stop(self) -> bool:
        """A checkpoint was asked of the job since its preemption began (any time, for a
        record written before `preempting_since` existed)."""
        asked, since = self.checkpoint_requested_at, self.preempting_since
        return asked is not None and (since is None or asked >= since)

    @property
    def declares_save_on_stop(self) -> bool:
        """The job says it saves on SIGTERM (it runs the training helper): label
        `SAVES_ON_STOP_LABEL` = "true"."""
        return str(self.labels.get(SAVES_ON_STOP_LABEL, "")).lower() == "true"

    @property
    def spot_paused(self) -> bool:
        """SageMaker managed spot holds its current run interrupted: taken away after the
        run started, and not restarted since."""
        at = self.spot_interrupted_at
        return (
            at is not None and self.started_at is not None and at >= self.started_at
            and (self.spot_resumed_at is None or self.spot_resumed_at < at)
        )

    def spot_interruption_counted(self, at: float) -> bool:
        """A managed-spot interruption at `at` is one whose lost work is already counted: one
        as close in time, with no restart seen between them (`spot_interrupted_at` is one:
        a job stored before `spot_interruptions` existed has only it)."""
        resumed = self.spot_resumed_at
        counted = [*self.spot_interruptions, *([self.spot_interrupted_at] if self.spot_interrupted_at is not None else [])]
        return any(
            abs(at - t) <= SAME_SPOT_CHANGE_S and not (resumed is not None and min(at, t) < resumed <= max(at, t))
            for t in counted
        )

    def spot_restart_seen(self, at: float) -> bool:
        """A managed-spot restart at `at` is the last one seen, or older. Never while the run
        is held interrupted since before `at`: that restart ends the pause."""
        resumed = self.spot_resumed_at
        if resumed is None or (self.spot_paused and at >= self.spot_interrupted_at):
            return False
        return resumed >= at - SAME_SPOT_CHANGE_S

    @property
    def spot_idle_s(self) -> float:
        """Seconds of the current run that managed spot held interrupted before its last
        restart (the last pause seen: the record keeps one interruption and one restart)."""
        at, resumed, started = self.spot_interrupted_at, self.spot_resumed_at, self.started_at
        if at is None or resumed is None or started is None or not started <= at < resumed:
            return 0.0
        return resumed - at

    @property
    def work_started_at(self) -> float | None:
        """When the current run's work began, for what a stop would throw away: its start,
        or its managed-spot restart after it."""
        resumed, started = self.spot_resumed_at, self.started_at
        return resumed if resumed is not None and started is not None and resumed > started else started

    def checkpoint_fresh(self, checkpoint_at: float | None, now: float, max_age_s: float) -> bool:
        """`progress.is_fresh` for its current run: at most `max_age_s` of work at risk since
        `checkpoint_at` (or since the run's work began); always, while managed spot holds the
        run interrupted (nothing at risk, and no checkpoint could come)."""
        return self.spot_paused or is_fresh(checkpoint_at, self.work_started_at, now, max_age_s)

    def with_changes(self, **changes) -> "JobRecord":
        return replace(self, **changes)

    def left_running(self, **changes) -> "JobRecord":
        """The victim back to RUNNING from a preemption that ends without a stop (called off,
        spared): whatever that preemption recorded (a stop claimed, "stop at once") is its
        own, so a later one starts with no signal sent; `changes` besides (a protection, a
        new priority)."""
        return replace(
            self, status=JobState.RUNNING, preempted_by=None, preempting_since=None,
            stop_signal_at=None, stop_fresh=None, stop_at_once=False, stop_reason=None, **changes,
        )
