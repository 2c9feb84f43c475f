"""Checkpoints in S3: when was the last one written, and asking for a new one."""

from __future__ import annotations

import json
import re
from typing import Any

from botocore.exceptions import ClientError

from ..core.errors import CheckpointLocationUnavailable
from ..core.s3uri import S3Uri
from .errors import ErrorKind, classify, code_of, translate

MANIFEST = "manifest.json"  # the training helper's, written after a checkpoint's files
CONTROL_DIR = "_preemptor"
REQUEST_KEY = f"{CONTROL_DIR}/checkpoint-request.json"
# A checkpoint directory of the training helper (docs/training.md: `step-<12 digits>/`): its
# files count only once its manifest is written, even before the location holds any manifest.
HELPER_DIR = re.compile(r"step-\d{12}")
MANIFEST_READS = 3  # helper manifests read per look, newest first (a location keeps a few)


def in_unsealed_helper_checkpoint(key: str) -> bool:
    """Whether `key` is a file inside a checkpoint directory of the training helper other than
    its manifest: such a file does not make a checkpoint (its manifest, written last, does)."""
    parts = key.split("/")
    return parts[-1] != MANIFEST and any(HELPER_DIR.fullmatch(p) for p in parts[:-1])


class CheckpointStore:
    def __init__(self, client: Any):
        self.client = client

    def newest(self, uri: str) -> float | None:
        """Epoch seconds of the newest checkpoint under `uri`, None if there is none.

        Where the training helper's layout is in use (`<dir>/manifest.json` written after the
        checkpoint's files, docs/training.md), the newest checkpoint is the newest directory
        with its manifest and a file beside it; otherwise, the newest object. The layout is
        in use once any manifest or any helper directory (`step-<12 digits>/`) is there: the
        files of a first save whose manifest is not written yet are no checkpoint. A helper
        directory's manifest is read (at most MANIFEST_READS of them, newest first): it counts
        only once every file it names is listed with its size (SageMaker's sync uploads in its
        own order, the manifest possibly first). Objects under `<uri>/_preemptor/` are the
        controller's own and do not count.

        Raises:
            CheckpointLocationUnavailable: the location is invalid, its bucket does not
                exist, or the controller may not list it (one job's problem: the caller
                records it and carries on with the others).
            Throttled, ServiceUnavailable: retry later.
        """
        location = _parse(uri)
        prefix = location.key_prefix
        newest = None
        manifests: dict[str, float] = {}  # checkpoint directory -> its manifest's time
        files: set[str] = set()  # directories holding a file besides their manifest
        sizes: dict[str, int] = {}  # relative key -> size, of the helper directories' objects
        helper = False  # a directory of the training helper's layout is there
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    relative = obj["Key"][len(prefix):]
                    if relative.startswith(CONTROL_DIR + "/"):
                        continue
                    stamp = obj["LastModified"].timestamp()
                    newest = stamp if newest is None else max(newest, stamp)
                    directory, _, name = relative.partition("/")  # the checkpoint's top directory
                    in_helper_dir = bool(name) and HELPER_DIR.fullmatch(directory) is not None
                    helper = helper or in_helper_dir
                    if in_helper_dir:
                        sizes[relative] = obj.get("Size", 0)
                    if name == MANIFEST:
                        manifests[directory] = stamp
                    elif name:
                        files.add(directory)
        except ClientError as e:
            raise _translate(e, f"ListObjectsV2 {location}") from e
        if manifests or helper:
            # The training helper's layout: a checkpoint is complete once its own manifest is
            # written, after its files. Files without a manifest are a save still in progress
            # (or torn): they never count as a fresh checkpoint.
            complete = sorted(((t, d) for d, t in manifests.items() if d in files), reverse=True)
            reads = 0
            for stamp, directory in complete:
                if HELPER_DIR.fullmatch(directory) is None:
                    return stamp  # another writer's manifest: the rule above is all there is
                if reads == MANIFEST_READS:
                    return None
                reads += 1
                if self._all_files_listed(location, prefix, directory, sizes):
                    return stamp
            return None
        return newest

    def _all_files_listed(self, location: S3Uri, prefix: str, directory: str, sizes: dict[str, int]) -> bool:
        """Whether the helper manifest of `directory` names only files the listing has, each
        with its size. A manifest that is not the helper's (not JSON, no file list) is judged
        as before: its own presence and a file beside it."""
        key = f"{prefix}{directory}/{MANIFEST}"
        try:
            body = self.client.get_object(Bucket=location.bucket, Key=key)["Body"].read()
        except ClientError as e:
            kind = classify(e)
            if kind.retryable:
                raise translate(e, f"GetObject s3://{location.bucket}/{key}") from e
            if kind is ErrorKind.NOT_FOUND:
                return False  # pruned since the listing: an older one may still count
            # Not allowed to read it (a bucket policy of the team's): judged by presence, as
            # where the role may only list.
            return True
        try:
            files = json.loads(body).get("files")
        except (ValueError, UnicodeDecodeError, AttributeError):
            return True
        if not isinstance(files, list):
            return True
        for item in files:
            if not (isinstance(item, dict) and isinstance(item.get("path"), str)):
                return False
            if sizes.get(item["path"]) != item.get("bytes"):
                return False  # not uploaded yet (or not whole): not a checkpoint to stop on
        return True

    def request(self, uri: str, now: float, reason: str) -> str:
        """Write the checkpoint-request marker a training helper watches; returns its URI.

        Raises the same errors as `newest`.
        """
        marker = _parse(uri).child(REQUEST_KEY)
        body = json.dumps({"requested_at": now, "reason": reason}).encode()
        try:
            self.client.put_object(Bucket=marker.bucket, Key=marker.prefix, Body=body, ContentType="application/json")
        except ClientError as e:
            raise _translate(e, f"PutObject {marker}") from e
        return str(marker)


def _parse(uri: str) -> S3Uri:
    try:
        return S3Uri.parse(uri)
    except ValueError as e:
        raise CheckpointLocationUnavailable(str(e), "InvalidUri") from e


def _translate(error: ClientError, what: str) -> Exception:
    """Retryable errors stay retryable; anything else (NoSuchBucket, AccessDenied...) is
    this location's problem."""
    kind = classify(error)
    if kind.retryable:
        return translate(error, what)
    reason = code_of(error) or kind.value
    return CheckpointLocationUnavailable(f"{what}: {reason}", reason)
