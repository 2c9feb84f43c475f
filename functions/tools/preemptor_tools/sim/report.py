"""Presenting replays: the terminal summary, the progress bar, Markdown tables, PNG plots."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TextIO

from .metrics import TIER_NAMES

OURS = "preemptor"


@contextlib.contextmanager
def progress_bar(total: int, description: str, *, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar on stderr counting finished jobs, or nothing when not `enabled`."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=description, unit="job", mininterval=0.5, smoothing=0.05) as bar:
        yield bar.update


def _tier(priority: str | int) -> str:
    return TIER_NAMES.get(int(priority), str(priority))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def print_summary(summary: dict, out: TextIO) -> None:
    """The human-readable form of `metrics.summarize`'s output."""
    sim = summary["simulator"]
    out.write(
        f"policy {summary['policy']}: {summary['jobs']} jobs on {summary['gpus']} GPUs "
        f"({summary['unschedulable_jobs']} larger than the pool left out); "
        f"replayed in {sim['wall_seconds']:.1f} s, {sim['plans']} plans\n\n"
    )
    out.write(f"{'priority':<16}{'jobs':>7}{'wait p50':>11}{'p95':>11}{'p99':>11}{'max':>11}{'completion p50':>16}{'preempted':>11}{'lost GPU-h':>12}\n")
    rows = list(summary["by_priority"].items()) + [("all", summary["overall"])]
    for priority, s in rows:
        label = "all" if priority == "all" else f"{priority} {_tier(priority)}"
        out.write(
            f"{label:<16}{s['jobs']:>7}{_duration(s['wait_p50_s']):>11}{_duration(s['wait_p95_s']):>11}"
            f"{_duration(s['wait_p99_s']):>11}{_duration(s['wait_max_s']):>11}{_duration(s['completion_p50_s']):>16}"
            f"{s['preemptions']:>11}{s['lost_gpu_hours']:>12.1f}\n"
        )
    lost = summary["lost_gpu_hours_breakdown"]
    longest = summary["longest_wait"] or {}
    out.write(
        f"\nutilisation {summary['utilization']:.1%} (goodput {summary['goodput']:.1%}); "
        f"preemptions {summary['preemptions']}, restarts/job {summary['restarts_per_job']:.3f} (max {summary['max_restarts']})\n"
        f"lost {summary['lost_gpu_hours']:.1f} GPU-h = {lost['work_since_checkpoint']:.1f} since checkpoints "
        f"+ {lost['stop_grace']:.1f} stop grace + {lost['restart_overhead']:.1f} restart overhead\n"
        f"checkpoints asked {sim.get('checkpoint_requests', 0)} at a preemption ({sim.get('checkpoint_timeouts', 0)} not written in time, "
        f"{sim.get('checkpoint_waits_cut', 0)} waits cut short, {sim.get('preemptions_called_off', 0)} preemptions called off), "
        f"{sim.get('checkpoint_requests_ahead', 0)} ahead of one (their writes take "
        f"{sim.get('ahead_checkpoint_write_gpu_hours', 0.0):.1f} GPU-h, not counted as lost: written while the job trains)\n"
        f"longest wait {_duration(longest.get('wait_s', 0.0))} ({longest.get('job')}, priority {longest.get('priority')}); "
        f"team fairness (Jain, bounded slowdown) {summary['fairness']['jain_bounded_slowdown']:.3f} over {summary['fairness']['teams']} teams\n"
    )


# --------------------------------------------------------------------------- tables

# (label, getter, lower is better)
HEADLINE: list[tuple[str, Callable[[dict], float], bool]] = [
    ("critical wait p95 (s)", lambda s: s["by_priority"].get("1000", {}).get("wait_p95_s", 0.0), True),
    ("critical wait p99 (s)", lambda s: s["by_priority"].get("1000", {}).get("wait_p99_s", 0.0), True),
    ("critical wait max (s)", lambda s: s["by_priority"].get("1000", {}).get("wait_max_s", 0.0), True),
    ("high wait p95 (s)", lambda s: s["by_priority"].get("500", {}).get("wait_p95_s", 0.0), True),
    ("high wait p99 (s)", lambda s: s["by_priority"].get("500", {}).get("wait_p99_s", 0.0), True),
    ("medium wait p95 (s)", lambda s: s["by_priority"].get("200", {}).get("wait_p95_s", 0.0), True),
    ("low wait p95 (s)", lambda s: s["by_priority"].get("50", {}).get("wait_p95_s", 0.0), True),
    ("all jobs wait mean (s)", lambda s: s["overall"]["wait_mean_s"], True),
    ("longest wait (s)", lambda s: (s["longest_wait"] or {}).get("wait_s", 0.0), True),
    ("lost GPU-hours", lambda s: s["lost_gpu_hours"], True),
    ("preemptions", lambda s: s["preemptions"], True),
    ("restarts per job", lambda s: s["restarts_per_job"], True),
    ("utilisation", lambda s: s["utilization"], False),
    ("goodput", lambda s: s["goodput"], False),
    ("team fairness (Jain)", lambda s: s["fairness"]["jain_bounded_slowdown"], False),
]


