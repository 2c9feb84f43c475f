"""`preemptor explain JOB`: why a job waits, runs, or was preempted. Pure.

`explain_job` takes what the caller already has: the decision of a plan, the snapshot it
was made from, the policy, `now` and, optionally, the job's decision log (the entries the
store's `history(job)` returns: dicts with `at`, `kind`, `reason`, `detail`, `extra`). The
CLI builds them from a snapshot file; the same call serves the live jobs table.

The answer is a dict (stable keys, JSON-ready) with a `text` rendering for people:

- a pending job: its position in its pool's queue and how its effective priority was
  derived, the decision's verdict, what is in the way (capacity, quota, budget, delay),
  and every running job of the pool in victim order with the rule that makes it a
  victim, or the reason it is not one;
- a running job: whether this plan preempts it (by whom, under which rule), its
  protections, quota status and checkpoint age;
- any job with a log: each past preemption, who preempted it, under which rule, how old
  its checkpoint was and how much work was lost.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterable

from .model import Decision, PreemptionRule, Reason, Snapshot, Verdict
from .trace import running_verdicts, trace_job
from .policy import Policy

_RULE_BY_REASON = {rule.victim_reason.value: rule.value for rule in PreemptionRule}


EPOCH_2001 = 978_307_200.0  # anything later is an epoch timestamp, not a relative time

def explain_job(
    name: str,
    decision: Decision,
    snapshot: Snapshot,
    policy: Policy,
    now: float,
    history: list[dict] | None = None,
) -> dict:
    """Explain job `name` from a decision and the snapshot and policy it was planned with."""
    pending = next((j for j in snapshot.pending if j.name == name), None)
    running = next((j for j in snapshot.running if j.name == name), None)
    answer: dict[str, Any] = {"job": name, "now": now}
    lines = [e for e in decision.explanations if e.job == name and e.for_job is None]
    if pending is not None:
        answer.update(status="pending", pool=pending.pool, team=pending.team, gpus=pending.gpus)
        answer["pending"] = _pending(name, decision, snapshot, policy, now, lines)
    elif running is not None:
        answer.update(
            status="stopping" if running.stopping else "running", pool=running.pool, team=running.team, gpus=running.gpus
        )
        answer["running"] = _running(name, decision, snapshot, policy, now)
    else:
        answer["status"] = "unknown" if not history else "not-in-snapshot"
    answer["preemptions"] = preemptions_from_history(history or [])
    answer["priority_changes"] = priority_changes_from_history(history or [])
    answer["text"] = render(answer)
    return answer


def priority_changes_from_history(history: Iterable[dict]) -> list[dict]:
    """The changes of the job's priority since its submission (the operator's `preemptor
    priority`, its team's lowerings), oldest first: {"at", "from", "to", "detail"}."""
    return [
        {"at": e.get("at"), "from": (e.get("extra") or {}).get("from"), "to": (e.get("extra") or {}).get("to"), "detail": e.get("detail", "")}
        for e in sorted(history, key=lambda e: (e.get("at", 0.0), e.get("sk", "")))
        if e.get("kind") == "priority-changed"
    ]


def _pending(name: str, decision: Decision, snapshot: Snapshot, policy: Policy, now: float, lines) -> dict:
    trace = trace_job(snapshot, policy, now, name)
    outcome = next((e for e in lines if e.verdict is not Verdict.RANK), None)
    out: dict[str, Any] = {
        "verdict": outcome.verdict.value if outcome else None,
        "reason": outcome.reason.value if outcome else None,
        "detail": outcome.detail if outcome else "",
        "preempting": [
            {"victim": p.victim, "rule": p.rule.value, "gpus": p.gpus, "lost_gpu_seconds": round(p.lost_gpu_seconds, 3)}
            for p in decision.preemptions
            if p.preemptor == name
        ],
    }
    if trace is None:  # unknown pool
        out["in_the_way"] = [outcome.detail] if outcome else []
        return out
    out.update({k: trace[k] for k in ("position", "queue_length", "ahead", "priority", "claimed_priority", "effective_priority", "team_usage_gpu_s", "adjustments")})
    out["pool_state"] = trace["state"]
    out["candidates"] = trace["candidates"]
    out["in_the_way"] = _in_the_way(outcome.reason if outcome else None, trace, snapshot, name)
    # The stops waiting for a checkpoint whose GPUs it waits for, and whether their wait was cut.
    out["in_the_way"] += [
        f"the stop of {e.job}: {e.detail}"
        for e in decision.explanations
        if e.for_job == name and e.reason in (Reason.CHECKPOINT_WAIT_CUT, Reason.CHECKPOINT_WAIT_KEPT)
    ]
    return out


