"""The what-if snapshot format read by `preemptor plan --snapshot FILE` and `preemptor explain`.

```json
{"now": 10000,
 "pools": [{"name": "p5", "gpus": 64}],
 "running": [{"name": "a", "team": "t1", "priority": 50, "pool": "p5", "gpus": 32,
              "started_at": 1000, "last_checkpoint_at": 9990}],
 "pending": [{"name": "x", "team": "t2", "priority": 1000, "pool": "p5", "gpus": 32,
              "submitted_at": 9900}]}
```
Times are seconds (epoch or any origin, as long as `now` uses the same); `priority` may be
a tier name. Optional fields (docs/policy.md, "Snapshot format", lists them all):

- every job: `team` (default "default"), `preemptions`, `sla_s`, `spot`,
  `expected_duration_s`, `restart_overhead_s`;
- running jobs: `last_checkpoint_at`, `stopping` (already being preempted),
  `work_done_s` (work earlier runs saved), `progress` (0..1, the job's own report);
- pending jobs: `pending_since` (when it last became pending; default `submitted_at`);
- top level: `usage` (decayed GPU-seconds of ended runs per team, either a number as of
  `now` or `{"gpu_seconds": ..., "at": ...}`), `preemption_history` (recent preemptions:
  `{"pool", "at", "gpus", "lost_gpu_seconds"}`).
"""

from __future__ import annotations

from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field

from preemptor.core.model import PastPreemption, PendingJob, Pool, RunningJob, Snapshot, TeamUsage
from preemptor.core.policy import DEFAULT_TIERS
from preemptor.core.requests import resolve_priority


class _Pool(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str
    gpus: int = Field(gt=0)
    no_capacity_until: float | None = None


class _Job(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    name: str
    team: str = "default"
    priority: int | str
    pool: str
    gpus: int = Field(gt=0)
    preemptions: int = Field(default=0, ge=0)
    sla_s: float | None = Field(default=None, gt=0)
    spot: bool = False
    expected_duration_s: float | None = Field(default=None, gt=0)
    restart_overhead_s: float = Field(default=0.0, ge=0)


class _Running(_Job):
    started_at: float
    submitted_at: float | None = None  # its first submission (None: its run's start alone makes it newer)
    last_checkpoint_at: float | None = None
    stopping: bool = False
    work_done_s: float = Field(default=0.0, ge=0)
    progress: float | None = Field(default=None, ge=0, le=1)


class _Pending(_Job):
    submitted_at: float
    pending_since: float | None = None


class _Usage(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    gpu_seconds: float = Field(ge=0)
    at: float | None = None


class _Preempted(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    pool: str
    at: float
    gpus: int = Field(default=0, ge=0)
    lost_gpu_seconds: float = Field(default=0.0, ge=0)
    victim: str = ""


class SnapshotFile(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    now: float
    pools: list[_Pool]
    running: list[_Running] = Field(default_factory=list)
    pending: list[_Pending] = Field(default_factory=list)
    usage: dict[str, float | _Usage] = Field(default_factory=dict)
    preemption_history: list[_Preempted] = Field(default_factory=list)


def load_snapshot(data: Mapping, tiers: Mapping[str, int] = DEFAULT_TIERS) -> tuple[float, Snapshot]:
    """Validate a snapshot document; returns (now, snapshot). Raises pydantic.ValidationError."""
    doc = SnapshotFile.model_validate(data)
    names = [j.name for j in doc.running + doc.pending]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"job names must be unique; repeated: {', '.join(duplicates)}")
    pools = [p.name for p in doc.pools]
    repeated = sorted({n for n in pools if pools.count(n) > 1})
    if repeated:
        raise ValueError(f"pool names must be unique; repeated: {', '.join(repeated)}")
    # A job in no listed pool would be left out of the plan without a word.
    for kind, jobs in (("running", doc.running), ("pending", doc.pending)):
        for i, j in enumerate(jobs):
            if j.pool not in pools:
                raise ValueError(f"field {kind}.{i}.pool: job {j.name!r} is in pool {j.pool!r}, which pools does not list")
    running = tuple(
        RunningJob(
            name=j.name,
            team=j.team,
            priority=resolve_priority(j.priority, tiers),
            pool=j.pool,
            gpus=j.gpus,
            started_at=j.started_at,
            submitted_at=j.submitted_at,
            last_checkpoint_at=j.last_checkpoint_at,
            preemptions=j.preemptions,
            stopping=j.stopping,
            sla_s=j.sla_s,
            spot=j.spot,
            expected_duration_s=j.expected_duration_s,
            work_done_s=j.work_done_s,
            progress=j.progress,
            restart_overhead_s=j.restart_overhead_s,
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
            sla_s=j.sla_s,
            spot=j.spot,
            expected_duration_s=j.expected_duration_s,
            restart_overhead_s=j.restart_overhead_s,
            pending_since=j.pending_since,
        )
        for j in doc.pending
    )
    usage = tuple(
        TeamUsage(team, u, doc.now) if isinstance(u, (int, float)) else TeamUsage(team, u.gpu_seconds, doc.now if u.at is None else u.at)
        for team, u in sorted(doc.usage.items())
    )
    history = tuple(PastPreemption(h.pool, h.at, h.gpus, h.lost_gpu_seconds, h.victim) for h in doc.preemption_history)
    pools = tuple(Pool(p.name, p.gpus, p.no_capacity_until) for p in doc.pools)
    return doc.now, Snapshot(pools, running, pending, usage, history)
