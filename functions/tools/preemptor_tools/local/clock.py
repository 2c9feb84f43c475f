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

Workflows wait their turns (`take_turns`, which the emulated stack turns on): a Wait state
or a Retry interval (`sleep`) moves time on only once every running workflow waits for time
too, and the waits end in the order of their ends, as a discrete-event simulation orders
them. Without it, the first workflow to reach its wait moved time for all: one that waited
240 s while another was still busy made the other's 30 s wait, begun a moment later, end at
270 s, and which came first depended on how the threads were scheduled. A Map's items, each
in a thread of its own, count as their one workflow (`join`). Nor does a Wait jump over
what happens outside the workflows (`on_due`: a run of the fleet that ends, a checkpoint
written): time goes there first, and the waits go on once the emulated stack has routed
what it emitted, as EventBridge delivers a run's end while a workflow waits.

While a listener processes something that happened at an earlier simulated time than the
new time (a checkpoint written at t=130 during an advance to t=3600), it runs that code inside
`pinned(t)`: `now()` then returns `t` in that thread only, so S3 `LastModified` and anything
else reading the clock see the moment the thing happened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

AdvanceListener = Callable[[float, float], None]
# How often a sleeper looks again whether its turn has come (real seconds), and how long it
# waits for the others to settle before it goes anyway (a thread blocked outside the clock).
# No test nor the demo gets there; it is long because a busy workflow's step on a heavily
# loaded machine may take seconds of real time, and a give-up would move time under it.
_TURN_POLL_S = 0.002
_TURN_GIVE_UP_S = 30.0


class SimClock:
    """A monotonic simulated clock (float seconds since the epoch)."""

    def __init__(self, start: float) -> None:
        self._now = float(start)
        self._lock = threading.RLock()
        self._listeners: list[AdvanceListener] = []
        self._pins = threading.local()
        self._holder: int | None = None  # the thread holding the clock (`held`)
        self._parked = 0  # threads whose advance waits for the hold to end, or asleep
        self._released = threading.Condition(self._lock)
        self._sleepers: list[float] = []  # the end of each `sleep` under way
        self._aside = 0  # threads that wait for the others, not for time (`aside`)
        self._joined = 0  # threads acting for a workflow besides its own (`join`)
        self._settled: Callable[[int], bool] | None = None
        # What happens outside the workflows at a time of its own (a run ending in the fleet):
        # each gives the next such time, or None (`on_due`).
        self._due: list[Callable[[], float | None]] = []

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
            self._released.notify_all()  # sleepers look again
            return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by `seconds` from the current clock time."""
        with self._lock:
            # The end is counted from now, even if the clock is held: a Wait state entered
            # during a hold ends `seconds` after it was entered, not after the hold.
            return self.advance_to(self._now + seconds)

    def take_turns(self, settled: Callable[[int], bool] | None) -> None:
        """Make `sleep` a discrete-event wait: a sleeper moves time on only once
        `settled(sleeping)` says every thread that may still act is asleep (`sleeping` of them
        are) and no sleeper ends earlier; the others wait for their turn. None: each sleep
        moves time at once (the first to get there decides where time is)."""
        with self._lock:
            self._settled = settled
            self._released.notify_all()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """The calling thread, one that would count as still acting (a workflow's), waits
        for the others for the duration of the block, not for time: it does not hold up
        their turns (`take_turns`)."""
        with self._lock:
            self._aside += 1
            self._released.notify_all()
        try:
            yield
        finally:
            with self._lock:
                self._aside -= 1

    def join(self) -> Callable[[], None]:
        """Count one more thread acting for a running workflow besides its execution's own
        (a Map item's: its execution counts once, its items may each wait or act), until the
        returned function is called, when that thread is done. Call it before that thread
        starts, so that no turn is taken in between. Its execution's own thread stands aside
        (`aside`) while it waits for its items."""
        with self._lock:
            self._joined += 1
        left = threading.Event()

        def leave() -> None:
            if left.is_set():
                return
            left.set()
            with self._lock:
                self._joined -= 1
                self._released.notify_all()

        return leave

    def sleep(self, seconds: float) -> float:
        """Wait `seconds` of simulated time (a Wait state, a Retry interval), counted from now.

        With `take_turns`, concurrent sleepers wake in the order of their ends, each once the
        others have gone as far as they can: a workflow that waits 30 s while another waits
        240 s acts at +30 s, before the other moves time to +240 s. Without it (or when the
        others do not settle within `_TURN_GIVE_UP_S` real seconds), as `advance`."""
        with self._lock:
            end = self._now + seconds  # from now, even if the clock is held
            if self._settled is None:
                return self.advance_to(end)
            me = threading.get_ident()
            self._sleepers.append(end)
            self._parked += 1
            try:
                give_up = time.monotonic() + _TURN_GIVE_UP_S
                while True:
                    if self._holder is not None and self._holder != me:
                        self._released.wait()
                        give_up = time.monotonic() + _TURN_GIVE_UP_S  # counted from the hold's end
                        continue
                    if end <= self._now:
                        return self._now  # someone else moved time past it
                    if end <= min(self._sleepers) and (
                        self._settled is None or self._settled(self._waiting()) or time.monotonic() >= give_up
                    ):
                        due = self._next_due(end)
                        if due is None:
                            break
                        # Something outside the workflows happens first (a run ends, a
                        # checkpoint is written): time goes there, and the sleeper waits its
                        # turn again, once what happened is delivered (`take_turns`).
                        self.advance_to(due)
                        give_up = time.monotonic() + _TURN_GIVE_UP_S
                        continue
                    self._released.wait(_TURN_POLL_S)
            finally:
                self._parked -= 1
                self._sleepers.remove(end)
                self._released.notify_all()
            return self.advance_to(end)

    def on_due(self, provider: Callable[[], float | None]) -> Callable[[], None]:
        """Register `provider`, which gives the next time something happens outside the
        workflows (the fleet's next transition), or None: a `sleep` under `take_turns` that
        would end later moves time only that far first, so that what happens then (a run's
        end, its event) is delivered at its time, not after the sleep. Returns a function
        that unregisters it."""
        with self._lock:
            self._due.append(provider)

        def remove() -> None:
            with self._lock:
                if provider in self._due:
                    self._due.remove(provider)

        return remove

    def _next_due(self, end: float) -> float | None:
        """The earliest time before `end`, and after now, at which something is due (`on_due`)."""
        now, first = self._now, None
        for provider in self._due:
            t = provider()
            if t is not None and now < t < end and (first is None or t < first):
                first = t
        return first

    def _wait_for_release(self) -> None:
        """Block (the lock held, released while waiting) while another thread holds the clock."""
        while self._holder is not None and self._holder != threading.get_ident():
            self._parked += 1
            try:
                self._released.wait()
            finally:
                self._parked -= 1

    def _waiting(self) -> int:
        """How many workflows wait for time: the sleepers and those standing aside, less the
        threads acting besides their workflow's own (`join`): a workflow whose Map items all
        wait counts once, not once per item."""
        return len(self._sleepers) + self._aside - self._joined

    def idle(self) -> int:
        """How many workflows wait (`parked` counted per workflow, as `take_turns` counts
        them): the threads parked in the clock and those standing aside, less the threads
        acting besides their workflow's own (`join`)."""
        with self._lock:
            return self._parked + self._aside - self._joined

    def parked(self) -> int:
        """How many threads wait in the clock: in an advance, for the hold to end, or asleep
        (`sleep`)."""
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
