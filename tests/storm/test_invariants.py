"""The policy invariants (storm/invariants.py) read synthetic logs: each finds what breaks
its promise and passes what keeps it, so a sweep that reports nothing has checked something.
"""

from __future__ import annotations

from pathlib import Path

from storm.invariants import (
    budget_never_exceeded,
    decision_log_tells_every_change,
    drained_pools_start_nothing,
    fleet_never_above_capacity,
    gpus_never_idle_while_a_job_that_fits_waits,
    launches_fit_what_the_controller_counts,
    launches_never_overfill,
    no_job_ended_by_the_controllers_own_stop,
    no_stop_without_required_checkpoint,
    priorities_within_team_ceilings,
    protections_hold,
    stops_serve_a_waiting_job,
    team_runs_are_counted,
    team_runs_stopped_only_as_victims,
)
from storm.random_story import random_story

from preemptor_tools.local import demo
from preemptor_tools.local.fleet import QuotaRefusal
from preemptor_tools.local.hostile import StopAttempt
from preemptor_tools.local.scenario import Scenario


def _line(job: str, at: float, kind: str, reason: str = "", detail: str = "", **extra: str) -> dict:
    return {"job": job, "at": demo.START + at, "kind": kind, "reason": reason or kind, "detail": detail, "extra": extra}


def _story(**policy):
    scenario = random_story("sagemaker", 0, jobs=3)
    scenario.policy = policy
    return scenario


def test_the_budget_check_counts_preemptions_in_the_window_less_those_called_off() -> None:
    scenario = _story(budget={"window_s": 1800, "max_preemptions": 1})
    a, b, c = (j.name for j in scenario.jobs)
    started = [_line(a, 0, "preemption-started", preemptor=c), _line(b, 600, "preemption-started", preemptor=c)]
    # Two preemptions 10 minutes apart under a budget of one per 30 minutes: found
    assert budget_never_exceeded(demo.DemoResult(history=started), scenario) == [
        "pool p5: 2 preemptions in the 1800 s to 600 s (budget 1)"
    ]
    # The first called off before the second: within the budget; so is a second 31 minutes on
    called_off = [started[0], _line(a, 300, "preemption-cancelled"), started[1]]
    assert budget_never_exceeded(demo.DemoResult(history=called_off), scenario) == []
    later = [started[0], _line(b, 1860, "preemption-started", preemptor=c)]
    assert budget_never_exceeded(demo.DemoResult(history=later), scenario) == []
    # Called off and started again in one millisecond, in that order: within; the other order: found
    again = [_line(a, 0, "preemption-started", preemptor=c), _line(a, 0, "preemption-cancelled"), _line(a, 0, "preemption-started", preemptor=c)]
    assert budget_never_exceeded(demo.DemoResult(history=again), scenario) == []
    assert budget_never_exceeded(demo.DemoResult(history=[again[0], again[2], again[1]]), scenario) == [
        "pool p5: 2 preemptions in the 1800 s to 0 s (budget 1)"
    ]


def test_the_protection_check_finds_a_victim_preempted_too_often_or_too_soon() -> None:
    scenario = _story(max_preemptions=1, min_runtime_s=600)
    a, b, c = (j.name for j in scenario.jobs)
    twice = [_line(a, 0, "requeued", "preempted"), _line(a, 900, "requeued", "preempted")]
    assert protections_hold(demo.DemoResult(history=twice), scenario) == [f"job {a}: requeued 2 times for preemptions (max_preemptions 1)"]
    soon = [_line(a, 0, "launched"), _line(a, 300, "preemption-started", preemptor=c)]
    assert protections_hold(demo.DemoResult(history=soon), scenario) == [
        f"job {a}: preemption started 300 s after its launch for {c} (min_runtime_s 600)"
    ]
    # An escalated preemptor lifts the minimum runtime
    escalated = [_line(a, 0, "launched"), _line(c, 200, "escalated"), _line(a, 300, "preemption-started", preemptor=c)]
    assert protections_hold(demo.DemoResult(history=escalated), scenario) == []


