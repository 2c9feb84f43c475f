"""Fluent builders for jobs, snapshots and policies in tests."""

from __future__ import annotations

from dataclasses import replace

from preemptor.core.model import PastPreemption, PendingJob, Pool, RunningJob, Snapshot, TeamUsage
from preemptor.core.policy import Policy


def pending(name: str, priority: int = 50, gpus: int = 8, **kw) -> PendingJob:
    defaults = {"team": "t1", "pool": "p5", "submitted_at": 0.0}
    defaults.update(kw)
    return PendingJob(name=name, priority=priority, gpus=gpus, **defaults)


def running(name: str, priority: int = 50, gpus: int = 8, **kw) -> RunningJob:
    defaults = {"team": "t1", "pool": "p5", "started_at": 0.0, "last_checkpoint_at": None}
    defaults.update(kw)
    return RunningJob(name=name, priority=priority, gpus=gpus, **defaults)


class SnapshotBuilder:
    def __init__(self, gpus: int = 64, pool: str = "p5"):
        self._pools = [Pool(pool, gpus)]
        self._running: list[RunningJob] = []
        self._pending: list[PendingJob] = []
        self._usage: list[TeamUsage] = []
        self._history: list[PastPreemption] = []

    def pool(self, name: str, gpus: int) -> "SnapshotBuilder":
        self._pools.append(Pool(name, gpus))
        return self

    def running(self, *jobs: RunningJob) -> "SnapshotBuilder":
        self._running.extend(jobs)
        return self

    def pending(self, *jobs: PendingJob) -> "SnapshotBuilder":
        self._pending.extend(jobs)
        return self

    def usage(self, team: str, gpu_seconds: float, at: float) -> "SnapshotBuilder":
        """Decayed GPU-seconds of `team`'s ended runs, as of `at`."""
        self._usage.append(TeamUsage(team, gpu_seconds, at))
        return self

    def preempted(self, at: float, gpus: int = 8, lost_gpu_seconds: float = 0.0, pool: str = "p5") -> "SnapshotBuilder":
        """A past preemption in the budget window."""
        self._history.append(PastPreemption(pool, at, gpus, lost_gpu_seconds))
        return self

    def build(self) -> Snapshot:
        return Snapshot(
            tuple(self._pools), tuple(self._running), tuple(self._pending), tuple(self._usage), tuple(self._history)
        )


def snapshot(gpus: int = 64) -> SnapshotBuilder:
    return SnapshotBuilder(gpus)


def policy(**knobs) -> Policy:
    """A policy with aging and fair share off unless asked for, so tests see one knob at a time."""
    knobs.setdefault("aging", {"rate_per_hour": 0, "starving_after_s": None})
    knobs.setdefault("fair_share", {"enabled": False})
    return Policy(**knobs)


def quota(team: str, nominal: int, borrowing: int | None = None, lending: int | None = None, tier: str | None = None) -> dict:
    return {"team": team, "tier": tier, "nominal_gpus": nominal, "borrowing_limit": borrowing, "lending_limit": lending}


__all__ = ["pending", "policy", "quota", "running", "snapshot", "replace"]
