"""`make bench`: every policy on the Philly trace, with tables, ratios and plots.

    python -m preemptor_tools.bench [--scenario week|full|all] [--policies a,b,...] [--workers N]
                                    [--full-policies a,b,...] [--no-models] [--no-plan-speed]

Scenarios (both on a 400-GPU pool, the model's defaults, seed 0):
- `week`: the jobs submitted in days 42-49 of the trace (the week with the most
  submissions, 14,724 jobs, ~630 GPUs of average demand), replayed until they all end;
- `full`: all 82,247 jobs.

The headline run of every policy is at cooperative fraction 0.7 (70 % of the jobs run the
training helper: they save on SIGTERM within the grace and answer checkpoint requests) and
SageMaker's 120 s grace. Ours and Kueue are also replayed at cooperative fractions 1.0 and
0, and at Batch's 30 s grace (`MODELS`): fifo, priority and oracle never stop a job the
way the model varies, so their headline run stands for every fraction. On the whole trace
only `--full-policies` (default ours, kueue and fifo) are replayed, for time. In the same
run, `plan()` is timed on the 10k-pending snapshot of `bench_plan` (p50 and p99).

Writes into bench/results/: `<scenario>-<policy>.json` (the `preemptor sim --json` metrics
of one run, with the equivalent command, the machine and the date), `<scenario>.json`
(all policies of the scenario and ours ÷ each baseline, from the same run),
`<scenario>-wait.png`, `<scenario>-lost.png`, `<scenario>-utilization.png`, and README.md
(the tables of every scenario present, the commands and the machine).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .sim.baselines import POLICY_NAMES, VARIANTS, policy_by_name
from .sim.engine import SimConfig, simulate
from .sim.metrics import step_averages, summarize
from .sim.report import (
    HEADLINE,
    OURS,
    metrics_table,
    not_ahead,
    plot_lost_gpu_hours,
    plot_utilization,
    plot_wait_distribution,
    ratio_table,
    ratios,
    wait_table,
)
from .sim.trace import DAY_S, load_trace

from .paths import REPO_ROOT as ROOT
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "philly" / "philly-jobs.csv"
TRACE_IN_COMMANDS = "../shared/data/traces/philly/philly-jobs.csv"
POOL_GPUS = 400


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    gpus: int
    start_s: float | None
    end_s: float | None
    bucket_s: float  # utilisation plot resolution

    def sim_args(self) -> list[str]:
        args = ["--gpus", str(self.gpus)]
        if self.start_s is not None:
            args += ["--start-s", f"{self.start_s:.0f}"]
        if self.end_s is not None:
            args += ["--end-s", f"{self.end_s:.0f}"]
        return args

    def command(self, policy: str, model: "Model | None" = None) -> str:
        model = model or HEADLINE_MODEL
        return " ".join(["preemptor sim --trace", TRACE_IN_COMMANDS, *self.sim_args(), *model.sim_args(), "--policy", policy, "--json"])


@dataclass(frozen=True)
class Model:
    """The cooperative fraction and the stop grace of a replay (the rest: SimConfig defaults)."""

    cooperative: float
    grace_s: float

    def sim_args(self) -> list[str]:
        return ["--cooperative-fraction", f"{self.cooperative:g}", "--stop-grace-s", f"{self.grace_s:g}"]

    @property
    def suffix(self) -> str:
        """Run key suffix: '' for the headline model."""
        return "" if self == HEADLINE_MODEL else f"@c{self.cooperative:g}-g{self.grace_s:g}"

    @property
    def label(self) -> str:
        return f"cooperative {self.cooperative:g}, grace {self.grace_s:g} s"


HEADLINE_MODEL = Model(0.7, 120.0)
# The other models ours and Kueue are replayed under: cooperative fractions side by side,
# and the grace sensitivity (SageMaker 120 s, Batch 30 s: shorter than the 60 s write).
FRACTIONS = (Model(1.0, 120.0), HEADLINE_MODEL, Model(0.0, 120.0))
GRACES = (HEADLINE_MODEL, Model(0.7, 30.0))
MODELS = tuple(dict.fromkeys(FRACTIONS + GRACES))
MODEL_POLICIES = ("preemptor", "kueue")  # the others do not depend on the model, or are shown once
FULL_POLICIES = ("preemptor", "kueue", "fifo")
# Variants of ours replayed on the week by default (shown, never compared): the top tiers
# alone preempting bounds what any policy keeping their waits must lose to restarts.
DIAGNOSTICS = ("preemptor-top-tiers",)


SCENARIOS = {
    "week": Scenario("week", "Philly, busiest week (days 42-49), 400 GPUs", POOL_GPUS, 42 * DAY_S, 49 * DAY_S, 3600.0),
    "full": Scenario("full", "Philly, whole trace (82,247 jobs), 400 GPUs", POOL_GPUS, None, None, 6 * 3600.0),
}


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        memory = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, IndexError, ValueError):
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory": memory,
        "python": platform.python_version(),
    }


def _run_one(trace_path: str, scenario: Scenario, policy: str, model: Model = HEADLINE_MODEL) -> dict:
    """One replay (in a worker process): the summary plus what the plots need."""
    trace = load_trace(trace_path, start_s=scenario.start_s, end_s=scenario.end_s)
    started = time.perf_counter()
    config = SimConfig(gpus=scenario.gpus, cooperative_fraction=model.cooperative, stop_grace_s=model.grace_s)
    result = simulate(trace, policy_by_name(policy), config)
    summary = summarize(result)
    summary["simulator"]["total_seconds"] = round(time.perf_counter() - started, 2)
    waits: dict[str, list[float]] = {}
    for job in result.jobs:
        waits.setdefault(str(job.priority), []).append(job.wait_s)
    span = summary["span_s"]
    series = step_averages(result.busy, span["first_submit"], span["last_submit"], scenario.bucket_s)
    return {"scenario": scenario.name, "policy": policy, "model": model, "summary": summary, "waits": waits, "series": series}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preemptor_tools.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument(
        "--policies",
        default=",".join([*POLICY_NAMES, *DIAGNOSTICS]),
        help="comma-separated (default: ours, every baseline and the diagnostic variants of ours)",
    )
    parser.add_argument("--full-policies", default=",".join(FULL_POLICIES), help="the policies replayed on the whole trace")
    parser.add_argument("--no-models", action="store_true", help="only the headline model (cooperative 0.7, grace 120 s)")
    parser.add_argument("--no-plan-speed", action="store_true", help="do not time plan() on the bench_plan snapshot")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--replot", action="store_true", help="redraw plots and tables from the last runs' cached data")
    parser.add_argument("--resume", action="store_true", help="keep the runs an interrupted bench finished; replay only the others")
    parser.add_argument(
        "--previous",
        type=Path,
        help="directory of an earlier run's <scenario>.json to compare with (default: the results being replaced; "
        "with --replot, the comparison already recorded)",
    )
    args = parser.parse_args(argv)

    scenarios = list(SCENARIOS.values()) if args.scenario == "all" else [SCENARIOS[args.scenario]]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES and p not in VARIANTS]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join([*POLICY_NAMES, *VARIANTS])}")
    if OURS not in policies:
        parser.error("the bench compares ours with the baselines: include preemptor")
    if not args.trace.is_file():
        parser.error(f"trace not found: {args.trace}")
    args.out.mkdir(parents=True, exist_ok=True)
    # The figures this run replaces, read before anything is written over them.
    previous_dir = args.previous or (None if args.replot else args.out)
    previous = {s.name: _read_json(previous_dir / f"{s.name}.json") for s in scenarios} if previous_dir else {}

    given = sys.argv[1:] if argv is None else argv
    bench_command = "make bench" + (f" ARGS='{' '.join(given)}'" if given else "")
    context = {"machine": machine(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "bench_command": bench_command}
    _log(f"bench: {len(scenarios)} scenario(s) x {len(policies)} policies on {args.workers} worker(s); {context['machine']}")

    full_policies = [p.strip() for p in args.full_policies.split(",") if p.strip()]
    models = [HEADLINE_MODEL] if args.no_models else list(MODELS)

    def wanted(scenario: Scenario) -> list[str]:
        return [p for p in policies if scenario.name != "full" or p in full_policies or p == OURS]

    # Longest first: the full trace, ours (the real core planner) before the small baselines.
    tasks = [
        (s, p, m)
        for s in sorted(scenarios, key=lambda s: s.name != "full")
        for m in models
        for p in sorted(wanted(s), key=lambda p: not p.startswith(OURS))
        if m == HEADLINE_MODEL or (p in MODEL_POLICIES and (s.name != "full" or m in FRACTIONS))
    ]
    runs: dict[str, dict[str, dict]] = {s.name: {} for s in scenarios}
    started = time.perf_counter()
    if args.replot:
        for scenario, policy, model in tasks:
            key = policy + model.suffix
            cached = json.loads((args.out / f"{scenario.name}-{_file_key(key)}.json").read_text())
            context = {k: cached[k] for k in ("machine", "date", "bench_command")}
            runs[scenario.name][key] = pickle.loads(_cache(scenario.name, key).read_bytes())
    else:
        if args.resume:
            for scenario, policy, model in list(tasks):
                key = policy + model.suffix
                cache, done = _cache(scenario.name, key), args.out / f"{scenario.name}-{_file_key(key)}.json"
                if cache.is_file() and done.is_file():
                    runs[scenario.name][key] = pickle.loads(cache.read_bytes())
                    tasks.remove((scenario, policy, model))
                    _log(f"  {scenario.name}/{key}: kept from {json.loads(done.read_text())['date']}")
        _simulate_all(args, tasks, runs, context)
    speed, failed = None, ""
    if args.replot:
        speed = _read_json(args.out / "plan_speed.json")  # the one measured with the runs
    elif not args.no_plan_speed:
        # In the same run as the replays: the plan() speed of the controller's hot loop, in
        # a process of its own, as the schedule function's (`bench_plan`: not in this one,
        # which holds every replay's results).
        target = args.out / "plan_speed.json"
        timed = subprocess.run([sys.executable, "-m", "preemptor_tools.bench_plan", "--out", str(target)], check=False)
        if timed.returncode == 0:
            speed = json.loads(target.read_text())
            speed["command"] = "python -m preemptor_tools.bench_plan (run by make bench)"
            target.write_text(json.dumps(speed, indent=2) + "\n")
        else:
            failed = f"timing plan() failed: `python -m preemptor_tools.bench_plan` exited {timed.returncode} (its error above)"
            _log(f"bench: {failed}; the tables are written without plan() figures")
    for scenario in scenarios:
        headline = [p for p in wanted(scenario) if p in runs[scenario.name]]
        since = None
        if previous.get(scenario.name):
            since = moved_since(previous[scenario.name], {p: runs[scenario.name][p]["summary"] for p in headline})
        elif args.replot:  # keep the comparison the run recorded
            since = (_read_json(args.out / f"{scenario.name}.json") or {}).get("since_previous")
        models_record = _models_record(scenario, runs[scenario.name], models)
        _write_scenario(args.out, scenario, {p: runs[scenario.name][p] for p in headline}, context, since, models_record, speed)
    _write_readme(args.out, context)
    _log(f"bench: done in {time.perf_counter() - started:.0f} s; results in {args.out}")
    if failed:
        _log(f"bench: {failed}")
        return 1
    return 0


def _file_key(key: str) -> str:
    return key.replace("@", "-")


def _cache(scenario: str, key: str) -> Path:
    """Plot data of a run, kept outside the results so `--replot` can redraw without replaying."""
    return Path(tempfile.gettempdir()) / f"preemptor-bench-{scenario}-{_file_key(key)}.pickle"


def _simulate_all(args, tasks: list, runs: dict, context: dict) -> None:
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = {pool.submit(_run_one, str(args.trace), s, p, m): (s, p, m) for s, p, m in tasks}
        for future in as_completed(futures):
            scenario, policy, model = futures[future]
            run = future.result()
            key = policy + model.suffix
            runs[scenario.name][key] = run
            sim = run["summary"]["simulator"]
            _log(f"  {scenario.name}/{key}: {sim['total_seconds']:.0f} s ({sim['plans']} plans, {sim['plan_seconds']:.0f} s planning)")
            _write_run(args.out, scenario, key, run["summary"], context, model)
            _cache(scenario.name, key).write_bytes(pickle.dumps(run))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _write_run(out: Path, scenario: Scenario, key: str, summary: dict, context: dict, model: Model = HEADLINE_MODEL) -> None:
    policy = key.split("@")[0]
    record = {"scenario": scenario.name, "command": scenario.command(policy, model), **context, **summary}
    (out / f"{scenario.name}-{_file_key(key)}.json").write_text(json.dumps(record, indent=2) + "\n")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


MOVE_THRESHOLD = 0.05  # a headline figure that moved by more than this since the previous run is listed


def moved_since(previous: dict, summaries: dict[str, dict], threshold: float = MOVE_THRESHOLD) -> dict:
    """The headline figures of `summaries` that moved by more than `threshold` (relative)
    from the same policy's in `previous` (an earlier `<scenario>.json`)."""
    moved = []
    for policy, summary in summaries.items():
        before_summary = previous.get("policies", {}).get(policy)
        if before_summary is None:
            continue
        for label, get, _ in HEADLINE:
            before, after = float(get(before_summary)), float(get(summary))
            if before == after:
                continue
            change = math.inf if before == 0 else (after - before) / abs(before)
            if abs(change) > threshold:
                moved.append({"policy": policy, "metric": label, "before": before, "after": after, "change": None if math.isinf(change) else round(change, 4)})
    return {"previous_date": previous.get("date"), "threshold": threshold, "moved": moved}