def test_the_ceiling_check_finds_a_job_adopted_above_its_teams_grant() -> None:
    scenario = _story(teams={"research": {"max_priority": "low"}, "applied": {}, "production": {}})
    research = next(j.name for j in scenario.jobs if j.team == "research")
    above = [_line(research, 0, "adopted", "tagged-outside-controller", "64 GPUs counted in p5 at priority 1000, stoppable")]
    assert priorities_within_team_ceilings(demo.DemoResult(history=above), scenario) == [
        f"job {research}: priority 1000 from 0 s, above team research's ceiling 50"
    ]
    at_the_ceiling = [_line(research, 0, "adopted", "tagged-outside-controller", "64 GPUs counted in p5 at priority 50, stoppable")]
    assert priorities_within_team_ceilings(demo.DemoResult(history=at_the_ceiling), scenario) == []


def test_the_quota_check_blames_the_controller_only_for_runs_it_knew_of() -> None:
    scenario = _story()
    job = scenario.jobs[0].name
    runs = [{"name": "mine", "job_id": "mine", "tags": {"preemptor:job": "other"}}, {"name": "teams", "job_id": "teams", "tags": {"preemptor:team": "research"}}]
    history = [_line(job, 100, "admitted")]
    adopted = {"teams": ("teams", demo.START + 30)}
    team_runs = {"teams": "teams", "unheard-of": "unheard-of", "raced": "raced"}

    def refused(holding: dict[str, int], by: str | None = "preemptor-StepsFunction") -> demo.DemoResult:
        refusal = QuotaRefusal(demo.START + 120, job, {"preemptor:job": job}, "ml.p5.48xlarge", 4, 8, holding, job, by)
        return demo.DemoResult(history=history, runs=runs, quota_refusals=[refusal], adopted_runs=adopted, team_runs=team_runs)

    # The controller's run and a run it adopted before the admission held 6 of 8: its own mistake
    assert launches_fit_what_the_controller_counts(refused({"mine": 2, "teams": 4}), scenario) == [
        f"launch of {job} at 120 s refused by the account's quota: the controller's own and adopted runs held 6 of 8 ml.p5.48xlarge, it asked 4"
    ]
    # A team's run it had not heard of held them: not the controller's to know
    assert launches_fit_what_the_controller_counts(refused({"mine": 2, "unheard-of": 4}), scenario) == []
    # Nor one whose adoption began as the job was admitted (the two raced; knobs seed sagemaker 65)
    adopted["raced"] = ("raced", demo.START + 100)
    assert launches_fit_what_the_controller_counts(refused({"mine": 2, "raced": 4}), scenario) == []
    # Nor a team's own creation the quota refused, whatever its tags claim (a copy of the job's run)
    assert launches_fit_what_the_controller_counts(refused({"mine": 2, "teams": 4}, by=None), scenario) == []


def test_the_quota_check_excuses_the_refusal_that_tells_the_controller_of_a_quota_below_its_pool() -> None:
    # Given a pool of 8 x ml.p5.48xlarge whose account quota is 6
    scenario = _story()
    scenario.unpooled = {"p5": -2}
    job = scenario.jobs[0].name
    runs = [{"name": "mine", "job_id": "mine", "tags": {"preemptor:job": "other"}}]
    learned = _line(job, 100, "capacity-wait", "no-capacity", "...; the account's quota 'ml.p5.48xlarge for training job usage' "
                    "is 6 instances, below pool p5's 64 GPUs: planned at 48 GPUs for 60 minutes (...)")

    def refused(at: float, history: list[dict]) -> demo.DemoResult:
        refusal = QuotaRefusal(demo.START + at, job, {"preemptor:job": job}, "ml.p5.48xlarge", 2, 6, {"mine": 6}, job, "preemptor-StepsFunction")
        return demo.DemoResult(history=history, runs=runs, quota_refusals=[refusal])

    # A refusal before the controller knew (or when what it learned could not be written): excused
    assert launches_fit_what_the_controller_counts(refused(100, []), scenario) == []
    # One within the hour after it learned the quota: the controller's own mistake
    assert launches_fit_what_the_controller_counts(refused(1000, [learned]), scenario) == [
        f"launch of {job} at 1000 s refused by the account's quota: the controller's own and adopted runs held 6 of 6 ml.p5.48xlarge, it asked 2"
    ]
    # One once its memory of it ran out (it plans the pool at its configuration again): excused
    assert launches_fit_what_the_controller_counts(refused(100 + 3601, [learned]), scenario) == []


