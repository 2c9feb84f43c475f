"""Every chaos rate and fault of the hostile emulator, one at a time, on a preemption story;
after each run the invariants (storm/invariants.py) hold.

The story: a low-priority job fills a pool; a critical one arrives and needs it all, so the
first must be checkpointed, stopped, requeued and relaunched. Each case turns one thing
against it and names the injection it expects to have happened (so a case that silently
stops exercising its fault fails).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from storm.invariants import violations

from preemptor_tools import ops, redrive
from preemptor_tools.local import demo, server
from preemptor_tools.local.scenario import Chaos, Scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def story(service: str = "sagemaker", chaos: dict | None = None, faults: list | None = None) -> Scenario:
    if service == "sagemaker":
        pool = {"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 4, "gpus_per_instance": 8}
        size = {"instances": 4}
    else:
        pool = {"name": "p5", "service": "batch", "gpus": 32}
        size = {"gpus": 32}
    return Scenario.model_validate(
        {
            "pools": [pool],
            "chaos": chaos,
            "faults": faults or [],
            "jobs": [
                {"name": "sweep", "team": "research", "priority": "low", "pool": "p5", **size,
                 "submit_at": 0, "duration": 2400, "checkpoint_every": 300},
                {"name": "incident-fix", "team": "production", "priority": "critical", "pool": "p5", **size,
                 "submit_at": 600, "duration": 600, "checkpoint_every": 300},
            ],
        }
    )


CASES = {
    # Throttles hit each attempt, and botocore retries them: at 0.5 one call in eight fails.
    "throttling": (story(chaos={"seed": 11, "throttle_rate": 0.5}), "throttle"),
    "transaction-conflicts": (story(chaos={"seed": 12, "transaction_conflict_rate": 0.6}), "transaction-conflict"),
    "duplicate-and-late-events": (story(chaos={"seed": 13, "duplicate_rate": 0.4, "reorder_rate": 0.4}), "event-late"),
    "lambda-crashes": (story(chaos={"seed": 14, "crash_rate": 0.2}), "lambda-crash"),
    "lagging-index": (story(chaos={"seed": 16, "index_lag_rate": 0.6}), "index-lag"),
    "batch-lagging-index": (story("batch", chaos={"seed": 17, "index_lag_rate": 0.6}), "index-lag"),
    "lost-answers": (story(chaos={"seed": 18, "answer_lost_rate": 0.3}), "answer-lost"),
    "batch-lost-answers": (story("batch", chaos={"seed": 19, "answer_lost_rate": 0.3}), "answer-lost"),
    "stop-denied": (story(faults=[{"type": "stop_denied", "at": 500, "job": "sweep", "duration": 1200}]), "stop-denied"),
    "stopped-by-hand": (story(faults=[{"type": "stopped_by_hand", "at": 300, "job": "sweep"}]), None),
    "workflow-crash": (story(faults=[{"type": "workflow_crash", "at": 590}]), "workflow-crash"),
    "batch-throttling-and-stop-denied": (
        story("batch", chaos={"seed": 15, "throttle_rate": 0.4},
              faults=[{"type": "stop_denied", "at": 500, "job": "sweep", "duration": 900}]),
        "throttle",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invariants_hold_under(case: str) -> None:
    # Given the preemption story with one hostile knob turned up
    scenario, expected_injection = CASES[case]

    # When it is replayed on the emulated stack
    result = demo.run(scenario, tick_s=60)

    # Then the knob really hit the controller, and every invariant holds
    if expected_injection is not None:
        assert result.report["chaos"]["injected"].get(expected_injection, 0) > 0, result.report["chaos"]
    else:
        assert result.stopped_by_hand, "nothing was stopped by hand"
    assert violations(result, scenario) == []


def test_a_drain_as_the_critical_job_arrives_holds_its_preemption_until_the_pool_is_undrained() -> None:
    # Given the operator draining the pool the moment the critical job arrives, for 15
    # minutes, while events come twice and late and calls are throttled
    scenario = story(
        chaos={"seed": 20, "throttle_rate": 0.3, "duplicate_rate": 0.3, "reorder_rate": 0.3},
        faults=[{"type": "drain", "at": 600, "pool": "p5", "duration": 900}],
    )

    # When it is replayed
    result = demo.run(scenario, tick_s=60)

    # Then nothing was preempted or admitted while the pool was drained; undrained, the
    # critical job preempted the sweep, and both completed
    [(pool, since, until)] = result.drains
    assert (pool, since - demo.START, until - demo.START) == ("p5", 600, 1500)
    marks = [e["at"] - demo.START for e in result.history if e["job"] == "sweep" and e["kind"] == "preemption-started"]
    assert marks and min(marks) >= 1500
    assert {j["name"]: j["state"] for j in result.report["jobs"]} == {"sweep": "Completed", "incident-fix": "Completed"}
    assert violations(result, scenario) == []


def test_hostile_world_example_every_job_completes_within_capacity() -> None:
    # Given the example scenario with every chaos rate and two faults
    scenario = Scenario.load(SCENARIOS / "hostile-world.yaml")

    # When it is replayed
    result = demo.run(scenario)

    # Then every job completes, the fleet never ran more GPUs than the pool has, nothing is
    # stuck, and the invariants hold
    report = result.report
    assert {j["name"]: j["state"] for j in report["jobs"]} == {j.name: "Completed" for j in scenario.jobs}
    assert all(p["max_gpus_in_use"] <= p["capacity_gpus"] for p in report["pools"])
    assert report["pools"][0]["max_gpus_in_use"] > 0
    assert report["stuck"] == []
    assert violations(result, scenario) == []


def test_the_dead_letters_of_a_chaos_run_redriven_once_it_is_over_change_nothing_settled() -> None:
    # Given the preemption story under every chaos rate at once, where Lambda dead-lettered
    # events after their three attempts (deliveries throttled or crashed each time: state
    # changes, checkpoint notices, submissions' copies, reconcile's schedule)
    chaos = {"seed": 21, "throttle_rate": 0.5, "crash_rate": 0.15, "duplicate_rate": 0.3, "reorder_rate": 0.3,
             "transaction_conflict_rate": 0.3}
    scenario = story(chaos=chaos)
    seen: dict = {}

    def settled(stack) -> dict:
        sagemaker = stack.client("sagemaker")
        return {
            "jobs": {j.name: (j.status, j.incarnation, j.run_id, j.preemptions, j.stops_without_fresh_checkpoint) for j in stack.jobs()},
            "runs": sorted(r["TrainingJobName"] for r in sagemaker.list_training_jobs(MaxResults=100)["TrainingJobSummaries"]),
            "used_gpus": stack.deps().store.pool("p5")["used_gpus"],
        }

    def at_the_end(stack) -> None:
        if "started" not in seen:
            seen["started"] = True
            return
        # When the storm is over and the operator redrives the queue
        seen["before"] = settled(stack)
        seen["dead_letters"] = len(stack.dead_letters)
        stack.hostile.chaos = Chaos(seed=chaos["seed"])
        target = ops.Target(stack.stack_name, server.stack_outputs(stack), dict(stack.parameters), stack.session)
        seen["redrive"] = redrive.redrive(target, wait_s=0)
        stack.drain()
        seen["after"] = settled(stack)
        seen["left"] = stack.client("sqs").receive_message(QueueUrl=target.outputs["EventsDeadLetterQueueUrl"]).get("Messages", [])
        seen["dead_letters_after"] = len(stack.dead_letters)

    result = demo.run(scenario, tick_s=60, on_stack=at_the_end)
    assert violations(result, scenario) == []
    # Then every dead letter went back to its function and was handled: none refused, none
    # failed again, the queue is empty
    assert seen["dead_letters"] >= 3, seen["dead_letters"]
    assert len(seen["redrive"]["redriven"]) == seen["dead_letters"]
    assert seen["redrive"]["refused"] == [] and seen["redrive"]["failed"] == []
    assert seen["left"] == [] and seen["dead_letters_after"] == seen["dead_letters"]
    # And the stale events changed nothing that had settled: no job moved, no run was
    # launched again, no GPU is held
    assert seen["after"] == seen["before"]
    assert seen["after"]["used_gpus"] == 0
    assert {j["name"]: j["state"] for j in result.report["jobs"]} == {"sweep": "Completed", "incident-fix": "Completed"}
