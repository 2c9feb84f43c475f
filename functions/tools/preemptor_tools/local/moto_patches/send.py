"""Each attempt botocore sends reaches moto through one handler (`BotocoreStubber`, on
`before-send`); it is patched to answer only the emulated AWS running now.

Gap filled: a Lambda that a workflow invoked is still running when its emulated AWS gives way
to the next one (a later test's or replay's stack: moto's backends reset, the patches installed
again with another clock). moto answers whoever calls, so the old handler's next calls would
write into the new stack's tables and start its runs. A call made by a handler invoked under
another clock than the one installed now is refused (`StaleInvocation`, raised to the handler,
which botocore does not retry): the old handler fails where it stands, as its execution does
(`stepfunctions.StaleExecution`).

A hostile world answers some attempts in moto's place or loses moto's answer
(`around_send`); a stale call is refused before it is asked.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from botocore.awsrequest import AWSResponse
from moto.core.botocore_stubber import BotocoreStubber

from preemptor_tools.local.clock import SimClock

from ._core import _STATE, replace, subscribe

# The clock of the emulated AWS that invoked the handler running in this context.
_INVOKED_UNDER: contextvars.ContextVar[SimClock | None] = contextvars.ContextVar("preemptor_invoked_under", default=None)
_AROUND_SEND = "around-send"
_ORIGINAL_CALL = BotocoreStubber.__call__

# (event name, request, carry_out) -> the attempt's answer; carry_out() is moto's.
AroundSend = Callable[[str, Any, Callable[[], AWSResponse | None]], AWSResponse | None]


class StaleInvocation(RuntimeError):
    """A call of a Lambda handler whose emulated AWS is gone: it must not act in the next."""


def patch() -> None:
    replace(BotocoreStubber, "__call__", _call)


@contextmanager
def invoked_under(clock: SimClock | None) -> Iterator[None]:
    """The handler run inside was invoked by the emulated AWS of `clock`."""
    token = _INVOKED_UNDER.set(clock)
    try:
        yield
    finally:
        _INVOKED_UNDER.reset(token)


def around_send(wrapper: AroundSend) -> Callable[[], None]:
    """Run each attempt moto would answer through `wrapper`; returns the function that stops it."""
    return subscribe(_AROUND_SEND, wrapper)


def _call(stubber: BotocoreStubber, event_name: str, request: Any, **kwargs: Any) -> AWSResponse | None:
    if not stubber.enabled:
        return None  # outside mock_aws: botocore sends the request itself
    invoked_under = _INVOKED_UNDER.get()
    if invoked_under is not None and invoked_under is not _STATE.clock:
        raise StaleInvocation(f"{event_name}: a call of a Lambda handler invoked by an emulated AWS that is gone")

    def carry_out() -> AWSResponse | None:
        return _ORIGINAL_CALL(stubber, event_name, request, **kwargs)

    with _STATE.lock:
        wrappers = list(_STATE.listeners.get(_AROUND_SEND, []))
    answer = carry_out
    for wrapper in reversed(wrappers):
        answer = _wrapped(wrapper, event_name, request, answer)
    return answer()


def _wrapped(wrapper: AroundSend, event_name: str, request: Any, inner: Callable[[], AWSResponse | None]) -> Callable[[], AWSResponse | None]:
    return lambda: wrapper(event_name, request, inner)
