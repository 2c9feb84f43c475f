"""Starting the Step Functions workflows (schedule, job ended, spot interruption)."""

from __future__ import annotations

import json
import re
from typing import Any

from botocore.exceptions import ClientError

from .errors import ErrorKind, classify, translate

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def execution_name(*parts: str) -> str:
    """A valid, deterministic execution name (<= 80 chars), so a redelivered event that
    starts the same workflow again is refused by Step Functions instead of running twice."""
    name = "-".join(_NAME_UNSAFE.sub("_", p) for p in parts if p)
    return name[:80]


class WorkflowStarter:
    def __init__(self, client: Any, arns: dict[str, str]):
        self.client = client
        self.arns = arns

    def start(self, workflow: str, name: str, payload: dict) -> str | None:
        """Start `workflow` ("schedule" | "job_ended" | "spot"); None if it already ran."""
        try:
            out = self.client.start_execution(
                stateMachineArn=self.arns[workflow], name=name, input=json.dumps(payload, sort_keys=True)
            )
        except ClientError as e:
            if classify(e) is ErrorKind.ALREADY_EXISTS:  # ExecutionAlreadyExists: a redelivery
                return None
            raise translate(e, f"StartExecution {workflow}") from e
        return out["executionArn"]
