"""The controller's promises, stated once, checked against what the emulated world saw.

Each check reads a `DemoResult` (the demo runner's record of a scenario: the report, every
run the simulated fleet ran, every stop as the run saw it, every stop the controller asked
AWS for, the runs stopped by hand, the controller's decision log) and returns the
violations it found, each a sentence naming the job or pool. `violations(result, scenario)`
runs them all.
"""

from __future__ import annotations

import math
import re

from preemptor.core.policy import TEAM_NAME, UNATTRIBUTED, CheckpointTimeoutAction, Policy, PreemptionMode, ReclaimMode
from preemptor.service.actions import QUOTA_MEMORY_S
from preemptor_tools.local.demo import START, DemoResult
from preemptor_tools.local.scenario import QuotaChange, Scenario

TERMINAL = {"Completed", "Failed", "Cancelled"}
MANAGED_TAG = "preemptor:managed"
# A stop is logged in the same instant the run sees it arrive; the fleet's clock and the
# controller's may differ by a Lambda's own pinned time, never by a poll.
_SAME_MOMENT_S = 1.0
# How long a function's handling may take, its AWS calls' retries included (`wiring`'s bound).
_HANDLING_S = 60.0


# A stop is logged as it is claimed, before it is sent; botocore's retries of a throttled
# call may land it a little later on the simulated clock.
_STOP_LANDS_WITHIN_S = 60.0


def _told_before(line: dict, at: float) -> bool:
    """`line` was logged for a stop the run saw at `at`: in that moment, or just before."""
    return -_SAME_MOMENT_S <= at - line["at"] <= _STOP_LANDS_WITHIN_S


def fleet_never_above_capacity(result: DemoResult, scenario: Scenario) -> list[str]:
    """GPUs of runs that exist (measured by the fleet, not the controller's table) never
    exceed a pool's capacity (with what the account has beyond it, `unpooled`, which only
    runs teams launch themselves may take: `launches_never_overfill`). A SageMaker pool with
    fallback instance types has no such bound: the account's quota is per type, so a team's
    run may take the pool's own type while the controller's runs are on a fallback."""
    return [
        f"pool {p['name']}: {p['max_gpus_in_use']} GPUs in use at once, capacity {p['capacity_gpus']}"
        + (f" and {extra} unpooled" if (extra := _unpooled_gpus(scenario, p["name"])) else "")
        for p in result.report["pools"]
        if p["max_gpus_in_use"] > p["capacity_gpus"] + _unpooled_gpus(scenario, p["name"])
    ]


def _unpooled_gpus(scenario: Scenario, pool: str) -> float:
    """The GPUs the account has beyond a pool (`Scenario.unpooled`), at most (a quota a
    story changes counts at its largest); unbounded beside a SageMaker pool with fallback
    instance types (the fleet's quota is of the pool's own)."""
    config = scenario.pool(pool)
    if config.service == "sagemaker" and config.fallback_instance_types:
        return math.inf
    extra = scenario.unpooled.get(pool, 0)
    if config.service != "sagemaker":
        return extra
    changed = [f.instances - config.instances for f in scenario.faults if isinstance(f, QuotaChange) and f.pool == pool]
    return max([extra, *changed]) * (config.gpus_per_instance or 8)


def _unpooled_gpus_at(scenario: Scenario, pool: str, at: float) -> float:
    """`_unpooled_gpus` at `at` seconds into the story: the quota the last `quota_change`
    before it set, else the story's own."""
    config = scenario.pool(pool)
    if config.service != "sagemaker" or config.fallback_instance_types:
        return _unpooled_gpus(scenario, pool)
    extra = scenario.unpooled.get(pool, 0)
    for change in sorted((f for f in scenario.faults if isinstance(f, QuotaChange) and f.pool == pool), key=lambda f: f.at):
        if change.at <= at:
            extra = change.instances - config.instances
    return extra * (config.gpus_per_instance or 8)


def _holding_from(run: dict) -> float | None:
    """When a run took its GPUs: a training job at its creation, a Batch job at its start."""
    return run["started_at"] if run["service"] == "batch" else run["created_at"]


