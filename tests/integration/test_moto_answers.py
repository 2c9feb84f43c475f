"""The emulator's shortcuts in DynamoDB change nothing moto answers or keeps.

- Its answers (moto_patches.dynamodb.fast_body) are written exactly as moto's own
  serializer writes them: checked on each answer of a preemption story, and on items holding
  every type of attribute value.
- A transaction it refuses (moto_patches.dynamodb backs up the items a transaction names,
  not whole tables) leaves every item as it was, and one it accepts writes them all.
- A query walking the table unsorted answers what moto's sorted walk answers."""

from __future__ import annotations

import inspect
import json
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import boto3
import pytest
from botocore.exceptions import ClientError
from emulation import emulation
from moto.dynamodb.responses import DynamoHandler

from preemptor_tools.local.moto_patches import dynamodb as patched


@contextmanager
def _both_written() -> Iterator[tuple[Counter, list]]:
    """While installed, each DynamoDB answer is written by moto's serializer (what the
    caller gets) and by the shortcut; yields (answers compared per action, differences)."""
    compared: Counter = Counter()
    differ: list = []
    installed = DynamoHandler.__dict__["serialized"]

    def both(self, action_result):
        answer = patched._ORIGINAL_SERIALIZED(self, action_result)
        fast = patched.fast_body(self._get_action(), action_result.result)
        if fast is not None:
            compared[self._get_action()] += 1
            if json.loads(fast) != json.loads(answer[2]):
                differ.append((self._get_action(), fast, answer[2]))
        return answer

    DynamoHandler.serialized = both
    try:
        yield compared, differ
    finally:
        DynamoHandler.serialized = installed


def _preemption_story(env) -> None:
    """A low sweep preempted by a critical job, then reconcile: every kind of item operation."""
    env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
    env.advance(600)
    env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1200)
    env.advance(1800)
    env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
    env.stack.drain()


def test_every_answer_of_a_preemption_story_is_written_as_moto_writes_it():
    with emulation() as env, _both_written() as (compared, differ):
        _preemption_story(env)
    assert differ == []
    assert {"GetItem", "PutItem", "UpdateItem", "DeleteItem", "Query", "TransactWriteItems"} <= set(compared)
    assert sum(compared.values()) > 100


def test_every_query_of_a_preemption_story_answers_what_the_sorted_walk_answers():
    from moto.dynamodb.models.table import Table

    compared, differ = Counter(), []

    def both(self, *args, **kwargs):
        def seen(answer):
            results, scanned, last = answer
            return [item.to_json() for item in results], scanned, last

        unordered = patched._unordered_query(self, *args, **kwargs)
        ordered = patched._ORIGINAL_QUERY(self, *args, **kwargs)
        index = inspect.signature(patched._ORIGINAL_QUERY).bind(self, *args, **kwargs).arguments.get("index_name")
        compared["index" if index else "table"] += 1
        if seen(unordered) != seen(ordered):
            differ.append((args, kwargs))
        return unordered

    with emulation() as env:
        installed = Table.__dict__["query"]
        Table.query = both
        try:
            _preemption_story(env)
        finally:
            Table.query = installed
    # Queries of the table (a job's log, newest first and in pages) and of its index alike
    assert differ == []
    assert compared["index"] >= 10 and compared["table"] >= 10, compared


