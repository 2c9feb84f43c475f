"""`preemptor sim`: replay a trace through a policy and print its metrics.

    preemptor sim --trace CSV --gpus N --policy NAME|FILE [--json] [model options]

NAME is one of preemptor (ours, default Policy), fifo, priority, blunt, kueue, slurm, oracle;
FILE is a Policy JSON (ours with those knobs). The model options and their defaults are
in docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import argtypes
from .engine import DEFAULT_PENDING_WINDOW, SimConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SimConfig(gpus=1)
    parser.add_argument("--trace", type=Path, required=True, help="CSV: job_id,submit_s,duration_s,gpus,team,priority")
    parser.add_argument("--gpus", type=argtypes.positive_int, required=True, help="GPUs in the pool")
    parser.add_argument("--policy", default="preemptor", help="preemptor|fifo|priority|blunt|kueue|slurm|oracle, or a Policy JSON file (ours)")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")
    parser.add_argument("--start-s", type=argtypes.any_time, help="keep jobs submitted at or after this time")
    parser.add_argument("--end-s", type=argtypes.any_time, help="keep jobs submitted before this time")
    parser.add_argument("--pool", default=defaults.pool, help="pool name (selects a Policy's per-pool overrides)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the per-job checkpoint intervals")
    parser.add_argument(
        "--checkpoint-interval",
        type=argtypes.interval,
        default=defaults.checkpoint_interval_s,
        metavar="MIN:MAX",
        help=f"seconds between a job's checkpoints: uniform MIN:MAX, or one value (default {defaults.checkpoint_interval_s[0]:g}:{defaults.checkpoint_interval_s[1]:g})",
    )
    parser.add_argument("--stop-grace-s", type=argtypes.seconds, default=defaults.stop_grace_s)
    parser.add_argument("--checkpoint-write-s", type=argtypes.seconds, default=defaults.checkpoint_write_s)
    parser.add_argument("--restart-overhead-s", type=argtypes.seconds, default=defaults.restart_overhead_s)
    parser.add_argument("--relaunch-delay-s", type=argtypes.seconds, default=defaults.relaunch_delay_s)
    parser.add_argument("--cooperative-fraction", type=argtypes.fraction, default=defaults.cooperative_fraction, help="share of jobs that checkpoint on request")
    parser.add_argument("--pending-window", type=argtypes.positive_int, default=DEFAULT_PENDING_WINDOW, help="pending jobs the planner sees")
    parser.add_argument("--declare-durations", action="store_true", help="jobs declare their true duration to the planner")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


def load_policy(spec: str, pool: str):
    """A policy by name, or ours with the knobs of a Policy JSON file."""
    from preemptor.core.policy import Policy
    from .. import ops
    from .baselines import POLICY_NAMES, VARIANTS, policy_by_name, preemptor_policy

    if spec == "preemptor":
        return preemptor_policy(pool=pool)
    if spec in POLICY_NAMES or spec in VARIANTS:
        return policy_by_name(spec)
    path = Path(spec)
    if not path.is_file():
        raise ops.BadInput(f"--policy: {spec!r} is neither a policy ({', '.join(POLICY_NAMES)}) nor a file")
    from ..inputs import load

    return preemptor_policy(load(path, "policy", lambda d: Policy(**d)), pool=pool)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        gpus=args.gpus,
        pool=args.pool,
        checkpoint_interval_s=args.checkpoint_interval,
        seed=args.seed,
        stop_grace_s=args.stop_grace_s,
        checkpoint_write_s=args.checkpoint_write_s,
        restart_overhead_s=args.restart_overhead_s,
        relaunch_delay_s=args.relaunch_delay_s,
        cooperative_fraction=args.cooperative_fraction,
        pending_window=args.pending_window,
        declare_durations=args.declare_durations,
    )


def run(args: argparse.Namespace) -> int:
    from .engine import simulate
    from .metrics import summarize
    from .report import print_summary, progress_bar

    config = config_from_args(args)  # every value is checked by its option's type (`argtypes`)
    policy = load_policy(args.policy, config.pool)
    trace = _trace(args)
    show = not args.no_progress and sys.stderr.isatty()
    with progress_bar(len(trace), f"{policy.name} on {args.trace.name}", enabled=show) as bar:
        result = simulate(trace, policy, config, progress=bar)
    summary = summarize(result)
    summary["trace"] = str(args.trace)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary, sys.stdout)
    return 0


def _trace(args):
    from ..inputs import InputFileError
    from .trace import TraceError, load_trace

    try:
        return load_trace(args.trace, start_s=args.start_s, end_s=args.end_s)
    except TraceError as e:
        raise InputFileError(args.trace, f"trace: {str(e).removeprefix(f'{args.trace}:').strip()}") from None
    except OSError as e:
        raise InputFileError(args.trace, f"cannot read the trace: {e.strerror or e}") from None