def launches_never_overfill(result: DemoResult, scenario: Scenario) -> list[str]:
    """Runs teams launch themselves may fill a pool beyond what it is configured with, where
    the account has more (`unpooled`, a fallback type's quota); the controller's own never do: as each of its runs
    takes its GPUs, its runs and the teams' runs it had counted by its job's admission (a
    handling's time before it) hold no more than the pool's capacity."""
    beyond = {p.name for p in scenario.pools if _unpooled_gpus(scenario, p.name) > 0}
    if not beyond:
        return []  # `fleet_never_above_capacity` holds every run to the pool's capacity
    teams = _team_runs(result)
    capacity = {p.name: p.capacity_gpus for p in scenario.pools}
    out = []
    for run in result.runs:
        job, start = _launched_for(run, teams), _holding_from(run)
        if job is None or start is None or run["created_by"] is None or run["pool"] not in beyond:
            continue
        admitted = [e["at"] for e in result.history if e["job"] == job and e["kind"] == "admitted" and e["at"] <= start]
        since = admitted[-1] if admitted else start
        counted = {r for r, (_, at) in result.adopted_runs.items() if at <= since - _HANDLING_S}
        held = sum(
            r["gpus"] for r in result.runs
            if r["pool"] == run["pool"] and (r["job_id"] not in teams or r["job_id"] in counted)
            and (s := _holding_from(r)) is not None and s <= start and (r["ended_at"] is None or r["ended_at"] > start)
        )
        if held > capacity[run["pool"]]:
            out.append(
                f"run {run['name']} of job {job} took its GPUs at {start - START:.0f} s in pool {run['pool']}: with the controller's "
                f"runs and the teams' runs it had counted, {held} of {capacity[run['pool']]} GPUs"
            )
    return out


def _team_runs(result: DemoResult) -> set[str]:
    """The runs teams created themselves, by id (a training job's name, a Batch job's id):
    their own, whatever their names and tags claim (a team may name one as a job's run, and
    put that job's tags on it)."""
    return set(result.team_runs)


def _adopted_as(result: DemoResult, run_id: str) -> str | None:
    """The job a team's run was adopted as (its own name, or one of its own where that is a
    job's), None if it never was."""
    return result.adopted_runs.get(run_id, (None, 0.0))[0]


def _story_jobs(result: DemoResult, scenario: Scenario) -> dict:
    """Each job as the decision log names it, with the scenario's job it is: a job the
    controller was given under its own name, a team's run under the name it was adopted as
    (and, never adopted, its scenario name)."""
    by_name = {j.name: j for j in scenario.jobs}
    out = {j.name: j for j in scenario.jobs if j.launched_by != "team"}
    for run_id, (name, _) in result.adopted_runs.items():
        if result.team_runs.get(run_id) in by_name:
            out[name] = by_name[result.team_runs[run_id]]
    for job in scenario.jobs:
        out.setdefault(job.name, job)
    return out


def _team_of(result: DemoResult, scenario: Scenario) -> dict[str, str]:
    """Each job's team as the controller counts it: a run its team launched under a team tag
    that is no team's name is no one's (`UNATTRIBUTED`)."""
    out = {}
    for name, job in _story_jobs(result, scenario).items():
        tagged = job.tags.get("preemptor:team", job.team) if job.launched_by == "team" else job.team
        out[name] = tagged.strip() if TEAM_NAME.fullmatch(tagged.strip()) else UNATTRIBUTED
    return out


def _launched_for(run: dict, teams: set[str]) -> str | None:
    """The job a run was launched for by the controller (its job tag), None for a team's."""
    return None if run["job_id"] in teams else run["tags"].get("preemptor:job")


# What the controller's capacity-wait line says when a refusal taught it a quota below the pool.
_LEARNED_QUOTA = re.compile(r"the account's quota '(\S+) for (?:spot )?training job usage' is \d+ instances, below pool")


def launches_fit_what_the_controller_counts(result: DemoResult, scenario: Scenario) -> list[str]:
    """A launch of the controller the account's quota refuses (`ResourceLimitExceeded`: the
    pool's instances are all held) is one the controller could not have known was too many:
    its own runs and the runs it had adopted by the job's admission leave room for it, and
    the rest is held by runs launched outside it that it had not heard of yet. Where the
    quota is below what the pool is configured with (a negative `unpooled`), a refusal is
    how the controller learns it: one is excused unless the controller had learned it (its
    capacity-wait line says so) within QUOTA_MEMORY_S, the time it remembers, before it (a
    write of what it learned that DynamoDB refused leaves it to the next refusal)."""
    tags = {run["job_id"]: run["tags"] for run in result.runs}
    teams = _team_runs(result)
    configured = {p.instance_type: p.instances for p in scenario.pools if p.service == "sagemaker" and p.instance_type and p.instances}
    learned: dict[str, list[float]] = {}
    for e in result.history:
        if e["kind"] == "capacity-wait" and (found := _LEARNED_QUOTA.search(e["detail"])):
            learned.setdefault(found[1], []).append(e["at"])
    out = []
    for refusal in result.quota_refusals:
        job = refusal.tags.get("preemptor:job")
        if job is None or refusal.by is None:
            continue  # a team's own launch
        if refusal.quota < configured.get(refusal.instance_type, 0) and not any(
            refusal.at - QUOTA_MEMORY_S <= at < refusal.at - 1 for at in learned.get(refusal.instance_type, ())
        ):
            continue  # a refusal that tells the controller of a quota below its pool
        admitted = [e["at"] for e in result.history if e["job"] == job and e["kind"] == "admitted" and e["at"] <= refusal.at]
        since = admitted[-1] if admitted else refusal.at
        # An adoption's line bears the time its handling began; one that began within a
        # handling's time of the admission may have committed after it (the two raced: the
        # team's run was heard of while the job was admitted). knobs seed sagemaker 65.
        adopted = {run for run, (_, at) in result.adopted_runs.items() if at <= since - _HANDLING_S}
        known = sum(
            n for run, n in refusal.holding.items() if ("preemptor:job" in tags.get(run, {}) and run not in teams) or run in adopted
        )
        if known + refusal.requested > refusal.quota:
            out.append(
                f"launch of {refusal.run} at {refusal.at - START:.0f} s refused by the account's quota: the controller's own "
                f"and adopted runs held {known} of {refusal.quota} {refusal.instance_type}, it asked {refusal.requested}"
            )
    return out


