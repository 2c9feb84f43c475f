"""Discrete-event replay of a job trace through a scheduling policy.

The loop is the controller's: events (a job submitted, a job ended, a stopped victim's
GPUs released, a victim requeued, the scheduled reconcile) change the pool or the queue;
after the events of an instant, the policy's planner gets a `Snapshot` (the pool, every job
holding GPUs, and a window of the best-ranked pending jobs) and returns a `Decision`, which
the loop carries out: admissions start jobs, preemptions stop victims. For `preemptor` the
planner is `preemptor.core.planner.plan`, the function the schedule Lambda calls.

Model and defaults (docs/simulator.md says the same, with the reasons):

- Pool: one pool of `gpus` GPUs; a job runs when admitted (no launch latency for anyone)
  and holds its GPUs until it ends or its stop completes. Jobs larger than the pool are
  left out and counted.
- Pending window: the planner sees the best `pending_window` pending jobs (default 200,
  the controller's `Settings.pending_window`) in the order of the DynamoDB pending index
  (priority desc, submission asc, name); FIFO sees them in submission order. The
  controller reads exactly this window (one indexed query with a limit), so the cost of a
  decision does not grow with the queue.
- When it plans: after any instant whose events released GPUs, put a job into the window,
  or followed a decision that admitted jobs (the window moved); plus every
  `replan_every_s` of the policy (ours: the 5-minute reconcile; slurm: its 60 s loop).
  An arrival that ranks below the window changes nothing the planner sees and is not
  planned for.
- Checkpoints: each job checkpoints every `I` seconds of progress, `I` drawn once per job
  from uniform(`checkpoint_interval_s`) (default 10..60 min) with a seeded RNG, so every
  policy replays the same jobs. A restarted job resumes from its newest checkpoint.
- Stop: a stopped job holds its GPUs for `stop_grace_s` (120 s: SageMaker's
  StopTrainingJob grace) after the stop signal; the work since its last checkpoint and
  the grace are lost.
- Ours (checkpoint-gated): the victim is stopped at once if its newest checkpoint is at
  most `checkpoint_max_age_s` old (Policy default 900 s); otherwise a checkpoint is
  requested; a cooperative job (fraction `cooperative_fraction`, default 1.0) writes it
  `checkpoint_write_s` (60 s) later, a periodic checkpoint also counts; the workflow sees
  it at its next poll (`checkpoint_poll_s`), then stops the job, so the loss is about the
  grace. With no checkpoint within `checkpoint_wait_max_s` the Policy's timeout action
  applies (stop anyway, losing the work since the last checkpoint; or spare the victim).
- Baselines (immediate): the stop signal goes at once, whatever the checkpoint's age.
- Restart: every relaunch costs `restart_overhead_s` (300 s: re-provisioning + reloading
  the checkpoint) of GPU time before progress resumes, counted as lost. A stopped job is
  pending again `relaunch_delay_s` (60 s) after its GPUs are released (requeue workflow).
- Oracle (free): a stop is instant and keeps all progress; no overhead, no delay.
- A victim that would finish before its stop signal simply finishes.

Waiting time of a job = all the time it is not holding GPUs between submission and end
(first wait, plus release-to-readmission after each preemption, relaunch delay included).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from preemptor.core import model as core_model
from preemptor.core.progress import is_fresh, stop_loss
from preemptor.core.model import Decision, PendingJob, Pool, RunningJob, Snapshot
from .baselines import SimPolicy, StopModel
from .trace import TraceJob

DEFAULT_PENDING_WINDOW = 200  # preemptor.config.Settings.pending_window

# Optional inputs of the core that the controller fills from the job record, when this
# version of the core has them (the simulator fills what exists, in the same way).
_PENDING_FIELDS = {f.name for f in fields(PendingJob)}
_RUNNING_FIELDS = {f.name for f in fields(RunningJob)}
_SNAPSHOT_FIELDS = {f.name for f in fields(Snapshot)}
_TeamUsage = getattr(core_model, "TeamUsage", None)
_PastPreemption = getattr(core_model, "PastPreemption", None)

# Event kinds, in the order they are applied within one instant.
_ARRIVE, _FINISH, _STOP_DONE, _REQUEUE, _SPARE, _TICK = range(6)

# Job states inside the simulator.
_FUTURE, _PENDING, _RUNNING, _STOPPING, _RELAUNCHING, _DONE = range(6)


class SimulationError(RuntimeError):
    """A planner's decision broke an invariant (oversubscription, unknown job, ...)."""


