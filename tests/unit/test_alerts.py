"""Notices: the attributes a team filters on, and a refused publish that never fails the step."""

from __future__ import annotations

import json
import logging

from botocore.exceptions import ClientError

from preemptor.adapters.alerts import Alerts
from preemptor.core.model import Notice


class _Topic:
    def __init__(self, error: ClientError | None = None):
        self.error = error
        self.published: list[dict] = []

    def publish(self, **kwargs):
        if self.error is not None:
            raise self.error
        self.published.append(kwargs)
        return {"MessageId": f"m-{len(self.published)}"}


def test_a_notice_carries_team_job_and_kind_as_message_attributes():
    topic = _Topic()
    notice = Notice("p5", 100.0, "preempted", "sweep", "research", "Preemptor: job sweep was preempted", {"by": "prod"})
    assert Alerts(topic, "arn:aws:sns:us-east-1:123456789012:alerts").send(notice)
    [call] = topic.published
    assert call["Subject"] == "Preemptor: job sweep was preempted"
    assert call["MessageAttributes"] == {
        "team": {"DataType": "String", "StringValue": "research"},
        "job": {"DataType": "String", "StringValue": "sweep"},
        "kind": {"DataType": "String", "StringValue": "preempted"},
    }
    assert json.loads(call["Message"]) == {"kind": "preempted", "job": "sweep", "team": "research", "by": "prod"}


def test_a_refused_notice_is_logged_not_raised(caplog):
    # Given SNS throttles the publish (its own error shape)
    throttled = ClientError({"Error": {"Code": "Throttling", "Message": "Rate exceeded"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "Publish")
    alerts = Alerts(_Topic(throttled), "arn:aws:sns:us-east-1:123456789012:alerts")
    # When a notice is sent
    with caplog.at_level(logging.WARNING):
        sent = alerts.send(Notice("p5", 100.0, "failed", "doomed", "a", "s"))
    # Then the step goes on (the notice is kept with its change, for reconcile to publish),
    # and the refusal is in the log
    assert sent is False
    assert any("notice not published" in r.getMessage() for r in caplog.records)


def test_without_a_topic_nothing_is_published():
    topic = _Topic()
    # (sent: there is nothing to publish it to, so reconcile forgets it)
    assert Alerts(topic, "").send(Notice("p5", 100.0, "relaunched", "j", "t", "s")) is True
    assert topic.published == []