# Reconcile adopts a tagged run whose events never came once it is 10 minutes old, in a round
# every 5 minutes. Under the sweep's chaos most rounds can fail (knobs seed batch 36: its
# events dead-lettered, adopted 38 minutes after its start): an hour, so that what is found is
# a run left uncounted, not a slow repair.
ADOPTION_BOUND_S = 3600.0


def team_runs_are_counted(result: DemoResult, scenario: Scenario, bound_s: float = ADOPTION_BOUND_S) -> list[str]:
    """Every run a team launched itself, tagged for the scheduler, is counted (adopted)
    within `bound_s` of its creation, or of its start where it waited for room (a Batch job
    RUNNABLE holds no GPUs), while it holds its GPUs, whatever else its tags claim
    (a priority beyond its team's grant, an unusable tag, the controller's own job tags, a
    pool it does not run on): its GPUs are in use, and a run left uncounted lets the
    controller fill the pool around it."""
    teams = _team_runs(result)
    # When each was counted: its record's (a handling that died after the insert, its event
    # then dead-lettered, leaves no `adopted` line: the decision-log invariant's to find).
    adopted = {run: at for run, (_, at) in result.adopted_runs.items()}
    end = max([e["at"] for e in result.history] + [r["ended_at"] or 0.0 for r in result.runs], default=START)
    out = []
    for run in result.runs:
        if run["job_id"] not in teams or (run["service"] == "batch" and run["started_at"] is None):
            continue
        deadline = _holding_from(run) + bound_s
        if (run["ended_at"] or end) > deadline and adopted.get(run["job_id"], math.inf) > deadline:
            held = f"until {run['ended_at'] - START:.0f} s" if run["ended_at"] else "to the end"
            out.append(
                f"team run {run['name']} (tags {sorted(run['tags'].items())}) created at {run['created_at'] - START:.0f} s, "
                f"held its GPUs {held}, not counted within {bound_s:.0f} s"
            )
    return out


def team_runs_stopped_only_as_victims(result: DemoResult, scenario: Scenario) -> list[str]:
    """The controller stops a run a team launched itself only as the victim of a preemption
    (or at its team's cancel) of the job it was adopted as, said in its decision log first:
    never as a run of its own that no job accounts for, whatever the run's tags claim."""
    teams = _team_runs(result)
    told = [e for e in result.history if e["kind"] in ("stop-requested", "cancel-requested")]
    return [
        f"team run {a.run} ({a.job_id}) stopped by {a.actor} at {a.at - START:.0f} s, not as a victim of its adopted job"
        for a in result.stop_attempts
        if a.job_id in teams and a.refused is None
        and not any(e["job"] == _adopted_as(result, a.job_id) and e["at"] <= a.at + _SAME_MOMENT_S for e in told)
    ]


def accepted_jobs_settle(result: DemoResult, scenario: Scenario) -> list[str]:
    """Each accepted job ends in a terminal state, or is pending with a reason."""
    stuck = {s["name"]: s for s in result.report["stuck"]}
    out = []
    for job in result.report["jobs"]:
        if job["state"] in ("Rejected", "Refused by AWS") or job["state"] in TERMINAL:
            continue
        if job["state"] == "Pending" and stuck.get(job["name"], {}).get("reason"):
            continue
        reason = stuck.get(job["name"], {}).get("reason")
        out.append(f"job {job['name']} ended the scenario {job['state']} ({reason or 'no reason'})")
    return out


