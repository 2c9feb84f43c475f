"""Seeded random stories (storm/random_story.py) under every chaos rate of the sweep: eight
jobs of every tier from three teams sharing a pool, teams lowering and cancelling jobs
while their victims checkpoint, stops denied, runs stopped by hand, Batch instances
reclaimed. The sweep (`chaos_sweep.py --random`) replays hundreds; these two run with the
tests, and each checks it still exercises what it is here for.
"""

from __future__ import annotations

from collections import Counter

import pytest
from storm.chaos_sweep import CHAOS
from storm.invariants import gpus_never_idle_while_a_job_that_fits_waits, violations
from storm.random_story import random_story

from preemptor_tools.local import demo
from preemptor_tools.local.scenario import Scenario


@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_a_random_story_in_a_hostile_world_keeps_every_promise(service: str) -> None:
    # Given seed 114's story: preemptions, lowerings, cancels and runs stopped by hand among
    # eight jobs, on SageMaker or on Batch (where a reclaimed spot instance takes a run too)
    scenario = random_story(service, 114, CHAOS)
    assert scenario.lowerings and scenario.cancellations

    # When it is replayed under every chaos rate at once
    result = demo.run(scenario, tick_s=60)

    # Then it preempted and lowered as it is meant to, under injected faults (a team's event
    # may be dead-lettered after its three deliveries failed: the cancel may not land)
    kinds = Counter(e["kind"] for e in result.history)
    assert kinds["preemption-started"] >= 3 and kinds["priority-changed"] >= 1, kinds
    injected = result.report["chaos"]["injected"]
    assert all(injected.get(k, 0) > 0 for k in ("throttle", "transaction-conflict", "answer-lost")), injected
    # And every invariant holds (storm/invariants.py): every accepted job settled, none
    # stopped for nobody, none oversubscribed the pool
    assert violations(result, scenario) == []


def test_a_random_story_under_a_random_policy_keeps_every_promise_and_the_platforms_grants() -> None:
    # Given seed 85's story with its random knobs: team quotas, team ceilings below what its
    # teams ask, runs the teams launch themselves claiming more than their ceiling (one of
    # the whole pool), and a run stopped by hand
    scenario = random_story("sagemaker", 85, CHAOS, knobs=True)
    policy = scenario.policy
    assert policy["quotas"] and policy["teams"] and any(j.launched_by == "team" for j in scenario.jobs)

    # When it is replayed under every chaos rate at once
    result = demo.run(scenario, tick_s=60)

    # Then the teams' runs were counted at the priority their team is granted, saying so,
    # and the submissions above a ceiling were refused
    adopted = [e for e in result.history if e["kind"] == "adopted"]
    assert sum("its priority tag claims" in e["detail"] for e in adopted) >= 2, adopted
    assert any(j["state"] == "Rejected" for j in result.report["jobs"])
    # And every invariant holds: none above its grant, the protections, the quotas' modes,
    # the pool never over what it owns (the account's quota refuses a team's launch into a
    # full pool, as AWS does)
    assert violations(result, scenario) == []


# The example scenario's rates (examples/scenarios/hostile-world.yaml): hostile, yet most
# plan steps get through, so the pool must not idle while work that fits waits.
EXAMPLE_CHAOS = {"throttle_rate": 0.3, "duplicate_rate": 0.15, "reorder_rate": 0.15, "transaction_conflict_rate": 0.1,
                 "crash_rate": 0.03, "index_lag_rate": 0.2, "answer_lost_rate": 0.02}


def test_a_random_story_in_the_examples_hostile_world_never_idles_gpus_a_waiting_job_fits() -> None:
    # Given seed 226's story on Batch (a job of the whole pool, four cancels) at the
    # example scenario's rates
    scenario = random_story("batch", 226, EXAMPLE_CHAOS)

    # When it is replayed
    result = demo.run(scenario, tick_s=60)

    # Then no GPUs stayed free more than 15 minutes while a job that fits them waited, and
    # every invariant holds
    assert gpus_never_idle_while_a_job_that_fits_waits(result, scenario) == []
    assert violations(result, scenario) == []


