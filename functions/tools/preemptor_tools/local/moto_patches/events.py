"""EventBridge: tell listeners about every event PutEvents accepted.

Gap filled: moto's `EventsBackend.put_events` delivers only to the targets it supports (SQS,
logs, archives) and raises `NotImplementedError` for Lambda and Step Functions targets, so
the emulated stack routes events itself (`EmulatedStack.put_event`). Events put over moto's
HTTP endpoint (the local stack: `preemptor submit --local`, the AWS CLI) would otherwise never
reach the intake. The patch lets moto accept and validate the entries as it does (unknown bus,
missing Source or Detail, malformed Detail), then hands each accepted one to the listeners as
the event EventBridge delivers: the same envelope, `id` the EventId PutEvents returned,
`time` from the simulated clock.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from moto.events.models import EventsBackend

from ._core import _STATE, notify, replace, subscribe

# (bus name, event): the bus the entry named (its name, not an ARN) and the delivered event.
EventsPut = Callable[[str, dict], None]
_EVENTS_PUT = "events_put"
_ORIGINAL_PUT_EVENTS = EventsBackend.put_events


def patch() -> None:
    replace(EventsBackend, "put_events", _put_events)


def on_events_put(callback: EventsPut) -> Callable[[], None]:
    """`callback(bus_name, event)` for every entry PutEvents accepted; returns unsubscribe."""
    return subscribe(_EVENTS_PUT, callback)


def _put_events(self: EventsBackend, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    entries = _ORIGINAL_PUT_EVENTS(self, events)
    if not _STATE.listeners.get(_EVENTS_PUT):
        return entries
    for entry, result in zip(events, entries):
        if "EventId" not in result:
            continue  # refused by moto as by EventBridge: nobody receives it
        bus = self._normalize_event_bus_arn(entry.get("EventBusName"))
        notify(_EVENTS_PUT, bus, _delivered(self, entry, result["EventId"]))
    return entries


def _delivered(backend: EventsBackend, entry: dict[str, Any], event_id: str) -> dict:
    at = _STATE.require_clock().now()
    return {
        "version": "0",
        "id": event_id,
        "detail-type": entry["DetailType"],
        "source": entry["Source"],
        "account": backend.account_id,
        "time": dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": backend.region_name,
        "resources": list(entry.get("Resources") or []),
        "detail": json.loads(entry["Detail"]),
    }