def _write_scenario(
    out: Path, scenario: Scenario, runs: dict[str, dict], context: dict, since: dict | None = None,
    models: dict | None = None, speed: dict | None = None,
) -> None:
    summaries = {p: r["summary"] for p, r in runs.items()}
    footer = f"{context['bench_command']} (scenario {scenario.name}; = {scenario.command('<policy>')}) | {_machine_line(context)} | {context['date']}"
    plot_wait_distribution(
        {p: r["waits"] for p, r in runs.items()}, out / f"{scenario.name}-wait.png", title=f"Wait per priority: {scenario.title}", footer=footer
    )
    plot_lost_gpu_hours(summaries, out / f"{scenario.name}-lost.png", title=f"GPU-hours lost: {scenario.title}", footer=footer)
    plot_utilization(
        {p: r["series"] for p, r in runs.items()},
        scenario.gpus,
        out / f"{scenario.name}-utilization.png",
        title=f"GPUs held over time ({scenario.bucket_s / 3600:g} h means): {scenario.title}",
        footer=footer,
    )
    record = {
        "scenario": scenario.name,
        "title": scenario.title,
        "commands": {p: scenario.command(p) for p in summaries},
        **context,
        "policies": summaries,
        "ratios_ours_over_baseline": ratios(_compared(summaries)),
        "not_ahead": [{"baseline": b, "metric": m, "ours": a, "theirs": t} for b, m, a, t in not_ahead(_compared(summaries))],
    }
    if since is not None:
        record["since_previous"] = since
    if models:
        record["models"] = models
        record["goals"] = goals(models, summaries, speed)
    if speed:
        record["plan_speed"] = {k: speed[k] for k in ("median_s", "p99_s", "pending", "running", "pools", "runs", "window", "window_p99_s") if k in speed}
    (out / f"{scenario.name}.json").write_text(json.dumps(record, indent=2) + "\n")


