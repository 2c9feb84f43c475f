"""DynamoDB: every request is atomic, as on AWS; and its answers are written out fast.

Gap filled: moto's `DynamoDBBackend` evaluates a write's condition and then applies the
write with no lock, and moto runs each Step Functions execution in a thread of its own. Two
executions writing one item (two schedule cycles reserving GPUs on the pool item) can both
pass their condition, and one update is lost: the pool's `used_gpus` undercounts and a later
cycle oversubscribes, a failure real DynamoDB never produces (a conditional write and a
transaction are atomic). Each item operation of the backend runs under one lock.

Cost: moto writes each answer by walking the operation's output shape and asking, for every
member of every structure, a chain of alias providers where the value might be. An item
is a map of attribute values, each a structure of ten members of which one is set, so a job
item of fifty attributes costs thousands of lookups: answering took a quarter of the event
storm test's time (cProfile). The answers of the item operations are plain dictionaries
keyed by the wire names already (`DynamoResult`), so `_fast_body` writes them by the same
shape, visiting the members that are present only; anything it does not write exactly as
moto's JSON serializer does (a timestamp, a value that is not a dictionary where a structure
is due) is left to moto's serializer. `tests/integration/test_moto_answers.py` checks both
give the same body for every answer of a preemption story and for items of every type.

Cost: moto's TransactWriteItems deep-copies each table a transaction writes, once per
item of the transaction, to put it back if the transaction is cancelled: the whole jobs
table copied several times for every transaction (a fifth of the workflow tests' DynamoDB
time). `_transact_write_items` backs up the items the transaction names instead (a copy of
each as it was, or its absence), lets moto run the transaction with its tables copied as
themselves, and puts those items back when moto refuses it in any way, as moto puts the
tables back. `tests/integration/test_moto_answers.py` checks that a cancelled
transaction leaves the table as it was.

Cost: moto parses an UpdateExpression twice per update (to name its placeholders, then to
apply it), and lexes a ConditionExpression token by token (a regular expression tried per kind of token), for every
request; the controller sends the same few dozen expressions again and again, with other
values. An UpdateExpression's syntax tree names its placeholders and holds no value (the
validator deep-copies it before it puts the values in), so one parse per expression string
serves every request. A ConditionExpression's tokens hold no value either (the parser looks
the placeholders up after lexing): the lexing is kept per string, and each parse gets
fresh tokens. A malformed expression is refused as before (a failed parse is not kept).

Cost: moto's Query walks every item of the table (`Table.all_items`), sorted by key with
moto's comparisons of attribute values, to pick the few of one partition or index key, and
then sorts those it picked by their full key again. The jobs table holds every decision-log
line and event claim, so each query sorted thousands of items: a fifth of a calm story's
time. A query walks them unsorted (`_unordered_query`), and only those that may match its
key: the queried partition (moto keeps the items by it), or the items whose index key has
the queried string value. moto tests each against the key as before, and sorts what it
picks by keys that are unique, so the order it walked them in changes nothing. A scan keeps
moto's sorted walk (its order is its pages'). `tests/integration/test_moto_answers.py` checks
that every query of a preemption story answers the same either way.

Gap filled: a TransactWriteItems request carries a `ClientRequestToken` (botocore fills one
in for every call, and sends the same one with each of its retries), and DynamoDB makes the
call idempotent with it: for 10 minutes after a transaction with that token succeeded, the
same request again succeeds and writes nothing, and a different request with that token is
refused with `IdempotentParameterMismatchException`. moto ignores the token, so the retry of
a transaction whose answer was lost (the hostile world's `answer_lost_rate`) was cancelled by
its own first attempt's writes, an answer DynamoDB never gives. `_idempotent_transact` keeps
each successful transaction's token, request and time (the simulated clock's).
"""

from __future__ import annotations

import base64
import copy
import functools
import inspect
import json
import threading
from collections import deque
from enum import Enum
from typing import Any, Callable

from botocore.model import Shape
from moto.core.responses import ActionResult
from moto.core.utils import get_service_model
from moto.dynamodb import models as dynamodb_models
from moto.dynamodb.comparisons import ConditionExpressionParser
from moto.dynamodb.exceptions import ERROR_TYPE_PREFIX, DynamodbException
from moto.dynamodb.models import DynamoDBBackend
from moto.dynamodb.models.table import Table
from moto.dynamodb.parsing.expressions import UpdateExpressionParser
from moto.dynamodb.responses import DynamoHandler

from ._core import replace, sim_now

