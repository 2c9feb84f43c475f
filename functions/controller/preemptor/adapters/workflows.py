"""Starting the Step Functions workflows (schedule, job ended, spot interruption)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from botocore.exceptions import ClientError

from .errors import ErrorKind, classify, translate

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_NAME_MAX = 80  # Step Functions' limit on an execution name


def execution_name(*parts: str) -> str:
    """A valid, deterministic execution name (<= 80 chars), so a redelivered event that
    starts the same workflow again is refused by Step Functions instead of running twice.
    A longer one (a long pool name) keeps its first 63 characters and ends with a digest of
    the whole: cut short, the names of two windows, or two jobs, would be one, and the
    second start refused as a repeat."""
    name = "-".join(_NAME_UNSAFE.sub("_", p) for p in parts if p)
    if len(name) <= _NAME_MAX:
        return name
    return f"{name[:_NAME_MAX - 17]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def settled_schedule(pool: str, at: float, settle_s: float, name: str) -> dict:
    """The schedule execution that plans a change of `pool` (a submission, GPUs freed) made
    by `at`, together with every change within its settle window of `settle_s` seconds: one
    execution per pool and window, named after the window's end (`settle-<pool>-<end in
    ms>`), that waits until then (`settle_s` of its input). `at` must be read after the
    change was written: the execution plans after the window's end, so it sees the change.
    Every change of the window asks for that execution: Step Functions answers with it (same
    name, same input) or refuses the name (another wait left), and it plans them all. With
    the window off (0), the change's own execution (`name`) plans at once.

    Returns {"name", "input"}, as the workflows' `states:startExecution` tasks take them."""
    if settle_s <= 0:
        return {"name": name, "input": {"pool": pool}}
    end = (math.floor(at / settle_s) + 1) * settle_s
    return {
        "name": execution_name("settle", pool, f"{round(end * 1000)}"),
        "input": {"pool": pool, "settle_s": math.ceil(end - at)},
    }


class WorkflowStarter:
    def __init__(self, client: Any, arns: dict[str, str]):
        self.client = client
        self.arns = arns

    def start(self, workflow: str, name: str, payload: dict) -> str | None:
        """Start `workflow` ("schedule" | "job_ended" | "spot" | "preempt"); None if it
        already ran (or runs) under that name."""
        try:
            out = self.client.start_execution(
                stateMachineArn=self.arns[workflow], name=name, input=json.dumps(payload, sort_keys=True)
            )
        except ClientError as e:
            if classify(e) is ErrorKind.ALREADY_EXISTS:  # ExecutionAlreadyExists: a redelivery
                return None
            raise translate(e, f"StartExecution {workflow}") from e
        return out["executionArn"]

    def status(self, workflow: str, name: str) -> tuple[str, str | None] | None:
        """The status of `workflow`'s execution `name` (RUNNING, SUCCEEDED, FAILED,
        TIMED_OUT, ABORTED) and the error it failed with, None if no execution has that name."""
        arn = f"{self.arns[workflow].replace(':stateMachine:', ':execution:', 1)}:{name}"
        try:
            out = self.client.describe_execution(executionArn=arn)
            return out["status"], out.get("error")
        except ClientError as e:
            if classify(e) is ErrorKind.NOT_FOUND:  # ExecutionDoesNotExist
                return None
            raise translate(e, f"DescribeExecution {workflow} {name}") from e
