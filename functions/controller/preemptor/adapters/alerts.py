"""The alerts topic (SNS): alerts for the operators, and notices to the teams that own jobs.

Every notice about a job carries the message attributes `team`, `job` and `kind`, so that a
team subscribes to its own with a filter policy (`{"team": ["research"]}`) and an operator's
unfiltered subscription still gets everything:

    aws sns subscribe --topic-arn <AlertsTopicArn> --protocol email \
        --notification-endpoint research-oncall@example.com \
        --attributes '{"FilterPolicy": "{\"team\": [\"research\"]}"}'
"""

from __future__ import annotations

import json
import logging
from typing import Any

from botocore.exceptions import ClientError

from ..core.errors import PreemptorError, ServiceUnavailable
from ..core.model import Notice
from .errors import NO_ANSWER, translate

log = logging.getLogger(__name__)

# What a notice tells its team (the `kind` attribute).
NOTICE_KINDS: tuple[str, ...] = (
    "preemption-planned", "preemption-called-off", "preempted", "relaunched", "failed", "waiting-too-long", "priority-changed",
)


class Alerts:
    def __init__(self, client: Any, topic_arn: str):
        self.client = client
        self.topic_arn = topic_arn

    def publish(self, subject: str, message: dict, attributes: dict[str, str] | None = None) -> str | None:
        """Publish one alert (subject cut to SNS's 100 characters); None if no topic is set."""
        if not self.topic_arn:
            return None
        kwargs: dict[str, Any] = {
            "TopicArn": self.topic_arn,
            "Subject": subject[:100],
            "Message": json.dumps(message, sort_keys=True, default=str),
        }
        if attributes:
            kwargs["MessageAttributes"] = {k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()}
        try:
            out = self.client.publish(**kwargs)
        except ClientError as e:
            raise translate(e, "SNS Publish") from e
        except NO_ANSWER as e:
            raise ServiceUnavailable(f"SNS Publish: no answer: {type(e).__name__}") from e
        return out.get("MessageId")

    def send(self, notice: Notice) -> bool:
        """Publish a notice kept in the table with its change; False if SNS refused it
        (logged; the notice stays for reconcile to publish). True with no topic set: there
        is nothing to publish it to."""
        if not self.topic_arn:
            return True
        attributes = {"team": notice.team, "job": notice.job, "kind": notice.kind}
        try:
            self.publish(notice.subject, {**attributes, **notice.message}, attributes)
            return True
        except PreemptorError as e:
            log.warning("notice not published yet: %s", e, extra={"job": notice.job, "kind": notice.kind, "error": type(e).__name__})
            return False
