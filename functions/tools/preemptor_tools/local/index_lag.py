"""DynamoDB's global secondary indexes as they are on AWS: eventually consistent.

A write to a table reaches its global secondary indexes a moment later ("normally under a
second"), and a query of an index cannot ask for a consistent read. moto answers an index
query from the table as it is, so code that reads an index right after a write (the plan
step reading the pool's queue, `finish` looking for a cycle's admissions, reconcile's
recount) was never shown the state it would see on AWS.

`LaggingIndex` keeps, for every item written, its image before the first write of the last
`lag_s` simulated seconds (the scenario's clock: one step of the demo is one moment), and
answers a query of an index from those images instead of the items written since: a job
submitted a moment ago is not in the queue yet, one just admitted still shows as pending,
one just deleted still shows. `HostileWorld` (`index_lag_rate`) decides which queries lag;
every other read is moto's. Queries it cannot answer exactly the way moto would (a filter,
a paginated continuation, a key condition other than `partition = :value`) are left to moto.
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Any

from moto.dynamodb.models import dynamodb_backends
from moto.dynamodb.models.dynamo_type import DynamoType

from .moto_patches.dynamodb import lock as moto_dynamodb_lock
from .scenario import ACCOUNT

LAG_S = 1.0  # how long a write stays out of the indexes (simulated seconds)
_WRITES = ("PutItem", "UpdateItem", "DeleteItem", "TransactWriteItems")
_EQUALS = re.compile(r"^\s*(#?\w+)\s*=\s*(:\w+)\s*$")

Key = tuple[str, ...]  # an item's primary key values, as strings
Image = dict[str, Any] | None  # an item in DynamoDB JSON, or None: it did not exist


class LaggingIndex:
    """What the indexes still show of the items written in the last `lag_s` seconds."""

    def __init__(self, clock: Any, lag_s: float = LAG_S) -> None:
        self.clock = clock
        self.lag_s = lag_s
        self._before: dict[tuple[str, str], dict[Key, tuple[Image, float]]] = {}  # (region, table) -> key -> (image, first write)
        self._lock = threading.Lock()

    # -- writes ------------------------------------------------------------------------------
    def note_write(self, region: str, operation: str, params: dict) -> None:
        """Remember, before a write, the image of each item it names (unless one of the last
        `lag_s` seconds is remembered already: the index shows the oldest)."""
        if operation not in _WRITES:
            return
        for table_name, key in _written_keys(operation, params):
            table = _table(region, table_name)
            if table is None:
                continue
            now = self.clock.now()
            with self._lock:
                before = self._before.setdefault((region, table.name), {})
                k = _key(table, key)
                if k is None:
                    continue
                seen = before.get(k)
                if seen is not None and seen[1] >= now - self.lag_s:
                    continue
                with moto_dynamodb_lock:
                    item = _get(table, key)
                    before[k] = (copy.deepcopy(item.to_json()["Attributes"]) if item is not None else None, now)

    # -- index queries -------------------------------------------------------------------------
    def lagging_answer(self, region: str, params: dict) -> dict | None:
        """The answer (its body) to a query of an index as the index stands `lag_s` behind the table, or
        None when no item the query could see was written that recently (or the query is one
        moto must answer: see the module's docstring)."""
        index_name = params.get("IndexName")
        if not index_name or params.get("FilterExpression") or params.get("ExclusiveStartKey") or params.get("Select") == "COUNT":
            return None
        table = _table(region, params.get("TableName", ""))
        if table is None:
            return None
        index = next((i for i in table.global_indexes if i.name == index_name), None)
        condition = _EQUALS.match(params.get("KeyConditionExpression", ""))
        if index is None or condition is None:
            return None
        names = params.get("ExpressionAttributeNames") or {}
        attribute = names.get(condition.group(1), condition.group(1))
        value = (params.get("ExpressionAttributeValues") or {}).get(condition.group(2))
        hash_attr = next(k["AttributeName"] for k in index.schema if k["KeyType"] == "HASH")
        range_attr = next((k["AttributeName"] for k in index.schema if k["KeyType"] == "RANGE"), None)
        if attribute != hash_attr or value is None:
            return None
        now = self.clock.now()
        with self._lock:
            recent = {k: image for k, (image, at) in self._before.get((region, table.name), {}).items() if at >= now - self.lag_s}
        if not recent:
            return None
        with moto_dynamodb_lock:
            current = {_key(table, attrs): attrs for attrs in (i.to_json()["Attributes"] for i in _items(table))}
        changed = {k: image for k, image in recent.items() if image != current.get(k)}
        if not any(image is not None and image.get(hash_attr) == value for image in (*changed.values(), *(current.get(k) for k in changed))):
            return None  # nothing written recently is, or was, in this partition of the index
        images = dict(current)
        for k, image in changed.items():
            if image is None:
                images.pop(k, None)
            else:
                images[k] = image
        shown = [i for i in images.values() if i.get(hash_attr) == value and (range_attr is None or range_attr in i)]
        if range_attr is not None:
            shown.sort(key=lambda i: _sortable(i[range_attr]), reverse=params.get("ScanIndexForward") is False)
        parsed: dict[str, Any] = {}
        limit = params.get("Limit")
        if limit is not None and len(shown) > limit:
            shown = shown[:limit]
            last = shown[-1]
            key_attrs = [*table.table_key_attrs, hash_attr, *([range_attr] if range_attr else [])]
            parsed["LastEvaluatedKey"] = {a: last[a] for a in key_attrs if a in last}
        parsed.update({"Items": copy.deepcopy(shown), "Count": len(shown), "ScannedCount": len(shown)})
        return parsed


def _written_keys(operation: str, params: dict) -> list[tuple[str, dict]]:
    if operation == "PutItem":
        return [(params.get("TableName", ""), params.get("Item") or {})]
    if operation in ("UpdateItem", "DeleteItem"):
        return [(params.get("TableName", ""), params.get("Key") or {})]
    out = []
    for entry in params.get("TransactItems") or []:
        for kind in ("Put", "Update", "Delete"):
            if kind in entry:
                write = entry[kind]
                out.append((write.get("TableName", ""), write.get("Item") or write.get("Key") or {}))
    return out


def _table(region: str, name: str) -> Any:
    try:
        return dynamodb_backends[ACCOUNT][region].tables.get(name)
    except KeyError:
        return None


def _key(table: Any, attributes: dict) -> Key | None:
    values = []
    for attr in table.table_key_attrs:
        typed = attributes.get(attr)
        if not isinstance(typed, dict) or len(typed) != 1:
            return None
        (kind, value), = typed.items()
        values.append(f"{kind}:{value}")
    return tuple(values)


def _get(table: Any, key: dict) -> Any:
    hash_key = DynamoType(key[table.hash_key_attr])
    range_key = DynamoType(key[table.range_key_attr]) if table.range_key_attr else None
    return table.get_item(hash_key, range_key)


def _items(table: Any) -> list[Any]:
    if table.range_key_attr:
        return [item for by_range in table.items.values() for item in by_range.values()]
    return list(table.items.values())


def _sortable(typed: dict) -> Any:
    (kind, value), = typed.items()
    return float(value) if kind == "N" else value

