"""Benchmark of `plan()`: 10k pending and 2k running jobs over a few full pools.

    python -m preemptor_tools.bench_plan [--pending 10000] [--running 2000] [--pools 4] [--runs 100]
                                   [--seed 7] [--out bench/results/plan_speed.json]
    python -m preemptor_tools.bench_plan --digest 40    # the decisions' fingerprint (`digest`)
    python -m preemptor_tools.bench_plan --repeat 3 --policy every-knob   # plans, untimed (`repeat`)

Wall-clock time on a shared 2-CPU VM moves by several per cent from one minute to the next,
more than most single speed changes. Instructions do not: under
`valgrind --tool=cachegrind --cache-sim=no`, half the difference between `--repeat 3` and
`--repeat 1` is the instructions of one plan (docs/policy.md, "Planner cost").

The snapshot is seeded-random and worst-case shaped: every pool is full, so each pending
job that does not fit goes through nomination (victim bound, scan, fill-back); priorities
follow the trace mix of DESIGN.md §6 (5 % critical, 15 % high, 30 % medium, 50 % low). The
policy turns on every knob that costs time: quotas with borrowing, aging, fair share,
protections, a budget and a delay ("every-knob"); the same snapshot is also planned under
the default policy ("defaults"), where nothing rate-limits preemption; and both again on
the pending jobs the controller's schedule step would read from that queue (its window,
`pending_window` 200 per pool, of the pending index: "controller window"). Prints the median
and the 99th percentile wall time of `--runs` plans (time.perf_counter, after one warm-up
plan, each run after a full garbage collection: see `measure`) per scenario and writes
them, the machine and the command to `--out` (`median_s` and `p99_s` are the slower
scenario's).

`main` measures in a process that holds what the schedule function's does: the handler's
modules (boto3, Powertools) and the snapshot. `make bench` runs it as a process of its own
for that reason: its own process holds the simulator's results, and the full collection
before each run walks all of them, so each plan would start on caches they evicted.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from preemptor.config import Settings
from preemptor.core.model import PastPreemption, PendingJob, Pool, RunningJob, Snapshot, TeamUsage
from preemptor.core.planner import plan
from preemptor.core.policy import Policy

NOW = 1_000_000.0
DEFAULT_WINDOW = Settings.model_fields["pending_window"].default  # pending jobs per pool the schedule step reads
TEAMS = [f"team-{i}" for i in range(12)]
SIZES = [1, 2, 4, 8, 8, 8, 16, 32, 64]


def _priority(rng: random.Random) -> int:
    roll = rng.random()
    return 1000 if roll < 0.05 else 500 if roll < 0.20 else 200 if roll < 0.50 else 50


def build(pending: int, running: int, pools: int, seed: int) -> tuple[Snapshot, Policy]:
    """A seeded snapshot with full pools, and a policy with every costly knob on."""
    rng = random.Random(seed)
    names = [f"pool-{i}" for i in range(pools)]
    used = dict.fromkeys(names, 0)
    run = []
    for i in range(running):
        pool = names[i % pools]
        gpus = rng.choice(SIZES)
        used[pool] += gpus
        started = NOW - rng.uniform(0, 48 * 3600)
        run.append(
            RunningJob(
                name=f"run-{i:05d}",
                team=rng.choice(TEAMS),
                priority=_priority(rng),
                pool=pool,
                gpus=gpus,
                started_at=started,
                last_checkpoint_at=rng.choice([None, NOW - rng.uniform(0, 3600)]),
                preemptions=rng.choice([0, 0, 0, 1, 2, 5]),
                stopping=rng.random() < 0.02,
                spot=rng.random() < 0.1,
                expected_duration_s=rng.choice([None, rng.uniform(3600, 72 * 3600)]),
                restart_overhead_s=rng.choice([0.0, 120.0, 600.0]),
            )
        )
    wait = [
        PendingJob(
            name=f"job-{i:05d}",
            team=rng.choice(TEAMS),
            priority=_priority(rng),
            pool=names[rng.randrange(pools)],
            gpus=rng.choice(SIZES),
            submitted_at=NOW - rng.uniform(0, 72 * 3600),
            preemptions=rng.choice([0, 0, 0, 1]),
            sla_s=rng.choice([None, 1800.0, 86_400.0]),
            spot=rng.random() < 0.1,
        )
        for i in range(pending)
    ]
    snap = Snapshot(
        pools=tuple(Pool(n, used[n]) for n in names),
        running=tuple(run),
        pending=tuple(wait),
        usage=tuple(TeamUsage(t, rng.uniform(0, 1e8), NOW - rng.uniform(0, 86_400)) for t in TEAMS),
        preemption_history=tuple(PastPreemption(rng.choice(names), NOW - rng.uniform(0, 3600), 8, 3600.0) for _ in range(20)),
    )
    share = min(used.values()) // len(TEAMS)
    policy = Policy(
        quotas=[{"team": t, "nominal_gpus": share, "borrowing_limit": share, "lending_limit": share // 2} for t in TEAMS[:-2]],
        tier_max_sla_s={"critical": 3600},
        min_runtime_s=600,
        near_completion={"remaining_s": 900, "progress": 0.95},
        max_preemptions=3,
        budget={"window_s": 3600, "max_preemptions": 200},
        preemption_delay_s=60,
        aging={"rate_per_hour": 10},  # off by default; on here (the former default)
        within_team="LowerOrNewerEqualPriority",
    )
    return snap, policy


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `values`, linearly interpolated."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def controller_window(snap: Snapshot, window: int = DEFAULT_WINDOW) -> Snapshot:
    """The snapshot as the schedule step reads it: per pool, the first `window` pending jobs
    of the pending index (priority desc, submission, name: `adapters.store.pending_rank`)."""
    by_pool: dict[str, list[PendingJob]] = {}
    for job in sorted(snap.pending, key=lambda j: (-j.priority, j.submitted_at, j.name)):
        by_pool.setdefault(job.pool, []).append(job)
    return replace(snap, pending=tuple(job for jobs in by_pool.values() for job in jobs[:window]))


def measure(pending: int = 10_000, running: int = 2_000, pools: int = 4, runs: int = 100, seed: int = 7, echo=print) -> dict:
    """Time `plan()` on the benchmark snapshot under both policies, whole and as the
    controller reads it (its pending window); the result `main` writes. The headline
    median and p99 are the slower whole-snapshot scenario's."""
    snap, every_knob = build(pending, running, pools, seed)
    windowed = controller_window(snap)
    scenarios = {}
    cases = (
        ("every-knob", snap, every_knob),
        ("defaults", snap, Policy()),
        ("every-knob, controller window", windowed, every_knob),
        ("defaults, controller window", windowed, Policy()),
    )
    for label, snap, policy in cases:
        decision = plan(snap, policy, NOW)  # warm-up: caches of the policy's tier table
        timings = []
        for _ in range(runs):
            # Each run starts from the same collector state. Back to back, the decisions of
            # earlier runs are promoted into the oldest generation until, every few runs, a
            # full collection walks the whole heap (the snapshot, every module) inside
            # whichever run comes next: a pause of the process's, not of that plan's (in the
            # controller it falls on any allocation of the invocation). The young
            # collections that plan()'s own allocations trigger stay counted. The previous
            # decision is freed here too, not inside the next run.
            decision = None
            gc.collect()
            start = time.perf_counter()
            decision = plan(snap, policy, NOW)
            timings.append(time.perf_counter() - start)
        scenarios[label] = {
            "pending": len(snap.pending),
            "median_s": round(statistics.median(timings), 4),
            "p99_s": round(percentile(timings, 99), 4),
            "min_s": round(min(timings), 4),
            "max_s": round(max(timings), 4),
            "admits": len(decision.admits),
            "preemptions": len(decision.preemptions),
            "failures": len(decision.failures),
            "explanations": len(decision.explanations),
            "checkpoint_requests": len(decision.checkpoint_requests),
        }
        echo(
            f"plan() [{label}]: {len(snap.pending)} pending, {running} running, {pools} pools: "
            f"median {statistics.median(timings) * 1000:.1f} ms, p99 {percentile(timings, 99) * 1000:.1f} ms over {runs} runs "
            f"(min {min(timings) * 1000:.1f}, max {max(timings) * 1000:.1f}); "
            f"{len(decision.admits)} admits, {len(decision.preemptions)} preemptions"
        )
    return {
        "benchmark": "plan() on one snapshot with full pools",
        "pending": pending,
        "running": running,
        "pools": pools,
        "runs": runs,
        "seed": seed,
        "median_s": max(scenarios[x]["median_s"] for x in ("every-knob", "defaults")),
        "p99_s": max(scenarios[x]["p99_s"] for x in ("every-knob", "defaults")),
        "window": DEFAULT_WINDOW,
        "window_p99_s": max(scenarios[x]["p99_s"] for x in ("every-knob, controller window", "defaults, controller window")),
        "scenarios": scenarios,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }


def digest(seeds: int = 40) -> tuple[int, str]:
    """A fingerprint of the planner's decisions: the SHA-256 of every field of every decision
    on `seeds` seeded snapshots of varied sizes (50 to 2,000 pending, 1 to 4 pools), each
    under every costly knob and under the defaults; returns (plans, hex digest).

    A change meant to make `plan()` faster, not different, leaves it as it was: run
    `--digest` before and after (the tests' equivalence checks cover the shortcuts within
    one planner, not two versions of it)."""
    h = hashlib.sha256()
    plans = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        snap, every_knob = build(rng.choice([50, 300, 2000]), rng.choice([40, 200, 600]), rng.choice([1, 2, 4]), seed)
        for policy in (every_knob, Policy()):
            h.update(repr(plan(snap, policy, NOW)).encode())
            plans += 1
    return plans, h.hexdigest()


def repeat(plans: int, policy: str, pending: int = 10_000, running: int = 2_000, pools: int = 4, seed: int = 7) -> int:
    """Plan the benchmark snapshot `plans` times under `policy` ("every-knob" or
    "defaults"), time nothing, collect no garbage: the work of `plans` plans on top of the
    build, for an instruction counter. Returns the preemptions of the last plan."""
    snap, every_knob = build(pending, running, pools, seed)
    chosen = {"every-knob": every_knob, "defaults": Policy()}[policy]
    preemptions = 0
    for _ in range(plans):
        preemptions = len(plan(snap, chosen, NOW).preemptions)
    return preemptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preemptor_tools.bench_plan", description=__doc__.splitlines()[0])
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=2_000)
    parser.add_argument("--pools", type=int, default=4)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/results/plan_speed.json"))
    parser.add_argument("--digest", type=int, metavar="SEEDS", help="print the fingerprint of the decisions on SEEDS snapshots (`digest`), time nothing")
    parser.add_argument("--repeat", type=int, metavar="PLANS", help="plan the snapshot PLANS times under --policy and time nothing (`repeat`)")
    parser.add_argument("--policy", choices=["every-knob", "defaults"], default="every-knob")
    args = parser.parse_args(argv)
    if args.repeat is not None:
        preemptions = repeat(args.repeat, args.policy, args.pending, args.running, args.pools, args.seed)
        print(f"{args.repeat} plans [{args.policy}], {preemptions} preemptions each")
        return 0
    if args.digest is not None:
        plans, hexdigest = digest(args.digest)
        print(f"{plans} decisions, sha256 {hexdigest}")
        return 0

    import preemptor.handlers.schedule  # noqa: F401 - the schedule function's modules, in memory as in its process

    result = measure(args.pending, args.running, args.pools, args.runs, args.seed)
    result["command"] = " ".join(["python -m preemptor_tools.bench_plan", *(argv if argv is not None else sys.argv[1:])]).strip()
    result["process"] = "its own: the schedule handler's modules imported, the snapshot, nothing else held"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
