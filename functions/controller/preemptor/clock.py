"""The process-wide source of "now" (float seconds since the epoch).

Handlers read `CLOCK.now()`; on AWS that is the system clock, the local runtime installs a
simulated clock with `use_clock` so workflows, fleet and handlers share one timeline.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class SystemClock:
    """Wall-clock time, as on AWS."""

    def now(self) -> float:
        return time.time()


CLOCK: Clock = SystemClock()


def use_clock(clock: Clock) -> Clock:
    """Install `clock` as the process clock and return the one it replaces."""
    global CLOCK
    previous, CLOCK = CLOCK, clock
    return previous
