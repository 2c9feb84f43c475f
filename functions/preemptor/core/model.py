"""Domain model of the scheduler: jobs, pools, snapshots, decisions.

Everything here is immutable and free of I/O. Times are float seconds since the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class JobState(StrEnum):
    """Lifecycle of a job in the controller (not of one SageMaker/Batch run)."""

    PENDING = "PENDING"
    ADMITTED = "ADMITTED"  # capacity reserved, service job being created
    RUNNING = "RUNNING"
    PREEMPTING = "PREEMPTING"  # chosen as a victim; checkpoint confirmation and stop under way
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def holds_capacity(self) -> bool:
        return self in (JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTING)

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


class Reason(StrEnum):
    """Why the planner admitted, preempted or held back a job. Logged, metered and explained."""

    FITS_FREE_CAPACITY = "fits-free-capacity"
    PREEMPTS_LOWER_PRIORITY = "preempts-lower-priority"
    LOWER_PRIORITY_VICTIM = "lower-priority-victim"
    WAITING_FOR_PREEMPTED_CAPACITY = "waiting-for-preempted-capacity"
    NO_CAPACITY_NO_ELIGIBLE_VICTIMS = "no-capacity-no-eligible-victims"
    BLOCKED_BY_HIGHER_RANKED = "blocked-by-higher-ranked-job"
    LARGER_THAN_POOL = "larger-than-pool"
    UNKNOWN_POOL = "unknown-pool"


class Verdict(StrEnum):
    ADMIT = "admit"
    PREEMPT = "preempt"
    WAIT = "wait"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Pool:
    """A unit of GPU capacity the user owns, e.g. 64 x ml.p5.48xlarge = 512 GPUs."""

    name: str
    gpus: int


@dataclass(frozen=True, slots=True)
class PendingJob:
    name: str
    team: str
    priority: int
    pool: str
    gpus: int
    submitted_at: float
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job that holds capacity: admitted, running, or already being preempted (`stopping`)."""

    name: str
    team: str
    priority: int
    pool: str
    gpus: int
    started_at: float
    last_checkpoint_at: float | None = None
    preemptions: int = 0
    stopping: bool = False

    def work_at_risk_s(self, now: float) -> float:
        """Seconds of work a stop at `now` throws away: time since the last checkpoint."""
        since = self.last_checkpoint_at if self.last_checkpoint_at is not None else self.started_at
        return max(0.0, now - max(since, self.started_at))

    def lost_gpu_seconds(self, now: float) -> float:
        return self.gpus * self.work_at_risk_s(now)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the planner may look at. Built by the adapters, never mutated by the core."""

    pools: tuple[Pool, ...]
    running: tuple[RunningJob, ...] = ()
    pending: tuple[PendingJob, ...] = ()


@dataclass(frozen=True, slots=True)
class Admission:
    job: str
    pool: str
    gpus: int
    reason: Reason


@dataclass(frozen=True, slots=True)
class Preemption:
    victim: str
    preemptor: str
    pool: str
    gpus: int
    reason: Reason
    lost_gpu_seconds: float
    checkpoint_age_s: float | None


@dataclass(frozen=True, slots=True)
class Explanation:
    """One line of the decision's audit trail: a candidate and the rule applied to it."""

    job: str
    verdict: Verdict
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class Decision:
    admits: tuple[Admission, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    explanations: tuple[Explanation, ...] = field(default=())

    def to_dict(self) -> dict:
        """The JSON shape printed by `preemptor plan` and returned by the plan workflow step."""
        return {
            "admit": [a.job for a in self.admits],
            "preempt": [
                {
                    "victim": p.victim,
                    "preemptor": p.preemptor,
                    "pool": p.pool,
                    "gpus": p.gpus,
                    "reason": p.reason.value,
                    "lost_gpu_seconds": round(p.lost_gpu_seconds, 3),
                    "checkpoint_age_s": None if p.checkpoint_age_s is None else round(p.checkpoint_age_s, 3),
                }
                for p in self.preemptions
            ],
            "explanations": [
                {"job": e.job, "verdict": e.verdict.value, "reason": e.reason.value, "detail": e.detail}
                for e in self.explanations
            ],
        }
