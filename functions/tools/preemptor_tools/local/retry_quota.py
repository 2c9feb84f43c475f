"""botocore's retry quota, kept per function, as each function's Lambda containers keep it.

A client in botocore's standard retry mode spends a quota on its retries (500 tokens: 5 per
retry of a throttle, 10 per retry of a timeout, one given back by each call that needed
none) and stops retrying once it is spent: a circuit breaker for an overloaded service. On
AWS each function's containers make their own clients, each with its own quota. The
emulated stack runs every function in one process, whose handlers share the clients that
`wiring.deps()` makes once: their quotas were shared too, and the retries of all seven
functions spent one quota, where one function's would spend its own. In a long hostile run
(a third of the attempts throttled, a fifth of the answers lost) the shared quota ran out
and every step then failed on its first throttle, until the run ended.

While installed, the quota a client makes (`botocore.retries.quota.RetryQuota`) is one per
function that calls through it (`hostile.ACTOR`, set by the stack for each invocation; the
harness's calls have their own).
"""

from __future__ import annotations

import threading

from botocore.retries import quota

from .hostile import ACTOR
from .moto_patches._core import replace

_ORIGINAL = quota.RetryQuota


class PerFunctionRetryQuota:
    """One client's retry quota: a quota of its own for each function calling through it."""

    INITIAL_CAPACITY = _ORIGINAL.INITIAL_CAPACITY

    def __init__(self, initial_capacity: int = _ORIGINAL.INITIAL_CAPACITY, lock: threading.Lock | None = None) -> None:
        self._initial = initial_capacity
        self._quotas: dict[str | None, quota.RetryQuota] = {}
        self._lock = threading.Lock()

    def _own(self) -> quota.RetryQuota:
        function = ACTOR.get()
        with self._lock:
            own = self._quotas.get(function)
            if own is None:
                own = self._quotas[function] = _ORIGINAL(self._initial)
            return own

    def acquire(self, capacity_amount: int) -> bool:
        return self._own().acquire(capacity_amount)

    def release(self, capacity_amount: int) -> None:
        self._own().release(capacity_amount)

    @property
    def available_capacity(self) -> int:
        return self._own().available_capacity


def install() -> None:
    """Clients made from now on keep their retry quota per function (undone with the moto
    patches, `moto_patches.uninstall`)."""
    replace(quota, "RetryQuota", PerFunctionRetryQuota)
