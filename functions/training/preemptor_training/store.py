"""The local checkpoint directory: where checkpoints are written, which are complete, pruning."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .manifest import (
    MANIFEST,
    REQUEST_FILE,
    FileEntry,
    Manifest,
    ManifestError,
    Reason,
    is_temporary,
    parse_step_dir,
    step_dir_name,
    write_atomic,
)

log = logging.getLogger("preemptor_training")


@dataclass(frozen=True, slots=True)
class Torn:
    """A checkpoint directory that must not be resumed from, and why."""

    name: str
    step: int
    reason: str  # no-manifest | manifest-* | missing-file | size-mismatch


class ReservedName(ValueError):
    """The save callback wrote a file the helper reserves for itself."""


class LocalStore:
    """Checkpoints in one directory (see `manifest` for the layout)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def scan(self) -> tuple[list[Manifest], list[Torn]]:
        """The complete checkpoints, newest first (highest step, then latest time), and the torn ones."""
        complete: list[Manifest] = []
        torn: list[Torn] = []
        if not self.root.is_dir():
            return complete, torn
        for entry in self.root.iterdir():
            step = parse_step_dir(entry.name)
            if step is None or not entry.is_dir():
                continue
            manifest, why = self._read_complete(entry, step)
            if manifest is None:
                torn.append(Torn(entry.name, step, why))
            else:
                complete.append(manifest)
        complete.sort(key=lambda m: (m.step, m.time), reverse=True)
        torn.sort(key=lambda t: t.step, reverse=True)
        return complete, torn

    def newest(self) -> Manifest | None:
        complete, _ = self.scan()
        return complete[0] if complete else None

    def _read_complete(self, directory: Path, step: int) -> tuple[Manifest | None, str]:
        try:
            body = (directory / MANIFEST).read_bytes()
        except FileNotFoundError:
            return None, "no-manifest"
        try:
            manifest = Manifest.decode(body)
        except ManifestError as e:
            return None, e.reason
        if manifest.path != directory.name:
            return None, "manifest-path"
        return (manifest, "") if not (why := self.verify(manifest)) else (None, why)

    def verify(self, manifest: Manifest) -> str:
        """'' when every file the manifest names is present with its size, else why not."""
        for item in manifest.files:
            try:
                size = (self.root / item.path).stat().st_size
            except FileNotFoundError:
                return "missing-file"
            if size != item.bytes:
                return "size-mismatch"
        return ""

    def begin(self, step: int) -> Path:
        """The (possibly shared between ranks) directory the save callback writes into."""
        directory = self.path(step)
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def seal(
        self,
        step: int,
        *,
        time: float,
        reason: Reason,
        requested_at: float | None,
        save_s: float | None,
    ) -> Manifest:
        """Write the checkpoint's own manifest, naming every file now in its directory.

        Called after the save callback returned: the manifest is the last thing written, so
        a checkpoint whose save was cut short has none.

        Raises:
            ReservedName: the save callback wrote a `manifest.json` of its own at the top.
        """
        directory = self.path(step)
        files = []
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames.sort()
            for name in sorted(filenames):
                full = Path(dirpath) / name
                relative = full.relative_to(self.root).as_posix()
                if is_temporary(name):
                    continue
                if full.parent == directory and name == MANIFEST:
                    raise ReservedName(f"{relative}: the save callback must not write {MANIFEST} at the top of the checkpoint")
                files.append(FileEntry(relative, full.stat().st_size))
        manifest = Manifest(
            step=step,
            time=time,
            reason=reason,
            path=directory.name,
            files=tuple(files),
            requested_at=requested_at,
            save_s=save_s,
        )
        write_atomic(directory / MANIFEST, manifest.encode())
        return manifest

    def seal_as(self, manifest: Manifest) -> None:
        """Rewrite the manifest of a complete checkpoint (same files, a new time or reason)."""
        write_atomic(self.root / manifest.path / MANIFEST, manifest.encode())

    def adopt(self, manifest: Manifest) -> str:
        """Make a copied checkpoint complete here: its manifest is written once every file
        it names is present with its size. Returns '' on success, else why not."""
        why = self.verify(manifest)
        if not why:
            write_atomic(self.root / manifest.path / MANIFEST, manifest.encode())
        return why

    def publish(self, manifest: Manifest) -> None:
        """Point the location's `manifest.json` at a complete checkpoint."""
        write_atomic(self.root / MANIFEST, manifest.encode())

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

    def prune(self, keep: int) -> list[str]:
        """Remove all but the `keep` newest complete checkpoints, and every torn directory
        older than the newest complete one; returns the removed directory names."""
        complete, torn = self.scan()
        if not complete:
            return []
        newest = complete[0].step
        doomed = [m.path for m in complete[keep:]] + [t.name for t in torn if t.step < newest]
        for name in doomed:
            self.remove(name)
        for leftover in self.root.iterdir():
            if is_temporary(leftover.name) and leftover.is_file():
                leftover.unlink(missing_ok=True)
        return doomed

    def remove_torn(self) -> list[Torn]:
        """Remove every torn checkpoint directory (before training starts: none is being written)."""
        _, torn = self.scan()
        for item in torn:
            log.warning("torn checkpoint removed: %s (%s)", item.name, item.reason, extra={"reason": item.reason})
            self.remove(item.name)
        return torn

    @property
    def request_file(self) -> Path:
        return self.root / REQUEST_FILE
