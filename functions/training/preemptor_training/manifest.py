"""The manifest: what a checkpoint holds, written after its files are complete.

A checkpoint location (a local directory, mirrored to an S3 prefix) looks like this:

    manifest.json                         the newest complete checkpoint (what readers read)
    step-000000000042/                    one checkpoint: the files `save(dir, step)` wrote
    step-000000000042/manifest.json       its manifest, written last: the checkpoint is complete
    _preemptor/checkpoint-request.json    the controller's request (never written here)

Both manifests hold the same document. A directory without a valid manifest, or whose
manifest names a file that is missing or of another size, is torn (a save or a copy was cut
short) and is never resumed from. Manifests are replaced atomically (temporary file, then
rename), so a reader sees the old document or the new one, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CONTROL_DIR = "_preemptor"
REQUEST_FILE = f"{CONTROL_DIR}/checkpoint-request.json"
FORMAT = 1
_STEP_DIR = re.compile(r"step-(\d{12})")
_TMP_MARK = ".tmp-"


class Reason(str, Enum):
    """Why a checkpoint was written."""

    PERIODIC = "periodic"  # `every_s` elapsed since the previous one
    REQUESTED = "requested"  # the controller asked (checkpoint-request marker)
    SIGTERM = "sigterm"  # the service is stopping the job


class ManifestError(ValueError):
    """A manifest document is not valid; `reason` is a short stable string."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def step_dir_name(step: int) -> str:
    """The directory of the checkpoint taken when `step` steps were done."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, None for any other name."""
    match = _STEP_DIR.fullmatch(name)
    return int(match[1]) if match else None


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint: its path relative to the checkpoint location, its size."""

    path: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """The document that makes a checkpoint complete.

    `step` is the step training resumes at (steps 0 .. step-1 are in the checkpoint).
    `time` is when the state was taken (the step boundary), epoch seconds on the training
    host's clock: the work at risk is what happened after it. `requested_at` is the
    controller's request this checkpoint answered, if any.
    """

    step: int
    time: float
    reason: Reason
    path: str
    files: tuple[FileEntry, ...]
    requested_at: float | None = None
    save_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": self.step,
            "time": self.time,
            "reason": self.reason.value,
            "requested_at": self.requested_at,
            "path": self.path,
            "files": [{"path": f.path, "bytes": f.bytes} for f in self.files],
            "save_s": self.save_s,
        }

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def decode(cls, body: bytes | str) -> "Manifest":
        """Parse and validate a manifest document.

        Raises:
            ManifestError: not JSON, or a field is missing or of the wrong type.
        """
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError("manifest-not-json", str(e)) from e
        if not isinstance(data, dict):
            raise ManifestError("manifest-not-object", type(data).__name__)
        if data.get("format") != FORMAT:
            raise ManifestError("manifest-format", repr(data.get("format")))
        step, path = data.get("step"), data.get("path")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ManifestError("manifest-step", repr(step))
        if not isinstance(path, str) or parse_step_dir(path) != step:
            raise ManifestError("manifest-path", repr(path))
        try:
            reason = Reason(data.get("reason"))
        except ValueError as e:
            raise ManifestError("manifest-reason", repr(data.get("reason"))) from e
        files = data.get("files")
        if not isinstance(files, list):
            raise ManifestError("manifest-files", repr(files))
        entries = []
        for item in files:
            if not (isinstance(item, dict) and isinstance(item.get("path"), str) and _is_size(item.get("bytes"))):
                raise ManifestError("manifest-files", repr(item))
            if not item["path"].startswith(path + "/") or ".." in item["path"].split("/"):
                raise ManifestError("manifest-file-outside", item["path"])
            entries.append(FileEntry(item["path"], item["bytes"]))
        return cls(
            step=step,
            time=_number(data.get("time"), "manifest-time"),
            reason=reason,
            path=path,
            files=tuple(entries),
            requested_at=_optional_number(data.get("requested_at"), "manifest-requested-at"),
            save_s=_optional_number(data.get("save_s"), "manifest-save-s"),
        )


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any, reason: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ManifestError(reason, repr(value))
    return float(value)


def _optional_number(value: Any, reason: str) -> float | None:
    return None if value is None else _number(value, reason)


def is_temporary(name: str) -> bool:
    """Whether a file name is one of the helper's temporary files (never part of a checkpoint)."""
    return name.startswith(".") and _TMP_MARK in name


def write_atomic(path: Path, body: bytes) -> None:
    """Replace `path` with `body` so that a reader sees the old content or the new, never a mix.

    The bytes go to a temporary file in the same directory, are flushed to disk, and the
    file is renamed over `path` (rename is atomic within a file system).
    """
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(body)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # The rename is durable once the directory entry is; some file systems refuse to open a
    # directory for this, which only weakens durability after a host crash, not atomicity.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