def _fmt(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    if abs(value) < 10:
        return f"{value:.3f}"
    return f"{value:,.1f}"


def metrics_table(summaries: dict[str, dict]) -> str:
    """Policies as columns, headline metrics as rows (Markdown)."""
    names = list(summaries)
    lines = ["| metric | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---:|" * len(names)]
    for label, get, _ in HEADLINE:
        lines.append(f"| {label} | " + " | ".join(_fmt(get(summaries[n])) for n in names) + " |")
    return "\n".join(lines)


def wait_table(summaries: dict[str, dict]) -> str:
    """Wait p50/p95/p99/max per priority and policy (Markdown)."""
    lines = ["| policy | priority | jobs | wait p50 | p95 | p99 | max | completion p50 | preemptions | lost GPU-h |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        for priority, g in s["by_priority"].items():
            lines.append(
                f"| `{name}` | {priority} {_tier(priority)} | {g['jobs']:,} | {_duration(g['wait_p50_s'])} | {_duration(g['wait_p95_s'])} | "
                f"{_duration(g['wait_p99_s'])} | {_duration(g['wait_max_s'])} | {_duration(g['completion_p50_s'])} | {g['preemptions']:,} | {g['lost_gpu_hours']:,.1f} |"
            )
    return "\n".join(lines)


def ratios(summaries: dict[str, dict], ours: str = OURS) -> dict[str, dict[str, float | None]]:
    """ours / baseline for every headline metric and every baseline of the same run."""
    out: dict[str, dict[str, float | None]] = {}
    mine = summaries[ours]
    for name, s in summaries.items():
        if name == ours:
            continue
        row = {}
        for label, get, _ in HEADLINE:
            theirs = get(s)
            row[label] = None if theirs == 0 else round(get(mine) / theirs, 4)
        out[name] = row
    return out


def ratio_table(summaries: dict[str, dict], ours: str = OURS) -> str:
    """ours ÷ baseline per metric; below 1 is better for ours where lower is better (bold when ours is ahead)."""
    table = ratios(summaries, ours)
    names = list(table)
    lines = ["| metric (ours ÷ baseline) | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---:|" * len(names)]
    for label, get, lower_better in HEADLINE:
        cells = []
        for name in names:
            r = table[name][label]
            if r is None:
                mine = get(summaries[ours])
                cells.append("= (both 0)" if mine == 0 else "∞ (theirs 0)")
                continue
            ahead = r < 1 if lower_better else r > 1
            text = f"{r:.3f}"
            cells.append(f"**{text}**" if ahead else text)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def not_ahead(summaries: dict[str, dict], ours: str = OURS) -> list[tuple[str, str, float, float]]:
    """(baseline, metric, ours, theirs) wherever ours is behind or only equal."""
    out = []
    mine = summaries[ours]
    for name, s in summaries.items():
        if name == ours:
            continue
        for label, get, lower_better in HEADLINE:
            a, b = get(mine), get(s)
            behind = a > b if lower_better else a < b
            if behind or a == b:
                out.append((name, label, a, b))
    return out


# --------------------------------------------------------------------------- plots


def _footer(fig, text: str) -> float:
    """Stamp the command and the machine under the plot; returns the height it takes (figure share)."""
    import textwrap

    width_in, height_in = fig.get_size_inches()
    lines = textwrap.wrap(text, width=max(40, int(width_in * 17.5)))
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=6.5, family="monospace", va="bottom")
    return min(0.3, (len(lines) * 0.11 + 0.05) / height_in)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLOURS = {
    "preemptor": "#d62728",
    "oracle": "#7f7f7f",
    "kueue": "#1f77b4",
    "slurm": "#2ca02c",
    "blunt": "#ff7f0e",
    "priority": "#9467bd",
    "fifo": "#8c564b",
}


def plot_wait_distribution(waits: dict[str, dict[str, list[float]]], path, *, title: str, footer: str) -> None:
    """One panel per priority: the share of jobs that waited longer than x (log-log)."""
    plt = _pyplot()
    priorities = sorted({p for per in waits.values() for p in per}, key=int, reverse=True)
    fig, axes = plt.subplots(1, len(priorities), figsize=(4.2 * len(priorities), 4.2), sharey=True)
    if len(priorities) == 1:
        axes = [axes]
    for ax, priority in zip(axes, priorities):
        for name, per in waits.items():
            values = sorted(per.get(priority, []))
            n = len(values)
            if not n:
                continue
            xs = [max(v, 1.0) for v in values]
            ys = [1.0 - i / n for i in range(n)]
            ax.step(xs, ys, where="post", label=name, color=COLOURS.get(name), linewidth=2.2 if name == OURS else 1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(1.0 / max(1, max(len(per.get(priority, [])) for per in waits.values())) * 0.8, 1.05)
        ax.set_title(f"priority {priority} ({_tier(priority)})")
        ax.set_xlabel("wait (s, waits < 1 s drawn at 1 s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("share of jobs waiting longer")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title)
    bottom = _footer(fig, footer)
    fig.tight_layout(rect=(0, bottom, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lost_gpu_hours(summaries: dict[str, dict], path, *, title: str, footer: str) -> None:
    """Lost GPU-hours per policy, split into work since the checkpoint, stop grace, restart overhead."""
    plt = _pyplot()
    names = list(summaries)
    parts = [("work_since_checkpoint", "work since last checkpoint"), ("stop_grace", "stop grace"), ("restart_overhead", "restart overhead")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottoms = [0.0] * len(names)
    for key, label in parts:
        values = [summaries[n]["lost_gpu_hours_breakdown"][key] for n in names]
        ax.bar(names, values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GPU-hours lost")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize=8)
    ax.set_title(title)
    bottom = _footer(fig, footer)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_utilization(series: dict[str, list[tuple[float, float]]], gpus: int, path, *, title: str, footer: str) -> None:
    """GPUs held over time (bucket means), as a share of the pool."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for name, points in series.items():
        if not points:
            continue
        t0 = points[0][0]
        ax.plot(
            [(t - t0) / 86400 for t, _ in points],
            [v / gpus for _, v in points],
            label=name,
            color=COLOURS.get(name),
            linewidth=1.8 if name == OURS else 0.9,
        )
    ax.set_xlabel("days since the first submission")
    ax.set_ylabel(f"GPUs held / {gpus}")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    ax.set_title(title)
    bottom = _footer(fig, footer)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
