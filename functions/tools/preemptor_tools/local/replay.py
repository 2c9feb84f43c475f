"""`preemptor replay-events FILE...`: captured events through the intake of the emulated stack.

Each file is read as it is (malformed JSON included) and put on the emulated bus exactly as
EventBridge would deliver it; one line per event says whether it was accepted, ignored or
rejected, and why. Files that no rule of the template matches are reported as unrouted.
A directory stands for every `*.json` file under it, in path order. A function that raises
is a bug of the controller: the line says `error` with the exception, and the replay goes on.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TextIO

from preemptor.handlers import intake
from .clock import SimClock
from .demo import START
from .stack import EmulatedStack, LambdaContext


def expand(paths: list[Path]) -> list[Path]:
    """Files as given; directories as their `*.json` files, recursively, sorted."""
    files: list[Path] = []
    for path in paths:
        files += sorted(p for p in path.rglob("*.json") if p.is_file()) if path.is_dir() else [path]
    return files


def replay_files(paths: list[Path], out: TextIO, policy_config: str | None = None) -> Counter:
    """Replay every file; `policy_config` (PolicyConfig JSON: teams and their ceilings, say)
    is the emulated stack's policy instead of the defaults."""
    counts: Counter = Counter({"accepted": 0, "ignored": 0, "rejected": 0, "duplicate": 0, "error": 0})
    parameters = {"PolicyConfig": policy_config} if policy_config else None
    with EmulatedStack(SimClock(START), parameters=parameters) as stack:
        for path in expand(paths):
            try:
                result = _replay_one(stack, path)
            except Exception as error:  # noqa: BLE001 - reported per event, the replay goes on
                result = {"outcome": "error", "reason": f"{type(error).__name__}: {error}"[:500]}
            counts[result["outcome"]] += 1
            out.write(f"{path.name}: {result['outcome']}: {result['reason']}\n")
    return counts


def _replay_one(stack: EmulatedStack, path: Path) -> dict:
    raw = path.read_text(errors="replace")
    try:
        event = json.loads(raw)
    except json.JSONDecodeError:
        event = None
    if event is None:
        # Not JSON: the intake must reject it with a reason, never crash.
        result = intake.handler(raw, LambdaContext(function_name="replay"))
    else:
        routed = stack.put_event(event) if isinstance(event, dict) else None
        if routed is not None and routed.matched:
            result = routed.results[0]
        else:
            what = f"{event.get('source')} / {event.get('detail-type')}" if isinstance(event, dict) else "not an object"
            result = {"outcome": "ignored", "reason": f"no rule of the stack matches it ({what})"}
    stack.drain()
    return result
