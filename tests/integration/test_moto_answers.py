"""The emulator's shortcut for DynamoDB's answers (moto_patches.dynamodb.fast_body) writes
every answer exactly as moto's own serializer does: checked on each answer of a preemption
story, and on items holding every type of attribute value."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import boto3
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


def test_every_answer_of_a_preemption_story_is_written_as_moto_writes_it():
    with emulation() as env, _both_written() as (compared, differ):
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(600)
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1200)
        env.advance(1800)
        env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
        env.stack.drain()
    assert differ == []
    assert {"GetItem", "PutItem", "UpdateItem", "DeleteItem", "Query", "TransactWriteItems"} <= set(compared)
    assert sum(compared.values()) > 100


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
