"""Waiting for Step Functions executions that moto runs in background threads."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Collection
from typing import Any

from moto.stepfunctions.responses import get_backend as stepfunctions_backend

_POLL_REAL_S = 0.01


class ExecutionStillRunning(TimeoutError):
    """The execution did not finish within the real-time bound."""


def wait_for_execution(sfn: Any, execution_arn: str, timeout_s: float = 60.0) -> dict:
    """Poll DescribeExecution until the execution is no longer RUNNING; return the description.

    moto executes state machines in a thread, so StartExecution returns at once. `timeout_s` is
    a bound in *real* seconds (simulated waits do not sleep, so a healthy workflow finishes in
    well under a second); past it, ExecutionStillRunning is raised.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        description = sfn.describe_execution(executionArn=execution_arn)
        if description["status"] != "RUNNING":
            return description
        if time.monotonic() >= deadline:
            raise ExecutionStillRunning(
                f"{execution_arn} still RUNNING after {timeout_s:g} real seconds"
            )
        time.sleep(_POLL_REAL_S)


def running_executions(account: str, region: str, machines: Collection[str] | None = None) -> list[str]:
    """The executions moto is running (of the state machines `machines`, or of all), read from
    its backend: a poll through boto3 every few milliseconds took the interpreter from the
    execution threads it waits for."""
    backend = stepfunctions_backend(account, region)  # the executing backend, as moto picks it
    return [
        e.execution_arn
        for machine in list(backend.state_machines)
        if machines is None or machine.arn in machines
        for e in _live(machine)
    ]


# Per state machine: how many of its executions were looked at, and those of them still
# running then. An execution that ended never runs again, so a poll looks only at those and
# at the executions started since: walking every execution of a long story at each poll,
# every few milliseconds and from every thread that waits, took the interpreter from the
# executions it waited for.
_LIVE: "weakref.WeakKeyDictionary[Any, tuple[int, list]]" = weakref.WeakKeyDictionary()
_LIVE_LOCK = threading.Lock()


def _live(machine: Any) -> list:
    """The executions of `machine` not ended (None: created, not yet started)."""
    executions = machine.executions
    with _LIVE_LOCK:
        seen, live = _LIVE.get(machine, (0, []))
        count = len(executions)
        if count < seen:
            seen, live = 0, []  # its list was replaced: looked at afresh
        live = [e for e in (*live, *executions[seen:count]) if e.exec_status is None or e.exec_status.value == "RUNNING"]
        _LIVE[machine] = (count, live)
    return live
