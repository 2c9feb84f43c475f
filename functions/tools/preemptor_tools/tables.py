"""How the operator commands print: aligned tables, durations people read, and colour only
for a terminal (stdout is a TTY and NO_COLOR is unset or empty, https://no-color.org)."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any, Iterable, TextIO

_STATE_COLOURS = {
    "PENDING": "33",  # yellow
    "ADMITTED": "36",  # cyan
    "RUNNING": "32",  # green
    "PREEMPTING": "35",  # magenta
    "COMPLETED": "2",  # dim
    "CANCELLED": "2",
    "FAILED": "31",  # red
    "DRAINED": "1;31",  # bold red
}


def use_colour(stream: TextIO, env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(getattr(stream, "isatty", lambda: False)()) and not env.get("NO_COLOR")


class Painter:
    def __init__(self, colour: bool):
        self.colour = colour

    def paint(self, text: str, code: str | None) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.colour and code else text

    def state(self, text: str) -> str:
        return self.paint(text, _STATE_COLOURS.get(text))

    def bold(self, text: str) -> str:
        return self.paint(text, "1")


def table(headers: list[str], rows: Iterable[list[Any]], painter: Painter, paint_column: str | None = None) -> str:
    """Columns padded to their widest cell (measured before colouring); `paint_column`'s
    cells coloured as states."""
    rows = [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    painted = headers.index(paint_column) if paint_column in headers else None
    lines = ["  ".join(painter.bold(h) + " " * (w - len(h)) for h, w in zip(headers, widths)).rstrip()]
    for row in rows:
        cells = []
        for i, (cell, width) in enumerate(zip(row, widths)):
            padded = cell.ljust(width)
            cells.append(painter.state(cell) + padded[len(cell):] if i == painted else padded)
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    """4s, 5m30s, 2h05m, 3d04h."""
    if seconds is None:
        return "-"
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def clock_time(at: float | None) -> str:
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


# -- the commands' renderings ------------------------------------------------------------------
def render_queue(data: dict, painter: Painter) -> str:
    out = []
    for pool in data["pools"]:
        pending = sum(1 for j in pool["jobs"] if j["state"] == "PENDING")
        header = (
            f"pool {pool['pool']}: {pool['used_gpus']}/{pool['capacity_gpus']} GPUs used, "
            f"{pending} pending, {len(pool['jobs']) - pending} running"
        )
        if pool["drained"]:
            header += "  " + painter.state("DRAINED") + (f" ({pool['drained_note']})" if pool.get("drained_note") else "")
        out.append(painter.bold(header) if not pool["drained"] else header)
        if not pool["jobs"]:
            out.append("  (no jobs)")
            continue
        rows = []
        for j in pool["jobs"]:
            if j["state"] == "PENDING":
                note = j["waiting_reason"] or ""
            elif j["state"] == "PREEMPTING":
                note = f"preempted by {j['preempted_by']}"
            else:
                ckpt = "no checkpoint yet" if j["checkpoint_age_s"] is None else f"checkpoint {duration(j['checkpoint_age_s'])} ago"
                note = f"running {duration(j['running_s'])}, {ckpt}"
            rows.append(
                [j["rank"] or "-", j["job"], j["team"], j["priority"], j["gpus"], j["state"], duration(j["wait_s"]), note]
            )
        block = table(["RANK", "JOB", "TEAM", "PRIORITY", "GPUS", "STATE", "WAIT", "NOTE"], rows, painter, "STATE")
        out.append("\n".join("  " + line for line in block.splitlines()))
    return "\n".join(out)


def render_status(v: dict, painter: Painter) -> str:
    lines = [f"{painter.bold(v['job'])}: {painter.state(v['state'])}"]
    fields = [
        ("team", v["team"]),
        ("priority", v["priority"]),
        ("pool", f"{v['pool']} ({v['service']})" + ("  " + painter.state("DRAINED") if v.get("pool_drained") else "")),
        ("gpus", v["gpus"]),
        ("run", f"{v['run'] or '-'} (incarnation {v['incarnation']})"),
        ("submitted", clock_time(v["submitted_at"])),
        ("waited" if v["state"] != "PENDING" else "waiting", duration(v["wait_s"])),
    ]
    if v["running_s"] is not None:
        fields.append(("running", duration(v["running_s"])))
    if v["checkpoint_age_s"] is not None:
        fields.append(("checkpoint", f"{duration(v['checkpoint_age_s'])} ago"))
    fields.append(("preempted", f"{v['preemptions']}x, {v['lost_gpu_seconds']:,.0f} GPU-seconds lost"))
    if v.get("preempted_by"):
        fields.append(("preempted by", v["preempted_by"]))
    if v.get("waiting_reason"):
        fields.append(("waits", f"{v['waiting_reason']}: {v['waiting_detail']}"))
    if v.get("outcome_reason"):
        fields.append(("outcome", v["outcome_reason"]))
    if v.get("cancel_requested") and v["state"] not in ("CANCELLED",):
        fields.append(("cancel", "requested"))
    last = v.get("last_decision")
    if last:
        fields.append(("last decision", f"{clock_time(last['at'])} {last['kind']} ({last['reason']}) {last['detail']}".rstrip()))
    width = max(len(k) for k, _ in fields)
    lines += [f"  {k.ljust(width)}  {val}" for k, val in fields]
    return "\n".join(lines)


def render_history(entries: list[dict], painter: Painter, one_job: bool) -> str:
    if not entries:
        return "(no decisions recorded)"
    headers = (["TIME"] if one_job else ["TIME", "JOB"]) + ["KIND", "REASON", "DETAIL"]
    rows = [
        [clock_time(e["at"])] + ([] if one_job else [e["job"]]) + [e["kind"], e["reason"], e["detail"]] for e in entries
    ]
    return table(headers, rows, painter)


def render_pools(data: dict, painter: Painter) -> str:
    rows = [
        [
            p["pool"],
            p["service"],
            p["capacity_gpus"],
            p["used_gpus"],
            p["free_gpus"],
            p["borrowed_gpus"],
            p["running"],
            p["pending"],
            "DRAINED" if p["drained"] else "open",
        ]
        for p in data["pools"]
    ]
    out = [table(["POOL", "SERVICE", "CAPACITY", "USED", "FREE", "BORROWED", "RUNNING", "PENDING", "STATE"], rows, painter, "STATE")]
    for p in data["pools"]:
        if p["drained"] and p.get("drained_note"):
            out.append(f"{p['pool']} drained since {clock_time(p['drained_at'])}: {p['drained_note']}")
        if p.get("quota"):
            out.append(
                f"{p['pool']} planned at {p['planned_gpus']} of its {p['capacity_gpus']} GPUs: the account's quota "
                f"'{p['quota']['name']}' leaves it no more (raise it in Service Quotas, or lower the pool; "
                f"where Service Quotas cannot show the raise: preemptor quota-raised {p['pool']})"
            )
        if not p["teams"]:
            continue
        out.append("")
        out.append(painter.bold(f"pool {p['pool']} by team"))
        team_rows = [
            [t["team"], t["used_gpus"], t["nominal_gpus"], t["borrowed_gpus"], t["running"], f"{t['pending']} ({t['pending_gpus']} GPUs)"]
            for t in p["teams"]
        ]
        block = table(["TEAM", "USED", "NOMINAL", "BORROWED", "RUNNING", "PENDING"], team_rows, painter)
        out.append("\n".join("  " + line for line in block.splitlines()))
    return "\n".join(out)