_LOCK = threading.RLock()
lock = _LOCK  # every item operation of the backend runs under it; a reader of its tables takes it too
_OPERATIONS = ("put_item", "get_item", "update_item", "delete_item", "query", "scan", "transact_write_items")
# The operations whose answers are items, written by `_fast_body`.
ITEM_ACTIONS = frozenset(
    {"GetItem", "PutItem", "UpdateItem", "DeleteItem", "Query", "Scan", "TransactWriteItems", "TransactGetItems", "BatchGetItem", "BatchWriteItem"}
)
_ORIGINAL_SERIALIZED = DynamoHandler.serialized
_ORIGINAL_UPDATE_PARSE = UpdateExpressionParser.__dict__["make"].__func__
_ORIGINAL_CONDITION_LEX = ConditionExpressionParser._lex_condition_expression
_ORIGINAL_TRANSACT_ANSWER = DynamoHandler.transact_write_items
_ORIGINAL_ALL_ITEMS = Table.all_items
_ORIGINAL_QUERY = Table.query
_QUERYING = threading.local()
_QUERY_SIGNATURE = inspect.signature(Table.query)
IDEMPOTENCY_WINDOW_S = 600.0  # how long DynamoDB keeps a transaction's ClientRequestToken


def patch() -> None:
    for name in _OPERATIONS:
        operation = _transact_write_items if name == "transact_write_items" else DynamoDBBackend.__dict__[name]
        replace(DynamoDBBackend, name, _atomic(operation))
    replace(dynamodb_models, "copy", _CopyTablesInTransactions())
    replace(DynamoHandler, "serialized", _serialized)
    _TOKENS.clear()
    replace(DynamoHandler, "transact_write_items", _idempotent_transact)
    replace(UpdateExpressionParser, "make", classmethod(_parsed_update_expression))
    replace(ConditionExpressionParser, "_lex_condition_expression", _lexed_condition_expression)
    replace(Table, "all_items", _all_items)
    replace(Table, "query", _unordered_query)


def _all_items(self: Table) -> list:
    """moto's `Table.all_items`; inside a query (`_unordered_query`), unsorted, and only the
    items that may match its key: moto tests each item it is given against the key again."""
    pick = getattr(_QUERYING, "pick", None)
    if pick is None:
        return _ORIGINAL_ALL_ITEMS(self)
    return pick()


def _unordered_query(self: Table, *args: Any, **kwargs: Any) -> Any:
    """moto's `Table.query`, walking only the items of the queried partition (a query of the
    table: `Table.items` is keyed by it) or those whose index key has the queried string
    value (an index), unsorted: it sorts what it picks."""
    bound = _QUERY_SIGNATURE.bind(self, *args, **kwargs).arguments
    _QUERYING.pick = functools.partial(_candidates, self, bound.get("index_name"), bound.get("hash_key"), bound.get("hash_key_conditions"))
    try:
        return _ORIGINAL_QUERY(self, *args, **kwargs)
    finally:
        _QUERYING.pick = None


def _candidates(table: Table, index_name: str | None, hash_key: Any, conditions: list | None) -> list:
    if not index_name and hash_key is not None:
        found = table.items.get(hash_key)
        if found is None:
            return []
        return list(found.values()) if table.range_key_attr else [found]
    items = list(table.items.values()) if not table.range_key_attr else [i for hash_set in table.items.values() for i in hash_set.values()]
    strings = [(name, value.value) for name, value in conditions or () if value.type == "S"]
    if not index_name or not conditions or len(strings) < len(conditions):
        return items  # a key that is not a string: every item, as moto walks them
    return [
        i for i in items
        if all((a := i.attrs.get(name)) is not None and a.type == "S" and a.value == value for name, value in strings)
    ]


def _parsed_update_expression(cls: type, expression: str) -> Any:
    return _update_expression_tree(expression)


@functools.lru_cache(maxsize=1024)
def _update_expression_tree(expression: str) -> Any:
    return _ORIGINAL_UPDATE_PARSE(UpdateExpressionParser, expression)


def _lexed_condition_expression(self: ConditionExpressionParser) -> deque:
    # Tokens are named tuples; their (empty) child lists are the only mutable part: fresh ones.
    return deque(node._replace(children=[]) for node in _condition_tokens(self.condition_expression))


@functools.lru_cache(maxsize=1024)
def _condition_tokens(expression: str) -> tuple:
    return tuple(_ORIGINAL_CONDITION_LEX(ConditionExpressionParser(expression, {}, {})))