def test_a_stop_serves_a_job_the_modes_let_preempt_it() -> None:
    scenario = _story(across_teams="LowerOrNewerEqualPriority", within_team="Never")
    victim, teammate, other = scenario.jobs  # applied, applied, research
    assert (victim.team, teammate.team, other.team) == ("applied", "applied", "research")

    def stopped_while(waiting: str, priority: int) -> list[str]:
        history = [
            _line(victim.name, 0, "submitted", detail="priority 200"),
            _line(waiting, 0, "submitted", detail=f"priority {priority}"),
            _line(victim.name, 60, "stop-requested", "fresh-checkpoint", f"preempted by {waiting}"),
        ]
        return stops_serve_a_waiting_job(demo.DemoResult(history=history), scenario)

    # Another team's job of equal priority may stop newer equal work here: served
    assert stopped_while(other.name, 200) == []
    # A teammate may preempt nobody of its team, whatever its priority: a stop for nobody
    assert stopped_while(teammate.name, 1000) == [
        f"job {victim.name}: stopped at 60 s (preempted by {teammate.name}) while no job that may preempt it (priority 200) waited"
    ]


def test_the_checkpoint_check_judges_fresh_at_the_stops_claim_not_where_it_lands() -> None:
    from preemptor_tools.local.fleet import FleetStop

    scenario = _story(checkpoint_max_age_s=300)
    job = scenario.jobs[0].name
    line = _line(job, 100, "stop-requested", "fresh-checkpoint", "preempted by job-2")

    def stopped(unsaved: float, lands_after: float) -> list[str]:
        stop = FleetStop(job, "id", demo.START + 100 + lands_after, True, unsaved)
        return no_stop_without_required_checkpoint(demo.DemoResult(history=[line], fleet_stops=[stop]), scenario)

    # Judged fresh at 299 s of work; the stop landed 2 s later, at 301 s: kept
    assert stopped(301, 2) == []
    # At 310 s of work on landing 2 s after its claim, it was not fresh when judged: found
    assert stopped(310, 2) == [f"run {job} stopped with 310 s of work since its checkpoint (policy: 300 s) and the controller called it fresh"]


def _team_story():
    """A story whose first job is a run its team launches itself, wearing the controller's tags."""
    scenario = _story()
    team = scenario.jobs[0].model_copy(update={"launched_by": "team", "tags": {"preemptor:job": scenario.jobs[1].name}})
    scenario.jobs = [team, *scenario.jobs[1:]]
    return scenario, team.name


RUN_ID = "b0c7c4de-batch-job-id"  # the team's run's id


def test_the_counting_check_finds_a_team_run_held_uncounted_past_the_bound() -> None:
    scenario, run = _team_story()
    tags = {"preemptor:team": "research", "preemptor:job": "job-1"}

    def held(ended_after: float | None, adopted_after: float | None) -> list[str]:
        runs = [{
            "name": run, "job_id": RUN_ID, "tags": tags, "service": "sagemaker", "created_at": demo.START, "started_at": demo.START + 120,
            "ended_at": None if ended_after is None else demo.START + ended_after,
        }]
        history = [_line("job-1", 4000, "completed")]
        adopted = {} if adopted_after is None else {RUN_ID: (run, demo.START + adopted_after)}
        result = demo.DemoResult(history=history, runs=runs, team_runs={RUN_ID: run}, adopted_runs=adopted)
        return team_runs_are_counted(result, scenario, bound_s=1800)

    # Held to the end (4,000 s), never adopted; or adopted only after the bound: found
    found = f"team run {run} (tags {sorted(tags.items())}) created at 0 s, held its GPUs to the end, not counted within 1800 s"
    assert held(None, None) == [found]
    assert held(None, 1900) == [found]
    # Adopted within the bound, or ended (stopped, refused) before it: kept
    assert held(None, 60) == []
    assert held(900, None) == []


