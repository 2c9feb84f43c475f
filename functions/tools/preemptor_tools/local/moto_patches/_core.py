"""What the per-service patches share: the installed state, patch/restore, listeners, time."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from preemptor_tools.local.clock import SimClock

LambdaInvoker = Callable[[str, dict], Any]


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.clock: SimClock | None = None
        self.lambda_invoker: LambdaInvoker | None = None
        self.async_invoker: LambdaInvoker | None = None  # InvocationType Event
        self.originals: list[tuple[Any, str, Any]] = []
        self.listeners: dict[str, list[Callable]] = defaultdict(list)
        self.logger_levels: dict[str, int] = {}

    @property
    def installed(self) -> bool:
        return bool(self.originals)

    def require_clock(self) -> SimClock:
        if self.clock is None:
            raise RuntimeError("preemptor_tools.local.moto_patches.install() has not been called")
        return self.clock


_STATE = _State()
_MISSING = object()


def replace(owner: Any, name: str, value: Any) -> None:
    """Set `owner.name = value`, remembering what was there for `restore_all`."""
    _STATE.originals.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


def restore_all() -> None:
    for owner, name, original in reversed(_STATE.originals):
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _STATE.originals.clear()
    for logger_name, level in _STATE.logger_levels.items():
        logging.getLogger(logger_name).setLevel(level)
    _STATE.logger_levels.clear()
    _STATE.listeners.clear()
    _STATE.clock = None
    _STATE.lambda_invoker = None
    _STATE.async_invoker = None


def subscribe(topic: str, callback: Callable) -> Callable[[], None]:
    """Add a listener of `topic`; returns the function that removes it."""
    with _STATE.lock:
        _STATE.listeners[topic].append(callback)

    def unsubscribe() -> None:
        with _STATE.lock:
            if callback in _STATE.listeners.get(topic, []):
                _STATE.listeners[topic].remove(callback)

    return unsubscribe


def listeners(topic: str) -> list[Callable]:
    """The listeners of `topic` now (a copy)."""
    with _STATE.lock:
        return list(_STATE.listeners.get(topic, []))


def notify(topic: str, *args: Any) -> None:
    for callback in listeners(topic):
        callback(*args)


def utc_naive(t: float) -> dt.datetime:
    """moto's S3 and SageMaker models keep naive UTC datetimes (moto.core.utils.utcnow)."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).replace(tzinfo=None)


def local_naive(t: float) -> dt.datetime:
    """moto's Batch models keep naive local datetimes (datetime.now) and call .timestamp()."""
    return dt.datetime.fromtimestamp(t)


def sim_now() -> float:
    """The simulated clock's time (seconds since the epoch)."""
    return _STATE.require_clock().now()


def sim_utcnow() -> dt.datetime:
    return utc_naive(_STATE.require_clock().now())


_QUIET_LOGGERS = {
    "moto": logging.WARNING,
    "moto.stepfunctions": logging.WARNING,
    # logs every failing ASL component with repr() of the whole state tree at ERROR, once per
    # nesting level; the failure is in the execution history anyway.
    "moto.stepfunctions.parser.asl.component.eval_component": logging.CRITICAL,
}


def quiet_moto_logging() -> None:
    """moto logs whole objects (ASL programs, requests) at DEBUG and every caught task error
    at ERROR; raise those loggers' levels while the patches are installed."""
    for name, level in _QUIET_LOGGERS.items():
        logger = logging.getLogger(name)
        _STATE.logger_levels[name] = logger.level
        logger.setLevel(level)