def _models_record(scenario: Scenario, runs: dict[str, dict], models: list[Model]) -> dict:
    """The headline metrics of ours and Kueue under every model replayed (and FIFO's
    utilisation, the same under every model: it never stops a job)."""
    out = {}
    for model in models:
        policies = {}
        for policy in (*MODEL_POLICIES, "fifo"):
            run = runs.get(policy + model.suffix) or (runs.get(policy) if policy == "fifo" else None)
            if run is None:
                continue
            summary = run["summary"]
            policies[policy] = {label: get(summary) for label, get, _ in HEADLINE}
            policies[policy]["lost GPU-hours breakdown"] = summary["lost_gpu_hours_breakdown"]
            policies[policy]["checkpoints asked ahead"] = summary["simulator"].get("checkpoint_requests_ahead", 0)
            policies[policy]["ahead checkpoint write GPU-hours"] = summary["simulator"].get("ahead_checkpoint_write_gpu_hours", 0.0)
            policies[policy]["replay seconds"] = summary["simulator"]["total_seconds"]
            policies[policy]["command"] = scenario.command(policy, model)
        out[model.label] = {"cooperative_fraction": model.cooperative, "stop_grace_s": model.grace_s, "policies": policies}
    return out


# The goals of issue 10: (model, metric, bound on ours / theirs, the baseline), checked per scenario.
GOALS = [
    (HEADLINE_MODEL, "critical wait p95 (s)", 1.1, "kueue"),
    (HEADLINE_MODEL, "high wait p95 (s)", 1.1, "kueue"),
    (HEADLINE_MODEL, "lost GPU-hours", 0.25, "kueue"),
    (HEADLINE_MODEL, "all jobs wait mean (s)", 1.0, "kueue"),
    (HEADLINE_MODEL, "low wait p95 (s)", 1.0, "kueue"),
    (HEADLINE_MODEL, "utilisation", 0.99, "fifo"),  # at least
    (Model(0.0, 120.0), "critical wait p95 (s)", 1.1, "kueue"),
    (Model(0.0, 120.0), "lost GPU-hours", 1.0, "kueue"),
]
PLAN_P99_GOAL_S = 0.050
REPLAY_RATIO_GOAL = 10.0


