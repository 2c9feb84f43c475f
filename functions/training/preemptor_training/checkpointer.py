"""The training side of the checkpoint protocol: resume, checkpoint at step boundaries,
answer the controller's requests, and stop cleanly on SIGTERM.

    with Checkpointer(directory, save=save, load=load, every_s=600) as ckpt:
        for step in range(ckpt.resume(), total_steps):
            train_one_step(step)
            ckpt.step_done(step)

Nothing is saved from inside a signal handler: SIGTERM sets a flag, and the checkpoint is
taken at the next step boundary, where the training state is consistent. If the step in
progress cannot finish within the service's grace, the service kills the process (SIGKILL)
and the run loses the work since the newest complete checkpoint; a checkpoint whose save
was cut short has no manifest and is never resumed from.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import replace
from enum import IntEnum
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Mapping

from .environment import Platform, Settings, detect_platform, process_started_at, settings_from
from .manifest import Manifest, Reason
from .marker import MalformedRequest, RequestBook, Verdict, parse_request
from .s3 import S3Error, S3Location, S3Mirror
from .store import LocalStore

log = logging.getLogger("preemptor_training")

SaveFn = Callable[[Path, int], None]
LoadFn = Callable[[Path], None]

# Reading the checkpoints to resume from: a transient S3 error (throttling, a 5xx, no
# answer) is retried with backoff before the run gives up, since giving up fails the job.
RESTORE_ATTEMPTS = 5
RESTORE_BACKOFF_S = 2.0  # attempt n waits 2 x 2^(n-1) s, at most 30 s
_TRANSIENT_S3_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
    "ServiceUnavailable", "503", "500", "RetriesExceeded", "IncompleteDownload", "EndpointConnectionError",
    "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
})


class Stopped(SystemExit):
    """Raised by `step_done` after the checkpoint SIGTERM asked for: the process exits 0."""

    def __init__(self, manifest: Manifest | None):
        super().__init__(0)
        self.manifest = manifest


class RestoreFailed(RuntimeError):
    """The mirrored checkpoints could not be read at start. Training does not start from
    scratch then: its first checkpoints would bury the real ones (and pruning remove them)."""

    def __init__(self, error: S3Error):
        super().__init__(f"cannot read the checkpoints to resume from: {error}")
        self.code = error.code


class Action(IntEnum):
    """What a step boundary does; ranks agree on the largest (see `agree`)."""

    NOTHING = 0
    PERIODIC = 1
    REQUESTED = 2
    SIGTERM = 3


_REASON = {Action.PERIODIC: Reason.PERIODIC, Action.REQUESTED: Reason.REQUESTED, Action.SIGTERM: Reason.SIGTERM}


class Checkpointer:
    """Checkpoints of one training run in `directory` (mirrored to S3 where asked).

    Args:
        directory: the local checkpoint directory (on SageMaker, the CheckpointConfig's
            LocalPath, `/opt/ml/checkpoints` by default, which SageMaker syncs to S3).
        save: `save(path, step)` writes the training state into the directory `path`;
            `step` is the step training will resume at.
        load: `load(path)` restores the training state from a checkpoint directory.
        every_s: a checkpoint at the first step boundary this many seconds after the
            previous one (None: only when asked or stopped).
        keep: how many complete checkpoints to keep (the newest and `keep - 1` older).
        s3_uri: the job's checkpoint location; default `PREEMPTOR_CHECKPOINT_S3_URI`. The
            request marker is read there.
        upload: copy each checkpoint to `s3_uri` and resume from it when the local
            directory has nothing newer; default: yes except on SageMaker (which syncs).
        grace_s: seconds the service allows after SIGTERM; default from the environment.
        poll_s: seconds between two reads of the marker in S3 (the local marker file is
            checked at every boundary: it costs one stat).
        writer: whether this process writes manifests, uploads and prunes. In distributed
            training every rank calls `save` (each writes its shard, or only rank 0 writes)
            and exactly one rank per checkpoint location is the writer.
        agree: distributed training: `agree(action) -> action` returns the largest action
            of all ranks (an all-reduce with MAX), so that every rank saves, or stops, at
            the same boundary. Called at every boundary on every rank.
        environ, clock, s3_client, run_started_at, sleep: for tests; the defaults are the
            process's environment, `time.time`, a boto3 client built on first use, the
            process's start time and `time.sleep`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save: SaveFn,
        load: LoadFn,
        every_s: float | None = None,
        keep: int = 2,
        s3_uri: str | None = None,
        upload: bool | None = None,
        grace_s: float | None = None,
        poll_s: float | None = None,
        writer: bool = True,
        agree: Callable[[int], int] | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        s3_client: Any = None,
        run_started_at: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if every_s is not None and every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        env = os.environ if environ is None else environ
        platform = detect_platform(env)
        defaults: Settings = settings_from(env, platform)
        self.store = LocalStore(directory)
        self.save, self.load = save, load
        self.every_s, self.keep = every_s, keep
        self.platform = platform
        self.grace_s = defaults.grace_s if grace_s is None else grace_s
        self.poll_s = defaults.poll_s if poll_s is None else poll_s
        uri = s3_uri if s3_uri is not None else defaults.s3_uri
        self.s3 = S3Mirror(S3Location.parse(uri), s3_client) if uri else None
        self.upload = self.s3 is not None and (upload if upload is not None else platform is not Platform.SAGEMAKER)
        self.writer, self.agree, self.clock, self._sleep = writer, agree, clock, sleep
        started = run_started_at if run_started_at is not None else process_started_at()
        self.requests = RequestBook(started if started is not None else clock())
        self.stats: Counter[str] = Counter()
        self.last: Manifest | None = None  # the newest complete checkpoint of this location
        self.step = 0  # the step training resumes at / the next step to run
        self._saved_step: int | None = None  # the step of this process's newest save
        self._last_save_at = clock()
        self._next_poll_at = 0.0
        self._request_etag: str | None = None
        self._request_stat: tuple[int, int] | None = None
        # The checkpoints known complete in S3 (oldest first), and those pruned here that S3
        # may still hold: S3 is pruned by what it holds, never by what was meant to reach it.
        self._mirrored: list[str] = []
        self._unpruned: set[str] = set()
        self._sigterm_at: float | None = None
        self._signalled = threading.Event()
        self._finished = threading.Event()
        self._previous_handler: Any = None
        self._installed = False

    # -- context -------------------------------------------------------------------------
    def __enter__(self) -> "Checkpointer":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Checkpointer must be entered in the main thread (signal handlers live there)")
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        threading.Thread(target=self._watch_deadline, name="preemptor-grace", daemon=True).start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._finished.set()
        self._signalled.set()
        if self._installed:
            # None: the previous handler was not installed from Python; the default it is.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous_handler is None else self._previous_handler)
            self._installed = False
        if isinstance(exc, Stopped):
            self._note("stopped", logging.INFO, "stopped after the checkpoint at step %s", self.step)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only flags: the checkpoint is taken at the next step boundary, in the main flow.
        if self._sigterm_at is None:
            self._sigterm_at = self.clock()
            self._signalled.set()

    @property
    def stopping(self) -> bool:
        """SIGTERM was received: the next `step_done` checkpoints and raises `Stopped`."""
        return self._sigterm_at is not None

    def _watch_deadline(self) -> None:
        """Say so in the log when the step in progress outlives the grace (SIGKILL follows)."""
        self._signalled.wait()
        if self._finished.is_set() or self._sigterm_at is None:
            return
        if self._finished.wait(max(0.0, self._sigterm_at + self.grace_s - self.clock())):
            return
        self._note(
            "grace-exceeded",
            logging.ERROR,
            "the step in progress and its checkpoint did not end within the %g s grace: the service "
            "kills the process; the next run resumes at step %s",
            self.grace_s,
            self.last.step if self.last else 0,
        )

    # -- resume ----------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest complete checkpoint; returns the step to start at (0 if none).

        With `upload`, a checkpoint in S3 newer than the local ones is copied here first.
        Torn checkpoints (no manifest, or files missing) are removed by the writer.

        Raises:
            RestoreFailed: with `upload`, S3 could not be read (or a copy was incomplete).
        """
        if self.writer:
            self.store.remove_torn()
        newest = self.store.newest()
        if self.upload and self.writer and self.s3 is not None:
            newest = self._restore_with_retries(newest)
        self.last = newest
        if newest is None:
            self.step = 0
            self._note("fresh-start", logging.INFO, "no complete checkpoint in %s: starting at step 0", self.store.root)
        else:
            self.load(self.store.root / newest.path)
            self.step = newest.step
            self._saved_step = newest.step  # the state on disk is the state in memory
            self.requests.checkpointed(max(newest.time, newest.requested_at or newest.time))
            self._note("resumed", logging.INFO, "resumed at step %s from %s (%s)", newest.step, newest.path, newest.reason.value)
        self._last_save_at = self.clock()
        return self.step

    def _restore_with_retries(self, local: Manifest | None) -> Manifest | None:
        for attempt in range(1, RESTORE_ATTEMPTS):
            try:
                return self._restore_from_s3(local)
            except RestoreFailed as e:
                if e.code not in _TRANSIENT_S3_CODES:
                    raise
                wait = min(30.0, RESTORE_BACKOFF_S * 2 ** (attempt - 1))
                self._note(f"s3-restore-retried:{e.code}", logging.WARNING, "reading %s again in %.0f s (%s)", self.s3.location, wait, e)
                self._sleep(wait)
        return self._restore_from_s3(local)  # the last try: its failure is the run's

    def _restore_from_s3(self, local: Manifest | None) -> Manifest | None:
        assert self.s3 is not None
        try:
            complete, torn = self.s3.complete()
            self._mirrored = [m.path for m in reversed(complete)]
            if torn:
                self._remove_torn_from_s3(torn)
            if not complete or (local is not None and local.step >= complete[0].step):
                return local
            remote = complete[0]
            self.s3.download(self.store.root, remote)
            if self.store.adopt(remote):
                raise S3Error("GetObject", "IncompleteDownload")
            self.store.publish(remote)
            self._note("restored-from-s3", logging.INFO, "checkpoint %s copied from %s", remote.path, self.s3.location)
            return remote
        except S3Error as e:
            self._note(f"s3-restore-failed:{e.code}", logging.ERROR, "could not restore from %s: %s", self.s3.location, e)
            raise RestoreFailed(e) from e

    def _remove_torn_from_s3(self, torn: list[str]) -> None:
        """Torn copies are never resumed from: one that cannot be deleted (a role that may
        read but not delete) is left for the prune, and the resume goes on."""
        assert self.s3 is not None
        try:
            self.s3.remove(torn)
        except S3Error as e:
            self._unpruned.update(torn)
            self._note(f"s3-torn-left:{e.code}", logging.WARNING, "torn checkpoints left in %s (%s): %s", self.s3.location, e, ", ".join(torn))
            return
        self._note("s3-torn-removed", logging.WARNING, "torn checkpoints removed from %s: %s", self.s3.location, ", ".join(torn))

    # -- the step boundary -----------------------------------------------------------------
    def step_done(self, step: int) -> None:
        """Step `step` is complete: checkpoint if it is time, if the controller asked, or if
        the service is stopping the job; in the last case raise `Stopped` (exit code 0)."""
        self.step = step + 1
        now = self.clock()
        self._read_requests(now)
        action = self._wanted(now)
        if self.agree is not None:
            action = Action(self.agree(int(action)))
        if action is not Action.NOTHING:
            self.checkpoint(_REASON[action], now)
        stop = action is Action.SIGTERM
        if self.agree is None and self._sigterm_at is not None:
            # SIGTERM came during this boundary's save: that checkpoint is current, unless
            # it was not taken at this step. (With `agree`, a rank never stops alone: the
            # next boundary's agreement carries the stop to every rank.)
            if self._saved_step != self.step:
                self.checkpoint(Reason.SIGTERM, self.clock())
            stop = True
        if stop:
            raise Stopped(self.last)

    def _wanted(self, now: float) -> Action:
        if self._sigterm_at is not None:
            return Action.SIGTERM
        if self.requests.pending is not None:
            return Action.REQUESTED
        if self.every_s is not None and now - self._last_save_at >= self.every_s:
            return Action.PERIODIC
        return Action.NOTHING

    def checkpoint(self, reason: Reason, now: float | None = None) -> Manifest | None:
        """Take a checkpoint of the state at `self.step` now (the writer returns its manifest)."""
        taken_at = self.clock() if now is None else now
        if self._sigterm_at is not None:
            left = self._sigterm_at + self.grace_s - taken_at
            self._note("sigterm-checkpoint", logging.WARNING, "SIGTERM: checkpoint at step %s, %.1f s of grace left", self.step, left)
        if self._saved_step == self.step:
            # No step ended since the newest checkpoint (the same on every rank): it holds
            # the current state. A new manifest answers without writing the files again,
            # and without overwriting a complete checkpoint in place.
            return self._republish(reason, taken_at)
        started = time.monotonic()
        path = self.store.begin(self.step)
        self.save(path, self.step)
        save_s = time.monotonic() - started
        self._last_save_at = taken_at
        self._saved_step = self.step
        pending = self.requests.pending
        answered = self.requests.checkpointed(taken_at)
        if not self.writer:
            return None
        manifest = self.store.seal(
            self.step, time=taken_at, reason=reason, requested_at=answered.requested_at if answered else None, save_s=round(save_s, 3)
        )
        if self.upload and self.s3 is not None:
            try:
                self.s3.upload(self.store.root, manifest)
            except S3Error as e:
                self._note(f"upload-failed:{e.code}", logging.ERROR, "checkpoint %s not copied to %s: %s", manifest.path, self.s3.location, e)
            else:
                self._mirrored = [p for p in self._mirrored if p != manifest.path] + [manifest.path]
        self.store.publish(manifest)
        self.last = manifest
        self._note(f"checkpoint:{reason.value}", logging.INFO, "checkpoint %s (%s) in %.2f s", manifest.path, reason.value, save_s)
        if pending is not None:
            self._note(
                "request-answered", logging.INFO, "checkpoint request of %.3f (%s) answered by %s", pending.requested_at, pending.reason, manifest.path
            )
        if save_s > self.grace_s:
            self._note(
                "save-exceeds-grace",
                logging.WARNING,
                "a checkpoint takes %.1f s, longer than the %g s stop grace: a stop would lose the work since the previous one",
                save_s,
                self.grace_s,
            )
        self._prune()
        return manifest

    def _republish(self, reason: Reason, taken_at: float) -> Manifest | None:
        answered = self.requests.checkpointed(taken_at)
        if not self.writer or self.last is None or self.last.step != self.step:
            return None
        manifest = replace(self.last, time=taken_at, reason=reason, requested_at=answered.requested_at if answered else None)
        self.store.seal_as(manifest)
        if self.upload and self.s3 is not None:
            try:
                self.s3.upload_manifest(manifest)
            except S3Error as e:
                self._note(f"upload-failed:{e.code}", logging.ERROR, "manifest of %s not copied to %s: %s", manifest.path, self.s3.location, e)
        self.store.publish(manifest)
        self.last = manifest
        self._note(f"checkpoint:{reason.value}", logging.INFO, "checkpoint %s is current (%s): manifest rewritten", manifest.path, reason.value)
        return manifest

    def _prune(self) -> None:
        """Keep `keep` checkpoints here and `keep` in S3. The two differ while copies fail:
        a checkpoint pruned here stays in S3 as long as it is one of the `keep` newest that
        S3 holds, so a location whose writes fail keeps the last good ones to resume from."""
        removed = self.store.prune(self.keep)
        if not (self.upload and self.s3 is not None):
            return
        self._unpruned.update(removed)
        doomed = sorted(self._unpruned - set(self._mirrored[-self.keep :]))
        if not doomed:
            return
        try:
            self.s3.remove(doomed)
        except S3Error as e:
            self._note(f"s3-prune-failed:{e.code}", logging.WARNING, "old checkpoints left in %s: %s", self.s3.location, e)
            return
        self._unpruned.difference_update(doomed)
        self._mirrored = [p for p in self._mirrored if p not in doomed]

    # -- requests --------------------------------------------------------------------------
    def _read_requests(self, now: float) -> None:
        """Read the marker (the local file at every boundary, S3 every `poll_s`); only the
        writer reads: with `agree`, the other ranks learn of a request from it."""
        if not self.writer:
            return
        try:
            stat = self.store.request_file.stat()
        except FileNotFoundError:
            stat = None
        if stat is not None and (stat.st_mtime_ns, stat.st_size) != self._request_stat:
            self._request_stat = (stat.st_mtime_ns, stat.st_size)
            try:
                self._consider(self.store.request_file.read_bytes(), str(self.store.request_file))
            except FileNotFoundError:
                pass
        if self.s3 is not None and now >= self._next_poll_at:
            self._next_poll_at = now + self.poll_s
            try:
                found = self.s3.read_request(self._request_etag)
            except S3Error as e:
                self._note(f"request-poll-failed:{e.code}", logging.WARNING, "could not read %s: %s", self.s3.request_uri, e)
                return
            if found is not None and found[0] != self._request_etag:
                self._request_etag = found[0]
                self._consider(found[1], self.s3.request_uri)

    def _consider(self, body: bytes, source: str) -> None:
        try:
            request = parse_request(body, source)
        except MalformedRequest as e:
            self._note("request-malformed", logging.WARNING, "checkpoint request ignored: %s", e)
            return
        verdict = self.requests.consider(request)
        if verdict is Verdict.NEW:
            self._note("request-seen", logging.INFO, "checkpoint request of %.3f (%s) seen in %s", request.requested_at, request.reason, source)
        elif verdict is Verdict.BEFORE_RUN:
            self._note("request-before-run", logging.INFO, "checkpoint request of %.3f predates this run: ignored", request.requested_at)
        elif verdict is Verdict.ANSWERED:
            self.stats["request-already-answered"] += 1

    def _note(self, reason: str, level: int, message: str, *args: Any) -> None:
        self.stats[reason] += 1
        log.log(level, message, *args, extra={"reason": reason})
