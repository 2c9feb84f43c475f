"""The S3 side: the controller's request marker, and a mirror of the checkpoints for hosts
whose local disk does not outlive the job (AWS Batch).

boto3 is imported only here, and only when an `s3://` location is used, so the helper runs
with the standard library alone elsewhere. Every S3 error becomes an `S3Error` carrying the
AWS error code (a stable string the caller logs and counts); nothing reads messages.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .manifest import MANIFEST, REQUEST_FILE, Manifest, ManifestError, parse_step_dir

log = logging.getLogger("preemptor_training")

# Bucket names: 3-63 lower-case letters, digits, dots and hyphens (S3 bucket naming rules).
_URI = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<prefix>.*[^/].*)")
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1,000 keys


def _code(error: Any) -> str:
    return error.response.get("Error", {}).get("Code", "") or "Unknown"


class S3Error(Exception):
    """An S3 call failed; `code` is the AWS error code."""

    def __init__(self, operation: str, code: str):
        super().__init__(f"{operation}: {code}")
        self.operation = operation
        self.code = code


@dataclass(frozen=True, slots=True)
class S3Location:
    """A checkpoint location: a bucket and a key prefix (never a bare bucket)."""

    bucket: str
    prefix: str  # no leading or trailing slash

    @classmethod
    def parse(cls, uri: str) -> "S3Location":
        """Parse `s3://bucket/prefix`.

        Raises:
            ValueError: not an `s3://` URI with a valid bucket and a prefix.
        """
        match = _URI.fullmatch(uri.strip())
        if match is None:
            raise ValueError(f"not an s3://bucket/prefix checkpoint location: {uri!r}")
        return cls(match["bucket"], match["prefix"].strip("/"))

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative.lstrip('/')}"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


class S3Mirror:
    """Reads the request marker and mirrors checkpoints under one S3 location."""

    def __init__(self, location: S3Location, client: Any = None):
        self.location = location
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3  # optional dependency: only an s3:// location needs it

            self._client = boto3.client("s3")
        return self._client

    def _call(self, operation: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        from boto3.exceptions import RetriesExceededError, S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except ClientError as e:
            raise S3Error(operation, _code(e)) from e
        except S3UploadFailedError as e:
            # The managed upload re-raises the service's error inside its own; the code is on
            # the error it was handling (its context), not in its message.
            cause = e.__context__
            raise S3Error(operation, _code(cause) if isinstance(cause, ClientError) else "UploadFailed") from e
        except RetriesExceededError as e:
            raise S3Error(operation, "RetriesExceeded") from e
        except BotoCoreError as e:
            # No response from S3 at all (no endpoint, no credentials): the class names it.
            raise S3Error(operation, type(e).__name__) from e

    # -- the request marker ----------------------------------------------------------------
    def read_request(self, etag_seen: str | None) -> tuple[str, bytes] | None:
        """The marker's (ETag, body); None when there is none. `etag_seen` skips the body
        when the marker has not changed since it was last read (S3 answers 304)."""
        kwargs: dict[str, Any] = {"Bucket": self.location.bucket, "Key": self.location.key(REQUEST_FILE)}
        if etag_seen:
            kwargs["IfNoneMatch"] = etag_seen
        try:
            response = self._call("GetObject", self.client.get_object, **kwargs)
        except S3Error as e:
            if e.code in ("NoSuchKey", "404"):
                return None
            if e.code in ("304", "NotModified"):
                return etag_seen or "", b""
            raise
        return response.get("ETag", ""), response["Body"].read()

    @property
    def request_uri(self) -> str:
        return f"s3://{self.location.bucket}/{self.location.key(REQUEST_FILE)}"

    # -- checkpoints -----------------------------------------------------------------------
    def upload(self, root: Path, manifest: Manifest) -> None:
        """Copy a complete checkpoint to S3: its files, then its manifest, then the
        location's `manifest.json`, so a reader of S3 never sees a manifest before the files
        it names."""
        bucket = self.location.bucket
        for item in manifest.files:
            self._call("PutObject", self.client.upload_file, Filename=str(root / item.path), Bucket=bucket, Key=self.location.key(item.path))
        self.upload_manifest(manifest)

    def upload_manifest(self, manifest: Manifest) -> None:
        """The checkpoint's manifest, then the location's."""
        body = manifest.encode()
        for key in (f"{manifest.path}/{MANIFEST}", MANIFEST):
            self._call("PutObject", self.client.put_object, Bucket=self.location.bucket, Key=self.location.key(key), Body=body, ContentType="application/json")

    def remove(self, names: list[str]) -> int:
        """Delete the checkpoint directories `names` from S3; returns the objects deleted."""
        keys = [key for name in names for key, _ in self._list(f"{name}/")]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start : start + _DELETE_BATCH]]
            response = self._call("DeleteObjects", self.client.delete_objects, Bucket=self.location.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = response.get("Errors") or []
            if errors:
                raise S3Error("DeleteObjects", errors[0].get("Code", "Unknown"))
        return len(keys)

    def _list(self, relative: str = "") -> Iterator[tuple[str, int]]:
        """(key, size) of every object under the location (or under `relative` in it)."""
        paginator = self.client.get_paginator("list_objects_v2")
        prefix = self.location.key(relative)
        pages = self._call("ListObjectsV2", lambda: list(paginator.paginate(Bucket=self.location.bucket, Prefix=prefix)))
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"], obj["Size"]

    def complete(self) -> tuple[list[Manifest], list[str]]:
        """The complete checkpoints in S3, newest first, and the names of torn ones.

        Complete: the checkpoint's own manifest is there and every file it names is there
        with its size (a copy cut short leaves files without a manifest, or the other way
        round when the copy was not made by this helper, e.g. a sync with its own order).
        """
        root = self.location.key("")
        sizes = {key[len(root):]: size for key, size in self._list()}
        names = sorted({rel.split("/", 1)[0] for rel in sizes if "/" in rel and parse_step_dir(rel.split("/", 1)[0]) is not None})
        complete: list[Manifest] = []
        torn: list[str] = []
        for name in names:
            if f"{name}/{MANIFEST}" not in sizes:
                torn.append(name)
                continue
            response = self._call("GetObject", self.client.get_object, Bucket=self.location.bucket, Key=self.location.key(f"{name}/{MANIFEST}"))
            try:
                manifest = Manifest.decode(response["Body"].read())
            except ManifestError as e:
                log.warning("torn checkpoint in S3: %s (%s)", name, e.reason, extra={"reason": e.reason})
                torn.append(name)
                continue
            if manifest.path != name or any(sizes.get(f.path) != f.bytes for f in manifest.files):
                torn.append(name)
                continue
            complete.append(manifest)
        complete.sort(key=lambda m: (m.step, m.time), reverse=True)
        return complete, torn

    def download(self, root: Path, manifest: Manifest) -> None:
        """Copy a complete checkpoint from S3 into `root`, its manifest last."""
        for item in manifest.files:
            target = root / item.path
            target.parent.mkdir(parents=True, exist_ok=True)
            self._call("GetObject", self.client.download_file, Bucket=self.location.bucket, Key=self.location.key(item.path), Filename=str(target))
