"""Metrics of a replay, per policy and per priority.

Definitions (docs/simulator.md):
- wait: time a job does not hold GPUs between its submission and its end (first wait, plus
  every release-to-readmission after a preemption). Percentiles interpolate linearly
  between order statistics (numpy's default).
- completion: end - submission.
- lost GPU-hours: work thrown away since the last checkpoint + GPUs held during stop grace
  + restart overhead of every relaunch.
- utilisation: GPU-seconds held / (pool GPUs x span), over the submission span [first
  submission, last submission] (the drain after the last arrival would dilute it);
  goodput counts only GPU-seconds whose work was kept.
- fairness across teams: Jain's index of the teams' mean bounded slowdown, where a job's
  bounded slowdown is completion / max(duration, 600 s) (1 = every team is slowed
  equally); with the teams' mean and p95 waits.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

from .engine import JobOutcome, SimResult

SLOWDOWN_BOUND_S = 600.0
TIER_NAMES = {1000: "critical", 500: "high", 200: "medium", 50: "low"}


def percentile(sorted_values: list[float], q: float) -> float:
    """q in [0, 100]; linear interpolation between the closest ranks."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _group_stats(jobs: list[JobOutcome]) -> dict:
    waits = sorted(j.wait_s for j in jobs)
    completions = sorted(j.completion_s for j in jobs if j.completion_s is not None)
    preemptions = sum(j.preemptions for j in jobs)
    return {
        "jobs": len(jobs),
        "wait_p50_s": round(percentile(waits, 50), 1),
        "wait_p95_s": round(percentile(waits, 95), 1),
        "wait_p99_s": round(percentile(waits, 99), 1),
        "wait_max_s": round(waits[-1], 1) if waits else 0.0,
        "wait_mean_s": round(sum(waits) / len(waits), 1) if waits else 0.0,
        "completion_p50_s": round(percentile(completions, 50), 1),
        "completion_p95_s": round(percentile(completions, 95), 1),
        "completion_mean_s": round(sum(completions) / len(completions), 1) if completions else 0.0,
        "preemptions": preemptions,
        "restarts_per_job": round(preemptions / len(jobs), 4) if jobs else 0.0,
        "max_restarts": max((j.preemptions for j in jobs), default=0),
        "lost_gpu_hours": round(sum(j.lost_gpu_s for j in jobs) / 3600.0, 2),
    }


def integrate(deltas: Iterable[tuple[float, int]], start: float, end: float) -> float:
    """Integral over [start, end] of the step function given by (time, +/-delta) changes."""
    total, level, last = 0.0, 0, start
    for t, d in sorted(deltas):
        if t > end:
            break
        if t > last:
            total += level * (t - last)
            last = t
        level += d
    if end > last:
        total += level * (end - last)
    return total


