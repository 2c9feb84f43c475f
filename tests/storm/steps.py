"""A workflow step for the hostile-world tests: it records that it ran, then answers."""

from __future__ import annotations

CALLS: list[dict] = []


def record(event: dict, context: object) -> dict:
    CALLS.append(event)
    return {"step": event.get("step"), "done": True}
