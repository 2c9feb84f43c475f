"""Waiting for Step Functions executions that moto runs in background threads."""

from __future__ import annotations

import time
from typing import Any

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