def no_run_launched_twice(result: DemoResult, scenario: Scenario) -> list[str]:
    """No incarnation of a job has two runs (and the controller never uses a run name twice)."""
    out = []
    names: dict[str, int] = {}
    incarnations: dict[tuple[str, str], list[str]] = {}
    teams = _team_runs(result)
    for run in result.runs:
        if run["job_id"] in teams:
            continue  # a team's own, whatever it is named and tagged (Batch's names are not unique)
        names[run["name"]] = names.get(run["name"], 0) + 1
        tags = run["tags"]
        if tags.get(MANAGED_TAG) == "true" and _launched_for(run, teams):
            key = (tags["preemptor:job"], tags.get("preemptor:incarnation", "?"))
            incarnations.setdefault(key, []).append(run["job_id"])
    out += [f"run name {name} launched {n} times" for name, n in sorted(names.items()) if n > 1]
    out += [
        f"job {job} incarnation {inc} launched {len(ids)} runs: {', '.join(ids)}"
        for (job, inc), ids in sorted(incarnations.items())
        if len(ids) > 1
    ]
    return out


def no_stop_without_required_checkpoint(result: DemoResult, scenario: Scenario) -> list[str]:
    """A running run the controller stops has a checkpoint as fresh as the policy demands
    (work since it at most `checkpoint_max_age_s`), unless the controller stopped it
    knowingly and said why (`checkpoint-timeout` only when the policy says stop anyway), or
    its team cancelled the job (`cancel-requested`: nothing of it is wanted any more)."""
    policy = Policy(**scenario.policy)
    launched_for = {run["job_id"]: _launched_for(run, _team_runs(result)) for run in result.runs}
    out = []
    for stop in result.fleet_stops:
        if stop.run in result.stopped_by_hand or not stop.started:
            continue
        if stop.unsaved_work_s <= policy.checkpoint_max_age_s:
            continue
        job = launched_for.get(stop.job_id) or _adopted_as(result, stop.job_id) or re.sub(r"-r\d+$", "", stop.run)
        # A cancel wants nothing of the job: its stop may land whenever Lambda's retries of
        # the cancel's handling get it through (a minute, then two, after a failure).
        if any(e["job"] == job and e["kind"] == "cancel-requested" and e["at"] <= stop.at + _SAME_MOMENT_S for e in result.history):
            continue
        logged = [e for e in result.history if e["job"] == job and e["kind"] == "stop-requested" and _told_before(e, stop.at)]
        # Fresh is judged at the stop's claim (its line); the work done until the stop lands
        # (botocore's retries, a Lambda's own pinned time) was not at risk when it was judged.
        if any(
            e["reason"] == "fresh-checkpoint" and stop.unsaved_work_s - max(0.0, stop.at - e["at"]) <= policy.checkpoint_max_age_s
            for e in logged
        ):
            continue
        declared = [e for e in logged if e["reason"] != "fresh-checkpoint"]
        if not declared:
            out.append(
                f"run {stop.run} stopped with {stop.unsaved_work_s:.0f} s of work since its checkpoint "
                f"(policy: {policy.checkpoint_max_age_s:.0f} s) and the controller "
                + ("called it fresh" if logged else "logged no stop")
            )
        elif any(e["reason"] == "checkpoint-timeout" for e in declared) and (
            policy.on_checkpoint_timeout != CheckpointTimeoutAction.STOP_ANYWAY
        ):
            out.append(f"run {stop.run} stopped after a checkpoint timeout, policy says {policy.on_checkpoint_timeout}")
    return out


def foreign_runs_never_stopped(result: DemoResult, scenario: Scenario) -> list[str]:
    """Every stop of a run the controller did not launch is refused (IAM's managed-tag
    condition), and no such run was stopped except by hand."""
    out = [
        f"stop of {a.run} (not launched by the controller) by {a.actor} was not refused"
        for a in result.stop_attempts
        if not a.managed and a.refused is None
    ]
    tags = {run["job_id"]: run["tags"] for run in result.runs}
    out += [
        f"run {s.run}, not launched by the controller, was stopped"
        for s in result.fleet_stops
        if tags.get(s.job_id, {}).get(MANAGED_TAG) != "true" and s.run not in result.stopped_by_hand
    ]
    return out


# Decision-log kinds that do not settle a started preemption: the checkpoint protocol's steps.
_PREEMPTION_STEPS = {"preemption-started", "checkpoint-requested", "checkpoint-confirmed", "checkpoint-unavailable", "stop-refused"}
# A reconcile runs every 5 minutes; allow it two rounds to notice and repair.
_RECONCILE_ROUNDS_S = 2 * 300