def test_the_idle_check_finds_gpus_left_free_while_a_job_that_fits_waits() -> None:
    # Given a 64-GPU pool held by one job until 600 s, and a job of the whole pool waiting
    # since 300 s, admitted 20 minutes after the end (then, in another log, 10 minutes after)
    scenario = random_story("sagemaker", 0, jobs=2)
    first, second = scenario.jobs
    first.instances, second.instances = 8, 8

    def line(job: str, at: float, kind: str, detail: str = "") -> dict:
        return {"job": job, "at": demo.START + at, "kind": kind, "reason": kind, "detail": detail, "extra": {}}

    def result(admitted_at: float) -> demo.DemoResult:
        history = [
            line(first.name, 0, "submitted", "priority 50"), line(first.name, 0, "admitted"),
            line(second.name, 300, "submitted", "priority 50"), line(first.name, 600, "completed"),
            line(second.name, admitted_at, "admitted"),
        ]
        return demo.DemoResult(history=history)

    # When the check reads each log, then the 20 minutes are found, the 10 are not
    assert gpus_never_idle_while_a_job_that_fits_waits(result(600 + 1200), scenario) == [
        f"pool p5: 64 GPUs free from 600 s to 1800 s while {second.name} waited"
    ]
    assert gpus_never_idle_while_a_job_that_fits_waits(result(600 + 600), scenario) == []


def _copy_story(service: str) -> Scenario:
    """A pool of 32 GPUs: "busy" holds 24 of them until 600 s; "train" (16) waits for it from
    30 s; at 60 s a team creates a copy of train's run to come (its name, every tag the
    controller will put on it but the token, 8 GPUs: it fits)."""
    if service == "sagemaker":
        pool = {"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 4, "gpus_per_instance": 8}
        size = lambda n: {"instances": n}  # noqa: E731
    else:
        pool = {"name": "p5", "service": "batch", "gpus": 32}
        size = lambda n: {"gpus": 8 * n}  # noqa: E731
    base = {"team": "research", "priority": "medium", "pool": "p5", "duration": 600, "checkpoint_every": 300}
    copy = {"preemptor:job": "train", "preemptor:incarnation": "1", "preemptor:controller": "preemptor"}
    return Scenario.model_validate({
        "pools": [pool],
        "jobs": [
            {**base, "name": "busy", "submit_at": 0, **size(3)},
            {**base, "name": "train", "submit_at": 30, **size(2)},
            {**base, "name": "copy-of-train", "run_name": "train", "launched_by": "team", "tags": copy, "submit_at": 60, **size(1)},
        ],
    })


@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_a_copy_a_team_makes_of_a_run_to_come_is_counted_as_its_own_and_the_job_runs_its_own(service: str) -> None:
    # Given a team's copy of a waiting job's run to come (`_copy_story`; the sweep's stories
    # make such copies at random)
    scenario = _copy_story(service)

    # When it is replayed
    result = demo.run(scenario, tick_s=60)

    # Then the copy was counted as its team's, under a name of its own, its claim refused
    [copy_id] = [run for run, name in result.team_runs.items() if name == "copy-of-train"]
    adopted_as, _ = result.adopted_runs[copy_id]
    assert adopted_as.startswith("train-")
    [line] = [e for e in result.history if e["job"] == adopted_as and e["kind"] == "adopted"]
    assert "controller-tags" in line["detail"]
    # And the job ran a run of its own, launched by the controller and bearing its token
    # (on SageMaker under the next name: the copy holds the first), and completed
    own = [r for r in result.runs if r["created_by"] is not None and r["tags"].get("preemptor:job") == "train"]
    assert [r["name"] for r in own] == ["train-r2" if service == "sagemaker" else "train"]
    assert own[0]["tags"]["preemptor:run-token"] and "preemptor:run-token" not in next(r for r in result.runs if r["job_id"] == copy_id)["tags"]
    assert {j["name"]: j["state"] for j in result.report["jobs"]}["train"] == "Completed"
    # And every invariant holds
    assert violations(result, scenario) == []


def test_a_pool_teams_runs_fill_over_its_capacity_gets_no_launch_of_the_controllers_on_top() -> None:
    # Given seed 4's story with its knobs: the account has two instances (16 GPUs) beyond
    # the pool of 64, and teams launch runs of their own of 16 GPUs each into a busy pool
    scenario = random_story("sagemaker", 4, knobs=True)
    assert scenario.unpooled == {"p5": 2}

    # When it is replayed
    result = demo.run(scenario, tick_s=60)

    # Then the pool was over-full by 8 (the teams' runs counted in full: SageMaker gave them
    # those instances), with room left in the account for a launch of the controller's, and
    # every invariant holds: none of its launches added to it
    assert result.report["pools"][0]["max_gpus_in_use"] == 72
    assert sum(e["kind"] == "adopted" and e["detail"].startswith("16 GPUs counted in p5") for e in result.history) == 2
    assert violations(result, scenario) == []
