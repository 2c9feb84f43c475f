"""SQS queues subscribed to the emulated stack's alerts topic, as a team subscribes to its
notices (moto's SNS applies filter policies as SNS does)."""

from __future__ import annotations

import json


def subscribe(env, name: str, filter_policy: dict | None) -> str:
    """An SQS queue subscribed to the alerts topic (with `filter_policy`); its URL."""
    sqs, sns = env.stack.client("sqs"), env.stack.client("sns")
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    attributes = {"FilterPolicy": json.dumps(filter_policy)} if filter_policy else {}
    sns.subscribe(TopicArn=env.stack.resources["AlertsTopic"], Protocol="sqs", Endpoint=arn, Attributes=attributes)
    return url


def received(env, url: str) -> list[dict]:
    """(attributes, message) of every notice the queue got, as SNS delivers them."""
    sqs = env.stack.client("sqs")
    out = []
    while messages := sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", []):
        for m in messages:
            envelope = json.loads(m["Body"])
            attributes = {k: v["Value"] for k, v in (envelope.get("MessageAttributes") or {}).items()}
            out.append({"attributes": attributes, "message": json.loads(envelope["Message"])})
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return out
