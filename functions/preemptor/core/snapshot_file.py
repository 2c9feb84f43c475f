"""The what-if snapshot format read by `preemptor plan --snapshot FILE`.

```json
{"now": 10000,
 "pools": [{"name": "p5", "gpus": 64}],
 "running": [{"name": "a", "team": "t1", "priority": 50, "pool": "p5", "gpus": 32,
              "started_at": 1000, "last_checkpoint_at": 9990}],
 "pending": [{"name": "x", "team": "t2", "priority": 1000, "pool": "p5", "gpus": 32,
              "submitted_at": 9900}]}
```
Times are seconds; `priority` may be a tier name; running jobs may carry `stopping: true`
(already being preempted) and `preemptions`.
"""

from __future__ import annotations

from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field

from .model import PendingJob, Pool, RunningJob, Snapshot
from .policy import DEFAULT_TIERS
from .requests import resolve_priority


class _Pool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    gpus: int = Field(gt=0)


class _Job(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    team: str = "default"
    priority: int | str
    pool: str
    gpus: int = Field(gt=0)
    preemptions: int = 0


class _Running(_Job):
    started_at: float
    last_checkpoint_at: float | None = None
    stopping: bool = False


class _Pending(_Job):
    submitted_at: float


class SnapshotFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    now: float
    pools: list[_Pool]
    running: list[_Running] = Field(default_factory=list)
    pending: list[_Pending] = Field(default_factory=list)


def load_snapshot(data: Mapping, tiers: Mapping[str, int] = DEFAULT_TIERS) -> tuple[float, Snapshot]:
    """Validate a snapshot document; returns (now, snapshot). Raises pydantic.ValidationError."""
    doc = SnapshotFile.model_validate(data)
    names = [j.name for j in doc.running + doc.pending]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"job names must be unique; repeated: {', '.join(duplicates)}")
    running = tuple(
        RunningJob(
            name=j.name,
            team=j.team,
            priority=resolve_priority(j.priority, tiers),
            pool=j.pool,
            gpus=j.gpus,
            started_at=j.started_at,
            last_checkpoint_at=j.last_checkpoint_at,
            preemptions=j.preemptions,
            stopping=j.stopping,
        )
        for j in doc.running
    )
    pending = tuple(
        PendingJob(
            name=j.name,
            team=j.team,
            priority=resolve_priority(j.priority, tiers),
            pool=j.pool,
            gpus=j.gpus,
            submitted_at=j.submitted_at,
            preemptions=j.preemptions,
        )
        for j in doc.pending
    )
    return doc.now, Snapshot(tuple(Pool(p.name, p.gpus) for p in doc.pools), running, pending)