def _fastest(speed: dict) -> str:
    """The fastest plan of the scenario behind the p99, when it is far below it: what the
    code costs, where the p99 above it is the machine's (a busy neighbour of the VM slows
    plans in streaks of several runs)."""
    scenarios = speed.get("scenarios") or {}
    slow = [s for s in ("every-knob", "defaults") if s in scenarios and scenarios[s].get("p99_s") == speed["p99_s"]]
    if not slow or "min_s" not in scenarios[slow[0]]:
        return ""
    fastest = scenarios[slow[0]]["min_s"]
    if speed["p99_s"] < 1.2 * fastest:
        return ""
    return (
        f", fastest {fastest * 1000:.0f} ms ({slow[0]}; a spread this wide between runs of the same plan is the"
        " machine's: its neighbours slow plans in streaks of several runs)"
    )


def goals(models: dict, headline: dict[str, dict], speed: dict | None) -> list[dict]:
    """Each goal of issue 10: the target, what this run measured, whether it is met and, when
    it is not, why (from the run's own figures)."""
    out = []
    for model, metric, bound, baseline in GOALS:
        entry = models.get(model.label, {}).get("policies", {})
        ours, theirs = entry.get(OURS), entry.get(baseline)
        if ours is None or theirs is None:
            continue
        mine, other = float(ours[metric]), float(theirs[metric])
        ratio = (1.0 if mine == 0 else math.inf) if other == 0 else mine / other
        at_least = metric == "utilisation"
        met = ratio >= bound if at_least else ratio <= bound
        out.append(
            {
                "model": model.label,
                "goal": f"{metric}: ours {'>=' if at_least else '<='} {bound:g} x {baseline}'s",
                "ours": mine,
                "theirs": other,
                "ratio": None if math.isinf(ratio) else round(ratio, 3),
                "met": met,
                "why": "" if met else _why_goal(metric, ours, theirs, model, headline.get("preemptor-top-tiers")),
            }
        )
    if speed:
        p99 = speed["p99_s"]
        out.append(
            {
                "model": "bench_plan snapshot",
                "goal": f"plan() p99 <= {PLAN_P99_GOAL_S * 1000:g} ms at {speed['pending']:,} pending / {speed['running']:,} running over {speed['pools']} pools",
                "ours": round(p99 * 1000, 1),
                "theirs": PLAN_P99_GOAL_S * 1000,
                "ratio": round(p99 / PLAN_P99_GOAL_S, 3),
                "met": p99 <= PLAN_P99_GOAL_S,
                "why": ""
                if p99 <= PLAN_P99_GOAL_S
                else (
                    f"median {speed['median_s'] * 1000:.0f} ms{_fastest(speed)}: no one hot spot is left (docs/policy.md,"
                    " \"Planner cost\"): every pending job of the 10k still costs a Python object and an explanation line,"
                    " and 800-1,600 of them preempt in this worst-case snapshot, each with a victim walk, a commit and a"
                    " preemption record with its text (40-60% of the time), the ranking about a fifth"
                    + (
                        f". The controller never plans the whole queue: its schedule step reads each pool's first"
                        f" {speed['window']} pending jobs of the index, and on those of this queue plan() takes"
                        f" p99 {speed['window_p99_s'] * 1000:.0f} ms"
                        if speed.get("window_p99_s") is not None
                        else ""
                    )
                ),
            }
        )
    head = models.get(HEADLINE_MODEL.label, {}).get("policies", {})
    if OURS in head and "kueue" in head:
        ratio = head[OURS]["replay seconds"] / max(1e-9, head["kueue"]["replay seconds"])
        out.append(
            {
                "model": HEADLINE_MODEL.label,
                "goal": f"replay time: ours <= {REPLAY_RATIO_GOAL:g} x kueue's",
                "ours": head[OURS]["replay seconds"],
                "theirs": head["kueue"]["replay seconds"],
                "ratio": round(ratio, 3),
                "met": ratio <= REPLAY_RATIO_GOAL,
                "why": "",
            }
        )
    return out


