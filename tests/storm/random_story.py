"""Seeded random stories for the hostile emulator: a shared pool, jobs of every tier from
three teams arriving over 40 minutes, and what teams and the world do to them meanwhile (a
team lowers or cancels a job, a run is stopped by hand, its stops are denied, a workflow
dies, a Batch instance is reclaimed). Each seed gives one story, the same on every replay;
with every chaos rate of the sweep on top, they probe the invariants where the two-job
preemption story cannot: several preemptions at once, preemptors that run elsewhere, are
lowered or cancelled while their victims checkpoint.
"""

from __future__ import annotations

import random

from preemptor_tools.local.scenario import Scenario

TIERS = ("low", "medium", "high", "critical")
TEAMS = ("research", "applied", "production")
INSTANCES = 8  # the pool: 8 instances of 8 GPUs (SageMaker), or 64 GPUs (Batch)


def random_story(service: str, seed: int, chaos: dict | None = None, jobs: int = 8) -> Scenario:
    """The story of `seed` on a `service` pool ("sagemaker" or "batch"), under `chaos`."""
    rng = random.Random(seed)
    if service == "sagemaker":
        pool = {"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": INSTANCES, "gpus_per_instance": 8}
    else:
        pool = {"name": "p5", "service": "batch", "gpus": INSTANCES * 8}
    specs = []
    for i in range(jobs):
        instances = rng.choice((1, 2, 2, 4, 4, 8))
        size = {"instances": instances} if service == "sagemaker" else {"gpus": instances * 8}
        specs.append(
            {
                "name": f"job-{i}", "team": rng.choice(TEAMS), "priority": rng.choice(TIERS), "pool": "p5", **size,
                "submit_at": 60 * rng.randrange(0, 40), "duration": 300 * rng.randrange(2, 16),
                "checkpoint_every": rng.choice((300, 900, 1800, 3600, None)), "runs_training_helper": rng.random() < 0.5,
            }
        )
    lowerings, cancellations, faults = [], [], []
    for spec in specs:
        later = spec["submit_at"] + 60 * rng.randrange(1, 30)
        tier = TIERS.index(spec["priority"])
        draw = rng.random()
        if draw < 0.15 and tier > 0:
            lowerings.append({"at": later, "job": spec["name"], "priority": TIERS[rng.randrange(0, tier)]})
        elif draw < 0.3:
            cancellations.append({"at": later, "job": spec["name"]})
        elif draw < 0.4:
            faults.append({"type": "stop_denied", "at": spec["submit_at"], "job": spec["name"], "duration": 600})
        elif draw < 0.45:
            faults.append({"type": "stopped_by_hand", "at": later, "job": spec["name"]})
        elif draw < 0.55 and service == "batch":
            faults.append({"type": "spot_interruption", "at": later, "job": spec["name"]})
    if rng.random() < 0.3:
        faults.append({"type": "workflow_crash", "at": 60 * rng.randrange(0, 60)})
    return Scenario.model_validate(
        {
            "pools": [pool], "jobs": specs, "lowerings": lowerings, "cancellations": cancellations, "faults": faults,
            "chaos": {"seed": seed, **(chaos or {})},
        }
    )
