"""Seeded random stories for the hostile emulator: a shared pool, jobs of every tier from
three teams arriving over 40 minutes, and what teams and the world do to them meanwhile (a
team lowers or cancels a job, a run is stopped by hand, its stops are denied, a workflow
dies, a Batch instance is reclaimed). Each seed gives one story, the same on every replay;
with every chaos rate of the sweep on top, they probe the invariants where the two-job
preemption story cannot: several preemptions at once, preemptors that run elsewhere, are
lowered or cancelled while their victims checkpoint.

With `knobs`, the seed also draws (from a generator of its own, so the story above stays
the same) a policy of random knobs (quotas and reclaim, the preemption modes, team
ceilings, protections, a budget, delays, aging, the checkpoint timeout's action), runs
teams launch themselves (adopted, some claiming more than their team is granted; on
Batch, some in a queue of their team's that shares the pool's compute environment) and
the service running out of capacity for a while, copies teams make of the controller's runs
to come (their names and tags), an account with more than the pool, so that teams' own
runs may fill the pool beyond its capacity, a pool that buys its instances more than one
way (a fallback instance type or job queue, spot before on-demand) with an outage of the
first (and, on a SageMaker spot pool, managed spot taking a run's instances for a while),
and a second pool beside the first with some of the jobs.
"""

from __future__ import annotations

import random

from preemptor_tools.local.scenario import Scenario

TIERS = ("low", "medium", "high", "critical")
TEAMS = ("research", "applied", "production")
INSTANCES = 8  # the pool: 8 instances of 8 GPUs (SageMaker), or 64 GPUs (Batch)


def random_story(service: str, seed: int, chaos: dict | None = None, jobs: int = 8, knobs: bool = False, drains: bool = False) -> Scenario:
    """The story of `seed` on a `service` pool ("sagemaker" or "batch"), under `chaos`; with
    `knobs`, under a random policy and more of the world's faults (`_knobs`); with `drains`,
    now and then an operator's drain of the pool (`_drain`: the sweep's `--drains`)."""
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
    policy = _knobs(random.Random(f"knobs-{seed}"), service, specs, faults) if knobs else {}
    if knobs:
        if service == "batch":  # a generator of its own: the policy's draws stay the seed's
            team_launches = random.Random(f"batch-team-launches-{seed}")
            for spec in specs:
                if team_launches.random() < 0.2:
                    spec["launched_by"], spec["runs_training_helper"] = "team", False
            # Half of them go to a queue of their team's own on the pool's compute
            # environment: counted in the pool all the same (a generator of its own again).
            own_queues = random.Random(f"batch-team-queues-{seed}")
            for spec in specs:
                if spec.get("launched_by") == "team" and own_queues.random() < 0.5:
                    spec["job_queue"] = f"{spec['team']}-queue"
        _claims_not_granted(random.Random(f"claims-{seed}"), specs)
        _copies(random.Random(f"copies-{seed}"), specs)
    # Now and then the account has more than the pool (its quota, its compute environments):
    # runs teams launch themselves may then fill the pool beyond its capacity.
    unpooled = random.Random(f"unpooled-{seed}")
    extra = unpooled.choice((1, 2)) * (1 if service == "sagemaker" else 8) if knobs and unpooled.random() < 0.3 else 0
    if knobs and not extra:
        extra = _quota_below(random.Random(f"quota-{seed}"), service, faults)
    if drains:
        _drain(random.Random(f"drain-{seed}"), faults)
    pools = [pool]
    if knobs:
        _offerings(random.Random(f"offerings-{seed}"), service, pool, specs, faults)
        _second_pool(random.Random(f"pools-{seed}"), service, specs, pools, faults)
    return Scenario.model_validate(
        {
            "pools": pools, "jobs": specs, "lowerings": lowerings, "cancellations": cancellations, "faults": faults,
            "chaos": {"seed": seed, **(chaos or {})}, "policy": policy, "unpooled": {"p5": extra} if extra else {},
        }
    )


def _quota_below(rng: random.Random, service: str, faults: list[dict]) -> int:
    """Now and then the account's SageMaker quota of the pool's type is below the pool (an
    increase not granted yet): a launch over it is refused, the controller plans the pool at
    what the quota leaves it, and reads it again from Service Quotas; half the time the
    increase is granted during the story. Returns the pool's `unpooled` (negative, or 0)."""
    if service != "sagemaker" or rng.random() >= 0.25:
        return 0
    short = rng.choice((1, 2))
    if rng.random() < 0.5:
        faults.append({"type": "quota_change", "at": 60 * rng.randrange(20, 150), "pool": "p5", "instances": INSTANCES})
    return -short