def _why_goal(metric: str, ours: dict, theirs: dict, model: Model, top_tiers: dict | None = None) -> str:
    """Why a goal is missed, in the run's own figures (`top_tiers`: the summary of the
    `preemptor-top-tiers` variant in the same run, when it was replayed)."""
    if metric == "lost GPU-hours" and model.cooperative == 0:
        mine, other = ours["lost GPU-hours breakdown"], theirs["lost GPU-hours breakdown"]
        return (
            f"with no job saving on SIGTERM or answering a request, ours stops at once unless a wait pays and then waits"
            f" for the periodic checkpoint: work since a checkpoint ours {mine['work_since_checkpoint']:,.0f}, Kueue"
            f" {other['work_since_checkpoint']:,.0f} GPU-h; {ours['preemptions']:,} preemptions against {theirs['preemptions']:,}"
        )
    if metric == "lost GPU-hours":
        mine, other = ours["lost GPU-hours breakdown"], theirs["lost GPU-hours breakdown"]
        return (
            f"restart overhead alone is {mine['restart_overhead']:,.0f} GPU-h of ours' {ours[metric]:,.0f} "
            f"({ours['preemptions']:,} preemptions; Kueue {other['restart_overhead']:,.0f} of {theirs[metric]:,.0f}, "
            f"{theirs['preemptions']:,} preemptions): every relaunch re-provisions and reloads (300 s x its GPUs) whoever "
            f"stopped it, and the {model.cooperative:.0%} of jobs that save on SIGTERM lose nothing more under Kueue's stop "
            f"either (work since a checkpoint: ours {mine['work_since_checkpoint']:,.0f}, Kueue {other['work_since_checkpoint']:,.0f} "
            "GPU-h). A quarter of Kueue's loss needs about a third of its preemptions: the higher tiers' waits need them "
            "(a per-tier preemption delay cuts them, `tier_preemption_delay_s`, at the price of the mean wait; docs/policy.md)."
            + _ahead_writes(ours)
            + (_top_tiers_floor(top_tiers, theirs) if top_tiers and model == HEADLINE_MODEL else "")
        )
    if metric == "low wait p95 (s)":
        return (
            f"ours stops {ours['preemptions']:,} jobs against Kueue's {theirs['preemptions']:,}: its victim order (least"
            " work lost, and 600 s more per earlier preemption of a job) spreads the stops over more low jobs, each"
            " of which waits again, where Kueue stops the most recently admitted first, often the same jobs again; the"
            f" mean wait is ours' better ({ours['all jobs wait mean (s)']:,.0f} s against {theirs['all jobs wait mean (s)']:,.0f} s)"
        )
    if "wait" in metric:
        return (
            "the queue dynamics of this run (fair share among equal priority, the 5-minute reconcile, victims "
            "stopped for other jobs whose GPUs a job waits for); see the tables and docs/simulator.md"
        )
    return "see the tables"