def _atomic(operation: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(operation)
    def atomic(self: DynamoDBBackend, *args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            return operation(self, *args, **kwargs)

    return atomic


# --------------------------------------------------------------------------- transactions


class IdempotentParameterMismatch(DynamodbException):
    error_type = ERROR_TYPE_PREFIX + "IdempotentParameterMismatchException"

    def __init__(self) -> None:
        super().__init__(
            self.error_type,
            message="DynamoDB rejected the request because you retried a request with a different payload "
            "but with an idempotent token that was already used.",
        )


# (account, region, token) -> (the request but its token, when it succeeded, its answer),
# in the order they succeeded (the expired ones are dropped from the front)
_TOKENS: dict[tuple[str, str, str], tuple[str, float, ActionResult]] = {}


def _idempotent_transact(self: DynamoHandler) -> ActionResult:
    token = self.body.get("ClientRequestToken") if isinstance(self.body, dict) else None
    if not token:
        return _ORIGINAL_TRANSACT_ANSWER(self)
    request = json.dumps({k: v for k, v in self.body.items() if k != "ClientRequestToken"}, sort_keys=True, default=repr)
    key = (self.current_account, self.region, str(token))
    now = sim_now()
    with _LOCK:
        while _TOKENS:
            oldest = next(iter(_TOKENS))
            if now - _TOKENS[oldest][1] <= IDEMPOTENCY_WINDOW_S:
                break
            del _TOKENS[oldest]
        found = _TOKENS.get(key)
        if found is not None and now - found[1] <= IDEMPOTENCY_WINDOW_S:
            if found[0] != request:
                raise IdempotentParameterMismatch()
            return found[2]  # succeeded already: the same answer, nothing written again
        answer = _ORIGINAL_TRANSACT_ANSWER(self)
        _TOKENS.pop(key, None)  # (an expired one: kept in order of success)
        _TOKENS[key] = (request, now, answer)
        return answer


_ORIGINAL_TRANSACT_WRITE_ITEMS = DynamoDBBackend.transact_write_items
_IN_TRANSACTION = threading.local()


def _transact_write_items(self: DynamoDBBackend, transact_items: list[dict[str, Any]]) -> None:
    before = _items_before(self, transact_items)
    _IN_TRANSACTION.active = True
    try:
        _ORIGINAL_TRANSACT_WRITE_ITEMS(self, transact_items)
    except BaseException:
        _put_back(before)
        raise
    finally:
        _IN_TRANSACTION.active = False


def _items_before(backend: DynamoDBBackend, transact_items: list[dict[str, Any]]) -> list[tuple[Table, Any, Any, Any]]:
    """Each item the transaction names, as it is now (a copy) or None where there is none."""
    before: list[tuple[Table, Any, Any, Any]] = []
    for entry in transact_items:
        if not isinstance(entry, dict) or len(entry) != 1:
            continue  # moto refuses it without writing it
        ((kind, operation),) = entry.items()
        try:
            table = backend.get_table(operation["TableName"])
            hash_key, range_key = backend.get_keys_value(table, operation["Item" if kind == "Put" else "Key"])
        except Exception:
            continue  # moto refuses this one without writing it
        item = table.get_item(hash_key, range_key)
        before.append((table, hash_key, range_key, copy.deepcopy(item) if item is not None else None))
    return before


def _put_back(before: list[tuple[Table, Any, Any, Any]]) -> None:
    for table, hash_key, range_key, item in before:
        if table.has_range_key:
            if item is None:
                table.items.get(hash_key, {}).pop(range_key, None)
            else:
                table.items[hash_key][range_key] = item
        elif item is None:
            table.items.pop(hash_key, None)
        else:
            table.items[hash_key] = item


class _CopyTablesInTransactions:
    """The `copy` module of moto's DynamoDB backend, but a table copied inside
    `_transact_write_items` is the table itself (that function backs up the items instead)."""

    @staticmethod
    def deepcopy(value: Any, memo: dict[int, Any] | None = None) -> Any:
        if isinstance(value, Table) and getattr(_IN_TRANSACTION, "active", False):
            return value
        return copy.deepcopy(value, memo)

    def __getattr__(self, name: str) -> Any:
        return getattr(copy, name)


# --------------------------------------------------------------------------- answers


class _NotPlain(Exception):
    """A value `_fast_body` does not write exactly as moto's serializer would."""


def _serialized(self: DynamoHandler, action_result: ActionResult) -> Any:
    body = fast_body(self._get_action(), action_result.result)
    if body is None:
        return _ORIGINAL_SERIALIZED(self, action_result)
    headers = {"Content-Type": "application/x-amz-json-1.0"}
    headers.update(self.response_headers)
    return 200, headers, body


def fast_body(action: str | None, result: Any) -> str | None:
    """The JSON body of an item operation's answer, as moto's serializer writes it; None
    for another operation, an error, or an answer with a value `_fast_body` leaves to it."""
    if action not in ITEM_ACTIONS or not isinstance(result, dict):
        return None
    shape = get_service_model("dynamodb").operation_model(action).output_shape
    try:
        return json.dumps(_fast_body(result, shape) if shape is not None else {})
    except _NotPlain:
        return None


def _fast_body(value: Any, shape: Shape) -> Any:
    kind = shape.type_name
    if kind == "structure":
        if not isinstance(value, dict):
            raise _NotPlain(shape.name)
        members = shape.members
        # moto's serializer writes the members of the shape it finds, not None: the same
        return {k: _fast_body(v, members[k]) for k, v in value.items() if v is not None and k in members}
    if kind == "map":
        return {k: _fast_body(v, shape.value) for k, v in value.items()}
    if kind == "list":
        return [_fast_body(v, shape.member) for v in value]
    if kind == "string":
        if isinstance(value, Enum):
            value = value.value
        return str(value) if value not in (None, {}, []) else value
    if kind in ("integer", "long"):
        return int(value)
    if kind in ("float", "double"):
        return float(value)
    if kind == "boolean":
        return value
    if kind == "blob":
        return base64.b64encode(value.encode("utf-8") if isinstance(value, str) else value).strip().decode("utf-8")
    raise _NotPlain(kind)  # timestamps and anything else: moto's serializer
