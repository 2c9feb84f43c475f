"""Fluent builders for jobs and snapshots in tests."""

from __future__ import annotations

from dataclasses import replace

from preemptor.core.model import PendingJob, Pool, RunningJob, Snapshot


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

    def pool(self, name: str, gpus: int) -> "SnapshotBuilder":
        self._pools.append(Pool(name, gpus))
        return self

    def running(self, *jobs: RunningJob) -> "SnapshotBuilder":
        self._running.extend(jobs)
        return self

    def pending(self, *jobs: PendingJob) -> "SnapshotBuilder":
        self._pending.extend(jobs)
        return self

    def build(self) -> Snapshot:
        return Snapshot(tuple(self._pools), tuple(self._running), tuple(self._pending))


def snapshot(gpus: int = 64) -> SnapshotBuilder:
    return SnapshotBuilder(gpus)


__all__ = ["pending", "running", "snapshot", "replace"]