def _ahead_writes(ours: dict) -> str:
    """What the checkpoints ours asks ahead would add to its loss if each write paused
    training (the model writes them while the job trains: docs/simulator.md)."""
    asked = ours.get("checkpoints asked ahead", 0)
    if not asked:
        return ""
    return (
        f" Not counted above: the {asked:,} checkpoints ours asks ahead take"
        f" {ours.get('ahead checkpoint write GPU-hours', 0.0):,.0f} GPU-h to write, lost too where a write pauses training."
    )


def _top_tiers_floor(variant: dict, kueue: dict) -> str:
    """The restart floor, from the `preemptor-top-tiers` replay of the same run."""
    restarts = variant["lost_gpu_hours_breakdown"]["restart_overhead"]
    goal = 0.25 * float(kueue["lost GPU-hours"])
    high = variant["by_priority"].get("500", {}).get("wait_p95_s", 0.0)
    return (
        f" Even with only critical and high jobs preempting (`preemptor-top-tiers`, same run: medium and low wait for"
        f" GPUs to free by themselves, the high p95 wait rises to {high:,.0f} s and the mean wait to"
        f" {variant['overall']['wait_mean_s']:,.0f} s), {variant['preemptions']:,} preemptions remain and ours loses"
        f" {variant['lost_gpu_hours']:,.0f} GPU-h, {restarts:,.0f} of them to restarts alone, against the goal's"
        f" {goal:,.0f}: under this model (300 s of restart per relaunch, counted as lost) no policy that serves the"
        " higher tiers as fast as Kueue meets it."
    )


def _compared(summaries: dict[str, dict]) -> dict[str, dict]:
    """Ours and the baselines: the variants of ours are shown, not compared."""
    return {p: s for p, s in summaries.items() if p in POLICY_NAMES}


def _machine_line(context: dict) -> str:
    m = context["machine"]
    return f"{m['cpu']} x{m['cpu_count']}, {m['memory']}, Python {m['python']}, {m['platform']}"


def _write_readme(out: Path, context: dict) -> None:
    """README.md from every `<scenario>.json` in `out` (a partial bench keeps the others)."""
    parts = [
        "# Bench results",
        "",
        "Generated by `make bench` (`python -m preemptor_tools.bench`, functions/tools/preemptor_tools/bench.py); do not edit by hand.",
        "The model, its defaults and the baselines are described in docs/simulator.md. Each run",
        "is one `preemptor sim` replay; its exact command is given with its table and in its JSON.",
        "Ratios are ours ÷ baseline from the same bench run; **bold** where ours is ahead.",
        "",
    ]
    for name in SCENARIOS:
        path = out / f"{name}.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        summaries = record["policies"]
        m = record["machine"]
        parts += [
            f"## {record['title']}",
            "",
            f"- bench command: `{record['bench_command']}`; date: {record['date']}",
            f"- machine: {m['cpu']}, {m['cpu_count']} CPUs, {m['memory']}, Python {m['python']}, {m['platform']}",
            "- each column is the replay `" + record["commands"][OURS].replace("--policy preemptor", "--policy <column>") + "`",
            "- replay time: "
            + ", ".join(f"`{p}` {s['simulator']['total_seconds']:.0f} s" for p, s in summaries.items()),
            "",
            metrics_table(summaries),
            "",
            "### Ours ÷ each baseline (same run)",
            "",
            ratio_table(_compared(summaries)),
            "",
            "### Waits per priority",
            "",
            wait_table(summaries),
            "",
            f"![wait distribution]({name}-wait.png)",
            f"![lost GPU-hours]({name}-lost.png)",
            f"![utilisation]({name}-utilization.png)",
            "",
            "### Where ours is not ahead",
            "",
        ]
        for baseline, metric, ours, theirs in not_ahead(_compared(summaries)):
            parts.append(f"- vs `{baseline}`, {metric}: ours {ours:,.3f}, theirs {theirs:,.3f}.{_why(baseline, metric, summaries)}")
        parts.append("")
        parts += _models_section(record)
        parts += _moved_section(record.get("since_previous"))
    why = out / WHY_MOVED
    if why.is_file():
        parts += ["## Why figures moved since the previous run", "", f"(hand-written: `{WHY_MOVED}`)", "", why.read_text().strip(), ""]
    (out / "README.md").write_text("\n".join(parts))


WHY_MOVED = "why-moved.md"  # hand-written reasons for the moves listed, included in README.md

MODEL_METRICS = (
    "critical wait p95 (s)", "high wait p95 (s)", "low wait p95 (s)", "all jobs wait mean (s)", "lost GPU-hours",
    "preemptions", "utilisation",
)


def _models_table(models: dict, labels: list[str]) -> list[str]:
    """Ours, Kueue and ours ÷ Kueue per metric, one column group per model."""
    head = "| metric | " + " | ".join(f"ours ({l}) | kueue | ÷" for l in labels) + " |"
    lines = [head, "|---|" + "---:|---:|---:|" * len(labels)]
    for metric in MODEL_METRICS:
        cells = []
        for label in labels:
            p = models.get(label, {}).get("policies", {})
            mine, theirs = p.get(OURS, {}).get(metric), p.get("kueue", {}).get(metric)
            ratio = "" if mine is None or not theirs else f"{mine / theirs:.3f}"
            cells += [_num(mine), _num(theirs), ratio]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return lines