def preemptions_resolve_within_their_waits(result: DemoResult, scenario: Scenario) -> list[str]:
    """A victim whose preemption started is stopped, spared or otherwise settled within the
    policy's checkpoint and stop waits (plus two reconcile rounds): it never stays
    PREEMPTING, holding GPUs a higher-priority job is waiting for."""
    policy = Policy(**scenario.policy)
    bound = policy.checkpoint_wait_max_s + policy.stop_wait_max_s + _RECONCILE_ROUNDS_S
    end = max((e["at"] for e in result.history), default=0.0)
    out = []
    for started in (e for e in result.history if e["kind"] == "preemption-started"):
        later = [
            e for e in result.history
            if e["job"] == started["job"] and e["at"] >= started["at"] and e["kind"] not in _PREEMPTION_STEPS
        ]
        settled_at = later[0]["at"] if later else end
        if settled_at - started["at"] > bound:
            what = f"{later[0]['kind']} ({later[0]['reason']})" if later else "nothing"
            out.append(
                f"job {started['job']}: preemption started at {started['at'] - START:.0f} s, "
                f"next settled by {what} {settled_at - started['at']:.0f} s later (bound {bound:.0f} s)"
            )
    return out


def decision_log_tells_every_change(result: DemoResult, scenario: Scenario) -> list[str]:
    """The decision log (what `explain` and `history` answer from) tells each change of a
    job that happened: a launch line per run the controller created, an admission before
    each, a preemption started per requeue for a preemption, and the end of a completed
    job, once."""
    out = []
    kinds: dict[str, dict[str, int]] = {}
    requeued_for: dict[str, int] = {}
    for entry in result.history:
        counts = kinds.setdefault(entry["job"], {})
        counts[entry["kind"]] = counts.get(entry["kind"], 0) + 1
        if entry["kind"] == "requeued" and entry["reason"] == "preempted":
            requeued_for[entry["job"]] = requeued_for.get(entry["job"], 0) + 1
    runs: dict[str, int] = {}
    teams = _team_runs(result)
    for run in result.runs:
        job = _launched_for(run, teams)
        if run["tags"].get(MANAGED_TAG) == "true" and job:
            runs[job] = runs.get(job, 0) + 1
    for job in result.report["jobs"]:
        name, seen = job["name"], kinds.get(job["name"], {})
        launches = seen.get("launched", 0) + seen.get("relaunched", 0)
        if launches != runs.get(name, 0):
            out.append(f"job {name}: {runs.get(name, 0)} runs created, {launches} launch lines")
        if seen.get("admitted", 0) < launches:
            out.append(f"job {name}: {launches} launch lines, {seen.get('admitted', 0)} admissions")
        # A requeue for a preemption follows its start; one for a lost instance is told by
        # its own line (reason `interrupted`), with or without the warning's `interruption`
        # (a warning lost, or the instance gone first).
        preempted = requeued_for.get(name, 0)
        if preempted > seen.get("preemption-started", 0):
            out.append(f"job {name}: requeued {preempted} times for a preemption, {seen.get('preemption-started', 0)} preemptions started")
        if job["state"] == "Completed" and seen.get("completed", 0) != 1:
            out.append(f"job {name}: Completed, {seen.get('completed', 0)} completion lines")
        if job.get("adopted_at") is not None and seen.get("adopted", 0) != 1:
            out.append(f"job {name}: adopted, {seen.get('adopted', 0)} adoption lines")
    return out


# Decision-log kinds that start and end a job's wait for GPUs (a launch that met no
# capacity gives its GPUs back: the job waits again, and may preempt for them).
_WAIT_STARTS = {"submitted", "requeued", "admission-released", "capacity-wait"}
_WAIT_ENDS = {"admitted", "cancelled", "failed", "completed"}


def _waits_and_priorities(result: DemoResult, scenario: Scenario) -> tuple[dict, dict]:
    """Per job, from the decision log: its waits for GPUs [(from, until)] (until None: still
    waiting at the end), and its priority from a time on [(at, priority)], lowerings included."""
    tiers = Policy(**scenario.policy).tiers
    waits: dict[str, list[list]] = {}
    priorities: dict[str, list[tuple[float, int]]] = {}
    for e in sorted(result.history, key=lambda e: e["at"]):
        job, kind, at = e["job"], e["kind"], e["at"]
        spans = waits.setdefault(job, [])
        if kind in _WAIT_STARTS and not (spans and spans[-1][1] is None):
            spans.append([at, None])
        elif kind in _WAIT_ENDS and spans and spans[-1][1] is None:
            spans[-1][1] = at
        if kind in ("submitted", "adopted") and (m := re.search(r"priority (\d+)", e["detail"])):
            priorities.setdefault(job, []).append((at, int(m.group(1))))
        elif kind == "priority-changed" and (m := re.search(r"priority \d+ -> (\d+)", e["detail"])):
            priorities.setdefault(job, []).append((at, int(m.group(1))))
    for job in scenario.jobs:  # a job the log never saw submitted has its scenario's priority
        if job.name not in priorities:
            priority = job.priority if isinstance(job.priority, int) else tiers[job.priority.lower()]
            priorities[job.name] = [(0.0, priority)]
    return waits, priorities


