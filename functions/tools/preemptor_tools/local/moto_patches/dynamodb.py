"""DynamoDB: every request is atomic, as on AWS.

Gap filled: moto's `DynamoDBBackend` evaluates a write's condition and then applies the
write with no lock, and moto runs each Step Functions execution in a thread of its own. Two
executions writing one item (two schedule cycles reserving GPUs on the pool item) can both
pass their condition, and one update is lost: the pool's `used_gpus` undercounts and a later
cycle oversubscribes, a failure real DynamoDB never produces (a conditional write and a
transaction are atomic). Each item operation of the backend runs under one lock.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from moto.dynamodb.models import DynamoDBBackend

from ._core import replace

_LOCK = threading.RLock()
_OPERATIONS = ("put_item", "get_item", "update_item", "delete_item", "query", "scan", "transact_write_items")


def patch() -> None:
    for name in _OPERATIONS:
        replace(DynamoDBBackend, name, _atomic(DynamoDBBackend.__dict__[name]))


def _atomic(operation: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(operation)
    def atomic(self: DynamoDBBackend, *args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            return operation(self, *args, **kwargs)

    return atomic