def _drain(rng: random.Random, faults: list[dict]) -> None:
    """Now and then the operator drains the pool for a while, as work arrives and
    preemptions are under way: nothing may be admitted or marked meanwhile (a cycle planning
    it as the drain lands included), and it is planned again once undrained."""
    if rng.random() < 0.2:
        faults.append({"type": "drain", "at": 60 * rng.randrange(5, 60), "pool": "p5", "duration": 60 * rng.randrange(5, 30)})


def _claims_not_granted(rng: random.Random, specs: list[dict]) -> None:
    """Some of the runs teams launch themselves carry tags the platform does not believe:
    the controller's own job tags (naming another job of the story, or none; with this
    stack's name, another's that is not listed, or none), a priority
    no tier is named, a pool it does not run on, or a team that is no team's name. Each is
    adopted and counted, at what the platform grants, in the pool it runs on."""
    others = [s["name"] for s in specs if s.get("launched_by") != "team"] or ["no-such-job"]
    for spec in specs:
        if spec.get("launched_by") != "team":
            continue
        roll = rng.random()
        if roll < 0.25:
            # The stack's own name, none, or a stack no operator listed (OtherControllers):
            # the last would hide the run from every stack's count were it believed.
            stack = rng.random()
            spec["tags"] = {
                "preemptor:job": rng.choice([*others, "no-such-job"]), "preemptor:incarnation": "1",
                **({"preemptor:controller": "preemptor" if stack < 0.35 else "preemptor-shadow"} if stack < 0.5 else {}),
            }
        elif roll < 0.4:
            spec["tags"] = {"preemptor:priority": "urgent"}
        elif roll < 0.5:
            spec["tags"] = {"preemptor:pool": "retired-pool"}  # a pool it does not run on
        elif roll < 0.58:
            spec["tags"] = {"preemptor:team": "Research Team"}  # no team's name: counted as no one's


def _copies(rng: random.Random, specs: list[dict]) -> None:
    """Now and then a team creates a copy of a run the controller is about to launch: under
    the name it will give that run (a job's first, or its relaunch's `-r2`), with every tag
    the controller puts on it but the token, which only the job's secret gives. Appended: the
    story's other draws stay the seed's. The controller must launch the job's own run (on
    SageMaker, under the next name), and count the copy as its team's."""
    jobs = [s for s in specs if s.get("launched_by") != "team"]
    for n in range(rng.choice((0, 0, 1, 2))):
        if not jobs:
            return
        job = rng.choice(jobs)
        relaunch = rng.random() < 0.5
        incarnation = 2 if relaunch else 1
        later = 60 * rng.randrange(1, 30) if relaunch else 60 * rng.randrange(0, 4)
        specs.append(
            {
                **{k: job[k] for k in ("team", "priority", "pool", "instances", "gpus", "checkpoint_every") if k in job},
                "name": f"copy-{n}-of-{job['name']}", "run_name": job["name"] + (f"-r{incarnation}" if relaunch else ""),
                "launched_by": "team", "runs_training_helper": False,
                "submit_at": job["submit_at"] + later, "duration": 300 * rng.randrange(2, 16),
                "tags": {"preemptor:job": job["name"], "preemptor:incarnation": str(incarnation), "preemptor:controller": "preemptor"},
            }
        )


def _offerings(rng: random.Random, service: str, pool: dict, specs: list[dict], faults: list[dict]) -> None:
    """Now and then the pool buys its instances more than one way: on SageMaker a fallback
    instance type, or spot first with on-demand behind it (or both); on Batch a fallback job
    queue on the pool's compute environment. An outage may then take the first offering
    only: a launch that meets it must go on to the next, and no run of the pool, whatever it
    runs on, may take its GPUs twice. On a spot pool, managed spot may take a job's
    instances for a while (SageMaker restarts it from its checkpoint). Changes `pool` and
    `faults` in place."""
    if rng.random() >= 0.35:
        return
    if service == "sagemaker":
        kind = rng.choice(("type", "spot", "both"))
        if kind != "spot":
            pool["fallback_instance_types"] = ["ml.p5e.48xlarge"]
        if kind != "type":
            pool.update(capacity_type="spot", on_demand_fallback=True, spot_wait_s=rng.choice((300, 900)))
    else:
        pool.update(job_queue="p5-queue", fallback_job_queues=["p5-fallback"], runnable_timeout_s=rng.choice((300, 900)))
    if pool.get("capacity_type") == "spot":
        # Managed spot takes a run's instances for a while; SageMaker restarts it itself.
        ours = [spec for spec in specs if spec.get("launched_by") != "team"]
        for _ in range(rng.choice((0, 1, 2))):
            victim = rng.choice(ours)
            at = victim["submit_at"] + 60 * rng.randrange(3, 30)
            # Until it has a run to take (it may wait, or be between runs), for two hours.
            faults.append({
                "type": "spot_interruption", "job": victim["name"], "at": at, "duration": 60 * rng.randrange(3, 20), "until": at + 7200,
            })
    if rng.random() < 0.6:
        outage = {"type": "capacity_error", "at": 60 * rng.randrange(0, 40), "pool": "p5", "duration": 60 * rng.randrange(5, 25)}
        if service == "batch":
            outage["job_queue"] = "p5-queue"
        elif pool.get("capacity_type") == "spot":
            outage["capacity_type"] = "spot"
        else:
            outage["instance_type"] = pool["instance_type"]
        faults.append(outage)


