"""Checkpoint freshness and lost work: the one rule the planner, the workflows and the
simulator share.

A run resumes from the newest checkpoint it was launched with, so what a stop at `now`
throws away is the work since the later of two times: the newest checkpoint, and the
start of the run. A relaunched victim whose newest checkpoint predates its run (it has
not written one since it reloaded) has nothing older than its run start at risk, and a
run still reloading loses nothing but its restart. Freshness follows the same clock:
a checkpoint is fresh when the work at risk since it is within the pool's limit.

Users: `model.RunningJob` (the planner's lost work and victim cost),
`service.actions` (the checkpoint check and the lost work recorded on requeue) and
`preemptor_tools.sim.engine` (ours' checkpoint check and the loss of every stopped run).
"""

from __future__ import annotations

from dataclasses import dataclass


def at_risk_since(last_checkpoint_at: float | None, run_started_at: float | None) -> float | None:
    """When the work a stop would throw away began: the later of the newest checkpoint and
    the run's start (whichever is known; None when neither is)."""
    if last_checkpoint_at is None:
        return run_started_at
    if run_started_at is None:
        return last_checkpoint_at
    return max(last_checkpoint_at, run_started_at)


def work_at_risk_s(last_checkpoint_at: float | None, run_started_at: float | None, now: float) -> float:
    """Seconds of work a stop at `now` throws away (0 when nothing is known to be at risk).

    `at_risk_since` and the `max`es inline: the planner asks this of every victim it
    weighs, several times a plan."""
    if last_checkpoint_at is None:
        since = run_started_at
    elif run_started_at is None:
        since = last_checkpoint_at
    else:
        since = run_started_at if run_started_at > last_checkpoint_at else last_checkpoint_at
    if since is None:
        return 0.0
    at_risk = now - since
    return at_risk if at_risk > 0.0 else 0.0


def lost_gpu_seconds(gpus: int, last_checkpoint_at: float | None, run_started_at: float | None, now: float) -> float:
    """GPU-seconds of work a stop at `now` throws away."""
    return gpus * work_at_risk_s(last_checkpoint_at, run_started_at, now)


def is_fresh(last_checkpoint_at: float | None, run_started_at: float | None, now: float, max_age_s: float) -> bool:
    """Whether a stop at `now` may go ahead without asking for a new checkpoint: the job
    has written one, and at most `max_age_s` of work is at risk since it (or since the run
    started, for a run that resumed from it)."""
    if last_checkpoint_at is None:
        return False
    return work_at_risk_s(last_checkpoint_at, run_started_at, now) <= max_age_s


def saved_in_run_s(last_checkpoint_at: float | None, run_started_at: float) -> float:
    """Seconds of a run's work its newest checkpoint keeps (0 when it predates the run)."""
    if last_checkpoint_at is None:
        return 0.0
    return max(0.0, last_checkpoint_at - run_started_at)


@dataclass(frozen=True, slots=True)
class RunLoss:
    """What one stopped run cost, in seconds, by cause."""

    progress_s: float  # work done since the checkpoint it will resume from, thrown away
    grace_s: float  # held between the stop signal and the release of its GPUs
    overhead_s: float  # restart overhead spent before the stop signal (reloading, not working)

    @property
    def total_s(self) -> float:
        return self.progress_s + self.grace_s + self.overhead_s


def stop_loss(
    *,
    run_started_at: float,
    work_started_at: float,
    checkpoint_at: float | None,
    signal_at: float,
    released_at: float,
) -> RunLoss:
    """The loss of a run started at `run_started_at` (working from `work_started_at`, after
    its restart overhead), signalled at `signal_at`, whose GPUs came back at `released_at`,
    and that resumes from the checkpoint written at `checkpoint_at`.

    The progress lost is the work at risk at the signal, counted from the later of the
    checkpoint and the start of the work (the same rule as `work_at_risk_s`).
    """
    return RunLoss(
        progress_s=work_at_risk_s(checkpoint_at, work_started_at, signal_at),
        grace_s=max(0.0, released_at - signal_at),
        overhead_s=max(0.0, min(work_started_at, signal_at) - run_started_at),
    )


__all__ = ["RunLoss", "at_risk_since", "is_fresh", "lost_gpu_seconds", "saved_in_run_s", "stop_loss", "work_at_risk_s"]