def _in_the_way(reason: Reason | None, trace: dict, snapshot: Snapshot, name: str) -> list[str]:
    """Short sentences naming what keeps a pending job from running now."""
    if reason in (Reason.FITS_FREE_CAPACITY, Reason.BORROWS_IDLE_QUOTA):
        return []
    state, job = trace["state"], next(j for j in snapshot.pending if j.name == name)
    out = [
        f"capacity: needs {job.gpus} GPUs; {state['free_gpus']} of {state['pool_gpus']} free at its turn, "
        f"{state['being_freed_gpus']} being freed; {state['admitted_ahead_gpus']} admitted and "
        f"{state['held_ahead_gpus']} held for the {trace['position'] - 1} job(s) ahead of it"
    ]
    quota = state.get("quota")
    if quota and (reason is Reason.OVER_QUOTA or quota["used_gpus"] + job.gpus > quota["nominal_gpus"]):
        ceiling = "unlimited" if quota["ceiling_gpus"] is None else quota["ceiling_gpus"]
        out.append(
            f"quota {quota['quota']}: uses {quota['used_gpus']} of nominal {quota['nominal_gpus']} "
            f"(ceiling {ceiling}); other quotas keep {quota['kept_unlent_by_others_gpus']} GPUs unlent"
        )
    budget = state.get("budget")
    if budget and reason is Reason.BUDGET_EXHAUSTED:
        out.append(
            f"budget: {budget['preemptions']} preemptions (max {budget['max_preemptions']}) and "
            f"{budget['lost_gpu_hours']} GPU-hours lost (max {budget['max_gpu_hours']}) in the last {budget['window_s']:g} s"
        )
    if reason is Reason.PREEMPTION_DELAYED:
        out.append(f"delay: preempts only after {state.get('delay_left_s', 0):.0f} s more")
    eligible = [c for c in trace["candidates"] if c["eligible"]]
    protected = [c for c in trace["candidates"] if c["reason"] in _PROTECTIONS]
    out.append(
        f"victims: {len(eligible)} running job(s) it may preempt ({sum(c['gpus'] for c in eligible)} GPUs); "
        f"{len(protected)} protected"
    )
    return out


_PROTECTIONS = {
    Reason.MIN_RUNTIME_PROTECTED.value,
    Reason.NEAR_COMPLETION_PROTECTED.value,
    Reason.MAX_PREEMPTIONS_PROTECTED.value,
    Reason.NOT_STOPPABLE.value,
}


def _running(name: str, decision: Decision, snapshot: Snapshot, policy: Policy, now: float) -> dict:
    facts = running_verdicts(snapshot, policy, now, name) or {}
    job = next((v for v in snapshot.running if v.name == name), None)
    if job is not None:
        # What the controller learned of it (service.learning), which decides how it is stopped.
        facts["learned"] = {
            "declares_save_on_stop": job.declares_save_on_stop,
            "saves_on_stop": job.saves_on_stop,
            "ignored_checkpoint_request": job.ignored_checkpoint_request,
            "checkpoint_requested_at": job.checkpoint_requested_at,
        }
        # Held interrupted by SageMaker managed spot: nothing at risk, no checkpoint asked.
        facts["spot_interrupted"] = job.paused
    ahead = next((c for c in decision.checkpoint_requests if c.job == name), None)
    facts["checkpoint_ahead"] = None if ahead is None else {"for": ahead.for_job, "detail": ahead.detail}
    chosen = next((p for p in decision.preemptions if p.victim == name), None)
    facts["preempted_now"] = (
        None
        if chosen is None
        else {
            "preemptor": chosen.preemptor,
            "rule": chosen.rule.value,
            "reason": chosen.reason.value,
            "checkpoint_age_s": None if chosen.checkpoint_age_s is None else round(chosen.checkpoint_age_s, 3),
            "checkpoint_fresh": chosen.checkpoint_fresh,
            "lost_gpu_seconds": round(chosen.lost_gpu_seconds, 3),
            "wait_for_checkpoint": chosen.wait_for_checkpoint,
            "stop": chosen.stop.value,
            "escalated": chosen.escalated,
        }
    )
    facts["considered_for"] = [
        {"preemptor": e.for_job, "verdict": e.verdict.value, "reason": e.reason.value, "detail": e.detail}
        for e in decision.explanations
        # an ahead-of-time request is told once, as `checkpoint_ahead`
        if e.job == name and e.for_job is not None and e.reason is not Reason.AHEAD_OF_PREEMPTION
    ]
    return facts