def test_the_stop_check_finds_a_team_run_stopped_as_no_jobs() -> None:
    scenario, run = _team_story()

    # Adopted under a name of its own: its name is a job's (Batch's names are not unique)
    adopted_as = f"{run}-3f9a2c71"

    def stopped(history: list[dict], refused: str | None = None) -> list[str]:
        attempt = StopAttempt(demo.START + 700, "preemptor-ReconcileFunction", run, True, refused, RUN_ID)
        result = demo.DemoResult(
            history=history, stop_attempts=[attempt], team_runs={RUN_ID: run}, adopted_runs={RUN_ID: (adopted_as, demo.START)}
        )
        return team_runs_stopped_only_as_victims(result, scenario)

    # Stopped by reconcile with no line on its adopted job (its tags claimed another job's),
    # or with the line of the job whose name it bears: found
    found = [f"team run {run} ({RUN_ID}) stopped by preemptor-ReconcileFunction at 700 s, not as a victim of its adopted job"]
    assert stopped([]) == found
    assert stopped([_line(run, 690, "stop-requested", "fresh-checkpoint", "preempted by job-2")]) == found
    # Stopped as a victim, said first; or a stop AWS refused: kept
    assert stopped([_line(adopted_as, 690, "stop-requested", "fresh-checkpoint", "preempted by job-2")]) == []
    assert stopped([], refused="AccessDenied") == []


def test_the_checkpoint_check_lets_a_cancels_stop_land_whenever_its_retries_get_it_through() -> None:
    from preemptor_tools.local.fleet import FleetStop

    scenario = _story(checkpoint_max_age_s=300)
    job = scenario.jobs[0].name
    cancelled = _line(job, 100, "cancel-requested", "job-cancelled", f"stopping {job}")
    # The cancel's stop landing 170 s after its line (its handling failed, Lambda retried it):
    # nothing of the job is wanted, whatever its unsaved work (knobs seed sagemaker 3)
    stop = FleetStop(job, "id", demo.START + 270, True, 800)
    assert no_stop_without_required_checkpoint(demo.DemoResult(history=[cancelled], fleet_stops=[stop]), scenario) == []
    # A stop before any cancel is still found
    early = FleetStop(job, "id", demo.START + 50, True, 800)
    assert no_stop_without_required_checkpoint(demo.DemoResult(history=[cancelled], fleet_stops=[early]), scenario) == [
        f"run {job} stopped with 800 s of work since its checkpoint (policy: 300 s) and the controller logged no stop"
    ]


def test_the_decision_log_check_finds_an_adopted_run_without_its_line() -> None:
    scenario, run = _team_story()
    report = {"jobs": [{"name": run, "state": "Running", "adopted_at": demo.START + 60}]}
    # Counted, and its line lost (knobs seeds batch 0, 34, 36 before 61552d0): found
    assert decision_log_tells_every_change(demo.DemoResult(report=report), scenario) == [f"job {run}: adopted, 0 adoption lines"]
    said = [_line(run, 60, "adopted", "tagged-outside-controller")]
    assert decision_log_tells_every_change(demo.DemoResult(report=report, history=said), scenario) == []


def test_the_overfill_check_blames_the_controller_only_for_team_runs_it_had_counted() -> None:
    # Given an account with two instances beyond the pool of 64 GPUs, a team's run of 16
    # GPUs, and the controller's run of 56 for job-1, admitted at 300 s and created at 310 s
    scenario = _story()
    scenario.unpooled = {"p5": 2}
    team = {"name": "team-run", "job_id": "team-run", "pool": "p5", "gpus": 16, "service": "sagemaker", "created_at": demo.START,
            "started_at": demo.START, "ended_at": None, "tags": {"preemptor:team": "research"}, "created_by": None}
    ours = {"name": "job-1", "job_id": "job-1", "pool": "p5", "gpus": 56, "service": "sagemaker", "created_at": demo.START + 310,
            "started_at": demo.START + 310, "ended_at": None, "tags": {"preemptor:job": "job-1"}, "created_by": "preemptor-StepsFunction"}

    def launched(adopted_at: float) -> list[str]:
        result = demo.DemoResult(
            runs=[team, ours], history=[_line("job-1", 300, "admitted")], team_runs={"team-run": "team-run"},
            adopted_runs={"team-run": ("team-run", demo.START + adopted_at)},
        )
        return launches_never_overfill(result, scenario)

    # The team's run was counted well before the admission: the controller filled the pool over its capacity
    assert launched(60) == [
        "run job-1 of job job-1 took its GPUs at 310 s in pool p5: with the controller's runs and the teams' runs it had counted, 72 of 64 GPUs"
    ]
    # Counted as the job was admitted, or after: not the controller's to know
    assert launched(290) == [] and launched(400) == []
    # And the fleet may hold the pool and what the account has beyond it, no more
    pools = {"pools": [{"name": "p5", "capacity_gpus": 64, "max_gpus_in_use": 80}]}
    assert fleet_never_above_capacity(demo.DemoResult(report=pools), scenario) == []
    pools["pools"][0]["max_gpus_in_use"] = 88
    assert fleet_never_above_capacity(demo.DemoResult(report=pools), scenario) == ["pool p5: 88 GPUs in use at once, capacity 64 and 16 unpooled"]


