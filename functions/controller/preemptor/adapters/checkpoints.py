"""Checkpoints in S3: when was the last one written, and asking for a new one."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlparse

from botocore.exceptions import ClientError

from ..core.errors import ServiceRejected, Throttled

CONTROL_DIR = "_preemptor"
REQUEST_KEY = f"{CONTROL_DIR}/checkpoint-request.json"


def split_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, 'prefix/'), the prefix always ending in a slash."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r}")
    prefix = parsed.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return parsed.netloc, prefix


class CheckpointStore:
    def __init__(self, client: Any):
        self.client = client

    def newest(self, uri: str) -> float | None:
        """Epoch seconds of the newest checkpoint object under `uri`, None if there is none.

        Objects under `<uri>/_preemptor/` are the controller's own and do not count.
        """
        bucket, prefix = split_uri(uri)
        newest = None
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    if obj["Key"][len(prefix):].startswith(CONTROL_DIR + "/"):
                        continue
                    stamp = obj["LastModified"].timestamp()
                    newest = stamp if newest is None else max(newest, stamp)
        except ClientError as e:
            raise self._translate(e, f"ListObjectsV2 {uri}") from e
        return newest

    def request(self, uri: str, now: float, reason: str) -> str:
        """Write the checkpoint-request marker a training helper watches; returns its key."""
        bucket, prefix = split_uri(uri)
        key = prefix + REQUEST_KEY
        body = json.dumps({"requested_at": now, "reason": reason}).encode()
        try:
            self.client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json")
        except ClientError as e:
            raise self._translate(e, f"PutObject s3://{bucket}/{key}") from e
        return f"s3://{bucket}/{key}"

    @staticmethod
    def _translate(error: ClientError, what: str) -> Exception:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("SlowDown", "Throttling", "ThrottlingException"):
            return Throttled(f"{what}: {code}")
        return ServiceRejected(f"{what}: {code}")