def _priority_at(priorities: list[tuple[float, int]], at: float) -> int:
    return [p for t, p in priorities if t <= at][-1] if priorities[0][0] <= at else priorities[0][1]


def _waiting_at(spans: list[list], at: float) -> bool:
    """Waiting at `at`: a wait begun by then and not ended before it (one that ends in that
    very second counts: the stop and that job's admission may be logged together)."""
    return any(start <= at and (end is None or end >= at) for start, end in spans)


def _may_preempt(policy: Policy, team: str, priority: int, victim_team: str, victim_priority: int) -> bool:
    """Whether a job of `team` at `priority` may ever stop a victim of `victim_team` at
    `victim_priority` under `policy`'s modes (an equal priority where newer equal work may be
    stopped; any priority across teams where a quota may reclaim what was borrowed)."""
    mode = policy.within_team if team == victim_team else policy.across_teams
    if mode is PreemptionMode.LOWER_PRIORITY and victim_priority < priority:
        return True
    if mode is PreemptionMode.LOWER_OR_NEWER_EQUAL_PRIORITY and victim_priority <= priority:
        return True
    return bool(policy.quotas) and policy.reclaim_within_pool is not ReclaimMode.NEVER and team != victim_team


def stops_serve_a_waiting_job(result: DemoResult, scenario: Scenario) -> list[str]:
    """A victim's stop is sent only while a job of its pool that may preempt it (by the
    policy's modes and quotas: under the defaults, one that outranks it) waits for GPUs:
    one sent after every such job ran in GPUs freed otherwise, was cancelled or lowered
    below it throws the victim's restart (and its work since the checkpoint) away for
    nobody."""
    policy = Policy(**scenario.policy)
    waits, priorities = _waits_and_priorities(result, scenario)
    pool_of = {name: j.pool for name, j in _story_jobs(result, scenario).items()}
    team_of = _team_of(result, scenario)
    out = []
    for stop in result.history:
        if stop["kind"] != "stop-requested" or not stop["detail"].startswith("preempted by"):
            continue
        if stop["detail"].startswith("preempted by spot-interruption"):
            continue  # its instance goes anyway
        victim, at = stop["job"], stop["at"]
        below = _priority_at(priorities[victim], at)
        served = [
            job for job, spans in waits.items()
            if job != victim and pool_of.get(job) == pool_of.get(victim) and job in priorities
            and _may_preempt(policy, team_of.get(job), _priority_at(priorities[job], at), team_of.get(victim), below)
            and _waiting_at(spans, at)
        ]
        if not served:
            out.append(f"job {victim}: stopped at {at - START:.0f} s ({stop['detail']}) while no job that may preempt it (priority {below}) waited")
    return out


def preemptors_outrank_their_victims(result: DemoResult, scenario: Scenario) -> list[str]:
    """Under the default modes (a job preempts only lower priority) and no quotas, every
    preemption is made for a job that outranks its victim when it is made."""
    policy = Policy(**scenario.policy)
    if policy.quotas or policy.pools or policy.within_team.value != "LowerPriority" or policy.across_teams.value != "LowerPriority":
        return []
    _, priorities = _waits_and_priorities(result, scenario)
    out = []
    for e in result.history:
        preemptor = e.get("extra", {}).get("preemptor")
        if e["kind"] != "preemption-started" or preemptor not in priorities:
            continue
        pj, pv = _priority_at(priorities[preemptor], e["at"]), _priority_at(priorities[e["job"]], e["at"])
        if pj <= pv:
            out.append(f"job {e['job']} (priority {pv}) preempted at {e['at'] - START:.0f} s for {preemptor} (priority {pj})")
    return out