def test_the_capacity_and_idle_checks_count_a_quota_as_the_story_changes_it() -> None:
    # Given a pool of 8 x ml.p5.48xlarge whose account quota is 6 until a raise to 8 at 7200 s
    # (quota-raised.yaml), a sweep holding 6 and a small job of 2 waiting
    scenario = Scenario.load(Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "quota-raised.yaml")
    scenario.jobs.append(scenario.jobs[0].model_copy(update={"name": "small", "instances": 2}))
    held = [_line("sweep", 0, "admitted"), _line("small", 100, "submitted", detail="priority 50")]
    # While the quota leaves the pool 48 GPUs, all held: nothing idles
    waited = held + [_line("small", 5000, "admitted")]
    assert gpus_never_idle_while_a_job_that_fits_waits(demo.DemoResult(history=waited), scenario) == []
    # Raised, the 16 GPUs are free: a small job waiting past the bound beside them is found
    after = held + [_line("pretrain", 7300, "capacity-wait"), _line("small", 9000, "admitted")]
    assert gpus_never_idle_while_a_job_that_fits_waits(demo.DemoResult(history=after), scenario) != []
    # And the fleet may hold all 64 once the quota is raised (the largest quota the story grants)
    pools = [{"name": "p5", "capacity_gpus": 64, "max_gpus_in_use": 64}]
    assert fleet_never_above_capacity(demo.DemoResult(report={"pools": pools}), scenario) == []


def test_the_end_check_finds_a_job_ended_by_a_stop_the_controller_sent_itself() -> None:
    scenario = _story()
    a, b, c = (j.name for j in scenario.jobs)
    history = [
        _line(a, 1394, "failed", "preemptor: no capacity (RUNNABLE for 1200 s in g5-queue)"),
        _line(b, 900, "failed", "Essential container in task exited"),  # its own failure
        _line(c, 7000, "failed", "no-capacity", "no capacity after 24 launches; last: preemptor: no capacity (...)"),
        _line(b, 2000, "cancelled", "stopped outside the controller"),  # its second run stopped by hand
        _line(c, 3000, "cancelled", "stopped outside the controller"),  # nobody did
        _line(a, 3000, "cancelled", "cancelled"),  # its team cancelled it
    ]
    result = demo.DemoResult(history=history, stopped_by_hand=[f"{b}-r2"])
    assert no_job_ended_by_the_controllers_own_stop(result, scenario) == [
        f"{a} failed at 1394 s: preemptor: no capacity (RUNNABLE for 1200 s in g5-queue)",
        f"{c} cancelled at 3000 s as stopped outside the controller, though nobody stopped it by hand",
    ]


def test_the_drain_check_finds_an_admission_or_a_mark_stamped_while_the_pool_is_drained() -> None:
    scenario = _story()
    a, b, _ = (j.name for j in scenario.jobs)
    drains = [("p5", demo.START + 1000, demo.START + 1600)]
    # Stamped before the drain landed (a cycle begun before it) or after the undrain: kept
    kept = [_line(a, 1000, "admitted"), _line(b, 1000, "preemption-started"), _line(a, 1600, "admitted")]
    assert drained_pools_start_nothing(demo.DemoResult(history=kept, drains=drains), scenario) == []
    # Stamped while it was drained: found, each
    found = [_line(a, 1001, "admitted"), _line(b, 1500, "preemption-started"), _line(b, 1200, "stop-requested")]
    assert drained_pools_start_nothing(demo.DemoResult(history=found, drains=drains), scenario) == [
        f"{a} admitted at 1001 s in pool p5, drained from 1000 s to 1600 s",
        f"{b} preemption-started at 1500 s in pool p5, drained from 1000 s to 1600 s",
    ]