# The decision-log kinds that end a stopped run: requeued, or (a run the controller adopted,
# which it does not relaunch) ended for its team to relaunch.
STOPPED_RUN_KINDS = ("requeued", "preempted-not-relaunched", "interrupted-not-relaunched")


def preemptions_from_history(history: Iterable[dict]) -> list[dict]:
    """One entry per past preemption in a job's decision log, oldest first.

    A preemption starts with a `preemption-started` entry (its `extra` has the preemptor,
    the checkpoint age and the lost work at decision time) and may be followed by
    `checkpoint-confirmed`, `stop-requested` and `requeued` (whose `extra` has the work
    actually lost and whether the checkpoint was fresh).
    """
    episodes: list[dict] = []
    for entry in sorted(history, key=lambda e: (e.get("at", 0.0), e.get("sk", ""))):
        kind, extra = entry.get("kind"), entry.get("extra") or {}
        if kind == "preemption-started":
            reason = entry.get("reason", "")
            episodes.append(
                {
                    "at": entry.get("at"),
                    "preemptor": extra.get("preemptor"),
                    "rule": extra.get("rule") or _RULE_BY_REASON.get(reason),
                    "reason": reason,
                    "checkpoint_age_s": extra.get("checkpoint_age_s"),
                    "lost_gpu_seconds": extra.get("lost_gpu_seconds"),
                    "detail": entry.get("detail", ""),
                    "checkpoint_confirmed": False,
                    "fresh_checkpoint": None,
                    "requeued_at": None,
                }
            )
            continue
        if not episodes:
            if kind not in STOPPED_RUN_KINDS:
                continue
            # A log that starts mid-way (trimmed) still tells who preempted the job.
            episodes.append({"at": entry.get("at"), "preemptor": extra.get("preemptor"), "rule": None, "reason": "",
                             "checkpoint_age_s": extra.get("checkpoint_age_s"), "lost_gpu_seconds": None, "detail": "",
                             "checkpoint_confirmed": False, "fresh_checkpoint": None, "requeued_at": None})
        current = episodes[-1]
        if kind == "checkpoint-confirmed":
            current["checkpoint_confirmed"] = True
            if extra.get("checkpoint_age_s") is not None:
                current["checkpoint_age_s"] = extra["checkpoint_age_s"]  # the age the stop relied on
        elif kind == "stop-requested":
            current["fresh_checkpoint"] = entry.get("reason") == "fresh-checkpoint"
        elif kind in STOPPED_RUN_KINDS:
            current["requeued_at"] = entry.get("at")
            current["preemptor"] = current["preemptor"] or extra.get("preemptor")
            if "lost_gpu_seconds" in extra:
                current["lost_gpu_seconds"] = extra["lost_gpu_seconds"]
            if "fresh_checkpoint" in extra:
                current["fresh_checkpoint"] = extra["fresh_checkpoint"]
            if current["checkpoint_age_s"] is None and "checkpoint_age_s" in extra:
                current["checkpoint_age_s"] = extra["checkpoint_age_s"]
    return episodes


# -- text ------------------------------------------------------------------------------------
def _time(at: Any) -> str:
    if at is None:
        return "an unknown time"
    if isinstance(at, (int, float)):
        # Live state carries epoch seconds; snapshot files often small relative times.
        if at >= EPOCH_2001:
            return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
        return f"{at:g}"
    return str(at)


