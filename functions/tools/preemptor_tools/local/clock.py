"""Simulated time shared by the emulated AWS (Step Functions waits, S3, the fleet) and handlers.

Time only moves when someone calls `advance_to`/`advance` (a Wait state, a Retry interval,
the demo driver). Listeners registered with `on_advance` run synchronously, in registration
order, in the advancing thread and while the clock's lock is held, so one advance is fully
processed before the next one starts. A listener must therefore never block on another thread
that may itself advance the clock (e.g. wait for a Step Functions execution that has a Wait).

While a thread holds the clock (`held`), time stands still for every other thread: an
advance from another thread (a Wait state, a Retry interval) blocks until the hold ends.
The emulated stack holds it while it delivers the events of one moment (a burst of
submissions, runs that end together), so each workflow they start waits where AWS would let
it wait, not in the middle of the burst.

While a listener processes something that happened at an earlier simulated time than the
new time (a checkpoint written at t=130 during an advance to t=3600), it runs that code inside
`pinned(t)`: `now()` then returns `t` in that thread only, so S3 `LastModified` and anything
else reading the clock see the moment the thing happened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

AdvanceListener = Callable[[float, float], None]


class SimClock:
    """A monotonic simulated clock (float seconds since the epoch)."""

    def __init__(self, start: float) -> None:
        self._now = float(start)
        self._lock = threading.RLock()
        self._listeners: list[AdvanceListener] = []
        self._pins = threading.local()
        self._holder: int | None = None  # the thread holding the clock (`held`)
        self._parked = 0  # threads whose advance waits for the hold to end
        self._released = threading.Condition(self._lock)

    def now(self) -> float:
        pinned = getattr(self._pins, "stack", None)
        if pinned:
            return pinned[-1]
        return self._now

    def advance_to(self, t: float) -> float:
        """Move time forward to `t` (never backwards) and notify listeners with (old, new).

        Returns the clock's time afterwards. An advance to the past or present is a no-op.
        """
        with self._lock:
            self._wait_for_release()
            old = self._now
            if t <= old:
                return old
            self._now = float(t)
            for listener in list(self._listeners):
                listener(old, self._now)
            return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by `seconds` from the current clock time."""
        with self._lock:
            # The end is counted from now, even if the clock is held: a Wait state entered
            # during a hold ends `seconds` after it was entered, not after the hold.
            return self.advance_to(self._now + seconds)

    def _wait_for_release(self) -> None:
        """Block (the lock held, released while waiting) while another thread holds the clock."""
        while self._holder is not None and self._holder != threading.get_ident():
            self._parked += 1
            try:
                self._released.wait()
            finally:
                self._parked -= 1

    def parked(self) -> int:
        """How many threads wait, in an advance, for the hold to end."""
        with self._lock:
            return self._parked

    def on_advance(self, callback: AdvanceListener) -> Callable[[], None]:
        """Register `callback(old, new)`; returns a function that unregisters it."""
        with self._lock:
            self._listeners.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return remove

    @contextmanager
    def held(self) -> Iterator[None]:
        """Stop time for every other thread for the duration of the block: their advances
        wait until it ends, then each moves time on to where it was going (if still ahead).
        The holding thread must not wait for one of them meanwhile (e.g. drain the workflows)."""
        with self._lock:
            if self._holder is not None:
                raise RuntimeError("the clock is already held")
            self._holder = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._holder = None
                self._released.notify_all()

    @contextmanager
    def pinned(self, t: float) -> Iterator[None]:
        """Make `now()` return `t` in this thread for the duration of the block."""
        stack = getattr(self._pins, "stack", None)
        if stack is None:
            stack = self._pins.stack = []
        stack.append(float(t))
        try:
            yield
        finally:
            stack.pop()