@dataclass(frozen=True)
class SimConfig:
    """The model's knobs; the defaults are the documented defaults."""

    gpus: int
    pool: str = "sim"
    checkpoint_interval_s: tuple[float, float] = (600.0, 3600.0)
    seed: int = 0
    stop_grace_s: float = 120.0
    checkpoint_write_s: float = 60.0
    restart_overhead_s: float = 300.0
    relaunch_delay_s: float = 60.0
    cooperative_fraction: float = 1.0
    pending_window: int = DEFAULT_PENDING_WINDOW
    declare_durations: bool = False  # jobs declare their true duration (`expected_duration_s`)
    max_plans_per_instant: int = 10_000

    def __post_init__(self) -> None:
        """Refuse a model that cannot be run, naming the field: a NaN or an infinite time
        would never let the replay end."""
        lo, hi = self.checkpoint_interval_s
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
            raise ValueError(f"checkpoint_interval_s must be finite seconds with 0 < min <= max, got {self.checkpoint_interval_s}")
        for name in ("stop_grace_s", "checkpoint_write_s", "restart_overhead_s", "relaunch_delay_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite seconds >= 0, got {value}")
        if not 0.0 <= self.cooperative_fraction <= 1.0:  # NaN fails it too
            raise ValueError(f"cooperative_fraction must be within 0..1, got {self.cooperative_fraction}")
        for name in ("gpus", "pending_window", "max_plans_per_instant"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def model(self) -> dict:
        return {
            "gpus": self.gpus,
            "checkpoint_interval_s": {"distribution": "uniform", "min": self.checkpoint_interval_s[0], "max": self.checkpoint_interval_s[1]},
            "seed": self.seed,
            "stop_grace_s": self.stop_grace_s,
            "checkpoint_write_s": self.checkpoint_write_s,
            "restart_overhead_s": self.restart_overhead_s,
            "relaunch_delay_s": self.relaunch_delay_s,
            "cooperative_fraction": self.cooperative_fraction,
            "pending_window": self.pending_window,
            "declare_durations": self.declare_durations,
        }


@dataclass(slots=True)
class JobOutcome:
    """What happened to one job, in seconds (GPU-seconds for `lost_*` and `held_gpu_s`)."""

    name: str
    team: str
    priority: int
    gpus: int
    submitted_at: float
    duration_s: float
    checkpoint_every_s: float
    first_started_at: float | None = None
    finished_at: float | None = None
    failed: bool = False  # the policy failed it instead of relaunching it (max preemptions)
    wait_s: float = 0.0
    preemptions: int = 0
    held_gpu_s: float = 0.0
    lost_progress_gpu_s: float = 0.0  # work done since the last checkpoint, thrown away
    lost_grace_gpu_s: float = 0.0  # GPUs held between the stop signal and the release
    lost_overhead_gpu_s: float = 0.0  # restart overhead of every relaunch

    @property
    def lost_gpu_s(self) -> float:
        return self.lost_progress_gpu_s + self.lost_grace_gpu_s + self.lost_overhead_gpu_s

    @property
    def completion_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at


@dataclass
class SimResult:
    policy: str
    config: SimConfig
    jobs: list[JobOutcome]
    unschedulable: list[str]
    busy: list[tuple[float, int]]  # (time, +/- GPUs held)
    useful: list[tuple[float, int]]  # (time, +/- GPUs doing work that is kept)
    counters: dict[str, float] = field(default_factory=dict)
    policy_source: str = ""
    policy_knobs: dict = field(default_factory=dict)


class _Job:
    __slots__ = (
        "idx", "trace", "name", "priority", "gpus", "interval", "cooperative", "state", "gen",
        "saved", "ckpt_wall", "run_start", "work_start", "overhead", "incarnation",
        "pending_since", "guaranteed", "pending_view", "running_view", "view_until",
        "signal_at", "saved_after", "ckpt_after", "outcome",
        "trusted", "ignored", "requested_at", "verdict_at", "verdict_ignored", "extra_ckpt",
        "awaits", "ignored_before", "preempted_for", "signalled", "trusted_before",
    )  # fmt: skip

    def __init__(self, idx: int, trace: TraceJob, interval: float, cooperative: bool) -> None:
        self.idx = idx
        self.trace = trace
        self.name = trace.job_id
        self.priority = trace.priority
        self.gpus = trace.gpus
        self.interval = interval
        self.cooperative = cooperative
        self.state = _FUTURE
        self.gen = 0
        self.saved = 0.0  # progress (s of work) kept in the newest checkpoint
        self.ckpt_wall: float | None = None  # when that checkpoint was written
        self.run_start = 0.0
        self.work_start = 0.0
        self.overhead = 0.0
        self.incarnation = 0
        self.pending_since = 0.0
        self.guaranteed = False
        self.pending_view: PendingJob | None = None
        self.running_view: RunningJob | None = None
        self.view_until = 0.0
        self.signal_at = 0.0
        self.saved_after = 0.0
        self.ckpt_after: float | None = None
        # What the controller learned of the job (service.learning): seen to save on SIGTERM
        # within the grace; did not honour its last checkpoint request; when it was asked.
        self.trusted = False
        self.ignored = False
        self.requested_at: float | None = None
        self.verdict_at = math.inf  # when the controller learns whether the request was honoured
        self.verdict_ignored = False
        self.extra_ckpt: float | None = None  # a checkpoint written on request, this run
        # Being stopped, the stop signal (at `signal_at`) waits for a requested checkpoint;
        # what the controller knew of its requests before that one (a cut wait restores it).
        self.awaits = False
        self.ignored_before = False
        # Being stopped: the job it is stopped for; whether its stop signal is scheduled (it
        # was not when the job ends first, or the policy spares it at the wait's end); what
        # the controller knew of its saving on SIGTERM before that signal.
        self.preempted_for: str | None = None
        self.signalled = False
        self.trusted_before = False
        self.outcome = JobOutcome(
            name=trace.job_id,
            team=trace.team,
            priority=trace.priority,
            gpus=trace.gpus,
            submitted_at=trace.submit_s,
            duration_s=trace.duration_s,
            checkpoint_every_s=interval,
        )

    @property
    def remaining(self) -> float:
        return self.trace.duration_s - self.saved

    @property
    def finish_at(self) -> float:
        return self.work_start + self.remaining

    def progress(self, t: float) -> float:
        return self.saved + min(max(0.0, t - self.work_start), self.remaining)

    def periodic_checkpoint(self, t: float) -> tuple[float | None, float]:
        """(wall time, progress) of the newest checkpoint at `t` while running: the periodic
        ones, and one written on request (`extra_ckpt`) if it is newer."""
        worked = t - self.work_start
        if worked < self.interval:
            wall, saved = self.ckpt_wall, self.saved
        else:
            k = math.floor(worked / self.interval)
            wall, saved = self.work_start + k * self.interval, self.saved + k * self.interval
        extra = self.extra_ckpt
        if extra is not None and extra <= t and (wall is None or extra > wall):
            return extra, self.saved + min(extra - self.work_start, self.remaining)
        return wall, saved


class Simulator:
    """Replays `trace` through `policy` under `config`. Use `run()` once."""

    def __init__(
        self,
        trace: list[TraceJob],
        policy: SimPolicy,
        config: SimConfig,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.policy = policy
        self.config = config
        self._pool = Pool(config.pool, config.gpus)
        self._progress = progress
        rng = random.Random(config.seed)
        lo, hi = config.checkpoint_interval_s
        self._jobs: list[_Job] = []
        self._unschedulable: list[str] = []
        for trace_job in trace:
            # Draw for every job, scheduled or not, so a job's interval depends only on
            # the seed and its place in the trace.
            interval = rng.uniform(lo, hi)
            cooperative = rng.random() < config.cooperative_fraction
            if trace_job.gpus > config.gpus:
                self._unschedulable.append(trace_job.job_id)
                continue
            self._jobs.append(_Job(len(self._jobs), trace_job, interval, cooperative))
        self._by_name = {j.name: j for j in self._jobs}
        if len(self._by_name) != len(self._jobs):
            raise SimulationError("duplicate job names in the trace")
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._queue: list[tuple[tuple, int]] = []  # sorted (window rank, job index)
        self._running: dict[int, _Job] = {}
        self._free = config.gpus
        self._dirty = False
        self._busy: list[tuple[float, int]] = []
        self._useful: list[tuple[float, int]] = []
        self._done = 0
        self._tick_pending = False
        self._usage: dict[str, object] = {}
        self._history: deque = deque()
        self._extra_pending, self._extra_running = self._declared_inputs()
        self.pairs: dict[str, int] = {}  # "preemptor priority>victim priority" -> decisions
        self.counters: dict[str, float] = {
            "events": 0,
            "plans": 0,
            "plan_seconds": 0.0,
            "max_window": 0,
            "max_running": 0,
            "max_queue": 0,
            "preemptions_decided": 0,
            "preemptions_moot": 0,  # the victim finished before its stop signal
            "checkpoint_requests": 0,
            "checkpoint_requests_ahead": 0,
            # GPU-seconds the checkpoints asked ahead take to write: free in this model
            # (written while the job trains), their cost if each write paused training
            "ahead_checkpoint_write_gpu_s": 0.0,
            "stopped_at_once": 0,
            "saved_on_sigterm": 0,
            "checkpoint_timeouts": 0,
            "checkpoint_waits_cut": 0,
            "victims_spared": 0,
            "preemptions_called_off": 0,  # stops that waited for a checkpoint, called off by a plan
            "failed_by_policy": 0,
        }

    def _declared_inputs(self) -> tuple[Callable[[_Job], dict], Callable[[_Job], dict]]:
        """Optional job inputs the core accepts and the controller would have."""
        overhead = self.config.restart_overhead_s if self.policy.declares_overhead else 0.0
        durations = self.config.declare_durations

        def pending(job: _Job) -> dict:
            extra = {}
            if "pending_since" in _PENDING_FIELDS:
                extra["pending_since"] = job.pending_since
            if overhead and "restart_overhead_s" in _PENDING_FIELDS:
                extra["restart_overhead_s"] = overhead
            if durations and "expected_duration_s" in _PENDING_FIELDS:
                extra["expected_duration_s"] = job.trace.duration_s
            return extra

        def running(job: _Job) -> dict:
            extra = {}
            if "work_done_s" in _RUNNING_FIELDS:
                extra["work_done_s"] = job.saved
            if overhead and "restart_overhead_s" in _RUNNING_FIELDS:
                extra["restart_overhead_s"] = overhead
            if durations and "expected_duration_s" in _RUNNING_FIELDS:
                extra["expected_duration_s"] = job.trace.duration_s
            return extra

        return pending, running

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        started = time.perf_counter()
        for job in self._jobs:
            self._push(job.trace.submit_s, _ARRIVE, job)
        if self.policy.replan_every_s and self._jobs:
            self._push(self._jobs[0].trace.submit_s, _TICK, None)
            self._tick_pending = True
        heap = self._heap
        last_now, plans = None, 0
        while heap:
            now = heap[0][0]
            while heap and heap[0][0] <= now:
                _, _, kind, idx, gen = heapq.heappop(heap)
                self.counters["events"] += 1
                self._apply_event(kind, idx, gen, now)
            if now != last_now:
                last_now, plans = now, 0
            while self._dirty and self._queue:
                self._dirty = False
                plans += 1
                if plans > self.config.max_plans_per_instant:
                    raise SimulationError(f"{self.policy.name}: planning does not settle at t={now}")
                self._plan(now)
            self._dirty = False
        unfinished = [j.name for j in self._jobs if j.state != _DONE]
        if unfinished:
            raise SimulationError(f"{len(unfinished)} job(s) never finished, e.g. {unfinished[:3]}")
        self.counters["wall_seconds"] = time.perf_counter() - started
        return SimResult(
            policy=self.policy.name,
            config=self.config,
            jobs=[j.outcome for j in self._jobs],
            unschedulable=self._unschedulable,
            busy=self._busy,
            useful=self._useful,
            counters={**self.counters, "preemptions_by_priority_pair": dict(sorted(self.pairs.items()))},
            policy_source=self.policy.source,
            policy_knobs=dict(self.policy.knobs),
        )

    def _push(self, t: float, kind: int, job: _Job | None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, -1 if job is None else job.idx, 0 if job is None else job.gen))

    def _apply_event(self, kind: int, idx: int, gen: int, now: float) -> None:
        if kind == _TICK:
            self._tick_pending = False
            self._dirty = True
            if self._done < len(self._jobs):
                self._push(now + self.policy.replan_every_s, _TICK, None)
                self._tick_pending = True
            return
        job = self._jobs[idx]
        if gen != job.gen:
            return  # superseded (a finish cancelled by a stop)
        if kind == _ARRIVE:
            job.pending_since = now
            self._enqueue(job)
        elif kind == _FINISH:
            self._finish(job, now)
        elif kind == _STOP_DONE:
            self._release_victim(job, now)
        elif kind == _REQUEUE:
            self._enqueue(job)
        elif kind == _SPARE:
            if job.state == _STOPPING:
                job.state = _RUNNING
                job.awaits = False
                job.running_view = None
                self.counters["victims_spared"] += 1
                self._forget_preemption(job)
                self._dirty = True

    def _forget_preemption(self, job: _Job) -> None:
        """A spared victim stopped nothing: its preemption leaves the budget's window, as
        the controller deletes its record (`JobsStore.transition`, `called_off`)."""
        for i in range(len(self._history) - 1, -1, -1):
            if self._history[i].victim == job.name:
                del self._history[i]
                return

    # ------------------------------------------------------------------ queue

    def _enqueue(self, job: _Job) -> None:
        job.state = _PENDING
        job.pending_view = PendingJob(
            name=job.name,
            team=job.trace.team,
            priority=job.priority,
            pool=self._pool.name,
            gpus=job.gpus,
            submitted_at=job.trace.submit_s,
            preemptions=job.outcome.preemptions,
            **self._extra_pending(job),
        )
        entry = (self.policy.window_rank(job.pending_view), job.idx)
        insort(self._queue, entry)
        if bisect_left(self._queue, entry) < self.config.pending_window:
            self._dirty = True
        if len(self._queue) > self.counters["max_queue"]:
            self.counters["max_queue"] = len(self._queue)

    def _dequeue(self, job: _Job) -> None:
        entry = (self.policy.window_rank(job.pending_view), job.idx)
        i = bisect_left(self._queue, entry)
        if i >= len(self._queue) or self._queue[i] != entry:
            raise SimulationError(f"{job.name} is not pending")
        del self._queue[i]

    # ------------------------------------------------------------------ planning

    def _snapshot(self, now: float) -> Snapshot:
        running = []
        for job in self._running.values():
            view = job.running_view
            if view is None or now >= job.view_until:
                view = self._running_view(job, now)
            running.append(view)
        window = [self._jobs[idx].pending_view for _, idx in self._queue[: self.config.pending_window]]
        extra = {}
        if self.policy.usage_half_life_s and "usage" in _SNAPSHOT_FIELDS:
            extra["usage"] = tuple(self._usage.values())
        if self.policy.history_window_s and "preemption_history" in _SNAPSHOT_FIELDS:
            horizon = now - self.policy.history_window_s
            while self._history and self._history[0].at < horizon:
                self._history.popleft()
            extra["preemption_history"] = tuple(self._history)
        return Snapshot(pools=(self._pool,), running=tuple(running), pending=tuple(window), **extra)

    def _running_view(self, job: _Job, now: float) -> RunningJob:
        """The job as the controller stores it: its newest checkpoint is read from S3."""
        if now >= job.verdict_at:
            job.ignored, job.verdict_at = job.verdict_ignored, math.inf
        if job.state == _RUNNING and now >= job.work_start:
            ckpt, _ = job.periodic_checkpoint(now)
            worked = now - job.work_start
            job.view_until = job.work_start + (math.floor(worked / job.interval) + 1) * job.interval
            if job.extra_ckpt is not None and job.extra_ckpt > now:
                job.view_until = min(job.view_until, job.extra_ckpt)
        else:
            ckpt = job.ckpt_wall
            job.view_until = job.work_start if job.state == _RUNNING else math.inf
        job.view_until = min(job.view_until, job.verdict_at)
        job.running_view = RunningJob(
            name=job.name,
            team=job.trace.team,
            priority=job.priority,
            pool=self._pool.name,
            gpus=job.gpus,
            started_at=job.run_start,
            last_checkpoint_at=ckpt,
            preemptions=job.outcome.preemptions,
            stopping=job.state == _STOPPING,
            guaranteed=job.guaranteed,
            **self._extra_running(job),
            **self._learned(job, now),
        )
        return job.running_view

    def _learned(self, job: _Job, now: float) -> dict:
        """What the controller observed of the job, as the snapshot passes it (when the core has it)."""
        extra = {}
        if "saves_on_stop" in _RUNNING_FIELDS:
            extra["declares_save_on_stop"] = job.cooperative  # it runs the training helper
            extra["saves_on_stop"] = job.trusted
            extra["ignored_checkpoint_request"] = job.ignored
            extra["checkpoint_requested_at"] = job.requested_at
        if "submitted_at" in _RUNNING_FIELDS:
            extra["submitted_at"] = job.trace.submit_s
        if job.awaits and job.signal_at > now and "stop_awaits_checkpoint" in _RUNNING_FIELDS:
            extra["stop_awaits_checkpoint"] = True
            if "preempted_for" in _RUNNING_FIELDS:
                extra["preempted_for"] = job.preempted_for
            job.view_until = min(job.view_until, job.signal_at)  # the signal ends the wait
        return extra

    def _plan(self, now: float) -> None:
        snapshot = self._snapshot(now)
        counters = self.counters
        counters["plans"] += 1
        counters["max_window"] = max(counters["max_window"], len(snapshot.pending))
        counters["max_running"] = max(counters["max_running"], len(snapshot.running))
        t0 = time.perf_counter()
        decision = self.policy.plan(snapshot, now)
        counters["plan_seconds"] += time.perf_counter() - t0
        self._carry_out(decision, now)

    def _carry_out(self, decision: Decision, now: float) -> None:
        window_was_full = len(self._queue) > self.config.pending_window
        for admission in decision.admits:
            job = self._by_name.get(admission.job)
            if job is None or job.state != _PENDING:
                raise SimulationError(f"{self.policy.name} admitted {admission.job}, which is not pending")
            job.guaranteed = getattr(admission, "guaranteed", False)
            self._start(job, now)
        for preemption in decision.preemptions:
            job = self._by_name.get(preemption.victim)
            if job is None or job.state != _RUNNING:
                raise SimulationError(f"{self.policy.name} preempted {preemption.victim}, which is not running")
            preemptor = self._by_name.get(preemption.preemptor)
            pair = f"{preemptor.priority if preemptor else '?'}>{job.priority}"
            self.pairs[pair] = self.pairs.get(pair, 0) + 1
            job.preempted_for = preemption.preemptor
            self._preempt(job, now, getattr(preemption, "wait_for_checkpoint", True))
            if preemptor is not None and preemptor.pending_view is not None and preemptor.state == _PENDING:
                # As the schedule step does: the GPUs freed go to the preemptor first.
                preemptor.pending_view = replace(preemptor.pending_view, nominated_at=now)
            if self.policy.history_window_s and _PastPreemption is not None:
                self._history.append(
                    _PastPreemption(pool=self._pool.name, at=now, gpus=job.gpus, lost_gpu_seconds=preemption.lost_gpu_seconds, victim=job.name)
                )
        for cut in getattr(decision, "wait_cuts", ()):
            job = self._by_name.get(cut.job)
            if job is None or job.state != _STOPPING:
                raise SimulationError(f"{self.policy.name} cut the checkpoint wait of {cut.job}, which is not being stopped")
            self._cut_wait(job, now)
        for call_off in getattr(decision, "call_offs", ()):
            job = self._by_name.get(call_off.job)
            if job is None or job.state != _STOPPING:
                raise SimulationError(f"{self.policy.name} called off the preemption of {call_off.job}, which is not being stopped")
            self._call_off(job, now)
        for request in getattr(decision, "checkpoint_requests", ()):
            job = self._by_name.get(request.job)
            if job is not None and job.state == _RUNNING:
                self._request_ahead(job, now)
        for failure in getattr(decision, "failures", ()):
            job = self._by_name.get(failure.job)
            if job is None or job.state != _PENDING:
                raise SimulationError(f"{self.policy.name} failed {failure.job}, which is not pending")
            self._fail(job, now)
        if (decision.admits or getattr(decision, "failures", ())) and window_was_full:
            self._dirty = True  # jobs below the old window moved into it

    # ------------------------------------------------------------------ job lifecycle

    def _start(self, job: _Job, now: float) -> None:
        if job.gpus > self._free:
            raise SimulationError(f"{self.policy.name} admitted {job.name} ({job.gpus} GPUs) with {self._free} free")
        self._dequeue(job)
        self._free -= job.gpus
        job.state = _RUNNING
        job.incarnation += 1
        job.gen += 1
        job.run_start = now
        free_restart = self.policy.stop is StopModel.FREE
        job.overhead = 0.0 if job.incarnation == 1 or free_restart else self.config.restart_overhead_s
        job.work_start = now + job.overhead
        job.extra_ckpt = None
        job.running_view = None
        job.signalled = False
        out = job.outcome
        out.wait_s += now - job.pending_since
        if out.first_started_at is None:
            out.first_started_at = now
        self._running[job.idx] = job
        self._busy.append((now, job.gpus))
        self._push(job.finish_at, _FINISH, job)

    def _finish(self, job: _Job, now: float) -> None:
        out = job.outcome
        out.finished_at = now
        out.held_gpu_s += (now - job.run_start) * job.gpus
        out.lost_overhead_gpu_s += job.overhead * job.gpus
        self._useful.append((job.work_start, job.gpus))
        self._useful.append((now, -job.gpus))
        self._release(job, now)
        job.state = _DONE
        self._done += 1
        if self._progress is not None:
            self._progress(1)

    def _fail(self, job: _Job, now: float) -> None:
        self._dequeue(job)
        job.outcome.wait_s += now - job.pending_since
        job.outcome.finished_at = now
        job.outcome.failed = True
        job.state = _DONE
        self.counters["failed_by_policy"] += 1
        self._done += 1
        if self._progress is not None:
            self._progress(1)

    def _release(self, job: _Job, now: float) -> None:
        if self.policy.usage_half_life_s and _TeamUsage is not None:
            team = job.trace.team
            usage = self._usage.get(team) or _TeamUsage(team, 0.0, job.run_start)
            self._usage[team] = usage.with_run(job.gpus, job.run_start, now, self.policy.usage_half_life_s)
        del self._running[job.idx]
        self._free += job.gpus
        self._busy.append((now, -job.gpus))
        job.running_view = None
        self._dirty = True

    def saves_on_sigterm(self, job: _Job) -> bool:
        """A cooperative job saves on SIGTERM when the grace leaves it time to write."""
        return job.cooperative and self.config.stop_grace_s >= self.config.checkpoint_write_s

    def _preempt(self, job: _Job, now: float, wait_for_checkpoint: bool = True) -> None:
        """Stop a victim the way the policy's stop model says (ours: as the decision says)."""
        self.counters["preemptions_decided"] += 1
        job.state = _STOPPING
        job.running_view = None
        job.awaits = False
        stop = self.policy.stop
        if stop is StopModel.FREE:
            signal_at, release_at = now, now
            saved_after, ckpt_after = job.progress(now), now
        elif stop is StopModel.IMMEDIATE or not wait_for_checkpoint:
            signal_at = now
            ckpt_after, saved_after = job.periodic_checkpoint(now) if now >= job.work_start else (job.ckpt_wall, job.saved)
            if stop is StopModel.CHECKPOINT_GATED:
                self.counters["stopped_at_once"] += 1
        else:
            job.ignored_before = job.ignored
            signal_at, saved_after, ckpt_after, spare = self._confirm_checkpoint(job, now)
            if spare:
                if job.finish_at > signal_at:
                    job.awaits, job.signal_at, job.ckpt_after = True, signal_at, None
                    self._push(signal_at, _SPARE, job)
                return
            # The controller sees its stop wait for the checkpoint until the signal, also
            # when the job ends first (the wait ends then).
            job.awaits, job.signal_at = signal_at > now, signal_at
        if job.finish_at <= signal_at:
            self.counters["preemptions_moot"] += 1  # it ends first; its FINISH stands
            job.ckpt_after = None  # a cut wait stops it from its newest checkpoint then
            return
        self._signal(job, signal_at, saved_after, ckpt_after)

    def _cut_wait(self, job: _Job, now: float) -> None:
        """The plan cut short the checkpoint wait of a victim being stopped: the stop signal
        goes now. The checkpoint it was asked for counts only if already written; the
        request is not held against it (the wait did not run out)."""
        if not job.awaits or job.signal_at <= now:
            return  # already signalled: nothing to cut
        self.counters["checkpoint_waits_cut"] += 1
        if job.ignored:
            self.counters["checkpoint_timeouts"] -= 1  # counted when the stop was decided; it did not run out
        if job.finish_at <= job.signal_at:
            self.counters["preemptions_moot"] -= 1  # it would have ended first; it is stopped now
        job.awaits = False
        job.running_view = None
        job.ignored = job.ignored_before
        if job.ckpt_after is None or job.ckpt_after > now:  # none asked for written yet
            ckpt_after, saved_after = job.periodic_checkpoint(now) if now >= job.work_start else (job.ckpt_wall, job.saved)
        else:
            ckpt_after, saved_after = job.ckpt_after, job.saved_after  # written, not yet seen
        self._signal(job, now, saved_after, ckpt_after)

    def _call_off(self, job: _Job, now: float) -> None:
        """The plan called off a preemption whose stop still waits for a checkpoint (its
        preemptor no longer needs the GPUs): the job runs on, as if never chosen. The
        checkpoint it was asked for is written all the same (a cooperative job's), and the
        request is not held against it (the wait did not run out)."""
        if not job.awaits or job.signal_at <= now:
            return  # signalled already: the stop goes on
        self.counters["preemptions_called_off"] += 1
        if job.ignored:
            self.counters["checkpoint_timeouts"] -= 1  # counted when the stop was decided; it did not run out
        job.ignored = job.ignored_before
        if job.finish_at <= job.signal_at and not job.signalled:
            self.counters["preemptions_moot"] -= 1  # it ends first all the same: its FINISH stands
        else:
            if job.signalled:
                if self.saves_on_sigterm(job):
                    self.counters["saved_on_sigterm"] -= 1  # counted when the signal was scheduled
                job.trusted = job.trusted_before
                job.signalled = False
            if job.ckpt_after is not None and job.ckpt_after > now:
                job.extra_ckpt = job.ckpt_after  # asked for, and written as the job runs on
            job.gen += 1  # cancels the scheduled release (or spare)
            self._push(job.finish_at, _FINISH, job)
        job.state = _RUNNING
        job.awaits = False
        job.running_view = None
        job.preempted_for = None
        self._forget_preemption(job)
        self._dirty = True

    def _signal(self, job: _Job, signal_at: float, saved_after: float, ckpt_after: float | None) -> None:
        """Send the stop signal at `signal_at` (cancelling the job's FINISH, or a pending
        signal or spare) and schedule the release of its GPUs."""
        stop = self.policy.stop
        job.signalled = True
        job.trusted_before = job.trusted
        release_at = signal_at
        if stop is not StopModel.FREE:
            # The stop signal: a job that saves on SIGTERM writes its state and exits once
            # written; any other is killed at the end of the grace and resumes from its
            # newest checkpoint (for ours, the one it was asked for, if it wrote it).
            if self.saves_on_sigterm(job):
                saved_after, ckpt_after = job.progress(signal_at), signal_at
                release_at = signal_at + self.config.checkpoint_write_s
                self.counters["saved_on_sigterm"] += 1
            else:
                release_at = signal_at + self.config.stop_grace_s
            # What the controller sees: a checkpoint written during the grace, or none.
            job.trusted = self.saves_on_sigterm(job)
        job.gen += 1  # cancels its FINISH
        job.signal_at = signal_at
        job.saved_after = saved_after
        job.ckpt_after = ckpt_after
        self._push(release_at, _STOP_DONE, job)

    def _request_ahead(self, job: _Job, now: float) -> None:
        """A checkpoint asked ahead of a preemption: a cooperative job writes it
        `checkpoint_write_s` after the request (after its reload); the controller knows
        whether it was honoured once a checkpoint appears, or the wait is over."""
        self.counters["checkpoint_requests_ahead"] += 1
        job.requested_at = now
        job.running_view = None
        wait_max = self.policy.checkpoint_wait_max_s
        if job.cooperative:
            written = max(now, job.work_start) + self.config.checkpoint_write_s
            if written < job.finish_at:
                job.extra_ckpt = written if job.extra_ckpt is None or job.extra_ckpt < now else min(job.extra_ckpt, written)
                self.counters["ahead_checkpoint_write_gpu_s"] += job.gpus * self.config.checkpoint_write_s
            job.verdict_at, job.verdict_ignored = written, False
        else:
            periods = math.floor(max(0.0, now - job.work_start) / job.interval)
            periodic = job.work_start + (periods + 1) * job.interval
            honoured = periodic <= now + wait_max
            job.verdict_at = periodic if honoured else now + wait_max
            job.verdict_ignored = not honoured

    def _confirm_checkpoint(self, job: _Job, now: float) -> tuple[float, float, float | None, bool]:
        """Ours: (stop signal time, progress kept, its checkpoint time, spare the victim?)."""
        policy = self.policy
        newest, saved = job.periodic_checkpoint(now) if now >= job.work_start else (job.ckpt_wall, job.saved)
        # The workflow's check itself (`core.progress.is_fresh`): a relaunched run resumed
        # from `newest`, so only the work since the later of it and the run's start is at risk.
        if is_fresh(newest, job.run_start, now, policy.checkpoint_max_age_s):
            return now, saved, newest, False
        self.counters["checkpoint_requests"] += 1
        job.requested_at = now
        poll = policy.checkpoint_poll_s
        attempts = max(1, int(policy.checkpoint_wait_max_s // poll))
        deadline = now + attempts * poll
        # The first checkpoint written after the request: the next periodic one, or the
        # one the training helper writes on request (once the job is past its reload).
        working_from = max(now, job.work_start)
        periods_done = math.floor((working_from - job.work_start) / job.interval)
        written = [job.work_start + (periods_done + 1) * job.interval]
        if job.cooperative:
            written.append(working_from + self.config.checkpoint_write_s)
        first = min(written)
        if first >= job.finish_at:
            return job.finish_at, job.saved, job.ckpt_wall, False  # it ends before it could checkpoint
        if first <= deadline:
            signal_at = now + math.ceil((first - now) / poll) * poll  # seen at the next poll
            job.ignored = False
            return signal_at, job.progress(first), first, False
        self.counters["checkpoint_timeouts"] += 1
        job.ignored = True  # not waited for again
        if policy.spare_on_timeout:
            return deadline, job.saved, job.ckpt_wall, True
        ckpt, saved = job.periodic_checkpoint(deadline) if deadline >= job.work_start else (job.ckpt_wall, job.saved)
        return deadline, saved, ckpt, False

    def _release_victim(self, job: _Job, now: float) -> None:
        """A stopped victim's GPUs are free: account for the loss, then requeue it."""
        job.awaits = False
        out = job.outcome
        kept = job.saved_after - job.saved
        # The run resumes from `ckpt_after`: the loss counts as the workflows count it
        # (`core.progress`), from the later of that checkpoint and the start of the work.
        loss = stop_loss(
            run_started_at=job.run_start,
            work_started_at=job.work_start,
            checkpoint_at=job.ckpt_after,
            signal_at=job.signal_at,
            released_at=now,
        )
        out.held_gpu_s += (now - job.run_start) * job.gpus
        out.lost_progress_gpu_s += loss.progress_s * job.gpus
        out.lost_grace_gpu_s += loss.grace_s * job.gpus
        out.lost_overhead_gpu_s += loss.overhead_s * job.gpus
        out.preemptions += 1
        if kept > 0:
            self._useful.append((job.work_start, job.gpus))
            self._useful.append((job.work_start + kept, -job.gpus))
        job.saved = job.saved_after
        job.ckpt_wall = job.ckpt_after
        self._release(job, now)
        job.state = _RELAUNCHING
        job.pending_since = now
        delay = 0.0 if self.policy.stop is StopModel.FREE else self.config.relaunch_delay_s
        self._push(now + delay, _REQUEUE, job)


def simulate(
    trace: list[TraceJob],
    policy: SimPolicy,
    config: SimConfig,
    *,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay `trace` through `policy`; see the module docstring for the model."""
    return Simulator(trace, policy, config, progress=progress).run()
