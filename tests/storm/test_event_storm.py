"""A thousand events, duplicated, reordered and replayed late, after a preemption story:
every one gets an outcome, none raises, and nothing the story settled moves.

EventBridge delivers at least once and in no order, and services re-announce old states
under new event ids. The storm is every event the story delivered (job state changes of
every incarnation, checkpoint writes, submissions), drawn with a seeded generator, half
under their own id (a redelivery), half under a new one (a re-announcement), in shuffled
order.
"""

from __future__ import annotations

import copy
import random

from storm.invariants import violations
from storm.test_storm_scenarios import story

from preemptor_tools.local import demo

STORM_EVENTS = 1000
OUTCOMES = {"accepted", "ignored", "rejected", "duplicate"}


def test_a_storm_of_duplicated_and_reordered_events_changes_nothing_settled() -> None:
    # Given the preemption story told in a world that duplicates and delays events, with
    # every event it delivers captured
    scenario = story(chaos={"seed": 21, "duplicate_rate": 0.3, "reorder_rate": 0.3})
    captured: list[dict] = []
    storm: dict = {}

    def instrument(stack) -> None:
        if not storm:
            deliver = stack.put_event

            def capturing(event, *args, **kwargs):
                captured.append(copy.deepcopy(event))
                return deliver(event, *args, **kwargs)

            stack.put_event = capturing
            storm["started"] = True
            return
        # When, the story told, thousands of its events arrive again in any order
        store = stack.deps().store
        before = {j.name: (j.status, j.incarnation, j.run_id) for j in store.all_jobs()}
        runs_before = len(stack.client("sagemaker").list_training_jobs(MaxResults=100)["TrainingJobSummaries"])
        rng = random.Random(21)
        results = []
        for n in range(STORM_EVENTS):
            event = copy.deepcopy(rng.choice(captured))
            if rng.random() < 0.5:
                event["id"] = f"storm-{n}"
            results += stack.put_event(event).results
        stack.drain()
        storm.update(
            results=results,
            before=before,
            after={j.name: (j.status, j.incarnation, j.run_id) for j in store.all_jobs()},
            runs=(runs_before, len(stack.client("sagemaker").list_training_jobs(MaxResults=100)["TrainingJobSummaries"])),
            dead_letters=list(stack.dead_letters),
        )

    result = demo.run(scenario, on_stack=instrument, tick_s=60)

    # Then the story itself kept the invariants
    assert violations(result, scenario) == []
    assert len(captured) > 50
    # And every storm event got a known outcome, none raised into a dead letter
    assert len(storm["results"]) >= STORM_EVENTS
    assert {r["outcome"] for r in storm["results"]} <= OUTCOMES
    assert storm["dead_letters"] == []
    # And no job moved, no run was launched
    assert storm["after"] == storm["before"]
    assert storm["runs"][0] == storm["runs"][1]
