"""The jobs table (DynamoDB): jobs, run aliases, pools with their usage, the decision log.

Every status change is a conditional write on the old status (and incarnation), and every
change of a pool's usage happens in the same transaction as the status change that causes
it, so capacity is taken and released exactly once, whatever the event order.
"""

from __future__ import annotations

import itertools
import json
import uuid
from decimal import Decimal
from typing import Any, Iterable, Iterator

from boto3.dynamodb.types import TypeDeserializer, TypeSerializer
from botocore.exceptions import ClientError

from ..core.errors import CapacityExhausted, ConflictError, JobNotFound, Throttled
from ..core.jobs import JobRecord
from ..core.model import JobState, PastPreemption, TeamUsage

GSI = "ByPoolStatus"
EVENT_TTL_S = 7 * 24 * 3600
_JSON_FIELDS = ("request", "labels")
_THROTTLING = {"ProvisionedThroughputExceededException", "ThrottlingException", "RequestLimitExceeded"}

_LOG_SEQ = itertools.count()
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


def _marshal(fields: dict) -> dict:
    return {k: _to_attr(v) for k, v in fields.items() if v is not None}


def _unmarshal(item: dict) -> dict:
    return {k: _from_attr(v) for k, v in item.items()}


def _prefix_key(uri: str) -> str:
    """`s3://bucket/a/b` -> `bucket/a/b/`: one spelling of a checkpoint prefix."""
    path = uri.removeprefix("s3://").rstrip("/")
    return path + "/"


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


def record_to_item(record: JobRecord) -> dict:
    fields = {f: getattr(record, f) for f in record.__dataclass_fields__}
    fields["status"] = record.status.value
    for name in _JSON_FIELDS:
        fields[name] = json.dumps(fields[name], sort_keys=True)
    fields.update(index_keys(record))
    item = _marshal(fields)
    item.update(job_key(record.name))
    return item


def item_to_record(item: dict) -> JobRecord:
    data = _unmarshal(item)
    kwargs = {f: data[f] for f in JobRecord.__dataclass_fields__ if f in data}
    kwargs["status"] = JobState(kwargs["status"])
    for name in _JSON_FIELDS:
        if name in kwargs:
            kwargs[name] = json.loads(kwargs[name])
    for name in ("gpus", "priority", "incarnation", "preemptions", "stops_without_fresh_checkpoint"):
        if name in kwargs:
            kwargs[name] = int(kwargs[name])
    for name in ("lost_gpu_seconds",):
        if name in kwargs:
            kwargs[name] = float(kwargs[name])
    return JobRecord(**kwargs)


