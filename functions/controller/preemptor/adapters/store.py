"""The jobs table (DynamoDB): jobs, run aliases, pools with their usage, the decision log.

Every status change is a field-level `UpdateItem` under a condition on the old status,
incarnation and version, and every change of a pool's usage happens in the same
transaction as the status change that causes it, so capacity is taken and released exactly
once, whatever the event order. Only the fields a transition changes are written: a field
another writer set meanwhile (a cancel, a checkpoint time) is never overwritten.

A transaction DynamoDB cancels for a concurrent one (`TransactionConflict`) wrote nothing:
it is retried here with backoff and jitter, then surfaces as the retryable
`TransactionConflict`, never as "already done". A failed condition is re-read and judged.
"""

from __future__ import annotations

import itertools
import json
import random
import time
import uuid
from dataclasses import dataclass, field as dataclass_field, fields as dataclass_fields
from decimal import Decimal
from typing import Any, Callable, Iterable, Iterator, TypeVar

from boto3.dynamodb.types import TypeDeserializer, TypeSerializer
from botocore.exceptions import ClientError

from ..core.errors import CapacityExhausted, ConflictError, EventInProgress, JobNotFound, LeaseLost, PoolDrained, TransactionConflict
from ..core.jobs import JobRecord
from ..core.model import EndedRun, JobState, Notice, PastPreemption, TeamUsage
from ..core.s3uri import S3Uri
from .errors import NO_ANSWER, translate

GSI = "ByPoolStatus"
EVENT_TTL_S = 7 * 24 * 3600
# A run's aliases (its EC2 instance, its Batch service job) are read only while the run
# lives; they expire well beyond the longest run SageMaker allows (28 days), so a table
# that has seen a million runs does not keep a million dead aliases.
ALIAS_TTL_S = 90 * 24 * 3600
# A claim outlives the intake function's 60 s timeout (a live handling is never taken
# over), and ends before Lambda's retries of a failed delivery (1 min, then 2 min more,
# after the failure): a handling killed mid-way is redone by a retry, not lost as a duplicate.
EVENT_CLAIM_S = 90
PREEMPTION_MEMORY_S = 7 * 86400  # a preemption's budget record outlives any sensible budget window
NOTICE_TTL_S = 7 * 86400  # a notice nothing could publish in a week is dropped
CYCLE_RESERVATION_TTL_S = 86400  # read back within its cycle's minutes (`cycle_reservations`)
USAGE_SETTLE_S = 5 * 60  # far beyond the index's propagation delay (normally under a second)
TRANSACT_ATTEMPTS = 5
CLAIM_ATTEMPTS = 3  # an adopted run's claim of a checkpoint location, each after a write meanwhile
TRANSACT_BACKOFF_S = 0.05  # full jitter: attempt n sleeps up to 0.05 x 2^n s
_JSON_FIELDS = ("request", "labels", "spot_interruptions")
_INT_FIELDS = ("gpus", "priority", "incarnation", "preemptions", "stops_without_fresh_checkpoint", "version", "launch_attempts", "launches_given_up")
_FLOAT_FIELDS = ("lost_gpu_seconds",)
# Fields another writer may set while a transition is decided, without changing the
# decision: a transition whose read missed only these is re-applied on the fresh item.
_NOTES = frozenset({"last_checkpoint_at", "nominated_at"})

_LOG_SEQ = itertools.count()
T = TypeVar("T")
NOT_APPLIED = object()  # `_written_or_again`: the write that got no answer was not applied
_ser = TypeSerializer()
_de = TypeDeserializer()


def _to_attr(value: Any) -> dict:
    if isinstance(value, float):
        value = Decimal(repr(value))
    return _ser.serialize(value)


def _from_attr(attr: dict) -> Any:
    value = _de.deserialize(attr)
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value


# A job's first line: written with a key of its own (`once`), it would sort after the
# job's other lines of the same instant (a lowering handled in the millisecond of its
# submission) by key alone.
_FIRST_LINES = frozenset({"submitted", "adopted"})


def _log_order(entry: dict) -> tuple:
    """Time order of log entries: by their key's millisecond, a job's first line before
    the lines of the same millisecond, then by key (the writer's sequence)."""
    sk = entry["sk"]
    return sk[: len("LOG#") + 17], entry["kind"] not in _FIRST_LINES, sk


def _marshal(fields: dict) -> dict:
    return {k: _to_attr(v) for k, v in fields.items() if v is not None}


def _unmarshal(item: dict) -> dict:
    return {k: _from_attr(v) for k, v in item.items()}


def job_key(name: str) -> dict:
    return {"pk": {"S": f"JOB#{name}"}, "sk": {"S": "JOB"}}


def pool_key(name: str) -> dict:
    return {"pk": {"S": f"POOL#{name}"}, "sk": {"S": "POOL"}}


def pending_rank(priority: int, submitted_at: float, name: str) -> str:
    """Sort key of the pending index: ascending order is the planner's rank order."""
    return f"{1000 - priority:04d}#{submitted_at:017.3f}#{name}"


def index_keys(record: JobRecord) -> dict:
    """GSI attributes: pending and capacity-holding jobs are indexed per pool; terminal ones not."""
    if record.status is JobState.PENDING:
        return {
            "gsi1pk": f"{record.pool}#PENDING",
            "gsi1sk": pending_rank(record.priority, record.submitted_at, record.name),
        }
    if record.status.holds_capacity:
        return {"gsi1pk": f"{record.pool}#ACTIVE", "gsi1sk": record.name}
    return {}


def _stored_value(record: JobRecord, name: str) -> Any:
    value = getattr(record, name)
    if name == "status":
        return value.value
    if name in _JSON_FIELDS:
        return json.dumps(value, sort_keys=True)
    return value


def _checkpoint_key(checkpoint_s3_uri: str) -> dict[str, str]:
    """The key of the alias that maps a checkpoint location to its job."""
    return {"pk": f"CKPT#{S3Uri.parse(checkpoint_s3_uri).location}", "sk": "CKPT"}


def record_to_item(record: JobRecord) -> dict:
    fields = {f: _stored_value(record, f) for f in record.__dataclass_fields__}
    fields.update(index_keys(record))
    item = _marshal(fields)
    item.update(job_key(record.name))
    return item


def changed_fields(old: JobRecord, new: JobRecord) -> dict[str, Any]:
    """The stored attributes `new` changes (None: remove), index keys included."""
    out = {
        f.name: _stored_value(new, f.name)
        for f in dataclass_fields(JobRecord)
        if f.name != "version" and getattr(old, f.name) != getattr(new, f.name)
    }
    old_index, new_index = index_keys(old), index_keys(new)
    for key in ("gsi1pk", "gsi1sk"):
        if old_index.get(key) != new_index.get(key):
            out[key] = new_index.get(key)
    return out


def _update_expression(changes: dict[str, Any], version: int) -> dict:
    """SET/REMOVE of `changes` plus the version bump, with placeholders for every name."""
    names, values, sets, removes = {"#ver": "version"}, {":ver1": _to_attr(version + 1)}, ["#ver = :ver1"], []
    for i, (field, value) in enumerate(sorted(changes.items())):
        names[f"#f{i}"] = field
        if value is None:
            removes.append(f"#f{i}")
        else:
            values[f":v{i}"] = _to_attr(value)
            sets.append(f"#f{i} = :v{i}")
    expression = "SET " + ", ".join(sets) + (" REMOVE " + ", ".join(removes) if removes else "")
    return {"UpdateExpression": expression, "ExpressionAttributeNames": names, "ExpressionAttributeValues": values}


def _version_condition(version: int) -> str:
    # Items written before versions existed have none: they are at version 0.
    return "(attribute_not_exists(#ver) OR #ver = :ver)" if version == 0 else "#ver = :ver"


def replace_version(record: JobRecord, version: int) -> JobRecord:
    return record.with_changes(version=version)


def _preemption_key(pool: str, at: float, victim: str) -> dict:
    """The key of a victim's preemption in its pool's budget window: its mark's time and name."""
    return {"pk": {"S": f"POOL#{pool}"}, "sk": {"S": f"PREEMPT#{at:017.3f}#{victim}"}}


def _preemption_item(p: PastPreemption) -> dict:
    """A preemption in its pool's budget window; it expires (TTL) once no window can reach it."""
    return _marshal(
        {
            "pk": f"POOL#{p.pool}",
            "sk": f"PREEMPT#{p.at:017.3f}#{p.victim}",
            "at": p.at,
            "gpus": p.gpus,
            "lost_gpu_seconds": p.lost_gpu_seconds,
            "victim": p.victim,
            "expires_at": int(p.at + PREEMPTION_MEMORY_S),
        }
    )


