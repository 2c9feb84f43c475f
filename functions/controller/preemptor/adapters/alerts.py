"""The operators' alerts topic (SNS)."""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import ClientError

from .errors import translate


class Alerts:
    def __init__(self, client: Any, topic_arn: str):
        self.client = client
        self.topic_arn = topic_arn

    def publish(self, subject: str, message: dict) -> str | None:
        """Publish one alert (subject cut to SNS's 100 characters); None if no topic is set."""
        if not self.topic_arn:
            return None
        try:
            out = self.client.publish(
                TopicArn=self.topic_arn, Subject=subject[:100], Message=json.dumps(message, sort_keys=True, default=str)
            )
        except ClientError as e:
            raise translate(e, "SNS Publish") from e
        return out.get("MessageId")