def step_averages(deltas: list[tuple[float, int]], start: float, end: float, step: float) -> list[tuple[float, float]]:
    """Mean level of the step function in each [t, t+step) bucket from start to end."""
    out: list[tuple[float, float]] = []
    events = sorted(deltas)
    i, level = 0, 0
    t = start
    while i < len(events) and events[i][0] <= start:
        level += events[i][1]
        i += 1
    while t < end:
        bucket_end = min(t + step, end)
        area, last = 0.0, t
        while i < len(events) and events[i][0] < bucket_end:
            area += level * (events[i][0] - last)
            last = events[i][0]
            level += events[i][1]
            i += 1
        area += level * (bucket_end - last)
        out.append((t, area / (bucket_end - t)))
        t = bucket_end
    return out


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all values are equal, 1/n when one takes everything."""
    if not values:
        return 1.0
    s, s2 = sum(values), sum(v * v for v in values)
    return (s * s) / (len(values) * s2) if s2 > 0 else 1.0


def summarize(result: SimResult) -> dict:
    """The JSON a replay prints (`preemptor sim --json`) and the bench stores."""
    jobs = result.jobs
    gpus = result.config.gpus
    submits = [j.submitted_at for j in jobs]
    first, last = (min(submits), max(submits)) if submits else (0.0, 0.0)
    drained = max((j.finished_at or 0.0 for j in jobs), default=0.0)
    span = max(last - first, 1e-9)

    by_priority: dict[int, list[JobOutcome]] = defaultdict(list)
    by_team: dict[str, list[JobOutcome]] = defaultdict(list)
    for job in jobs:
        by_priority[job.priority].append(job)
        by_team[job.team].append(job)

    team_stats = {}
    slowdowns = []
    for team, members in sorted(by_team.items()):
        waits = sorted(j.wait_s for j in members)
        slowdown = sum((j.completion_s or 0.0) / max(j.duration_s, SLOWDOWN_BOUND_S) for j in members) / len(members)
        slowdowns.append(slowdown)
        team_stats[team] = {
            "jobs": len(members),
            "wait_mean_s": round(sum(waits) / len(waits), 1),
            "wait_p95_s": round(percentile(waits, 95), 1),
            "mean_bounded_slowdown": round(slowdown, 3),
        }

    longest = max(jobs, key=lambda j: (j.wait_s, j.name), default=None)
    lost_progress = sum(j.lost_progress_gpu_s for j in jobs)
    lost_grace = sum(j.lost_grace_gpu_s for j in jobs)
    lost_overhead = sum(j.lost_overhead_gpu_s for j in jobs)
    busy_in_span = integrate(result.busy, first, last)
    useful_in_span = integrate(result.useful, first, last)
    overall = _group_stats(jobs)
    counters = result.counters
    return {
        "policy": result.policy,
        "jobs": len(jobs),
        "unschedulable_jobs": len(result.unschedulable),
        "failed_jobs": sum(1 for j in jobs if j.failed),
        "gpus": gpus,
        "by_priority": {str(p): _group_stats(by_priority[p]) for p in sorted(by_priority, reverse=True)},
        "overall": overall,
        "lost_gpu_hours": round((lost_progress + lost_grace + lost_overhead) / 3600.0, 2),
        "lost_gpu_hours_breakdown": {
            "work_since_checkpoint": round(lost_progress / 3600.0, 2),
            "stop_grace": round(lost_grace / 3600.0, 2),
            "restart_overhead": round(lost_overhead / 3600.0, 2),
        },
        "useful_gpu_hours": round(sum(j.duration_s * j.gpus for j in jobs) / 3600.0, 2),
        "utilization": round(busy_in_span / (gpus * span), 4),
        "goodput": round(useful_in_span / (gpus * span), 4),
        "utilization_until_drained": round(integrate(result.busy, first, drained) / (gpus * max(drained - first, 1e-9)), 4),
        "preemptions": overall["preemptions"],
        "restarts_per_job": overall["restarts_per_job"],
        "max_restarts": overall["max_restarts"],
        "longest_wait": None
        if longest is None
        else {"job": longest.name, "priority": longest.priority, "gpus": longest.gpus, "wait_s": round(longest.wait_s, 1)},
        "fairness": {
            "teams": len(team_stats),
            "jain_bounded_slowdown": round(jain(slowdowns), 4),
            "by_team": team_stats,
        },
        "span_s": {"first_submit": first, "last_submit": last, "drained": drained},
        "model": result.config.model(),
        "policy_source": result.policy_source,
        "policy_knobs": result.policy_knobs,
        "simulator": {
            "wall_seconds": round(counters.get("wall_seconds", 0.0), 2),
            "plans": int(counters.get("plans", 0)),
            "plan_seconds": round(counters.get("plan_seconds", 0.0), 2),
            "events": int(counters.get("events", 0)),
            "max_queue": int(counters.get("max_queue", 0)),
            "max_window": int(counters.get("max_window", 0)),
            "max_running": int(counters.get("max_running", 0)),
            "preemptions_decided": int(counters.get("preemptions_decided", 0)),
            "preemptions_moot": int(counters.get("preemptions_moot", 0)),
            "checkpoint_requests": int(counters.get("checkpoint_requests", 0)),
            "checkpoint_requests_ahead": int(counters.get("checkpoint_requests_ahead", 0)),
            "ahead_checkpoint_write_gpu_hours": round(counters.get("ahead_checkpoint_write_gpu_s", 0.0) / 3600.0, 2),
            "checkpoint_timeouts": int(counters.get("checkpoint_timeouts", 0)),
            "checkpoint_waits_cut": int(counters.get("checkpoint_waits_cut", 0)),
            "victims_spared": int(counters.get("victims_spared", 0)),
            "preemptions_called_off": int(counters.get("preemptions_called_off", 0)),
            "failed_by_policy": int(counters.get("failed_by_policy", 0)),
            # decisions by claimed priorities "preemptor>victim"; "50>50" means a job
            # preempted one of its own priority (aging, or LowerOrNewerEqualPriority)
            "preemptions_by_priority_pair": counters.get("preemptions_by_priority_pair", {}),
        },
    }