class JobsStore:
    """Typed access to the jobs table. `client` is a boto3 DynamoDB client."""

    def __init__(self, table_name: str, client: Any):
        self.table = table_name
        self.client = client

    # -- errors ---------------------------------------------------------------------------
    def _call(self, method: str, **kwargs) -> dict:
        try:
            return getattr(self.client, method)(**kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code == "ConditionalCheckFailedException":
                raise ConflictError(f"{method}: condition failed") from e
            if code == "TransactionCanceledException":
                reasons = [r.get("Code") for r in e.response.get("CancellationReasons", [])]
                raise ConflictError(f"{method}: transaction cancelled: {reasons}") from e
            if code in _THROTTLING:
                raise Throttled(f"{method}: {code}") from e
            raise

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

    def pool(self, name: str) -> dict | None:
        item = self._call("get_item", TableName=self.table, Key=pool_key(name), ConsistentRead=True).get("Item")
        return _unmarshal(item) if item else None

    def set_pool_usage(self, name: str, used_gpus: int) -> None:
        """Overwrite usage (used by reconcile after recounting the capacity-holding jobs)."""
        self._call(
            "update_item",
            TableName=self.table,
            Key=pool_key(name),
            UpdateExpression="SET used_gpus = :u",
            ExpressionAttributeValues={":u": _to_attr(used_gpus)},
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
        """Take the pool's scheduling lease; if someone holds it, ask them to run again."""
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

    def release_lease(self, pool: str, owner: str) -> bool:
        """Give the lease back. Returns True if the holder must plan again (work arrived)."""
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression="REMOVE lease_owner, lease_expires",
                ConditionExpression="lease_owner = :o AND rerun = :f",
                ExpressionAttributeValues={":o": _to_attr(owner), ":f": _to_attr(False)},
            )
            return False
        except ConflictError:
            pass
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=pool_key(pool),
                UpdateExpression="SET rerun = :f",
                ConditionExpression="lease_owner = :o AND rerun = :t",
                ExpressionAttributeValues={":o": _to_attr(owner), ":f": _to_attr(False), ":t": _to_attr(True)},
            )
            return True
        except ConflictError:
            return False  # the lease expired and someone else holds it: they will plan

    # -- jobs -----------------------------------------------------------------------------
    def put_new(self, record: JobRecord) -> bool:
        """Insert a job. Returns False if a job of that name already exists (duplicate)."""
        try:
            self._call(
                "put_item",
                TableName=self.table,
                Item=record_to_item(record),
                ConditionExpression="attribute_not_exists(pk)",
            )
            return True
        except ConflictError:
            return False

    def put_adopted(self, record: JobRecord) -> bool:
        """Insert a job started outside the controller and count its GPUs against the pool.

        It is already running, so usage is added without a capacity condition.
        """
        try:
            self._call(
                "transact_write_items",
                TransactItems=[
                    {
                        "Put": {
                            "TableName": self.table,
                            "Item": record_to_item(record),
                            "ConditionExpression": "attribute_not_exists(pk)",
                        }
                    },
                    self._usage_update(record.pool, record.gpus, limit=None),
                    {"Put": {"TableName": self.table, "Item": self._alias_item(record)}},
                ],
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
        """Every job that holds capacity in the pool (bounded by the pool's size)."""
        return [item_to_record(i) for i in self._query_all(f"{pool}#ACTIVE")]

    def count_pending(self, pool: str) -> int:
        return sum(1 for _ in self._query_all(f"{pool}#PENDING", select_count=True))

    def _query_all(self, partition: str, select_count: bool = False) -> Iterator[dict]:
        kwargs = {
            "TableName": self.table,
            "IndexName": GSI,
            "KeyConditionExpression": "gsi1pk = :p",
            "ExpressionAttributeValues": {":p": {"S": partition}},
        }
        while True:
            out = self._call("query", **kwargs)
            yield from out.get("Items", [])
            if "LastEvaluatedKey" not in out:
                return
            kwargs["ExclusiveStartKey"] = out["LastEvaluatedKey"]

    def all_jobs(self) -> list[JobRecord]:
        """Every job (a scan: for the CLI and reports, never on the scheduling path)."""
        return [item_to_record(i) for i in self._scan("JOB")]

    def _scan(self, sk_prefix: str) -> Iterator[dict]:
        kwargs = {
            "TableName": self.table,
            "FilterExpression": "begins_with(sk, :s)",
            "ExpressionAttributeValues": {":s": {"S": sk_prefix}},
        }
        while True:
            out = self._call("scan", **kwargs)
            yield from out.get("Items", [])
            if "LastEvaluatedKey" not in out:
                return
            kwargs["ExclusiveStartKey"] = out["LastEvaluatedKey"]

    # -- transitions ----------------------------------------------------------------------
    def transition(
        self,
        record: JobRecord,
        new: JobRecord,
        expect: Iterable[JobState],
        usage_delta: int = 0,
        pool_limit: int | None = None,
        alias: bool = False,
    ) -> JobRecord:
        """Write `new` over `record` if the stored job still has one of the `expect` statuses
        and the same incarnation; move pool usage by `usage_delta` in the same transaction.

        With a positive delta and `pool_limit`, the write fails with CapacityExhausted rather
        than push usage above the limit. Raises ConflictError when the job moved meanwhile.
        """
        status_keys = {f":s{i}": {"S": s.value} for i, s in enumerate(expect)}
        values = {**status_keys, ":inc": _to_attr(record.incarnation)}
        condition = f"#st IN ({', '.join(status_keys)}) AND incarnation = :inc"
        put = {
            "Put": {
                "TableName": self.table,
                "Item": record_to_item(new),
                "ConditionExpression": condition,
                "ExpressionAttributeNames": {"#st": "status"},
                "ExpressionAttributeValues": values,
            }
        }
        items = [put]
        if usage_delta:
            items.append(self._usage_update(record.pool, usage_delta, pool_limit))
        if alias:
            items.append({"Put": {"TableName": self.table, "Item": self._alias_item(new)}})
        try:
            self._call("transact_write_items", TransactItems=items)
        except ConflictError as e:
            if usage_delta > 0 and pool_limit is not None and self._capacity_was_the_reason(e):
                raise CapacityExhausted(f"pool {record.pool} cannot take {usage_delta} more GPUs") from e
            raise
        return new

    @staticmethod
    def _capacity_was_the_reason(error: ConflictError) -> bool:
        cause = error.__cause__
        if not isinstance(cause, ClientError):
            return False
        reasons = cause.response.get("CancellationReasons", [])
        return len(reasons) > 1 and reasons[1].get("Code") == "ConditionalCheckFailed"

    def _usage_update(self, pool: str, delta: int, limit: int | None) -> dict:
        update = {
            "TableName": self.table,
            "Key": pool_key(pool),
            "UpdateExpression": "SET used_gpus = if_not_exists(used_gpus, :zero) + :d",
            "ExpressionAttributeValues": {":d": _to_attr(delta), ":zero": _to_attr(0)},
        }
        if limit is not None and delta > 0:
            update["ConditionExpression"] = "attribute_not_exists(used_gpus) OR used_gpus <= :lim"
            update["ExpressionAttributeValues"][":lim"] = _to_attr(limit - delta)
        return {"Update": update}

    def nominate(self, name: str, at: float) -> None:
        """Mark a pending job as the one its victims' GPUs are handed to."""
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=job_key(name),
                UpdateExpression="SET nominated_at = :t",
                ConditionExpression="#st = :pending",
                ExpressionAttributeNames={"#st": "status"},
                ExpressionAttributeValues={":t": _to_attr(at), ":pending": {"S": JobState.PENDING.value}},
            )
        except ConflictError:
            pass  # admitted or cancelled meanwhile: nothing to hand over

    def note_checkpoint(self, name: str, at: float) -> None:
        """Remember the newest checkpoint time seen (never moves backwards)."""
        try:
            self._call(
                "update_item",
                TableName=self.table,
                Key=job_key(name),
                UpdateExpression="SET last_checkpoint_at = :t",
                ConditionExpression="attribute_exists(pk) AND (attribute_not_exists(last_checkpoint_at) OR last_checkpoint_at < :t)",
                ExpressionAttributeValues={":t": _to_attr(at)},
            )
        except ConflictError:
            pass

    # -- fair share and the preemption budget (per pool, bounded reads) -------------------
    def team_usage(self, pool: str) -> list[TeamUsage]:
        """Decayed GPU usage of each team's ended runs in the pool (one item per team)."""
        out = self._call(
            "query",
            TableName=self.table,
            KeyConditionExpression="pk = :p AND begins_with(sk, :u)",
            ExpressionAttributeValues={":p": {"S": f"POOL#{pool}"}, ":u": {"S": "USAGE#"}},
            ConsistentRead=True,
        )
        items = [_unmarshal(i) for i in out.get("Items", [])]
        return [TeamUsage(i["team"], float(i["gpu_seconds"]), float(i["at"])) for i in items]

    def add_usage(self, pool: str, team: str, gpus: int, started_at: float, ended_at: float, half_life_s: float) -> None:
        """Fold an ended run into its team's decayed usage (optimistic, retried on a race)."""
        key = {"pk": {"S": f"POOL#{pool}"}, "sk": {"S": f"USAGE#{team}"}}
        for _ in range(5):
            item = self._call("get_item", TableName=self.table, Key=key, ConsistentRead=True).get("Item")
            current = _unmarshal(item) if item else None
            usage = TeamUsage(team, float(current["gpu_seconds"]), float(current["at"])) if current else TeamUsage(team, 0.0, ended_at)
            new = usage.with_run(gpus, started_at, ended_at, half_life_s)
            condition = "attribute_not_exists(pk)" if current is None else "#at = :old"
            values = {":g": _to_attr(new.gpu_seconds), ":at": _to_attr(new.at), ":team": _to_attr(team)}
            if current is not None:
                values[":old"] = _to_attr(current["at"])
            try:
                self._call(
                    "update_item",
                    TableName=self.table,
                    Key=key,
                    UpdateExpression="SET gpu_seconds = :g, #at = :at, team = :team",
                    ConditionExpression=condition,
                    ExpressionAttributeNames={"#at": "at"},
                    ExpressionAttributeValues=values,
                )
                return
            except ConflictError:
                continue
        raise ConflictError(f"usage of team {team} in {pool} kept changing")

    def record_preemption(self, p: PastPreemption, ttl_s: float) -> None:
        """Remember a preemption for the pool's budget window (expires with the TTL)."""
        self._call(
            "put_item",
            TableName=self.table,
            Item=_marshal(
                {
                    "pk": f"POOL#{p.pool}",
                    "sk": f"PREEMPT#{p.at:017.3f}#{p.victim}",
                    "at": p.at,
                    "gpus": p.gpus,
                    "lost_gpu_seconds": p.lost_gpu_seconds,
                    "victim": p.victim,
                    "expires_at": int(p.at + ttl_s),
                }
            ),
        )

    def preemptions_since(self, pool: str, since: float) -> list[PastPreemption]:
        out = self._call(
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
            for i in map(_unmarshal, out.get("Items", []))
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

    def put_checkpoint_alias(self, checkpoint_s3_uri: str, job: str) -> None:
        """Map a checkpoint prefix to its job, so S3 "Object Created" events find the job."""
        self._call(
            "put_item",
            TableName=self.table,
            Item=_marshal({"pk": f"CKPT#{_prefix_key(checkpoint_s3_uri)}", "sk": "CKPT", "job": job}),
        )

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

    def put_instance_alias(self, instance_id: str, job: str, incarnation: int) -> None:
        self._call(
            "put_item",
            TableName=self.table,
            Item=_marshal({"pk": f"RUN#instance#{instance_id}", "sk": "RUN", "job": job, "incarnation": incarnation}),
        )

    # -- decision log ---------------------------------------------------------------------
    def log(self, job: str, at: float, kind: str, reason: str, detail: str = "", **extra: Any) -> None:
        """Append one entry to a job's decision log (`explain` and the timeline read it)."""
        fields = {
            "pk": f"JOB#{job}",
            # The counter keeps entries of one container in order within a millisecond.
            "sk": f"LOG#{at:017.3f}#{next(_LOG_SEQ):08d}#{uuid.uuid4().hex[:8]}",
            "at": at,
            "job": job,
            "kind": kind,
            "reason": reason,
            "detail": detail,
        }
        if extra:
            fields["extra"] = json.dumps(extra, sort_keys=True, default=str)
        self._call("put_item", TableName=self.table, Item=_marshal(fields))

    def history(self, job: str) -> list[dict]:
        out = self._call(
            "query",
            TableName=self.table,
            KeyConditionExpression="pk = :p AND begins_with(sk, :l)",
            ExpressionAttributeValues={":p": {"S": f"JOB#{job}"}, ":l": {"S": "LOG#"}},
        )
        return [self._log_entry(i) for i in out.get("Items", [])]

    def all_history(self) -> list[dict]:
        """Every log entry of every job, in time order (for the demo timeline and reports)."""
        entries = [self._log_entry(i) for i in self._scan("LOG#")]
        return sorted(entries, key=lambda e: (e["at"], e["sk"]))

    @staticmethod
    def _log_entry(item: dict) -> dict:
        entry = _unmarshal(item)
        entry["extra"] = json.loads(entry["extra"]) if "extra" in entry else {}
        return entry

    # -- intake idempotency ---------------------------------------------------------------
    def event_seen(self, event_id: str) -> bool:
        item = self._call(
            "get_item", TableName=self.table, Key={"pk": {"S": f"EVENT#{event_id}"}, "sk": {"S": "EVENT"}}
        ).get("Item")
        return item is not None

    def remember_event(self, event_id: str, now: float, outcome: str) -> None:
        self._call(
            "put_item",
            TableName=self.table,
            Item=_marshal(
                {
                    "pk": f"EVENT#{event_id}",
                    "sk": "EVENT",
                    "outcome": outcome,
                    "expires_at": int(now + EVENT_TTL_S),
                }
            ),
        )

    def count(self, counter: str, by: int = 1) -> None:
        self._call(
            "update_item",
            TableName=self.table,
            Key={"pk": {"S": "STATS"}, "sk": {"S": "STATS"}},
            UpdateExpression="ADD #c :b",
            ExpressionAttributeNames={"#c": counter},
            ExpressionAttributeValues={":b": _to_attr(by)},
        )

    def counters(self) -> dict:
        item = self._call("get_item", TableName=self.table, Key={"pk": {"S": "STATS"}, "sk": {"S": "STATS"}}).get(
            "Item"
        )
        data = _unmarshal(item) if item else {}
        return {k: v for k, v in data.items() if k not in ("pk", "sk")}
