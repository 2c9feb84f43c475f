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
from storm.invariants import violations
from storm.random_story import random_story

from preemptor_tools.local import demo


@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_a_random_story_in_a_hostile_world_keeps_every_promise(service: str) -> None:
    # Given seed 115's story: preemptions, lowerings and a cancel among eight jobs, on
    # SageMaker or on Batch (where a reclaimed spot instance takes a run too)
    scenario = random_story(service, 115, CHAOS)
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