def render(answer: dict) -> str:
    """The answer as a few lines of text."""
    name, status = answer["job"], answer["status"]
    out: list[str] = []
    if status == "pending":
        p = answer["pending"]
        if "position" in p:
            out.append(
                f"{name}: pending in {answer['pool']}, position {p['position']} of {p['queue_length']}; "
                f"priority {p['priority']}, claimed {p['claimed_priority']}, effective {p['effective_priority']}"
            )
            for adj in p["adjustments"]:
                out.append(f"  rank: {adj['reason']}: {adj['detail']}")
            if p["ahead"]:
                out.append(f"  ahead of it: {', '.join(p['ahead'])}{' ...' if p['position'] - 1 > len(p['ahead']) else ''}")
        else:
            out.append(f"{name}: pending in {answer['pool']}")
        out.append(f"  decision: {p['verdict']} ({p['reason']}): {p['detail']}")
        for victim in p["preempting"]:
            out.append(f"  preempting {victim['victim']} ({victim['gpus']} GPUs) under {victim['rule']}")
        for sentence in p.get("in_the_way", []):
            out.append(f"  in the way: {sentence}")
        candidates = p.get("candidates", [])
        if candidates:
            out.append("  running jobs of the pool, in victim order:")
            for c in candidates:
                verdict = f"may preempt ({c['rule']})" if c["eligible"] else f"not a victim ({c['reason']})"
                borrowed = ", borrowed" if c["borrowed"] else ""
                out.append(
                    f"    {c['job']}: team {c['team']}, priority {c['priority']}, {c['gpus']} GPUs{borrowed}, "
                    f"stop costs {c['cost_gpu_seconds']:.0f} GPU-s: {verdict}: {c['detail']}"
                )
    elif status in ("running", "stopping"):
        r = answer["running"]
        age = "no checkpoint yet" if r.get("checkpoint_age_s") is None else f"checkpoint {r['checkpoint_age_s']:.0f} s old"
        out.append(
            f"{name}: {status} in {answer['pool']}, claimed priority {r.get('claimed_priority')}, "
            f"{answer['gpus']} GPUs{' on borrowed quota' if r.get('borrowed') else ''}; {age}"
        )
        if r.get("protected"):
            out.append(f"  protected: {r['protected']['reason']}: {r['protected']['detail']}")
        learned = r.get("learned") or {}
        if any(learned.get(k) for k in ("declares_save_on_stop", "saves_on_stop", "ignored_checkpoint_request")):
            facts = []
            if learned.get("saves_on_stop"):
                facts.append("seen to save on SIGTERM within the grace (stopped at once)")
            elif learned.get("declares_save_on_stop"):
                facts.append("declares it saves on SIGTERM, not yet seen to")
            if learned.get("ignored_checkpoint_request"):
                facts.append("did not honour its last checkpoint request (not waited for again)")
            out.append(f"  learned: {'; '.join(facts)}")
        if r.get("checkpoint_ahead"):
            out.append(f"  asked for a checkpoint ahead of preemption: {r['checkpoint_ahead']['detail']}")
        now = r.get("preempted_now")
        if now:
            how = "a checkpoint is asked for first" if now.get("wait_for_checkpoint") else "stopped at once"
            out.append(
                f"  this plan preempts it for {now['preemptor']} under {now['rule']}; a stop now loses "
                f"{now['lost_gpu_seconds']:.0f} GPU-seconds; {how} ({now.get('stop')})"
            )
        for c in r.get("considered_for", []):
            out.append(f"  considered for {c['preemptor']}: {c['verdict']} ({c['reason']}): {c['detail']}")
    elif status == "unknown":
        out.append(f"{name}: not in the snapshot and no log")
    else:
        out.append(f"{name}: not pending or running")
    for change in answer.get("priority_changes", []):
        out.append(f"  priority changed at {_time(change['at'])}: {change['detail']}")
    for i, e in enumerate(answer.get("preemptions", []), start=1):
        age = "unknown" if e["checkpoint_age_s"] is None else f"{e['checkpoint_age_s']:.0f} s"
        lost = "" if e["lost_gpu_seconds"] is None else f", {e['lost_gpu_seconds']:.0f} GPU-seconds lost"
        fresh = {True: ", stopped after a fresh checkpoint", False: ", stopped WITHOUT a fresh checkpoint", None: ""}[e["fresh_checkpoint"]]
        out.append(
            f"  preemption {i} at {_time(e['at'])}: by {e['preemptor']} under {e['rule'] or e['reason'] or 'unknown rule'}; "
            f"checkpoint age {age}{lost}{fresh}"
        )
    return "\n".join(out)
