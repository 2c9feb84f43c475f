"""`make bench`: every policy on the Philly trace, with tables, ratios and plots.

    python -m preemptor_tools.bench [--scenario week|full|all] [--policies a,b,...] [--workers N]

Scenarios (both on a 400-GPU pool, the model's defaults, seed 0):
- `week`: the jobs submitted in days 42-49 of the trace (the week with the most
  submissions, 14,724 jobs, ~630 GPUs of average demand), replayed until they all end;
- `full`: all 82,247 jobs.

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

    def command(self, policy: str) -> str:
        return " ".join(["preemptor sim --trace", TRACE_IN_COMMANDS, *self.sim_args(), "--policy", policy, "--json"])


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


def _run_one(trace_path: str, scenario: Scenario, policy: str) -> dict:
    """One replay (in a worker process): the summary plus what the plots need."""
    trace = load_trace(trace_path, start_s=scenario.start_s, end_s=scenario.end_s)
    started = time.perf_counter()
    result = simulate(trace, policy_by_name(policy), SimConfig(gpus=scenario.gpus))
    summary = summarize(result)
    summary["simulator"]["total_seconds"] = round(time.perf_counter() - started, 2)
    waits: dict[str, list[float]] = {}
    for job in result.jobs:
        waits.setdefault(str(job.priority), []).append(job.wait_s)
    span = summary["span_s"]
    series = step_averages(result.busy, span["first_submit"], span["last_submit"], scenario.bucket_s)
    return {"scenario": scenario.name, "policy": policy, "summary": summary, "waits": waits, "series": series}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preemptor_tools.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument(
        "--policies", default=",".join([*POLICY_NAMES, *VARIANTS]), help="comma-separated (default: all, and the diagnostic variants of ours)"
    )
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

    # Longest first: the full trace, ours (the real core planner) before the small baselines.
    tasks = [(s, p) for s in sorted(scenarios, key=lambda s: s.name != "full") for p in sorted(policies, key=lambda p: not p.startswith(OURS))]
    runs: dict[str, dict[str, dict]] = {s.name: {} for s in scenarios}
    started = time.perf_counter()
    if args.replot:
        for scenario, policy in tasks:
            cached = json.loads((args.out / f"{scenario.name}-{policy}.json").read_text())
            context = {k: cached[k] for k in ("machine", "date", "bench_command")}
            runs[scenario.name][policy] = pickle.loads(_cache(scenario.name, policy).read_bytes())
    else:
        if args.resume:
            for scenario, policy in list(tasks):
                cache, done = _cache(scenario.name, policy), args.out / f"{scenario.name}-{policy}.json"
                if cache.is_file() and done.is_file():
                    runs[scenario.name][policy] = pickle.loads(cache.read_bytes())
                    tasks.remove((scenario, policy))
                    _log(f"  {scenario.name}/{policy}: kept from {json.loads(done.read_text())['date']}")
        _simulate_all(args, tasks, runs, context)
    for scenario in scenarios:
        since = None
        if previous.get(scenario.name):
            since = moved_since(previous[scenario.name], {p: runs[scenario.name][p]["summary"] for p in policies})
        elif args.replot:  # keep the comparison the run recorded
            since = (_read_json(args.out / f"{scenario.name}.json") or {}).get("since_previous")
        _write_scenario(args.out, scenario, {p: runs[scenario.name][p] for p in policies}, context, since)
    _write_readme(args.out, context)
    _log(f"bench: done in {time.perf_counter() - started:.0f} s; results in {args.out}")
    return 0


def _cache(scenario: str, policy: str) -> Path:
    """Plot data of a run, kept outside the results so `--replot` can redraw without replaying."""
    return Path(tempfile.gettempdir()) / f"preemptor-bench-{scenario}-{policy}.pickle"


def _simulate_all(args, tasks: list, runs: dict, context: dict) -> None:
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = {pool.submit(_run_one, str(args.trace), s, p): (s, p) for s, p in tasks}
        for future in as_completed(futures):
            scenario, policy = futures[future]
            run = future.result()
            runs[scenario.name][policy] = run
            sim = run["summary"]["simulator"]
            _log(f"  {scenario.name}/{policy}: {sim['total_seconds']:.0f} s ({sim['plans']} plans, {sim['plan_seconds']:.0f} s planning)")
            _write_run(args.out, scenario, policy, run["summary"], context)
            _cache(scenario.name, policy).write_bytes(pickle.dumps(run))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _write_run(out: Path, scenario: Scenario, policy: str, summary: dict, context: dict) -> None:
    record = {"scenario": scenario.name, "command": scenario.command(policy), **context, **summary}
    (out / f"{scenario.name}-{policy}.json").write_text(json.dumps(record, indent=2) + "\n")


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


def _write_scenario(out: Path, scenario: Scenario, runs: dict[str, dict], context: dict, since: dict | None = None) -> None:
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
    (out / f"{scenario.name}.json").write_text(json.dumps(record, indent=2) + "\n")


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
        parts += _moved_section(record.get("since_previous"))
    why = out / WHY_MOVED
    if why.is_file():
        parts += ["## Why figures moved since the previous run", "", f"(hand-written: `{WHY_MOVED}`)", "", why.read_text().strip(), ""]
    (out / "README.md").write_text("\n".join(parts))


WHY_MOVED = "why-moved.md"  # hand-written reasons for the moves listed, included in README.md


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
            "Ours confirms a checkpoint before stopping a victim whose newest one is older than 900 s: written 60 s"
            " after the request, seen at the next 30 s poll; a victim still reloading after a relaunch (300 s of"
            " restart overhead) cannot write it before it has reloaded, and its newest checkpoint is old by the"
            " clock though it has nothing at risk. The others stop at once and throw the work away."
        )
    if metric in ("preemptions", "restarts per job") and not never_preempts and ours.get("preemptions") and theirs.get("preemptions"):
        mine = ours["lost_gpu_hours"] / ours["preemptions"]
        other = theirs["lost_gpu_hours"] / theirs["preemptions"]
        reasons.append(
            f"Ours picks the victims that lose the least work, sometimes more of them; each of its preemptions"
            f" lost {mine:.2f} GPU-h against {other:.2f} for `{baseline}`."
        )
    if metric == "utilisation" and ours.get("goodput", 0) > theirs.get("goodput", 0):
        reasons.append(
            f"Utilisation counts GPUs held, wasted time included; in GPUs doing work that is kept (goodput) ours"
            f" is ahead: {ours['goodput']:.3f} against {theirs['goodput']:.3f}."
        )
    variant = summaries.get("preemptor-no-aging")
    lower_better = {label: lb for label, _, lb in HEADLINE}
    getters = {label: get for label, get, _ in HEADLINE}
    if variant is not None and metric in getters and not ("critical" in metric or "high" in metric):
        v, t = getters[metric](variant), getters[metric](theirs)
        if (v < t) if lower_better[metric] else (v > t):
            reasons.append(
                f"Without aging (`preemptor-no-aging`, same run) ours gets {v:,.3f} here: the default Policy's"
                " aging and its reservation for jobs waiting over a day (lower-ranked jobs may not take the GPUs a"
                " starving job waits for) move waiting onto the many small low jobs."
            )
    if metric == "longest wait (s)" and not never_preempts:
        reasons.append(
            "The pending window is read in claimed-priority order (the DynamoDB index), so an old low job behind"
            f" more than the window's {ours.get('model', {}).get('pending_window', 200)} higher-tier pending jobs"
            " is not seen by the planner, and aging cannot lift it."
        )
    thrash = _thrash(summaries)
    if thrash and not ("critical" in metric or "high" in metric):
        reasons.append(thrash)
    return (" " + " ".join(reasons)) if reasons else ""


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