def _second_pool(rng: random.Random, service: str, specs: list[dict], pools: list[dict], faults: list[dict]) -> None:
    """Now and then a second, smaller pool of another instance type (SageMaker) or job queue
    (Batch) beside the first, and a third of the story's jobs in it (no bigger than it): each
    pool is planned, counted and preempted on its own, and a team's run is counted in the
    pool it runs on. Changes `specs` and `pools` in place."""
    if rng.random() >= 0.3:
        return
    if service == "sagemaker":
        pools.append({"name": "p4", "service": "sagemaker", "instance_type": "ml.p4d.24xlarge", "instances": 4, "gpus_per_instance": 8})
    else:
        pools.append({"name": "p4", "service": "batch", "gpus": 32})
    # A managed-spot interruption's job stays on the spot pool (the second is on-demand).
    interrupted = {f["job"] for f in faults if f["type"] == "spot_interruption"} if service == "sagemaker" else set()
    for spec in specs:
        # A team's run in a queue of its own, and a copy, stay: their queue and name are the first pool's.
        if spec.get("job_queue") or spec["name"].startswith("copy-") or rng.random() >= 0.35:
            continue
        if spec["name"] in interrupted:
            continue
        spec["pool"] = "p4"
        if "instances" in spec:
            spec["instances"] = min(spec["instances"], 4)
        if "gpus" in spec:
            spec["gpus"] = min(spec["gpus"], 32)


def _knobs(rng: random.Random, service: str, specs: list[dict], faults: list[dict]) -> dict:
    """A random policy for the story's pool; changes `specs` (runs their teams launch) and
    `faults` (a capacity outage) in place."""
    if service == "sagemaker":
        for spec in specs:
            if rng.random() < 0.2:
                spec["launched_by"], spec["runs_training_helper"] = "team", False
    if rng.random() < 0.3:
        faults.append({"type": "capacity_error", "at": 60 * rng.randrange(0, 40), "pool": "p5", "duration": 60 * rng.randrange(5, 25)})
    policy: dict = {}
    if rng.random() < 0.4:
        cuts = sorted(rng.sample(range(1, INSTANCES), 2))
        nominal = [8 * n for n in (cuts[0], cuts[1] - cuts[0], INSTANCES - cuts[1])]
        policy["quotas"] = [
            {"team": team, "nominal_gpus": gpus, "borrowing_limit": rng.choice((None, 0, 16)),
             "lending_limit": rng.choice((None, gpus // 2))}
            for team, gpus in zip(TEAMS, nominal)
        ]
        policy["reclaim_within_pool"] = rng.choice(("Never", "LowerPriority", "Any"))
    if rng.random() < 0.3:
        # A ceiling below some of the story's jobs: their submissions are refused, and a run
        # their team launched claiming more is counted at the ceiling.
        policy["teams"] = {team: {"max_priority": rng.choice(TIERS)} for team in TEAMS}
    for mode in ("within_team", "across_teams"):
        policy[mode] = rng.choice(("LowerPriority", "LowerPriority", "LowerOrNewerEqualPriority", "Never"))
    policy["min_runtime_s"] = rng.choice((0, 0, 600, 1800))
    policy["near_completion"] = rng.choice(({}, {}, {"progress": 0.9}))
    policy["max_preemptions"] = rng.choice((None, None, 1, 2))
    policy["on_max_preemptions"] = rng.choice(("protect", "fail"))
    policy["budget"] = rng.choice((None, None, {"window_s": 1800, "max_preemptions": 2}, {"window_s": 3600, "max_gpu_hours": 4}))
    policy["preemption_delay_s"] = rng.choice((0, 0, 120, 600))
    policy["on_checkpoint_timeout"] = rng.choice(("stop-anyway", "stop-anyway", "spare"))
    policy["checkpoint_max_age_s"] = rng.choice((900, 900, 300, 1800))
    if rng.random() < 0.3:
        policy["aging"] = {"rate_per_hour": 120, "starving_after_s": 1800}
    return policy