def _ended_run_key(run: EndedRun) -> dict:
    return {"pk": {"S": f"POOL#{run.pool}"}, "sk": {"S": f"RUNEND#{run.job}#{run.incarnation}"}}


def _ended_run_item(run: EndedRun) -> dict:
    """A run's end, kept until it is folded into its team's usage."""
    return {
        **_ended_run_key(run),
        **_marshal(
            {
                "team": run.team,
                "job": run.job,
                "incarnation": run.incarnation,
                "gpus": run.gpus,
                "started_at": run.started_at,
                "ended_at": run.ended_at,
            }
        ),
    }


def _notice_key(notice: Notice) -> dict:
    return {"pk": {"S": f"POOL#{notice.pool}"}, "sk": {"S": f"NOTICE#{notice.at:017.3f}#{notice.job}#{notice.kind}"}}


def _notice_item(notice: Notice) -> dict:
    """A notice kept until published; it expires (TTL) after a week if nothing could publish it."""
    fields = {
        "at": notice.at,
        "kind": notice.kind,
        "job": notice.job,
        "team": notice.team,
        "subject": notice.subject,
        "message": json.dumps(notice.message, sort_keys=True, default=str),
        "expires_at": int(notice.at + NOTICE_TTL_S),
    }
    return {**_notice_key(notice), **_marshal(fields)}


def _cycle_item(pool: str, mark: str, record: JobRecord) -> dict:
    """A scheduling cycle's reservation of `record` (admitted, or marked as a victim), under
    its pool (`JobsStore.cycle_reservations`)."""
    admitted = record.status is JobState.ADMITTED
    at = (record.admitted_at if admitted else record.preempting_since) or 0.0
    fields = {
        "job": record.name,
        "incarnation": record.incarnation,
        "kind": "admitted" if admitted else "marked",
        "expires_at": int(at + CYCLE_RESERVATION_TTL_S),
    }
    return {"pk": {"S": f"POOL#{pool}"}, "sk": {"S": f"CYCLE#{mark}#{record.name}"}, **_marshal(fields)}


def _rebase(seen: JobRecord, new: JobRecord, current: JobRecord | None, expect: tuple[JobState, ...]) -> JobRecord | None:
    """`new`'s changes applied on `current`, if what changed since `seen` was read is only
    notes the change does not touch; None when the change must be judged again."""
    if current is None or current.status not in expect or current.incarnation != seen.incarnation:
        return None
    if current.version == seen.version:
        return None  # the condition failed for another reason (the index keys, a lost race)
    moved = {f.name for f in dataclass_fields(JobRecord) if f.name != "version" and getattr(current, f.name) != getattr(seen, f.name)}
    ours = {f.name for f in dataclass_fields(JobRecord) if f.name != "version" and getattr(new, f.name) != getattr(seen, f.name)}
    if not moved <= _NOTES or moved & ours:
        return None
    return current.with_changes(**{name: getattr(new, name) for name in ours})


@dataclass(frozen=True)
class LogLine:
    """A decision-log entry written in the same transaction as the state change it tells
    (`JobsStore.transition(log=...)`): both are written, or neither. A line written after
    its change is lost when that write is refused or the function dies between the two, and
    the retry, finding the change made, does not write it again."""

    job: str
    at: float
    kind: str
    reason: str
    detail: str = ""
    extra: dict = dataclass_field(default_factory=dict)
    once: str | None = None  # as `JobsStore.log`'s: written again with the same `at`, it replaces itself


@dataclass(frozen=True, slots=True)
class UsageRecount:
    """What a usage recount of a pool saw and did."""

    pool: str
    stored: int
    counted: int
    applied: bool
    reason: str  # in-step | drift-seen | drift-unconfirmed | usage-moved | repaired


def item_to_record(item: dict) -> JobRecord:
    data = _unmarshal(item)
    kwargs = {f: data[f] for f in JobRecord.__dataclass_fields__ if f in data}
    kwargs["status"] = JobState(kwargs["status"])
    for name in _JSON_FIELDS:
        if name in kwargs:
            kwargs[name] = json.loads(kwargs[name])
    for name in _INT_FIELDS:
        if name in kwargs:
            kwargs[name] = int(kwargs[name])
    for name in _FLOAT_FIELDS:
        if name in kwargs:
            kwargs[name] = float(kwargs[name])
    return JobRecord(**kwargs)


