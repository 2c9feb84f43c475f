"""The controller's checkpoint request: `<location>/_preemptor/checkpoint-request.json`.

The controller writes `{"requested_at": <epoch s>, "reason": "..."}` and then waits, for a
bounded time, for a checkpoint newer than `requested_at`. A request is answered by the first
checkpoint taken after it is seen; it is for this run only when it is newer than both the
newest checkpoint and the start of the run (a marker left by an earlier run, or restored
into the directory by SageMaker, is not answered again).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Verdict(str, Enum):
    """What the helper made of a request it read."""

    NEW = "new"  # to answer at the next step boundary
    PENDING = "pending"  # already waiting for the next boundary
    ANSWERED = "answered"  # a checkpoint newer than it exists
    BEFORE_RUN = "before-run"  # written before this run started: it was for an earlier run
    MALFORMED = "malformed"  # not the controller's format


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    requested_at: float
    reason: str
    source: str  # where it was read: a file path or an s3:// URI


class MalformedRequest(ValueError):
    pass


def parse_request(body: bytes | str, source: str) -> CheckpointRequest:
    """Parse a request marker.

    Raises:
        MalformedRequest: not a JSON object with a finite number `requested_at`.
    """
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedRequest(f"{source}: not JSON") from e
    if not isinstance(data, dict):
        raise MalformedRequest(f"{source}: not a JSON object")
    requested_at = data.get("requested_at")
    if isinstance(requested_at, bool) or not isinstance(requested_at, (int, float)) or not math.isfinite(requested_at):
        raise MalformedRequest(f"{source}: requested_at is {requested_at!r}")
    reason = data.get("reason", "")
    return CheckpointRequest(float(requested_at), reason if isinstance(reason, str) else str(reason), source)


class RequestBook:
    """Which request is waiting for a checkpoint.

    A request is new when it is later than the run's start and than the newest checkpoint
    (a checkpoint taken after a request was seen answers it).
    """

    def __init__(self, run_started_at: float):
        self.run_started_at = run_started_at
        self.newest_checkpoint_at: float | None = None
        self.pending: CheckpointRequest | None = None

    def consider(self, request: CheckpointRequest) -> Verdict:
        if request.requested_at < self.run_started_at:
            return Verdict.BEFORE_RUN
        if self.newest_checkpoint_at is not None and request.requested_at <= self.newest_checkpoint_at:
            return Verdict.ANSWERED
        if self.pending is not None and request.requested_at <= self.pending.requested_at:
            return Verdict.PENDING
        self.pending = request
        return Verdict.NEW

    def checkpointed(self, at: float) -> CheckpointRequest | None:
        """A checkpoint of the state at `at` was written; returns the request it answered.

        The pending request is answered even when its `requested_at` is later than `at`:
        it was seen before this checkpoint was taken, and the two clocks may disagree by a
        little (the controller's and the training host's). Its time then counts as the
        checkpoint's for later reads of the same marker, so it is not answered twice.
        """
        answered, self.pending = self.pending, None
        newest = at if answered is None else max(at, answered.requested_at)
        if self.newest_checkpoint_at is None or newest > self.newest_checkpoint_at:
            self.newest_checkpoint_at = newest
        return answered
