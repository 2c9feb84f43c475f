"""The explain trace: what a job found at its turn in the planner, for `explain`.

`trace_job` replays `plan` and, at the traced job's turn, records its rank and how its
priority was derived, the pool as it stood (capacity, quota, budget, delay) and every
running job of the pool in victim order with the rule that makes it a victim or the
reason it is not one. `running_verdicts` says the same of a running job. The decision loop
knows nothing of this: it calls an observer at every turn (`planner.run`).
"""

from __future__ import annotations

from .model import Reason, RunningJob, Snapshot
from .planner import OURS, Discipline, PoolPlanner, run
from .policy import Policy
from .ranking import RankedJob


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def pool_state(planner: PoolPlanner, r: RankedJob) -> dict:
    """The pool as the job found it at its turn."""
    bucket = planner.quotas.bucket_for(r.job.team, r.claimed)
    out = {
        "pool_gpus": planner.pool.gpus,
        "running_gpus": sum(v.gpus for v in planner.running),
        "free_gpus": planner.free,
        "being_freed_gpus": planner.releasing,
        "admitted_ahead_gpus": planner.admitted_gpus,
        "held_ahead_gpus": planner.held_gpus,
    }
    if bucket is not None:
        ceiling = bucket.ceiling_label()
        out["quota"] = {
            "quota": bucket.label(),
            "used_gpus": bucket.used,
            "nominal_gpus": bucket.nominal,
            "ceiling_gpus": None if ceiling == "unlimited" else ceiling,
            "kept_unlent_by_others_gpus": planner.quotas.kept_by_others(bucket),
        }
    budget = planner.knobs.budget
    if budget is not None:
        out["budget"] = {
            "window_s": budget.window_s,
            "preemptions": planner.budget_count,
            "max_preemptions": budget.max_preemptions,
            "lost_gpu_hours": round(planner.budget_lost / 3600.0, 3),
            "max_gpu_hours": budget.max_gpu_hours,
        }
    delay = 0.0 if r.job.escalated else planner.delay_for(r.claimed)  # its tier's, else the pool's
    if delay:
        waited = planner.now - r.job.waiting_since()
        out["delay_left_s"] = round(max(0.0, delay - waited), 3)
    return out


def _candidate(planner: PoolPlanner, r: RankedJob, v: RunningJob) -> dict:
    now = planner.now
    verdict = planner.candidate_verdict(r, v)
    return {
        "job": v.name,
        "team": v.team,
        "priority": planner.claimed[v.name],
        "gpus": v.gpus,
        "borrowed": v.name in planner.quotas.borrowed,
        "lost_gpu_seconds": round(v.lost_gpu_seconds(now), 3),
        "cost_gpu_seconds": round(v.stop_cost_gpu_seconds(now), 3),
        "checkpoint_age_s": _round(v.checkpoint_age_s(now)),
        "eligible": verdict.rule is not None,
        "rule": verdict.rule.value if verdict.rule else None,
        "reason": verdict.reason.value,
        "detail": verdict.detail,
    }


def candidates(planner: PoolPlanner, r: RankedJob) -> list[dict]:
    """Every running job of the pool, in victim order, and whether `r` may stop it."""
    return [_candidate(planner, r, v) for v in sorted(planner.running, key=planner.victim_order)]


def trace_job(snapshot: Snapshot, policy: Policy, now: float, name: str, discipline: Discipline = OURS) -> dict | None:
    """How pending job `name` ranked and what it found at its turn: for `explain`.

    Returns None when `name` is not a pending job of a configured pool.
    """
    traced: dict = {}

    def observe(planner: PoolPlanner, ranked: list[RankedJob], position: int, r: RankedJob) -> None:
        if r.job.name != name:
            return
        traced.update(
            {
                "pool": planner.pool.name,
                "position": position,
                "queue_length": len(ranked),
                "ahead": [a.job.name for a in ranked[: position - 1][:5]],
                "priority": r.job.priority,
                "claimed_priority": r.claimed,
                "effective_priority": r.effective,
                "team_usage_gpu_s": round(r.team_usage, 3),
                "adjustments": [{"reason": reason.value, "detail": detail} for reason, detail in r.adjustments]
                + _placed_later(planner, r),
                "state": pool_state(planner, r),
                "candidates": candidates(planner, r),
            }
        )

    run(snapshot, policy, now, discipline, observe)
    return traced or None


def _placed_later(planner: PoolPlanner, r: RankedJob) -> list[dict]:
    """The job would borrow and was placed after other teams' work within its nominal quota
    (`PoolPlanner.nominal_first`)."""
    if r.job.name not in planner.borrowing_last:
        return []
    detail = "it would run above its quota's nominal share: placed after the work of other teams within theirs"
    return [{"reason": Reason.BORROWS_AFTER_NOMINAL.value, "detail": detail}]


def running_verdicts(snapshot: Snapshot, policy: Policy, now: float, name: str) -> dict | None:
    """For running job `name`: its claimed priority, quota status and protection, for `explain`."""
    job = next((v for v in snapshot.running if v.name == name), None)
    pool = next((p for p in snapshot.pools if p.name == (job.pool if job else None)), None)
    if job is None or pool is None:
        return None
    running = [v for v in snapshot.running if v.pool == pool.name]
    planner = PoolPlanner(pool, policy.for_pool(pool.name), policy, now, running, snapshot.preemption_history)
    protection = planner.protected.get(name)
    return {
        "claimed_priority": planner.claimed[name],
        "borrowed": name in planner.quotas.borrowed,
        "protected": None if protection is None else {"reason": protection.reason.value, "detail": protection.detail},
        "lost_gpu_seconds": round(job.lost_gpu_seconds(now), 3),
        "checkpoint_age_s": _round(job.checkpoint_age_s(now)),
        "remaining_s": _round(job.remaining_s(now)),
        "progress": None if job.progress_at(now) is None else round(job.progress_at(now), 4),
    }


__all__ = ["candidates", "pool_state", "running_verdicts", "trace_job"]