def _num(value) -> str:
    if value is None:
        return "–"
    return f"{value:,.3f}" if abs(value) < 10 and value != int(value) else f"{value:,.0f}"


def _models_section(record: dict) -> list[str]:
    models = record.get("models")
    if not models:
        return []
    def replayed(label: str) -> bool:
        return OURS in models.get(label, {}).get("policies", {})

    fractions = [m.label for m in FRACTIONS if replayed(m.label)]
    graces = [m.label for m in GRACES if replayed(m.label)]
    parts = [
        "### Cooperative fractions side by side (ours and Kueue)",
        "",
        "A cooperative job saves on SIGTERM when the grace is at least its 60 s write, and answers checkpoint"
        " requests; the same jobs are cooperative under every policy. FIFO's utilisation, the reference of the"
        " utilisation goal, does not depend on the fraction (it never stops a job).",
        "",
        *_models_table(models, fractions),
        "",
    ]
    if len(graces) > 1:
        parts += [
            "### Grace sensitivity at cooperative fraction 0.7 (SageMaker 120 s, Batch 30 s)",
            "",
            "With a 30 s grace no job can write its 60 s checkpoint on SIGTERM: ours waits for a requested one where it"
            " pays; Kueue's stop loses the work since the last checkpoint.",
            "",
            *_models_table(models, graces),
            "",
        ]
    else:
        parts += ["The grace sensitivity (30 s, AWS Batch) is replayed on the week only, for time.", ""]
    parts += [
        "Commands: " + "; ".join(
            f"`{p['command']}`" for label in models for name, p in models[label]["policies"].items() if name in MODEL_POLICIES and label != HEADLINE_MODEL.label
        ),
        "",
    ]
    speed = record.get("plan_speed")
    if speed:
        parts += [
            f"plan() on the `bench_plan` snapshot ({speed['pending']:,} pending, {speed['running']:,} running, {speed['pools']} pools,"
            f" {speed['runs']} plans, same bench run): median {speed['median_s'] * 1000:.1f} ms, p99 {speed['p99_s'] * 1000:.1f} ms"
            + (
                f"; on the controller's window of it ({speed['window']} pending per pool), p99 {speed['window_p99_s'] * 1000:.1f} ms"
                if speed.get("window_p99_s") is not None
                else ""
            )
            + " (bench/results/plan_speed.json).",
            "",
        ]
    goals_ = record.get("goals") or []
    if goals_:
        parts += ["### Goals of issue 10 (this run)", "", "| model | goal | ours | reference | ratio | met |", "|---|---|---:|---:|---:|---|"]
        for g in goals_:
            parts.append(
                f"| {g['model']} | {g['goal']} | {_num(g['ours'])} | {_num(g['theirs'])} | {'–' if g['ratio'] is None else g['ratio']} |"
                f" {'yes' if g['met'] else '**no**'} |"
            )
        missed = [g for g in goals_ if not g["met"]]
        if missed:
            parts += ["", "Not met, and why:", ""]
            parts += [f"- {g['model']}, {g['goal']}: {g['why'] or 'see the tables'}" for g in missed]
        parts.append("")
    return parts


def _moved_section(since: dict | None) -> list[str]:
    if not since:
        return []
    threshold = f"{since['threshold']:.0%}"
    head = [f"### Moved by more than {threshold} since the previous run ({since.get('previous_date') or 'unknown date'})", ""]
    if not since["moved"]:
        return head + [f"No headline figure of any policy moved by more than {threshold}.", ""]
    lines = ["| policy | metric | before | after | change |", "|---|---|---:|---:|---:|"]
    for m in since["moved"]:
        change = "from 0" if m["change"] is None else f"{m['change']:+.1%}"
        lines.append(f"| `{m['policy']}` | {m['metric']} | {m['before']:,.3f} | {m['after']:,.3f} | {change} |")
    return head + lines + ["", f"Why: see the section at the end, from `{WHY_MOVED}`.", ""]