class JobsStore:
    """Typed access to the jobs table. `client` is a boto3 DynamoDB client; `sleep` and
    `rng` pace the retries of conflicting transactions (injected by tests)."""

    def __init__(
        self,
        table_name: str,
        client: Any,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ):
        self.table = table_name
        self.client = client
        self._sleep = sleep
        self._rng = rng or random.Random()

    # -- errors ---------------------------------------------------------------------------
    def _call(self, method: str, **kwargs) -> dict:
        try:
            return getattr(self.client, method)(**kwargs)
        except ClientError as e:
            raise translate(e, f"DynamoDB {method}") from e

    def _pages(self, operation: str, **kwargs) -> Iterator[dict]:
        """Every item of a query or scan, page after page (botocore's paginator)."""
        try:
            for page in self.client.get_paginator(operation).paginate(**kwargs):
                yield from page.get("Items", [])
        except ClientError as e:
            raise translate(e, f"DynamoDB {operation}") from e

    def _written_or_again(self, write: Callable[[], T], applied: Callable[[], T | object]) -> T:
        """`write()`. When no answer comes back (botocore's retries ran out on a lost
        connection), it may have been applied: `applied()`, a consistent read, gives what it
        answered, or NOT_APPLIED, and then it is made once more (a write still in flight then
        meets its own condition; a second lost answer is raised)."""
        try:
            return write()
        except NO_ANSWER:
            found = applied()
            return write() if found is NOT_APPLIED else found  # type: ignore[return-value]

    def _transact(self, items: list[dict]) -> None:
        """TransactWriteItems, retried with full-jitter backoff while DynamoDB cancels it
        for a concurrent transaction (nothing was written); then `TransactionConflict`."""
        for attempt in range(TRANSACT_ATTEMPTS):
            try:
                self._call("transact_write_items", TransactItems=items)
                return
            except TransactionConflict:
                if attempt == TRANSACT_ATTEMPTS - 1:
                    raise
                self._sleep(self._rng.uniform(0, TRANSACT_BACKOFF_S * 2**attempt))

    # -- pools ----------------------------------------------------------------------------
    def ensure_pool(self, name: str, capacity_gpus: int) -> None:
        """Create the pool item, or update its capacity; usage is left as it is."""
        self._call(
            "update_item",
            TableName=self.table,
            Key=pool_key(name),
            UpdateExpression="SET capacity_gpus = :c, used_gpus = if_not_exists(used_gpus, :zero), #n = :name",
            ExpressionAttributeNames={"#n": "name"},
            ExpressionAttributeValues={":c": _to_attr(capacity_gpus), ":zero": _to_attr(0), ":name": _to_attr(name)},
        )

    def mark_unavailable(self, pool: str, instance_type: str, until: float, cache: str = "unavailable") -> None:
        """Remember that `instance_type` just had no capacity for `pool`: launches avoid it
        until `until` (the unavailable-offerings cache, on the pool item). `cache`
        "no_capacity": the service itself had none (`no_capacity_until`), not the account's
        quota."""
        self._call(
            "update_item",
            TableName=self.table,
            Key=pool_key(pool),
            UpdateExpression="SET #c = if_not_exists(#c, :empty)",
            ExpressionAttributeNames={"#c": cache},
            ExpressionAttributeValues={":empty": {"M": {}}},
        )
        self._call(
            "update_item",
            TableName=self.table,
            Key=pool_key(pool),
            UpdateExpression="SET #c.#t = :until",
            ExpressionAttributeNames={"#c": cache, "#t": instance_type},
            ExpressionAttributeValues={":until": _to_attr(until)},
        )

    def note_quota(self, pool: str, gpus: int, until: float, quota: str, *, over: dict | None = None) -> bool:
        """The account's quota of `pool`'s offering (`quota`, as Service Quotas names it)
        leaves it `gpus`, fewer than it is configured for: it is planned at that until
        `until` (`quota_capacity_gpus`). Written unconditionally (a launch's refusal: the
        newest word), or, with `over` (the note as `noted_quota` read it: a renewal), only over
        that note: one forgotten since (an operator's `quota-raised`) or noted again stands.
        Returns whether it was written."""
        cap = {":cap": {"M": {"gpus": _to_attr(gpus), "until": _to_attr(float(until)), "quota": _to_attr(quota)}}}
        return self._write_quota_note(pool, "SET quota_cap = :cap", cap, over=over)

    def noted_quota(self, pool: str) -> dict | None:
        """The quota `note_quota` last wrote for `pool` ({"gpus", "until", "quota"}), its
        memory over or not, or None."""
        item = self._call("get_item", TableName=self.table, Key=pool_key(pool), ProjectionExpression="quota_cap", ConsistentRead=True).get("Item")
        cap = _unmarshal(item or {}).get("quota_cap")
        if not cap:
            return None
        return {"gpus": int(cap["gpus"]), "until": float(cap["until"]), "quota": str(cap["quota"])}

    def forget_quota(self, pool: str, noted: dict) -> bool:
        """`pool` is planned at its configured size again: the quota `noted` (as
        `noted_quota` read it) covers it now. A quota noted since (a launch refused
        meanwhile: the newer word) is left. Returns whether it was forgotten."""
        return self._write_quota_note(pool, "REMOVE quota_cap", {}, over=noted)

    def _write_quota_note(self, pool: str, update: str, values: dict, *, over: dict | None) -> bool:
        """`update` of the pool's quota note; with `over` (the note as `noted_quota` read it),
        only over that note. Returns whether it was written. `values` may be empty only with
        `over` (which adds `:until`): DynamoDB refuses an empty ExpressionAttributeValues."""
        condition = {}
        if over is not None:
            condition = {"ConditionExpression": "quota_cap.#u = :until", "ExpressionAttributeNames": {"#u": "until"}}
            values = {**values, ":until": _to_attr(float(over["until"]))}
        try:
            self._call(
                "update_item", TableName=self.table, Key=pool_key(pool), UpdateExpression=update, ExpressionAttributeValues=values, **condition
            )
        except ConflictError:
            return False
        return True

    @staticmethod
    def quota_capacity_gpus(item: dict | None, capacity_gpus: int, now: float) -> int:
        """The GPUs a pool whose item is `item`, configured for `capacity_gpus`, is planned at:
        fewer while the account's quota left it fewer a moment ago (`note_quota`)."""
        cap = (item or {}).get("quota_cap") or {}
        if not cap or float(cap.get("until", 0)) <= now:
            return capacity_gpus
        return min(capacity_gpus, int(cap["gpus"]))

    def capacity_seen(self, pool: str, offering: str) -> bool:
        """A run of `pool` on `offering` got its instances: the service has capacity there
        again, and `no_capacity_until` forgets it (False: it was not marked).

        Read first, written only when marked: every run's start comes here, and a write to
        the pool item (its count, which admissions change in transactions) would cancel an
        admission under way with a TransactionConflict for nothing."""
        item = self._call(
            "get_item", TableName=self.table, Key=pool_key(pool), ProjectionExpression="no_capacity.#t",
            ExpressionAttributeNames={"#t": offering},
        ).get("Item")
        if not item:
            return False
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression="REMOVE no_capacity.#t",
                ConditionExpression="attribute_exists(no_capacity.#t)",
                ExpressionAttributeNames={"#t": offering},
            )
        except ConflictError:
            return False
        return True

    # The offering of a pool without a choice of them (one instance type or queue).
    ANY_OFFERING = "*"

    @staticmethod
    def no_capacity_until(item: dict | None, offerings: tuple[str, ...], now: float) -> float | None:
        """Until when (about) the service has no capacity for any offering of a pool whose
        item is `item`: its launches met none (CapacityError, InsufficientCapacity, a Batch
        queue without instances) on each of `offerings` ("*" for a pool without a choice)
        within UNAVAILABLE_OFFERING_S and no run got instances since. None: capacity may be
        there."""
        marks = (item or {}).get("no_capacity") or {}
        untils = [float(marks[o]) for o in offerings if o in marks]
        if len(untils) < len(offerings) or not untils or min(untils) <= now:
            return None
        return min(untils)

    def unavailable_offerings(self, pool: str, now: float) -> set[str]:
        """Instance types of `pool` that had no capacity a moment ago (still cached at `now`)."""
        item = self.pool(pool) or {}
        return {t for t, until in (item.get("unavailable") or {}).items() if float(until) > now}

    def pool(self, name: str) -> dict | None:
        item = self._call("get_item", TableName=self.table, Key=pool_key(name), ConsistentRead=True).get("Item")
        return _unmarshal(item) if item else None

    def set_pool_usage(self, name: str, used_gpus: int) -> None:
        """Overwrite usage unconditionally: only for seeding a table (benchmarks, tests).
        Reconcile repairs usage with `recount_usage`."""
        self._call(
            "update_item",
            TableName=self.table,
            Key=pool_key(name),
            UpdateExpression="SET used_gpus = :u, usage_seq = if_not_exists(usage_seq, :zero) + :one",
            ExpressionAttributeValues={":u": _to_attr(used_gpus), ":zero": _to_attr(0), ":one": _to_attr(1)},
        )

    def recount_usage(self, pool: str, now: float, settle_s: float = USAGE_SETTLE_S) -> UsageRecount:
        """Recount the GPUs held in `pool` and repair the pool's `used_gpus` if it drifted.

        The holders are found through the pool's index (eventually consistent: a job admitted
        a moment ago may be missing) and each is confirmed by a consistent read (a job that
        ended a moment ago does not count). Usage is written only when the same drift is seen
        twice, `settle_s` apart, with no change of usage in between (`usage_seq`, bumped by
        every usage change, unchanged): by then the index has caught up, so an admission it
        did not show yet is never undercounted. The write is conditional on the observed
        usage and sequence. Run it under the pool's lease.
        """
        stored = self.pool(pool) or {}
        used, seq = int(stored.get("used_gpus", 0)), int(stored.get("usage_seq", 0))
        counted = 0
        for item in self._pages(
            "query",
            TableName=self.table,
            IndexName=GSI,
            KeyConditionExpression="gsi1pk = :p",
            ExpressionAttributeValues={":p": {"S": f"{pool}#ACTIVE"}},
        ):
            current = self.get(_from_attr(item["pk"]).removeprefix("JOB#"))
            if current is not None and current.pool == pool and current.status.holds_capacity:
                counted += current.gpus
        suspect = stored.get("recount_suspect")
        suspect = json.loads(suspect) if suspect else None
        if counted == used:
            if suspect:
                self._pool_update(pool, "REMOVE recount_suspect", seq, used)
            return UsageRecount(pool, used, counted, False, "in-step")
        observation = {"seq": seq, "used": used, "counted": counted}
        if suspect is None or {k: suspect.get(k) for k in observation} != observation:
            reason = "drift-seen" if suspect is None else "usage-moved"
            self._pool_update(pool, "SET recount_suspect = :s", seq, used, {":s": json.dumps({**observation, "at": now})})
            return UsageRecount(pool, used, counted, False, reason)
        if now - float(suspect["at"]) < settle_s:
            return UsageRecount(pool, used, counted, False, "drift-unconfirmed")
        applied = self._pool_update(
            pool,
            "SET used_gpus = :c, usage_seq = :next REMOVE recount_suspect",
            seq,
            used,
            {":c": counted, ":next": seq + 1},
        )
        return UsageRecount(pool, used, counted, applied, "repaired" if applied else "usage-moved")

    def _pool_update(self, pool: str, expression: str, seq: int, used: int, values: dict | None = None) -> bool:
        """An update of the pool item if its usage and usage sequence are still as observed."""
        attr_values = {":seq": _to_attr(seq), ":used": _to_attr(used)}
        attr_values.update({k: _to_attr(v) for k, v in (values or {}).items()})
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression=expression,
                ConditionExpression="(attribute_not_exists(usage_seq) OR usage_seq = :seq) AND "
                "(attribute_not_exists(used_gpus) OR used_gpus = :used)",
                ExpressionAttributeValues=attr_values,
            )
            return True
        except ConflictError:
            return False

    def set_drained(self, pool: str, drained: bool, at: float, note: str = "") -> None:
        """Drain a pool (its cycles admit nothing and preempt nothing; `note` says why), or
        undrain it. The flag is on the pool item; its capacity and usage are left as they are."""
        if drained:
            expression = "SET drained = :t, drained_at = :at, drained_note = :n"
            values = {":t": _to_attr(True), ":at": _to_attr(at), ":n": _to_attr(note)}
        else:
            expression, values = "REMOVE drained, drained_at, drained_note", None
        self._call(
            "update_item",
            TableName=self.table,
            Key=pool_key(pool),
            UpdateExpression=expression,
            **({"ExpressionAttributeValues": values} if values else {}),
        )

    def remember_waits(self, pool: str, waiting: list[dict], now: float) -> None:
        """Keep the latest plan's reasons why jobs wait on the pool item, for `explain`."""
        self._call(
            "update_item",
            TableName=self.table,
            Key=pool_key(pool),
            UpdateExpression="SET last_plan_at = :t, last_waits = :w",
            ExpressionAttributeValues={":t": _to_attr(now), ":w": _to_attr(json.dumps(waiting[:100]))},
        )

    # -- scheduler lease (serialises scheduling per pool) ---------------------------------
    def acquire_lease(self, pool: str, owner: str, now: float, ttl_s: float) -> bool:
        """Take the pool's scheduling lease; if someone holds it, ask them to run again.

        When no answer comes back (botocore's retries ran out on a lost connection), the
        write may have been applied: a consistent read tells. A lease taken without its
        taker knowing would hold the pool for its whole life, every plan meanwhile told that
        another run holds it."""
        try:
            return self._take_lease(pool, owner, now, ttl_s)
        except NO_ANSWER:
            if self.lease_holder(pool) == owner:
                return True
            raise

    def _take_lease(self, pool: str, owner: str, now: float, ttl_s: float) -> bool:
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression="SET lease_owner = :o, lease_expires = :e, rerun = :f",
                ConditionExpression="attribute_not_exists(lease_owner) OR lease_expires < :now OR lease_owner = :o",
                ExpressionAttributeValues={
                    ":o": _to_attr(owner),
                    ":e": _to_attr(now + ttl_s),
                    ":now": _to_attr(now),
                    ":f": _to_attr(False),
                },
            )
            return True
        except ConflictError:
            self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression="SET rerun = :t",
                ExpressionAttributeValues={":t": _to_attr(True)},
            )
            return False

    def lease_holder(self, pool: str) -> str | None:
        """Who holds the pool's scheduling lease (a consistent read), expired or not."""
        return (self.pool(pool) or {}).get("lease_owner")

    def release_lease(self, pool: str, owner: str) -> bool:
        """Give the lease back, always (the next cycle takes it again). Returns True if the
        holder must plan again: someone asked for a plan while it held the lease.

        The request to plan again (`rerun`) stays on the item until the next holder takes
        the lease: a release resent after its answer was lost (its condition fails, the
        lease being gone) still reads it."""
        try:
            out = self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression="REMOVE lease_owner, lease_expires",
                ConditionExpression="lease_owner = :o",
                ExpressionAttributeValues={":o": _to_attr(owner)},
                ReturnValues="ALL_OLD",
            )
        except ConflictError:
            item = _unmarshal(self._call("get_item", TableName=self.table, Key=pool_key(pool), ConsistentRead=True).get("Item") or {})
            if "lease_owner" in item:
                return False  # the lease expired and someone else holds it: they will plan
            return bool(item.get("rerun", False))  # released already (by this very call)
        return bool(_unmarshal(out.get("Attributes", {})).get("rerun", False))

    def clear_expired_lease(self, pool: str, now: float) -> str | None:
        """Remove a lease whose holder died (expired and never given back); returns the
        holder it belonged to, or None when there was nothing to clear."""
        try:
            out = self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression="REMOVE lease_owner, lease_expires",
                ConditionExpression="attribute_exists(lease_owner) AND lease_expires < :now",
                ExpressionAttributeValues={":now": _to_attr(now)},
                ReturnValues="UPDATED_OLD",
            )
        except ConflictError:
            return None
        return str(_unmarshal(out.get("Attributes", {})).get("lease_owner", ""))

    def register_pool(self, name: str) -> None:
        """Remember that `name` was a configured pool (reconcile finds pools that left the
        configuration by comparing this set with the configuration)."""
        self._call(
            "update_item",
            TableName=self.table,
            Key={"pk": {"S": "POOLS"}, "sk": {"S": "POOLS"}},
            UpdateExpression="ADD #n :n",
            ExpressionAttributeNames={"#n": "names"},
            ExpressionAttributeValues={":n": {"SS": [name]}},
        )

    def known_pools(self) -> set[str]:
        item = self._call(
            "get_item", TableName=self.table, Key={"pk": {"S": "POOLS"}, "sk": {"S": "POOLS"}}, ConsistentRead=True
        ).get("Item")
        return set(item["names"]["SS"]) if item and "names" in item else set()

    # -- jobs -----------------------------------------------------------------------------
    def put_new(self, record: JobRecord, log: LogLine | None = None) -> bool:
        """Insert a job (with `log`, its decision-log line, in the same transaction). Returns
        False if a job of that name already exists (duplicate).

        When no answer comes back (botocore's retries ran out on a lost connection), the
        insert may have been applied: a consistent read tells. This very record (the same
        submitting event, `submitted_by`) is the insert's own; none there is inserted once
        more (a write still in flight then refuses it: False, and the caller reads whose it
        is); another job's is a duplicate. Raised, the submission would wait a minute for
        Lambda's retry of the whole event."""
        def applied() -> bool | object:
            existing = self.get(record.name)
            if existing is None:
                return NOT_APPLIED
            return record.submitted_by is not None and existing.submitted_by == record.submitted_by

        return self._written_or_again(lambda: self._put_new(record, log), applied)

    def _put_new(self, record: JobRecord, log: LogLine | None) -> bool:
        put = {"TableName": self.table, "Item": record_to_item(record), "ConditionExpression": "attribute_not_exists(pk)"}
        try:
            if log is None:
                self._call("put_item", **put)
            else:
                self._transact([{"Put": put}, self._log_put(log)])
            return True
        except ConflictError:
            return False

    def put_adopted(self, record: JobRecord, log: LogLine | None = None) -> bool:
        """Insert a job started outside the controller and count its GPUs against the pool
        (with `log`, its decision-log line, in the same transaction).

        It is already running, so usage is added without a capacity condition.
        """
        try:
            self._transact(
                [
                    {
                        "Put": {
                            "TableName": self.table,
                            "Item": record_to_item(record),
                            "ConditionExpression": "attribute_not_exists(pk)",
                        }
                    },
                    self._usage_update(record.pool, record.gpus, limit=None),
                    {"Put": {"TableName": self.table, "Item": self._alias_item(record)}},
                    *([self._log_put(log)] if log is not None else []),
                ]
            )
            return True
        except ConflictError:
            return False

    def get(self, name: str) -> JobRecord | None:
        item = self._call("get_item", TableName=self.table, Key=job_key(name), ConsistentRead=True).get("Item")
        return item_to_record(item) if item else None

    def require(self, name: str) -> JobRecord:
        record = self.get(name)
        if record is None:
            raise JobNotFound(name)
        return record

    def pending(self, pool: str, limit: int) -> list[JobRecord]:
        """The best-ranked pending jobs of a pool (one indexed query, never a scan)."""
        out = self._call(
            "query",
            TableName=self.table,
            IndexName=GSI,
            KeyConditionExpression="gsi1pk = :p",
            ExpressionAttributeValues={":p": {"S": f"{pool}#PENDING"}},
            Limit=limit,
        )
        return [item_to_record(i) for i in out.get("Items", [])]

    def active(self, pool: str) -> list[JobRecord]:
        """Every job that holds capacity in the pool (bounded by the pool's size), as the
        eventually consistent index shows them."""
        return [
            item_to_record(i)
            for i in self._pages(
                "query",
                TableName=self.table,
                IndexName=GSI,
                KeyConditionExpression="gsi1pk = :p",
                ExpressionAttributeValues={":p": {"S": f"{pool}#ACTIVE"}},
            )
        ]

    def used_gpus(self, pool: str) -> int:
        """The GPUs the pool's count says are held (a consistent read of the pool item)."""
        return int((self.pool(pool) or {}).get("used_gpus", 0))

    def still_holding(self, pool: str, records: list[JobRecord]) -> list[JobRecord]:
        """Of `records` (read through the index), each as it is now (a consistent read),
        kept while it still holds capacity in `pool`."""
        current = (self.get(r.name) for r in records)
        return [r for r in current if r is not None and r.pool == pool and r.status.holds_capacity]

    def all_jobs(self) -> list[JobRecord]:
        """Every job (a scan: for the CLI and reports, never on the scheduling path)."""
        return [item_to_record(i) for i in self._scan("JOB")]

    def _scan(self, sk_prefix: str) -> Iterator[dict]:
        return self._pages(
            "scan",
            TableName=self.table,
            FilterExpression="begins_with(sk, :s)",
            ExpressionAttributeValues={":s": {"S": sk_prefix}},
        )

    # -- transitions ----------------------------------------------------------------------
    def transition(
        self,
        record: JobRecord,
        new: JobRecord,
        expect: Iterable[JobState],
        usage_delta: int = 0,
        pool_limit: int | None = None,
        alias: bool = False,
        lease_owner: str | None = None,
        log: LogLine | tuple[LogLine, ...] = (),
        preemption: PastPreemption | None = None,
        called_off: bool = False,
        ended_run: EndedRun | None = None,
        notice: Notice | None = None,
        reserved_by: str | None = None,
    ) -> JobRecord:
        """Write what `new` changes from `record` (field by field) if the stored job still has
        one of the `expect` statuses, the same incarnation and the version `record` was read
        at; move pool usage by `usage_delta` in the same transaction. Returns the written record.

        When the version moved only because of notes (a checkpoint time, a nomination) the
        same change is applied on the fresh item; any other change meanwhile (a status, a
        cancel request...) raises ConflictError, and the caller re-reads and judges. With a
        positive delta and `pool_limit`, raises CapacityExhausted rather than push usage
        above the limit. With `lease_owner`, the write happens only while that scheduling
        cycle holds the job's pool's lease (the same transaction), else raises LeaseLost.
        `log`: the decision-log lines that tell the change (the job's, and its preemptor's),
        written with it. `preemption`: a victim's mark is counted in its pool's preemption
        budget in the same transaction (counted after it, a function that died in between left
        the budget short of a preemption it had made). `called_off`: `record`'s preemption ends
        without a stop (called off, or given up with no stop taking effect): it leaves the
        budget in the same transaction, having stopped nothing and lost nothing. `ended_run`:
        the run's end is recorded for its team's usage in the same transaction, and folded by
        `fold_ended_run` (folded after the change, a function that died in between lost it:
        its retry finds the end written). `notice`: the team's notice of the change, kept until
        it is published (`notice_sent`; reconcile publishes what its writer did not).
        `reserved_by`: the scheduling cycle admitting the job or marking it as a victim (its
        mark): recorded under the pool in the same transaction, for the cycle to read back
        (`cycle_reservations`). A transaction DynamoDB keeps cancelling for concurrent ones
        raises the retryable TransactionConflict.
        """
        expect = tuple(expect)
        for _ in range(3):
            items = self._transition_items(record, new, expect, usage_delta, pool_limit, alias, lease_owner)
            for line in (log,) if isinstance(log, LogLine) else log:
                items.append(self._log_put(line))
            if preemption is not None:
                items.append({"Put": {"TableName": self.table, "Item": _preemption_item(preemption)}})
            if called_off and record.preempting_since is not None:
                key = _preemption_key(record.pool, record.preempting_since, record.name)
                items.append({"Delete": {"TableName": self.table, "Key": key}})
            if ended_run is not None:
                items.append({"Put": {"TableName": self.table, "Item": _ended_run_item(ended_run)}})
            if notice is not None:
                items.append({"Put": {"TableName": self.table, "Item": _notice_item(notice)}})
            if reserved_by is not None:
                items.append({"Put": {"TableName": self.table, "Item": _cycle_item(new.pool, reserved_by, new)}})
            try:
                self._transact(items)
                return replace_version(new, record.version + 1)
            except ConflictError as e:
                if len(e.reasons) > 1 and e.reasons[1] == "ConditionalCheckFailed" and (usage_delta or lease_owner):
                    # The pool item's condition: the lease and the pool not drained, or
                    # (admissions) the capacity.
                    if lease_owner is not None:
                        pool = self.pool(record.pool) or {}
                        if pool.get("lease_owner") != lease_owner:
                            raise LeaseLost(f"the cycle {lease_owner} no longer holds pool {record.pool}'s lease") from e
                        if pool.get("drained"):
                            raise PoolDrained(f"pool {record.pool} was drained while the cycle {lease_owner} planned it") from e
                    if usage_delta > 0 and pool_limit is not None:
                        raise CapacityExhausted(f"pool {record.pool} cannot take {usage_delta} more GPUs") from e
                current = self.get(record.name)
                rebased = _rebase(record, new, current, expect)
                if rebased is None:
                    moved = "gone" if current is None else f"{current.status.value}, incarnation {current.incarnation}"
                    raise ConflictError(f"job {record.name} moved meanwhile ({moved})", e.reasons) from e
                record, new = current, rebased
        raise ConflictError(f"job {record.name} kept changing")

    def _transition_items(
        self,
        record: JobRecord,
        new: JobRecord,
        expect: tuple[JobState, ...],
        usage_delta: int,
        pool_limit: int | None,
        alias: bool,
        lease_owner: str | None = None,
    ) -> list[dict]:
        update = _update_expression(changed_fields(record, new), record.version)
        status_keys = {f":s{i}": {"S": s.value} for i, s in enumerate(expect)}
        update["ExpressionAttributeNames"]["#st"] = "status"
        update["ExpressionAttributeNames"]["#inc"] = "incarnation"
        update["ExpressionAttributeValues"].update(status_keys)
        update["ExpressionAttributeValues"][":inc"] = _to_attr(record.incarnation)
        update["ExpressionAttributeValues"][":ver"] = _to_attr(record.version)
        condition = f"#st IN ({', '.join(status_keys)}) AND #inc = :inc AND {_version_condition(record.version)}"
        items = [{"Update": {"TableName": self.table, "Key": job_key(record.name), "ConditionExpression": condition, **update}}]
        if usage_delta:
            items.append(self._usage_update(record.pool, usage_delta, pool_limit, lease_owner))
        elif lease_owner is not None:  # (one operation per item in a transaction: else on the usage update)
            items.append(
                {
                    "ConditionCheck": {
                        "TableName": self.table,
                        "Key": pool_key(record.pool),
                        # A cycle writes only while it holds the lease, and the pool is not
                        # drained (a drain that lands while it plans: `PoolDrained`).
                        "ConditionExpression": "lease_owner = :lease AND attribute_not_exists(drained)",
                        "ExpressionAttributeValues": {":lease": {"S": lease_owner}},
                    }
                }
            )
        if alias:
            items.append({"Put": {"TableName": self.table, "Item": self._alias_item(new)}})
        return items

    def _usage_update(self, pool: str, delta: int, limit: int | None, lease_owner: str | None = None) -> dict:
        update = {
            "TableName": self.table,
            "Key": pool_key(pool),
            "UpdateExpression": "SET used_gpus = if_not_exists(used_gpus, :zero) + :d, "
            "usage_seq = if_not_exists(usage_seq, :zero) + :one",
            "ExpressionAttributeValues": {":d": _to_attr(delta), ":zero": _to_attr(0), ":one": _to_attr(1)},
        }
        conditions = []
        if limit is not None and delta > 0:
            conditions.append("(attribute_not_exists(used_gpus) OR used_gpus <= :lim)")
            update["ExpressionAttributeValues"][":lim"] = _to_attr(limit - delta)
        if lease_owner is not None:
            conditions.append("lease_owner = :lease AND attribute_not_exists(drained)")
            update["ExpressionAttributeValues"][":lease"] = {"S": lease_owner}
        if conditions:
            update["ConditionExpression"] = " AND ".join(conditions)
        return {"Update": update}

    def update_fields(self, record: JobRecord, expect: Iterable[JobState], **changes: Any) -> JobRecord:
        """Set a few fields of a job (no usage change) under the same conditions as
        `transition`; returns the written record."""
        return self.transition(record, record.with_changes(**changes), expect)

    def request_cancel(self, record: JobRecord, now: float, log: LogLine | None = None) -> bool:
        """Record that the job's owner cancelled it, whatever it is doing (a field-level
        write that bumps the version, so no transition decided before it can undo it), with
        `log` in the same transaction: the line is written before the stop it tells is sent,
        or not at all. False if the job meanwhile left the status it was read in."""
        update = {
            "TableName": self.table,
            "Key": job_key(record.name),
            "UpdateExpression": "SET cancel_requested = :t, cancel_requested_at = if_not_exists(cancel_requested_at, :now), #ver = if_not_exists(#ver, :zero) + :one",
            "ConditionExpression": "#st = :st AND #inc = :inc",
            "ExpressionAttributeNames": {"#st": "status", "#inc": "incarnation", "#ver": "version"},
            "ExpressionAttributeValues": {
                ":t": _to_attr(True),
                ":now": _to_attr(now),
                ":zero": _to_attr(0),
                ":one": _to_attr(1),
                ":st": {"S": record.status.value},
                ":inc": _to_attr(record.incarnation),
            },
        }
        try:
            if log is None:
                self._call("update_item", **update)
            else:
                self._transact([{"Update": update}, self._log_put(log)])
            return True
        except ConflictError as e:
            if log is not None and e.reasons[:1] != ("ConditionalCheckFailed",):
                raise
            return False

    def _set_fields(self, name: str, update: str, condition: str, values: dict, names: dict | None = None) -> bool:
        """A conditional SET on a job's item, no status transition: True if it was written,
        False if the condition did not hold (the job moved or is gone meanwhile)."""
        return self._update_if(job_key(name), update, condition, values, names)

    def _update_if(self, key: dict, update: str, condition: str, values: dict, names: dict | None = None) -> bool:
        """A conditional update of one item: True if it was written, False if the condition
        did not hold."""
        kwargs = {"ExpressionAttributeNames": names} if names else {}
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=key,
                UpdateExpression=update,
                ConditionExpression=condition,
                ExpressionAttributeValues=values,
                **kwargs,
            )
        except ConflictError:
            return False
        return True

    def nominate(self, name: str, at: float) -> None:
        """Mark a pending job as the one its victims' GPUs are handed to (admitted or
        cancelled meanwhile: nothing to hand over)."""
        pending = {":t": _to_attr(at), ":pending": {"S": JobState.PENDING.value}}
        self._set_fields(name, "SET nominated_at = :t", "#st = :pending", pending, {"#st": "status"})

    def note_learning(self, name: str, **fields: Any) -> None:
        """Set what the controller learned of a job (`service.learning`): plain fields of its
        record, written as they are, no status transition (a job gone meanwhile is skipped)."""
        if not fields:
            return
        names = {f"#f{i}": key for i, key in enumerate(fields)}
        values = {f":v{i}": _to_attr(value) for i, value in enumerate(fields.values())}
        update = "SET " + ", ".join(f"#f{i} = :v{i}" for i in range(len(fields)))
        self._set_fields(name, update, "attribute_exists(pk)", values, names)

    def escalate(self, name: str, at: float, log: LogLine, notice: Notice | None = None) -> bool:
        """Mark a pending job escalated, with the decision-log line that tells it and its
        team's notice, in one transaction (once: True only for the write that did it).
        Written one after the other, a function that died in between left the job escalated
        and nobody told: its retry found the mark and wrote nothing more."""
        mark = {
            "TableName": self.table,
            "Key": job_key(name),
            "UpdateExpression": "SET escalated_at = :t",
            "ConditionExpression": "attribute_exists(pk) AND #s = :pending AND attribute_not_exists(escalated_at)",
            "ExpressionAttributeNames": {"#s": "status"},
            "ExpressionAttributeValues": {":t": _to_attr(at), ":pending": {"S": JobState.PENDING.value}},
        }
        items = [{"Update": mark}, self._log_put(log)]
        if notice is not None:
            items.append({"Put": {"TableName": self.table, "Item": _notice_item(notice)}})
        try:
            self._transact(items)
        except ConflictError as e:
            if e.reasons[:1] == ("ConditionalCheckFailed",):
                return False  # escalated in this wait already, or no longer pending
            raise
        return True

    def set_priority(self, record: JobRecord, priority: int, log: LogLine, notice: Notice | None = None) -> JobRecord:
        """Give a job another priority (the operator's `preemptor priority`, a team's
        lowering), with the decision-log line that tells it and its team's notice, in one
        transaction conditional on the job as `record` read it: its status, incarnation and
        version. A pending job's index sort key moves with it. A cycle that planned the job at
        its old priority finds its own write refused (the version moved) and judges again.
        Raises ConflictError when the job moved meanwhile (anything but notes): re-read it and
        decide again.

        A lowered job loses its escalation (`escalated_at`): it was granted for the wait at
        its former priority; the wait alarm escalates it again if its new tier is watched and
        its wait warrants it."""
        escalated_at = None if priority < record.priority else record.escalated_at
        new = record.with_changes(priority=priority, escalated_at=escalated_at)
        return self.transition(record, new, (record.status,), log=log, notice=notice)

    def claim_stop(self, record: JobRecord, at: float, fresh: bool = False) -> bool:
        """Record that this preemption's stop goes out now, before it is sent, with whether
        the victim's checkpoint is fresh as it goes (`fresh`: what a step retried, or a
        workflow restarted, after the stop says of it): the job still PREEMPTING in its
        incarnation, in the preemption `record` read (`preempting_since`), and no stop
        recorded since it began. The version moves, so a write decided on the job as read
        before (the operator's release of a raised victim, `ops.set_priority`) is refused
        once the stop is on its way. False when the condition does not hold: released (and
        perhaps chosen again since, by another preemption), moved on, or claimed already."""
        since = record.preempting_since
        values = {
            ":at": _to_attr(at),
            ":fresh": _to_attr(fresh),
            ":preempting": {"S": JobState.PREEMPTING.value},
            ":inc": _to_attr(record.incarnation),
            ":zero": _to_attr(0),
            ":one": _to_attr(1),
        }
        if since is None:  # a record written before `preempting_since` existed
            this_preemption = "attribute_not_exists(preempting_since) AND attribute_not_exists(stop_signal_at)"
        else:
            this_preemption = "preempting_since = :since AND (attribute_not_exists(stop_signal_at) OR stop_signal_at < :since)"
            values[":since"] = _to_attr(since)
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=job_key(record.name),
                UpdateExpression="SET stop_signal_at = :at, stop_fresh = :fresh, #ver = if_not_exists(#ver, :zero) + :one",
                ConditionExpression=f"#st = :preempting AND #inc = :inc AND {this_preemption}",
                ExpressionAttributeNames={"#st": "status", "#inc": "incarnation", "#ver": "version"},
                ExpressionAttributeValues=values,
            )
        except ConflictError:
            return False
        return True

    def note_checkpoint(self, name: str, at: float) -> None:
        """Remember the newest checkpoint time seen (never moves backwards)."""
        condition = "attribute_exists(pk) AND (attribute_not_exists(last_checkpoint_at) OR last_checkpoint_at < :t)"
        self._set_fields(name, "SET last_checkpoint_at = :t", condition, {":t": _to_attr(at)})

    # -- fair share and the preemption budget (per pool, bounded reads) -------------------
    def _pool_items(self, pool: str, prefix: str) -> Iterator[dict]:
        """The pool's items of one kind (sort key `prefix...`), read consistently, in key order."""
        items = self._pages(
            "query",
            TableName=self.table,
            KeyConditionExpression="pk = :p AND begins_with(sk, :s)",
            ExpressionAttributeValues={":p": {"S": f"POOL#{pool}"}, ":s": {"S": prefix}},
            ConsistentRead=True,
        )
        return map(_unmarshal, items)

    def team_usage(self, pool: str, half_life_s: float) -> list[TeamUsage]:
        """Decayed GPU usage of each team's ended runs in the pool (one item per team), with
        the runs whose end is recorded and not yet folded (`ended_runs`) added as a fold
        would add them: whoever reads it sees every ended run, folded or not."""
        items = self._pool_items(pool, "USAGE#")
        usage = {i["team"]: TeamUsage(i["team"], float(i["gpu_seconds"]), float(i["at"])) for i in items}
        for run in self.ended_runs(pool):
            current = usage.get(run.team) or TeamUsage(run.team, 0.0, run.ended_at)
            usage[run.team] = current.with_run(run.gpus, run.started_at, run.ended_at, half_life_s)
        return list(usage.values())

    def ended_runs(self, pool: str) -> list[EndedRun]:
        """The pool's ended runs not yet folded into their teams' usage, oldest end first."""
        runs = [
            EndedRun(pool, i["team"], i["job"], int(i["incarnation"]), int(i["gpus"]), float(i["started_at"]), float(i["ended_at"]))
            for i in self._pool_items(pool, "RUNEND#")
        ]
        return sorted(runs, key=lambda r: (r.ended_at, r.job, r.incarnation))

    def fold_ended_run(self, run: EndedRun, half_life_s: float) -> bool:
        """Fold an ended run into its team's decayed usage and forget its end, in one
        transaction: exactly once, however many folders race or retry (the one whose delete
        finds the end gone folds nothing). True if this call folded it."""
        key = {"pk": {"S": f"POOL#{run.pool}"}, "sk": {"S": f"USAGE#{run.team}"}}
        for _ in range(5):
            item = self._call("get_item", TableName=self.table, Key=key, ConsistentRead=True).get("Item")
            current = _unmarshal(item) if item else None
            usage = TeamUsage(run.team, float(current["gpu_seconds"]), float(current["at"])) if current else TeamUsage(run.team, 0.0, run.ended_at)
            new = usage.with_run(run.gpus, run.started_at, run.ended_at, half_life_s)
            values = {":g": _to_attr(new.gpu_seconds), ":at": _to_attr(new.at), ":team": _to_attr(run.team)}
            if current is not None:
                values[":old"] = _to_attr(current["at"])
            update = {
                "TableName": self.table,
                "Key": key,
                "UpdateExpression": "SET gpu_seconds = :g, #at = :at, team = :team",
                "ConditionExpression": "attribute_not_exists(pk)" if current is None else "#at = :old",
                "ExpressionAttributeNames": {"#at": "at"},
                "ExpressionAttributeValues": values,
            }
            forget = {"TableName": self.table, "Key": _ended_run_key(run), "ConditionExpression": "attribute_exists(pk)"}
            try:
                self._transact([{"Update": update}, {"Delete": forget}])
                return True
            except ConflictError as e:
                if len(e.reasons) > 1 and e.reasons[1] == "ConditionalCheckFailed":
                    return False  # folded meanwhile, by another cycle or an earlier attempt
                continue  # the team's usage moved meanwhile: fold on the fresh value
        raise ConflictError(f"usage of team {run.team} in {run.pool} kept changing")

    # -- what a scheduling cycle reserved --------------------------------------------------
    def cycle_reservations(self, pool: str, mark: str) -> list[tuple[str, int, str]]:
        """(job, incarnation, "admitted" or "marked") of every job the scheduling cycle `mark`
        admitted or marked as a victim in `pool` (`transition`'s `reserved_by`), read
        consistently: the pool index may not show them yet, and they are what a cycle must
        hand over to its launches and preemptions, or give back."""
        return [(i["job"], int(i["incarnation"]), i["kind"]) for i in self._pool_items(pool, f"CYCLE#{mark}#")]

    # -- notices to the teams (an outbox: written with their change) -----------------------
    def notice_sent(self, notice: Notice) -> None:
        """Mark a notice published (reconcile then forgets it instead of publishing it; one
        forgotten already was published by reconcile meanwhile)."""
        self._update_if(_notice_key(notice), "SET sent = :t", "attribute_exists(pk)", {":t": {"BOOL": True}})

    def notices(self, pool: str) -> list[tuple[Notice, bool]]:
        """The pool's notices still kept, oldest first, each with whether it was published."""
        out = []
        for i in self._pool_items(pool, "NOTICE#"):
            notice = Notice(pool, float(i["at"]), i["kind"], i["job"], i["team"], i["subject"], json.loads(i["message"]))
            out.append((notice, bool(i.get("sent"))))
        return out

    def forget_notice(self, notice: Notice) -> None:
        self._call("delete_item", TableName=self.table, Key=_notice_key(notice))

    def preemptions_since(self, pool: str, since: float) -> list[PastPreemption]:
        items = self._pages(
            "query",
            TableName=self.table,
            KeyConditionExpression="pk = :p AND sk BETWEEN :a AND :b",
            ExpressionAttributeValues={
                ":p": {"S": f"POOL#{pool}"},
                ":a": {"S": f"PREEMPT#{max(0.0, since):017.3f}"},
                ":b": {"S": "PREEMPT#~"},
            },
        )
        return [
            PastPreemption(pool, float(i["at"]), int(i["gpus"]), float(i["lost_gpu_seconds"]), i["victim"])
            for i in map(_unmarshal, items)
        ]

    # -- run aliases: service job -> controller job ---------------------------------------
    def _alias_item(self, record: JobRecord) -> dict:
        return _marshal(
            {
                "pk": f"RUN#{record.service}#{record.run_id}",
                "sk": "RUN",
                "job": record.name,
                "incarnation": record.incarnation,
                "run_name": record.run_name,
            }
        )

    def find_run(self, service: str, run_id: str) -> tuple[str, int] | None:
        """(job name, incarnation) of a SageMaker/Batch run the controller launched or adopted."""
        item = self._call(
            "get_item",
            TableName=self.table,
            Key={"pk": {"S": f"RUN#{service}#{run_id}"}, "sk": {"S": "RUN"}},
            ConsistentRead=True,
        ).get("Item")
        if not item:
            return None
        data = _unmarshal(item)
        return data["job"], int(data["incarnation"])

    def put_checkpoint_alias(self, checkpoint_s3_uri: str, job: str) -> str | None:
        """Map a checkpoint prefix to its job, so S3 "Object Created" events find the job, and
        return the job it was taken from (None if none). A submission's location is the
        controller's own choice and always taken; an adopted run's is claimed instead
        (`claim_checkpoint_alias`).

        The job it was taken from stays on the alias (`replaced`): a write repeated because
        the handling that made it died before it dealt with that job returns it again. So
        does a write that got no answer (botocore's retries ran out on a lost connection): a
        consistent read tells whether it was applied, and one that was not is made once
        more, instead of the submission waiting a minute for Lambda's retry."""
        key = _marshal(_checkpoint_key(checkpoint_s3_uri))

        def applied() -> str | None | object:
            item = self._call("get_item", TableName=self.table, Key=key, ConsistentRead=True).get("Item")
            alias = _unmarshal(item) if item else {}
            return (alias.get("replaced") or None) if alias.get("job") == job else NOT_APPLIED

        return self._written_or_again(lambda: self._take_alias(key, job), applied)

    def _take_alias(self, key: dict, job: str) -> str | None:
        try:
            old = self._call(
                "update_item",
                TableName=self.table,
                Key=key,
                UpdateExpression="SET #replaced = if_not_exists(#job, :none), #job = :job",
                ConditionExpression="attribute_not_exists(#job) OR #job <> :job",
                ExpressionAttributeNames={"#job": "job", "#replaced": "replaced"},
                ExpressionAttributeValues={":job": {"S": job}, ":none": {"S": ""}},
                ReturnValues="ALL_OLD",
            ).get("Attributes")
        except ConflictError:  # the alias is this job's already, written by an earlier try
            item = self._call("get_item", TableName=self.table, Key=key, ConsistentRead=True).get("Item")
            return (_unmarshal(item).get("replaced") or None) if item else None
        return _unmarshal(old)["job"] if old else None

    def claim_checkpoint_alias(self, checkpoint_s3_uri: str, job: str) -> str | None:
        """Map a checkpoint prefix to `job` unless another job holds it
        (`checkpoint_location_user`): None once it is `job`'s, else the job holding it. The
        write is conditional on the alias read, so a submission taking the location
        meanwhile is never overwritten."""
        key = _checkpoint_key(checkpoint_s3_uri)
        for _ in range(CLAIM_ATTEMPTS):
            item = self._call("get_item", TableName=self.table, Key=_marshal(key), ConsistentRead=True).get("Item")
            owner = _unmarshal(item)["job"] if item else None
            if owner == job:
                return None
            if owner is not None and self._holds_location(owner, checkpoint_s3_uri):
                return owner
            try:
                self._call(
                    "put_item",
                    TableName=self.table,
                    Item=_marshal({**key, "job": job}),
                    **(
                        {"ConditionExpression": "attribute_not_exists(pk)"}
                        if owner is None
                        else {
                            "ConditionExpression": "#job = :owner",
                            "ExpressionAttributeNames": {"#job": "job"},
                            "ExpressionAttributeValues": {":owner": {"S": owner}},
                        }
                    ),
                )
                return None
            except ConflictError:
                continue  # written meanwhile: judged again on what is there now
        return owner or "a job that wrote it meanwhile"

    def checkpoint_location_user(self, checkpoint_s3_uri: str, job: str) -> str | None:
        """Another job, not ended, whose checkpoint location is exactly this one (its
        checkpoints would answer for both jobs: a stop confirmed by the other's), or None."""
        item = self._call("get_item", TableName=self.table, Key=_marshal(_checkpoint_key(checkpoint_s3_uri)), ConsistentRead=True).get("Item")
        owner = _unmarshal(item)["job"] if item else None
        if owner is None or owner == job:
            return None
        return owner if self._holds_location(owner, checkpoint_s3_uri) else None

    def _holds_location(self, job: str, checkpoint_s3_uri: str) -> bool:
        record = self.get(job)
        return record is not None and not record.status.is_terminal and record.checkpoint_s3_uri == checkpoint_s3_uri

    def find_checkpoint_owner(self, bucket: str, key: str) -> str | None:
        """The job whose checkpoint prefix contains `key` (the deepest one), or None."""
        parts = key.split("/")[:-1]
        for depth in range(len(parts), 0, -1):
            prefix = f"{bucket}/{'/'.join(parts[:depth])}/"
            item = self._call(
                "get_item", TableName=self.table, Key={"pk": {"S": f"CKPT#{prefix}"}, "sk": {"S": "CKPT"}}
            ).get("Item")
            if item:
                return _unmarshal(item)["job"]
        return None

    def put_service_job_alias(self, service_job_id: str, training_job: str, now: float) -> None:
        """Map a Batch service job to the training job of its current attempt (for ALIAS_TTL_S)."""
        fields = {"pk": f"RUN#batch-service#{service_job_id}", "sk": "RUN", "training_job": training_job}
        self._call("put_item", TableName=self.table, Item=_marshal({**fields, "expires_at": int(now + ALIAS_TTL_S)}))

    def service_job_training_job(self, service_job_id: str) -> str | None:
        item = self._call(
            "get_item", TableName=self.table, Key={"pk": {"S": f"RUN#batch-service#{service_job_id}"}, "sk": {"S": "RUN"}}
        ).get("Item")
        return _unmarshal(item)["training_job"] if item else None

    def put_instance_alias(self, instance_id: str, job: str, incarnation: int, now: float) -> None:
        """Map an EC2 instance to a job's run on it (one item per job: an instance may host
        several Batch jobs, each warned when it is reclaimed), for ALIAS_TTL_S."""
        fields = {"pk": f"RUN#instance#{instance_id}", "sk": f"RUN#{job}", "job": job, "incarnation": incarnation}
        self._call("put_item", TableName=self.table, Item=_marshal({**fields, "expires_at": int(now + ALIAS_TTL_S)}))

    def runs_on_instance(self, instance_id: str) -> list[tuple[str, int]]:
        """(job name, incarnation) of every run placed on the EC2 instance, by job name."""
        items = self._pages(
            "query",
            TableName=self.table,
            KeyConditionExpression="pk = :p AND begins_with(sk, :run)",
            ExpressionAttributeValues={":p": {"S": f"RUN#instance#{instance_id}"}, ":run": {"S": "RUN"}},
            ConsistentRead=True,
        )
        found = {data["job"]: int(data["incarnation"]) for data in map(_unmarshal, items)}
        return sorted(found.items())

    # -- decision log ---------------------------------------------------------------------
    def log(self, job: str, at: float, kind: str, reason: str, detail: str = "", *, once: str | None = None, **extra: Any) -> None:
        """Append one entry to a job's decision log (`explain` and the timeline read it).

        `once`: what makes the entry unique (e.g. the step and its execution): written again,
        with the same `at`, it replaces itself, so a retried step that logs what its first
        attempt may have logged already leaves one entry.
        """
        self._call("put_item", TableName=self.table, Item=self._log_item(job, at, kind, reason, detail, once, extra))

    def _log_put(self, line: LogLine) -> dict:
        """A transaction's Put of a decision-log line."""
        item = self._log_item(line.job, line.at, line.kind, line.reason, line.detail, line.once, line.extra)
        return {"Put": {"TableName": self.table, "Item": item}}

    @staticmethod
    def _log_item(job: str, at: float, kind: str, reason: str, detail: str, once: str | None, extra: dict) -> dict:
        # The counter keeps entries of one container in order within a millisecond.
        unique = f"{next(_LOG_SEQ):08d}#{uuid.uuid4().hex[:8]}" if once is None else f"once#{once}"
        fields = {
            "pk": f"JOB#{job}",
            "sk": f"LOG#{at:017.3f}#{unique}",
            "at": at,
            "job": job,
            "kind": kind,
            "reason": reason,
            "detail": detail,
        }
        if extra:
            fields["extra"] = json.dumps(extra, sort_keys=True, default=str)
        return _marshal(fields)

    def history(self, job: str) -> list[dict]:
        """The job's log entries, in time order (`_log_order`)."""
        items = self._pages(
            "query",
            TableName=self.table,
            KeyConditionExpression="pk = :p AND begins_with(sk, :l)",
            ExpressionAttributeValues={":p": {"S": f"JOB#{job}"}, ":l": {"S": "LOG#"}},
        )
        return sorted((self._log_entry(i) for i in items), key=_log_order)

    def all_history(self) -> list[dict]:
        """Every log entry of every job, in time order (for the demo timeline and reports)."""
        entries = [self._log_entry(i) for i in self._scan("LOG#")]
        return sorted(entries, key=lambda e: (e["at"], *_log_order(e)[1:]))

    @staticmethod
    def _log_entry(item: dict) -> dict:
        entry = _unmarshal(item)
        entry["extra"] = json.loads(entry["extra"]) if "extra" in entry else {}
        return entry

    # -- intake idempotency ---------------------------------------------------------------
    def claim_event(self, event_id: str, now: float, owner: str) -> bool:
        """Claim an event for the handling `owner` (a token of its own; a conditional put: of
        two deliveries handled at once, one wins). True: this handling has it, including when
        the put was resent after its answer was lost. False: the event was handled already.

        When no answer comes back (botocore's retries ran out on a lost connection), a
        consistent read tells whether the put was applied: a claim of `owner`'s is this
        handling's, none is put once more. Raised, the claim the put left would hold the
        event until it ends (EVENT_CLAIM_S), past Lambda's first retry: three minutes.

        Raises:
            EventInProgress: another handling holds a live claim (it may still finish, or it
                died and its claim ends after EVENT_CLAIM_S): the delivery is retried.
        """
        return self._written_or_again(
            lambda: self._claim_event(event_id, now, owner),
            lambda: True if self._event_claim(event_id).get("owner") == owner else NOT_APPLIED,
        )

    def _event_claim(self, event_id: str) -> dict:
        held = self._call(
            "get_item", TableName=self.table, Key={"pk": {"S": f"EVENT#{event_id}"}, "sk": {"S": "EVENT"}}, ConsistentRead=True
        ).get("Item")
        return _unmarshal(held) if held else {}

    def _claim_event(self, event_id: str, now: float, owner: str) -> bool:
        try:
            self._call(
                "put_item",
                TableName=self.table,
                Item=_marshal(
                    {
                        "pk": f"EVENT#{event_id}",
                        "sk": "EVENT",
                        "state": "in-progress",
                        "owner": owner,
                        "claim_expires": now + EVENT_CLAIM_S,
                        "expires_at": int(now + EVENT_TTL_S),
                    }
                ),
                ConditionExpression="attribute_not_exists(pk) OR (#state = :progress AND (claim_expires < :now OR #owner = :me))",
                ExpressionAttributeNames={"#state": "state", "#owner": "owner"},
                ExpressionAttributeValues={":progress": {"S": "in-progress"}, ":now": _to_attr(now), ":me": {"S": owner}},
            )
            return True
        except ConflictError:
            pass
        claim = self._event_claim(event_id)
        if claim.get("state") == "done":
            return False
        raise EventInProgress(f"event {event_id} is being handled (claim until {claim.get('claim_expires')})")

    def finish_event(self, event_id: str, now: float, outcome: str) -> None:
        """Mark a claimed event handled, with its outcome (kept for EVENT_TTL_S)."""
        self._call(
            "update_item",
            TableName=self.table,
            Key={"pk": {"S": f"EVENT#{event_id}"}, "sk": {"S": "EVENT"}},
            UpdateExpression="SET #state = :done, outcome = :o, expires_at = :e REMOVE claim_expires",
            ExpressionAttributeNames={"#state": "state"},
            ExpressionAttributeValues={":done": {"S": "done"}, ":o": _to_attr(outcome), ":e": _to_attr(int(now + EVENT_TTL_S))},
        )

    def release_event(self, event_id: str, owner: str) -> None:
        """Give `owner`'s claim back after a failed handling, so Lambda's retry handles the
        event. Never another handling's claim (one that took over an expired claim of ours),
        never a finished event."""
        try:
            self._call(
                "delete_item",
                TableName=self.table,
                Key={"pk": {"S": f"EVENT#{event_id}"}, "sk": {"S": "EVENT"}},
                ConditionExpression="#state = :progress AND #owner = :me",
                ExpressionAttributeNames={"#state": "state", "#owner": "owner"},
                ExpressionAttributeValues={":progress": {"S": "in-progress"}, ":me": {"S": owner}},
            )
        except ConflictError:
            pass  # finished, taken over, or already given back: nothing of ours to give back
