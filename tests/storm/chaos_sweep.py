"""Seed sweep of the preemption story under every chaos rate at once: not a test (too long
for `make test`), a probe for the next invariant that breaks. Each seed replays exactly.

    PYTHONPATH=functions/controller:functions/tools:functions/training:tests \\
        .venv/bin/python tests/storm/chaos_sweep.py sagemaker 300 340 [--random]

prints one line per seed (job states, events dead-lettered, index queries answered lagging,
answers lost, violated invariants) and the count of seeds with a violation. `--random`
replays each seed's random story (storm/random_story.py: eight jobs of every tier, teams
lowering and cancelling, runs stopped by hand, stops denied) instead of the two-job one;
`--knobs` too, under the seed's random policy, team launches and capacity outages.
`--calm` replays the random story without chaos: the faults the sweep injects retry, delay
and reorder the controller's work, and so hide what it would do with none (knobs seed
sagemaker 1: two jobs preempting each other in turn, found calm). `--drains` adds, now and
then, an operator's drain of the pool for a while (`drained_pools_start_nothing`). `--jobs 24`
tells stories of that many jobs (eight by default). `--only 9 13` replays those seeds of the
range alone.

    ... chaos_sweep.py examples 0 5 [--names batch-queue-fallback ...]

replays each example scenario (examples/scenarios/, or those `--names`) under every chaos
rate at once with each seed: the examples reach corners the random stories rarely do (seed 2
of batch-queue-fallback: a run the controller terminated for want of capacity failed its job
for good when the capacity wait's write was refused). `--rates answer_lost_rate=0.5 ...`
replaces the chaos rates with those given (one extreme fault at a time, say).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from storm.invariants import violations
from storm.random_story import random_story
from storm.test_storm_scenarios import story

from preemptor_tools.local import demo
from preemptor_tools.local.scenario import Chaos, Scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
CHAOS = {"throttle_rate": 0.3, "crash_rate": 0.15, "duplicate_rate": 0.3, "reorder_rate": 0.3, "transaction_conflict_rate": 0.3, "index_lag_rate": 0.3,
         "answer_lost_rate": 0.2}


def _rate(text: str) -> tuple[str, float]:
    """NAME=RATE, NAME a rate of the scenario's `chaos:` (Chaos), RATE in [0, 1)."""
    name, _, value = text.partition("=")
    if name not in Chaos.model_fields or not name.endswith("_rate"):
        raise argparse.ArgumentTypeError(f"{name!r} is no chaos rate ({', '.join(f for f in Chaos.model_fields if f.endswith('_rate'))})")
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the rate must be a number") from None
    if not 0 <= rate < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the rate must be in [0, 1)")
    return name, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("service", choices=("sagemaker", "batch", "examples"), help="the story's service, or the example scenarios")
    parser.add_argument("first", type=int, help="first seed")
    parser.add_argument("end", type=int, help="seed after the last")
    parser.add_argument("--random", action="store_true", help="each seed's random story (storm/random_story.py)")
    parser.add_argument("--knobs", action="store_true", help="with --random: under the seed's random policy and faults")
    parser.add_argument("--calm", action="store_true", help="with --random: without the chaos rates")
    parser.add_argument("--drains", action="store_true", help="with --random: now and then the operator drains the pool a while")
    parser.add_argument("--jobs", type=int, default=8, help="with --random: the story's number of jobs (more contend for the pool)")
    parser.add_argument("--only", type=int, nargs="+", metavar="SEED", help="these seeds of the range only (those a violation named)")
    parser.add_argument("--names", nargs="+", metavar="EXAMPLE", help="with examples: these example scenarios only")
    parser.add_argument("--rates", nargs="+", metavar="NAME=RATE", type=_rate, help="these chaos rates instead of the sweep's (Chaos fields)")
    args = parser.parse_args()
    rates = dict(args.rates) if args.rates else CHAOS
    if args.calm and not args.random:
        parser.error("--calm replays the random stories: give --random")
    if args.jobs != 8 and not args.random:
        parser.error("--jobs sizes the random stories: give --random")
    if args.service == "examples" and (args.random or args.knobs or args.calm or args.drains):
        parser.error("examples replays the example scenarios as they are, under the chaos rates")
    chaos = None if args.calm else rates
    bad = runs = 0
    seeds = [s for s in range(args.first, args.end) if args.only is None or s in args.only]
    names = args.names or sorted(p.stem for p in SCENARIOS.glob("*.yaml"))
    for seed in seeds:
        for name in names if args.service == "examples" else [args.service]:
            if args.service == "examples":
                scenario = Scenario.load(SCENARIOS / f"{name}.yaml")
                scenario.chaos = Chaos(seed=seed, **rates)
            elif args.random:
                scenario = random_story(args.service, seed, chaos, jobs=args.jobs, knobs=args.knobs, drains=args.drains)
            else:
                scenario = story(args.service, chaos={"seed": seed, **rates})
            started = time.monotonic()
            result = demo.run(scenario, tick_s=60)
            found = violations(result, scenario)
            states = {j["name"]: j["state"] for j in result.report["jobs"]}
            dead = result.report.get("chaos", {}).get("dead_letters")
            injected = result.report.get("chaos", {}).get("injected", {})
            lagged, lost = injected.get("index-lag", 0), injected.get("answer-lost", 0)
            print(f"{name} seed {seed} {time.monotonic() - started:.1f}s {states} dead-lettered {dead} index-lagged {lagged} "
                  f"answers-lost {lost} {found}", flush=True)
            bad += bool(found)
            runs += 1
    print(f"{bad} of {runs} runs violated an invariant")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