def test_items_of_every_attribute_type_are_written_as_moto_writes_them():
    with emulation() as env, _both_written() as (compared, differ):
        client = boto3.client("dynamodb", region_name=env.stack.region)
        table = "answers"
        client.create_table(
            TableName=table,
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
            AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}, {"AttributeName": "sk", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        every = {
            "s": {"S": "text with \u00e9 and \"quotes\""},
            "empty": {"S": ""},
            "n": {"N": "12.50"},
            "b": {"B": b"\x00\xffbytes"},
            "ss": {"SS": ["a", "b"]},
            "ns": {"NS": ["1", "2.5"]},
            "bs": {"BS": [b"x", b"y"]},
            "m": {"M": {"inner": {"L": [{"S": "x"}, {"N": "1"}, {"NULL": True}, {"M": {}}]}, "flag": {"BOOL": False}}},
            "l": {"L": []},
            "null": {"NULL": True},
            "bool": {"BOOL": True},
        }
        for i in range(3):
            client.put_item(TableName=table, Item={"pk": {"S": "p"}, "sk": {"S": f"s{i}"}, **every})
        key = {"pk": {"S": "p"}, "sk": {"S": "s0"}}
        client.get_item(TableName=table, Key=key, ConsistentRead=True)
        client.get_item(TableName=table, Key={"pk": {"S": "p"}, "sk": {"S": "none"}})
        client.put_item(TableName=table, Item={**key, "n": {"N": "1"}}, ReturnValues="ALL_OLD")
        client.update_item(
            TableName=table, Key=key, UpdateExpression="SET n = :n", ExpressionAttributeValues={":n": {"N": "2"}}, ReturnValues="ALL_NEW"
        )
        client.query(
            TableName=table, KeyConditionExpression="pk = :p", ExpressionAttributeValues={":p": {"S": "p"}}, Limit=2,
            ReturnConsumedCapacity="TOTAL",
        )
        client.scan(TableName=table, Select="COUNT")
        client.delete_item(TableName=table, Key={"pk": {"S": "p"}, "sk": {"S": "s1"}}, ReturnValues="ALL_OLD")
        client.transact_write_items(TransactItems=[{"Delete": {"TableName": table, "Key": {"pk": {"S": "p"}, "sk": {"S": "s2"}}}}])
    assert differ == []
    assert {"GetItem", "PutItem", "UpdateItem", "DeleteItem", "Query", "Scan", "TransactWriteItems"} <= set(compared)


def _items(client, table: str) -> list[dict]:
    return sorted(client.scan(TableName=table, ConsistentRead=True)["Items"], key=json.dumps)


@pytest.mark.parametrize("keys", [("pk",), ("pk", "sk")], ids=["hash-key", "hash-and-range-key"])
def test_a_refused_transaction_leaves_every_item_as_it_was_and_an_accepted_one_writes_them_all(keys):
    with emulation() as env:
        client = boto3.client("dynamodb", region_name=env.stack.region)
        table = "transactions"
        client.create_table(
            TableName=table,
            KeySchema=[{"AttributeName": k, "KeyType": kind} for k, kind in zip(keys, ("HASH", "RANGE"))],
            AttributeDefinitions=[{"AttributeName": k, "AttributeType": "S"} for k in keys],
            BillingMode="PAY_PER_REQUEST",
        )

        def key(name: str) -> dict:
            return {k: {"S": f"{name}-{k}"} for k in keys}

        for name in ("updated", "replaced", "deleted", "checked", "untouched"):
            client.put_item(TableName=table, Item={**key(name), "n": {"N": "1"}, "tags": {"L": [{"S": "a"}]}})
        before = _items(client, table)
        writes = [
            {"Put": {"TableName": table, "Item": {**key("new"), "n": {"N": "9"}}}},
            {"Put": {"TableName": table, "Item": {**key("replaced"), "n": {"N": "9"}}}},
            {
                "Update": {
                    "TableName": table, "Key": key("updated"),
                    "UpdateExpression": "SET n = n + :one, tags = list_append(tags, :more)",
                    "ExpressionAttributeValues": {":one": {"N": "1"}, ":more": {"L": [{"S": "b"}]}},
                }
            },
            {"Delete": {"TableName": table, "Key": key("deleted")}},
        ]

        # Refused by a condition that fails after the other items were written.
        refused = {"ConditionCheck": {"TableName": table, "Key": key("checked"), "ConditionExpression": "n = :two",
                                      "ExpressionAttributeValues": {":two": {"N": "2"}}}}
        with pytest.raises(ClientError) as cancelled:
            client.transact_write_items(TransactItems=[*writes, refused])
        assert cancelled.value.response["Error"]["Code"] == "TransactionCanceledException"
        assert _items(client, table) == before

        # Refused for naming one item twice, which moto finds after writing the first.
        with pytest.raises(ClientError) as twice:
            client.transact_write_items(TransactItems=[*writes, {"Delete": {"TableName": table, "Key": key("updated")}}])
        assert twice.value.response["Error"]["Code"] == "ValidationException"
        assert _items(client, table) == before

        client.transact_write_items(TransactItems=writes)
        after = {item[keys[0]]["S"].split("-")[0]: item for item in _items(client, table)}
        assert sorted(after) == ["checked", "new", "replaced", "untouched", "updated"]
        assert after["new"]["n"] == after["replaced"]["n"] == {"N": "9"}
        assert after["updated"]["n"] == {"N": "2"} and after["updated"]["tags"] == {"L": [{"S": "a"}, {"S": "b"}]}
        assert after["untouched"] == next(i for i in before if i[keys[0]]["S"].startswith("untouched"))


def test_an_expression_sent_again_applies_its_new_values_and_a_malformed_one_is_refused_each_time():
    # Each expression string is parsed once; its values are the request's, every time
    with emulation() as env:
        client = boto3.client("dynamodb", region_name=env.stack.region)
        client.create_table(
            TableName="again", KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}], BillingMode="PAY_PER_REQUEST",
        )
        key = {"pk": {"S": "job"}}
        client.put_item(TableName="again", Item={**key, "n": {"N": "0"}, "state": {"S": "PENDING"}})

        def update(value: str, expected: str) -> None:
            client.update_item(
                TableName="again", Key=key, UpdateExpression="SET #s = :new, n = n + :one",
                ConditionExpression="attribute_exists(pk) AND #s = :expected",
                ExpressionAttributeNames={"#s": "state"},
                ExpressionAttributeValues={":new": {"S": value}, ":one": {"N": "1"}, ":expected": {"S": expected}},
            )

        # When the same update and condition are sent three times with other values
        update("ADMITTED", "PENDING")
        update("RUNNING", "ADMITTED")
        # Then each applied its own values, and a condition on a value no longer there fails
        with pytest.raises(ClientError) as stale:
            update("STOPPED", "ADMITTED")
        assert stale.value.response["Error"]["Code"] == "ConditionalCheckFailedException"
        item = client.get_item(TableName="again", Key=key, ConsistentRead=True)["Item"]
        assert item["state"] == {"S": "RUNNING"} and item["n"] == {"N": "2"}
        # And a malformed expression is refused every time it is sent, with the same reason
        reasons = []
        for _ in range(2):
            for malformed in ("SET n = ", "SET n = :one REMOVE"):
                with pytest.raises(ClientError) as refused:
                    client.update_item(TableName="again", Key=key, UpdateExpression=malformed, ExpressionAttributeValues={":one": {"N": "1"}})
                reasons.append((refused.value.response["Error"]["Code"], refused.value.response["Error"]["Message"]))
        assert reasons[:2] == reasons[2:] and {code for code, _ in reasons} == {"ValidationException"}
        assert client.get_item(TableName="again", Key=key, ConsistentRead=True)["Item"] == item