def protections_hold(result: DemoResult, scenario: Scenario) -> list[str]:
    """No victim is preempted more often than `max_preemptions` allows (protected, or failed
    instead of relaunched, after that many), nor before it ran `min_runtime_s` (from its
    launch, as the planner counts it) unless its preemptor was escalated."""
    policy = Policy(**scenario.policy)
    teams = _team_runs(result)
    out = []
    requeues: dict[str, int] = {}
    for e in result.history:
        if e["kind"] == "requeued" and e["reason"] == "preempted":
            requeues[e["job"]] = requeues.get(e["job"], 0) + 1
    if policy.max_preemptions is not None:
        out += [
            f"job {job}: requeued {n} times for preemptions (max_preemptions {policy.max_preemptions})"
            for job, n in sorted(requeues.items()) if n > policy.max_preemptions
        ]
    if policy.min_runtime_s:
        for started in (e for e in result.history if e["kind"] == "preemption-started"):
            preemptor = started.get("extra", {}).get("preemptor")
            escalated = any(e["job"] == preemptor and e["kind"] == "escalated" and e["at"] <= started["at"] for e in result.history)
            job, at = started["job"], started["at"]
            lines = [e["at"] for e in result.history if e["job"] == job and e["kind"] in ("launched", "relaunched", "adopted") and e["at"] <= at]
            # A run reconcile found launched counts from its creation, before reconcile's line.
            created = [
                r["created_at"] for r in result.runs if job == (_launched_for(r, teams) or _adopted_as(result, r["job_id"])) and r["created_at"] <= at
            ]
            if not lines or escalated:
                continue
            since = min(lines[-1], max(created)) if created else lines[-1]
            if at - since < policy.min_runtime_s:
                out.append(f"job {job}: preemption started {at - since:.0f} s after its launch for {preemptor} (min_runtime_s {policy.min_runtime_s:g})")
    return out


def budget_never_exceeded(result: DemoResult, scenario: Scenario) -> list[str]:
    """A pool's preemptions in any `budget.window_s` (those started and not called off by
    then) never exceed `budget.max_preemptions`."""
    budget = Policy(**scenario.policy).budget
    if budget is None or budget.max_preemptions is None:
        return []
    pool_of = {name: j.pool for name, j in _story_jobs(result, scenario).items()}
    # In the log's order (by time, then as written): a call-off and the next start in one
    # millisecond are told in the order they were made (sweep sagemaker knobs seed 618).
    started = [(i, e) for i, e in enumerate(result.history) if e["kind"] == "preemption-started"]
    ended = [(i, e) for i, e in enumerate(result.history) if e["kind"] == "preemption-cancelled"]

    def counted(i: int, e: dict, until: int) -> bool:  # in the budget at line `until`: not called off before it
        return not any(c["job"] == e["job"] and i < j < until for j, c in ended)

    out = []
    for n, e in started:
        within = [
            o for i, o in started
            if pool_of.get(o["job"]) == pool_of.get(e["job"]) and e["at"] - budget.window_s < o["at"] and i <= n and counted(i, o, n)
        ]
        if len(within) > budget.max_preemptions:
            out.append(
                f"pool {pool_of.get(e['job'])}: {len(within)} preemptions in the {budget.window_s:g} s to "
                f"{e['at'] - START:.0f} s (budget {budget.max_preemptions})"
            )
    return sorted(set(out))


def priorities_within_team_ceilings(result: DemoResult, scenario: Scenario) -> list[str]:
    """No job is ever at a priority its team is not granted (`teams`): a submission above
    it is refused, a run whose tags claim more is counted at the ceiling, the run of a team
    the policy does not list (or of no team: `UNATTRIBUTED`) at the lowest tier."""
    policy = Policy(**scenario.policy)
    if policy.teams is None:
        return []
    _, priorities = _waits_and_priorities(result, scenario)
    logged = {e["job"] for e in result.history if e["kind"] in ("submitted", "adopted")}
    team_of = _team_of(result, scenario)
    lowest = min(policy.tiers.values())
    ceiling = {job: policy.max_priority(team) if policy.team_listed(team) else lowest for job, team in team_of.items()}
    return [
        f"job {job}: priority {p} from {at - START:.0f} s, above team {team_of[job]}'s ceiling {ceiling[job]}"
        for job, changes in sorted(priorities.items()) if job in logged
        for at, p in changes if p > ceiling[job]
    ]


# Decision-log kinds that start and end a job's hold on its pool's GPUs (the controller's count).
_HOLD_STARTS = {"admitted"}
_HOLD_ENDS = {"requeued", "completed", "failed", "cancelled", "admission-released"}
IDLE_BOUND_S = 900.0  # three reconcile rounds