def _why(baseline: str, metric: str, summaries: dict[str, dict]) -> str:
    """Why ours trails `baseline` on `metric`: structural reasons, and what the run itself shows."""
    if baseline == "oracle":
        return " The oracle stops jobs instantly and for free: a lower bound, not a competitor."
    ours, theirs = summaries.get(OURS, {}), summaries.get(baseline, {})
    reasons = []
    never_preempts = baseline in ("fifo", "priority")
    if never_preempts and metric in ("lost GPU-hours", "preemptions", "restarts per job", "goodput"):
        reasons.append("It never preempts, so it loses nothing; it pays in high-priority waits instead.")
    if baseline == "fifo" and any(k in metric for k in ("low", "medium", "fairness", "longest", "all jobs")):
        reasons.append("FIFO gives no precedence to the higher tiers, so the lower tiers wait less than under any priority policy.")
    if "critical" in metric or "high" in metric:
        reasons.append(
            "Ours asks a victim for a checkpoint and waits (written 60 s after the request, seen at the next 30 s"
            " poll) when the work it would save outweighs the preemptor's wait weighted by priority (rarely for"
            " these tiers), and a job waits for GPUs still being freed by victims stopped for others; the others"
            " stop at once and throw the work of the jobs that do not save on SIGTERM away."
        )
    if metric in ("preemptions", "restarts per job") and not never_preempts and ours.get("preemptions") and theirs.get("preemptions"):
        mine = ours["lost_gpu_hours"] / ours["preemptions"]
        other = theirs["lost_gpu_hours"] / theirs["preemptions"]
        reasons.append(
            f"Ours takes a victim with a fresh checkpoint before a more recently started one, so it stops other"
            f" jobs than `{baseline}` does, which lose less: each of its preemptions lost {mine:.2f} GPU-h against"
            f" {other:.2f} for `{baseline}`."
        )
    if metric == "utilisation" and ours.get("goodput", 0) > theirs.get("goodput", 0):
        reasons.append(
            f"Utilisation counts GPUs held, wasted time included; in GPUs doing work that is kept (goodput) ours"
            f" is ahead: {ours['goodput']:.3f} against {theirs['goodput']:.3f}."
        )
    if metric == "longest wait (s)" and not never_preempts:
        reasons.append(
            "The pending window is read in claimed-priority order (the DynamoDB index), so an old low job behind"
            f" more than the window's {ours.get('model', {}).get('pending_window', 200)} higher-tier pending jobs"
            " is not seen by the planner, and aging cannot lift it."
        )
    if metric == "team fairness (Jain)":
        reasons.append(_fairness_gap(ours, theirs, baseline))
    thrash = _thrash(summaries)
    if thrash and not ("critical" in metric or "high" in metric):
        reasons.append(thrash)
    return (" " + " ".join(reasons)) if reasons else ""


def _fairness_gap(ours: dict, theirs: dict, baseline: str) -> str:
    """What a lower Jain index means in this run: the teams slower under ours than under
    `baseline` (mean bounded slowdown), or, when none is, how uneven the gains are. The
    index measures only how equal the teams' slowdowns are, not how large they are."""
    mine = {t: s["mean_bounded_slowdown"] for t, s in ours.get("fairness", {}).get("by_team", {}).items()}
    other = {t: s["mean_bounded_slowdown"] for t, s in theirs.get("fairness", {}).get("by_team", {}).items()}
    teams = sorted(t for t in mine.keys() & other.keys() if other[t] > 0)
    if not teams:
        return ""
    slower = [t for t in teams if mine[t] > other[t]]
    if slower:
        named = ", ".join(f"{t} ({mine[t]:.2f} vs {other[t]:.2f})" for t in slower)
        return f"{len(slower)} of {len(teams)} teams {'has' if len(slower) == 1 else 'have'} a higher mean bounded slowdown under ours than under `{baseline}`: {named}."
    share = {t: mine[t] / other[t] for t in teams}
    best, least = min(teams, key=share.get), max(teams, key=share.get)
    return (
        f"No team is slower under ours: each of the {len(teams)} teams' mean bounded slowdown is lower than under"
        f" `{baseline}`, from {share[best]:.2f}x ({best}) to {share[least]:.2f}x ({least}, {mine[least]:.2f} vs"
        f" {other[least]:.2f}). The index is lower because the gains are uneven: it measures how equal the"
        " teams' slowdowns are, not how large."
    )


def _thrash(summaries: dict[str, dict]) -> str:
    """The explanation of repeated preemptions, when ours preempts far more than any baseline."""
    ours = summaries.get(OURS)
    others = [s["preemptions"] for p, s in summaries.items() if p in POLICY_NAMES and p != OURS]
    if ours is None or not others or ours["preemptions"] < 3 * max(1, max(others)):
        return ""
    pairs = ours["simulator"].get("preemptions_by_priority_pair", {})
    top = ", ".join(f"{pair}: {n:,}" for pair, n in sorted(pairs.items(), key=lambda kv: -kv[1])[:3])
    text = (
        f"Ours preempted {ours['preemptions']:,} times (one job {ours['max_restarts']:,} times; decisions by"
        f" preemptor>victim priority: {top}) against at most {max(others):,} for a baseline. The default Policy"
        " ranks a job waiting longer than `starving_after_s` (1 day, counted from its submission, running time"
        " included) above the higher tiers, while only its claimed priority may preempt: a medium job stops a low"
        " job, a 'starving' low job ranked above it takes the freed GPUs, and the medium job preempts again; each"
        " requeued victim is at once 'starving' too (tests/unit/test_sim.py reproduces it with three jobs)."
    )
    if "preemptor-no-aging" in summaries:
        text += " The `preemptor-no-aging` column is ours without aging."
    return text


if __name__ == "__main__":
    sys.exit(main())