def gpus_never_idle_while_a_job_that_fits_waits(result: DemoResult, scenario: Scenario, bound_s: float = IDLE_BOUND_S) -> list[str]:
    """Liveness: GPUs the controller counts free in a pool never stay free longer than
    `bound_s` while a job of that pool that fits them waits (sizes from the scenario). Not
    among `INVARIANTS`: under the sweep's rates most plan steps fail their seven attempts, and
    a pool may idle for half an hour though nothing unsafe happens; it is checked where the
    world is hostile as the example scenario is (examples/scenarios/hostile-world.yaml)."""
    jobs = _story_jobs(result, scenario)
    waits, _ = _waits_and_priorities(result, scenario)
    events = sorted(result.history, key=lambda e: e["at"])
    out = []
    for pool in scenario.pools:
        size = {
            name: j.gpus if j.gpus is not None else j.instances * (pool.gpus_per_instance or 8)
            for name, j in jobs.items() if j.pool == pool.name
        }
        held, holding, since = 0, set(), None
        for i, e in enumerate(events):
            job, kind = e["job"], e["kind"]
            if kind in _HOLD_STARTS and job in size and job not in holding:
                holding.add(job)
                held += size[job]
            elif kind in _HOLD_ENDS and job in holding:
                holding.discard(job)
                held -= size[job]
            if i + 1 < len(events) and events[i + 1]["at"] == e["at"]:
                continue  # the moment's other lines first
            # A quota below the pool (negative `unpooled`, or changed so) leaves it fewer to be free.
            at, free = e["at"], pool.capacity_gpus + min(0, _unpooled_gpus_at(scenario, pool.name, e["at"] - START)) - held
            fitting = sorted(
                j for j, spans in waits.items()
                if j in size and size[j] <= free and any(s <= at and (u is None or u > at) for s, u in spans)
            )
            if fitting and since is None:
                since = (at, free, fitting)
            elif not fitting and since is not None:
                if at - since[0] > bound_s:
                    out.append(f"pool {pool.name}: {since[1]} GPUs free from {since[0] - START:.0f} s to {at - START:.0f} s while {', '.join(since[2])} waited")
                since = None
    return out


# What a drained pool never does (`preemptor drain`): nothing is admitted, nothing preempted.
_DRAIN_FORBIDS = frozenset({"admitted", "preemption-started"})


def drained_pools_start_nothing(result: DemoResult, scenario: Scenario) -> list[str]:
    """While a pool is drained (`drain` faults, as they landed: `DemoResult.drains`), no job
    of it is admitted and none is marked a victim. A cycle that began before the drain
    stamps its lines with its start: only lines stamped after the drain landed are its
    breaches (a cycle in flight then must write nothing more: `PoolDrained`)."""
    if not result.drains:
        return []
    pool_of = {name: job.pool for name, job in _story_jobs(result, scenario).items()}
    out = []
    for e in result.history:
        if e["kind"] not in _DRAIN_FORBIDS:
            continue
        pool = pool_of.get(e["job"]) or pool_of.get(re.sub(r"-r\d+$", "", e["job"]))
        for drained, since, until in result.drains:
            if drained == pool and since < e["at"] and (until is None or e["at"] < until):
                out.append(
                    f"{e['job']} {e['kind']} at {e['at'] - START:.0f} s in pool {pool}, drained from {since - START:.0f} s"
                    + (f" to {until - START:.0f} s" if until is not None else "")
                )
    return out


def no_job_ended_by_the_controllers_own_stop(result: DemoResult, scenario: Scenario) -> list[str]:
    """No job ends for good because of a stop the controller sent itself, whatever write of
    the controller's the hostile world refused in between: a run it terminated for want of
    capacity waits and relaunches, a victim is requeued. Neither fails with the controller's
    own reason (its reasons begin "preemptor:"), nor is cancelled as "stopped outside the
    controller" where nobody stopped one of its runs by hand (`stopped_by_hand` faults)."""
    by_hand = {re.sub(r"-r\d+$", "", run) for run in result.stopped_by_hand}
    out = []
    for e in result.history:
        reason = str(e.get("reason", ""))
        if e["kind"] == "failed" and reason.startswith("preemptor:"):
            out.append(f"{e['job']} failed at {e['at'] - START:.0f} s: {reason}")
        if e["kind"] == "cancelled" and reason == "stopped outside the controller" and e["job"] not in by_hand:
            out.append(f"{e['job']} cancelled at {e['at'] - START:.0f} s as stopped outside the controller, though nobody stopped it by hand")
    return out


INVARIANTS = (
    decision_log_tells_every_change,
    fleet_never_above_capacity,
    launches_never_overfill,
    launches_fit_what_the_controller_counts,
    team_runs_are_counted,
    team_runs_stopped_only_as_victims,
    accepted_jobs_settle,
    no_run_launched_twice,
    no_stop_without_required_checkpoint,
    foreign_runs_never_stopped,
    preemptions_resolve_within_their_waits,
    stops_serve_a_waiting_job,
    preemptors_outrank_their_victims,
    protections_hold,
    budget_never_exceeded,
    priorities_within_team_ceilings,
    drained_pools_start_nothing,
    no_job_ended_by_the_controllers_own_stop,
)


def violations(result: DemoResult, scenario: Scenario) -> list[str]:
    """Every invariant's violations, each prefixed with the invariant's name."""
    return [f"{check.__name__}: {v}" for check in INVARIANTS for v in check(result, scenario)]
