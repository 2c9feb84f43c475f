"""Checkpoint freshness read from S3, as the training helper writes checkpoints; a request
asked, and a spot interruption marked, once however often their step is retried."""

from __future__ import annotations

import json

import pytest

from emulation import emulation

from preemptor.service import actions


def _put(env, key: str, body: bytes = b"x") -> float:
    s3 = env.stack.client("s3")
    s3.put_object(Bucket=env.stack.parameters["CheckpointBucketName"], Key=key, Body=body)
    return env.clock.now()


def _manifest(directory: str, *files: tuple[str, int]) -> bytes:
    """A training-helper manifest naming `files` (path relative to the location, size)."""
    step = int(directory.removeprefix("step-"))
    return json.dumps({
        "format": 1, "step": step, "time": 0.0, "reason": "periodic", "path": directory, "requested_at": None, "save_s": 1.0,
        "files": [{"path": p, "bytes": n} for p, n in files],
    }).encode()


def test_a_checkpoint_counts_once_its_manifest_is_written_and_a_torn_one_never():
    with emulation() as env:
        checkpoints = env.stack.deps().checkpoints
        bucket = env.stack.parameters["CheckpointBucketName"]
        uri = f"s3://{bucket}/research/train"
        # Given a complete checkpoint in the helper's layout: its files, then its manifest
        _put(env, "research/train/step-000000000420/state.pt")
        env.clock.advance(5)
        complete_at = _put(env, "research/train/step-000000000420/manifest.json")
        _put(env, "research/train/manifest.json")
        # When a newer save has uploaded its files but not yet its manifest (or was torn)
        env.clock.advance(300)
        _put(env, "research/train/step-000000000440/state.pt")
        # Then the newest checkpoint is the complete one, not the newer files
        assert checkpoints.newest(uri) == complete_at
        # And once the newer manifest is written, that one counts
        env.clock.advance(5)
        written = _put(env, "research/train/step-000000000440/manifest.json")
        assert checkpoints.newest(uri) == written


def test_the_first_checkpoint_of_the_helpers_layout_counts_only_once_its_manifest_is_written():
    with emulation() as env:
        checkpoints = env.stack.deps().checkpoints
        uri = f"s3://{env.stack.parameters['CheckpointBucketName']}/research/first"
        # Given a job's first save in the helper's layout, its files uploaded, its manifest not
        # (a save in progress, or one cut short by a stop: torn, never resumed from)
        _put(env, "research/first/step-000000000100/weights.pt")
        _put(env, "research/first/step-000000000100/optimizer/state.bin")
        # Then the location has no checkpoint: a stop now would lose everything
        assert checkpoints.newest(uri) is None
        # And once its manifest is written, it counts
        env.clock.advance(5)
        written = _put(env, "research/first/step-000000000100/manifest.json")
        assert checkpoints.newest(uri) == written


def test_a_manifest_uploaded_before_the_files_it_names_is_no_checkpoint_until_they_are_all_there():
    with emulation() as env:
        checkpoints = env.stack.deps().checkpoints
        uri = f"s3://{env.stack.parameters['CheckpointBucketName']}/research/synced"
        # Given a complete checkpoint, then SageMaker's sync uploading a newer one in its own
        # order: the manifest and one of its two files, the other one not yet
        older = "step-000000000100"
        _put(env, f"research/synced/{older}/weights.pt")
        complete_at = _put(env, f"research/synced/{older}/manifest.json", _manifest(older, (f"{older}/weights.pt", 1)))
        env.clock.advance(300)
        newer = "step-000000000200"
        _put(env, f"research/synced/{newer}/manifest.json", _manifest(newer, (f"{newer}/weights.pt", 1), (f"{newer}/optimizer.pt", 1)))
        _put(env, f"research/synced/{newer}/weights.pt")
        # Then the newest checkpoint is still the complete one: a stop now would lose the work
        # since it, and the controller does not take the half-copied one for fresh
        assert checkpoints.newest(uri) == complete_at
        # And once the last file is there, the newer one counts
        env.clock.advance(5)
        _put(env, f"research/synced/{newer}/optimizer.pt")
        assert checkpoints.newest(uri) > complete_at


def test_a_manifest_the_controller_may_not_read_is_judged_by_its_presence_and_a_throttled_read_is_retried():
    from aws_faults import THROTTLING, aws_says_no, error_response

    from preemptor.core.errors import Throttled

    with emulation() as env:
        checkpoints = env.stack.deps().checkpoints
        uri = f"s3://{env.stack.parameters['CheckpointBucketName']}/research/guarded"
        step = "step-000000000100"
        _put(env, f"research/guarded/{step}/weights.pt")
        written = _put(env, f"research/guarded/{step}/manifest.json", _manifest(step, (f"{step}/weights.pt", 1)))
        # Given a bucket policy that denies the controller the manifest: judged as before,
        # by the manifest's presence beside its files (confirmations keep working)
        with aws_says_no(checkpoints.client, "GetObject", error_response("AccessDenied", "Access Denied", 403)):
            assert checkpoints.newest(uri) == written
        # And a throttled read is not a verdict: it is retried by the step
        with aws_says_no(checkpoints.client, "GetObject", THROTTLING["s3"]):
            with pytest.raises(Throttled):
                checkpoints.newest(uri)


def test_a_location_without_manifests_counts_its_newest_object():
    with emulation() as env:
        checkpoints = env.stack.deps().checkpoints
        bucket = env.stack.parameters["CheckpointBucketName"]
        _put(env, "research/plain/ckpt-1.pt")
        env.clock.advance(60)
        newest = _put(env, "research/plain/ckpt-2.pt")
        # The controller's own markers never count
        env.clock.advance(60)
        _put(env, "research/plain/_preemptor/checkpoint-request.json")
        assert checkpoints.newest(f"s3://{bucket}/research/plain") == newest


class Killed(BaseException):
    """The Lambda's runtime killed mid-step (a timeout, out of memory): no code of the step
    runs after it, so no `except Exception` sees it."""


class _FailsOnce:
    """A step's jobs or checkpoint store whose `method` raises `error` on its first call:
    what the step did before is done, that call and what follows are not. The rest passes
    through."""

    def __init__(self, target, method: str, error: BaseException):
        self._target, self._method, self._error, self.failed = target, method, error, False

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name != self._method:
            return attr

        def once(*args, **kwargs):
            if not self.failed:
                self.failed = True
                raise self._error
            return attr(*args, **kwargs)

        return once


def _killed_at(target, method: str) -> _FailsOnce:
    """`target` of a step whose Lambda is killed as it calls `method`."""
    return _FailsOnce(target, method, Killed("Lambda.Unknown: the runtime was killed"))


# The request marker of "sweep" (`_running_sweep`), in the checkpoint bucket.
MARKER = "research/sweep/_preemptor/checkpoint-request.json"


def _running_sweep(env, versioned: bool = False):
    """A low job "sweep" running for 300 s, checkpointing every two hours; `versioned`: its
    bucket keeps every version of its marker (`_versions`). Returns the stack's deps."""
    if versioned:
        s3, bucket = env.stack.client("s3"), env.stack.parameters["CheckpointBucketName"]
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=14400, checkpoint_every=7200)
    env.advance(300)
    return env.stack.deps()


def _request(env, d, *, store=None, checkpoints=None, execution: str | None = "preempt-sweep-1", reason: str = "preemption", later_s: float = 0.0) -> dict:
    """The `checkpoint:request` step for "sweep", with the stack's stores unless given."""
    return actions.request_checkpoint(
        store=store or d.store, checkpoints=checkpoints or d.checkpoints, job="sweep", reason=reason,
        now=env.clock.now() + later_s, execution=execution,
    )


def test_a_retried_checkpoint_request_answers_with_its_first_attempt_and_writes_its_line_once():
    with emulation() as env:
        d = _running_sweep(env)
        s3, bucket, key = env.stack.client("s3"), env.stack.parameters["CheckpointBucketName"], MARKER

        def request(store, execution):
            return _request(env, d, store=store, execution=execution)

        def lines():
            return [e for e in d.store.history("sweep") if e["kind"] == "checkpoint-requested"]

        # Given a request step whose Lambda died after the record and the marker, before its line
        dying = _killed_at(d.store, "log")
        with pytest.raises(Killed):
            request(dying, "preempt-sweep-1")
        assert dying.failed and lines() == []
        first_at = env.job("sweep").checkpoint_requested_at
        # When Step Functions retries it, 5 s later
        env.clock.advance(5)
        again = request(d.store, "preempt-sweep-1")
        # Then it answers with the first attempt's request, the marker written again with the
        # same time (the helper answers a request once per time), and the line once
        assert again == {"requested_at": first_at, "marker": f"s3://{bucket}/{key}", "again": True}
        assert json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())["requested_at"] == first_at
        [line] = lines()
        assert line["at"] == first_at
        # And a retry after the line was written leaves one line still
        env.clock.advance(10)
        assert request(d.store, "preempt-sweep-1")["again"] is True
        assert len(lines()) == 1
        # And another workflow's request is a new one: a new marker, a new line
        env.clock.advance(60)
        other = request(d.store, "spot-sweep-1")
        assert "again" not in other and other["requested_at"] == env.clock.now() > first_at
        assert json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())["requested_at"] == other["requested_at"]
        assert len(lines()) == 2


def _versions(env, key: str) -> list[float]:
    """The `requested_at` of every version of a marker, oldest first."""
    s3, bucket = env.stack.client("s3"), env.stack.parameters["CheckpointBucketName"]
    versions = sorted(s3.list_object_versions(Bucket=bucket, Prefix=key).get("Versions", []), key=lambda v: v["LastModified"])
    return [json.loads(s3.get_object(Bucket=bucket, Key=key, VersionId=v["VersionId"])["Body"].read())["requested_at"] for v in versions]


def test_a_request_step_that_died_before_its_marker_writes_it_on_retry_with_the_first_time():
    with emulation() as env:
        d = _running_sweep(env, versioned=True)
        # Given a request step whose Lambda died after recording the request, as it wrote the marker
        dying = _killed_at(d.checkpoints, "request")
        asked_at = env.clock.now()
        with pytest.raises(Killed):
            _request(env, d, checkpoints=dying)
        assert dying.failed and _versions(env, MARKER) == [] and env.job("sweep").checkpoint_requested_at == asked_at
        # When Step Functions retries it, 5 s later
        env.clock.advance(5)
        again = _request(env, d)
        # Then the marker is written, with the time the job's record and the workflow's wait
        # count from, and the line once
        assert again["again"] is True and again["requested_at"] == asked_at
        assert _versions(env, MARKER) == [asked_at]
        assert [e["at"] for e in d.store.history("sweep") if e["kind"] == "checkpoint-requested"] == [asked_at]


def test_a_request_step_that_died_before_recording_asks_once_on_retry():
    with emulation() as env:
        d = _running_sweep(env, versioned=True)
        # Given a request step whose Lambda died as it recorded the request (the marker,
        # written after the record, is not written either)
        dying = _killed_at(d.store, "note_learning")
        with pytest.raises(Killed):
            _request(env, d, store=dying)
        assert dying.failed and _versions(env, MARKER) == []
        # When it is retried
        env.clock.advance(5)
        retried = _request(env, d)
        # Then it is the one request: one marker, of the retry's time, on the record and in the line
        assert "again" not in retried
        assert _versions(env, MARKER) == [retried["requested_at"]] == [env.job("sweep").checkpoint_requested_at]


def test_a_request_the_location_refuses_leaves_the_job_its_earlier_request():
    with emulation() as env:
        d = _running_sweep(env)
        # Given a job asked for a checkpoint ahead of time (by the schedule step)
        first = _request(env, d, reason="ahead", execution=None)
        assert env.job("sweep").checkpoint_requested_at == first["requested_at"]
        # When its checkpoint bucket is gone as a preemption asks again
        s3, bucket = env.stack.client("s3"), env.stack.parameters["CheckpointBucketName"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=obj["Key"])
        s3.delete_bucket(Bucket=bucket)
        refused = _request(env, d, later_s=60)
        # Then the step says why, and the job keeps its earlier request: it was not asked
        # this one, so it cannot be found to have ignored it
        assert refused["marker"] is None and refused["error"] == "NoSuchBucket"
        job = env.job("sweep")
        assert job.checkpoint_requested_at == first["requested_at"] and job.checkpoint_request_by is None
        assert "checkpoint-unavailable" in env.kinds("sweep")


def test_a_request_whose_marker_write_is_throttled_is_asked_anew_on_retry():
    from preemptor.core.errors import Throttled

    with emulation() as env:
        d = _running_sweep(env)
        before = env.job("sweep").checkpoint_requested_at
        # Given a request whose marker write S3 throttles: the step raises, for the workflow to retry
        with pytest.raises(Throttled):
            _request(env, d, checkpoints=_FailsOnce(d.checkpoints, "request", Throttled("PutObject: SlowDown")))
        # Then the job is not taken to have been asked (it cannot be found to ignore it)
        assert env.job("sweep").checkpoint_requested_at == before and env.job("sweep").checkpoint_request_by is None
        # And the retry asks anew: a marker, of its own time, on the record and in the line
        env.clock.advance(4)
        retried = _request(env, d)
        assert "again" not in retried and retried["requested_at"] == env.clock.now() == env.job("sweep").checkpoint_requested_at
        assert [e["at"] for e in d.store.history("sweep") if e["kind"] == "checkpoint-requested"] == [retried["requested_at"]]


def test_a_retried_interruption_mark_writes_its_line_if_the_first_attempt_died_before_it():
    with emulation() as env:
        d = env.stack.deps()
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=1, duration=7200)
        env.advance(300)
        record = env.job("spotty")

        def interrupt(store):
            return actions.interrupt(
                store=store, job="spotty", incarnation=record.incarnation, reason="spot-interruption", now=env.clock.now(), execution="spot-1"
            )

        # Given the mark step's Lambda dying between its mark and its line
        dying = _killed_at(d.store, "log")
        with pytest.raises(Killed):
            interrupt(dying)
        marked_at = env.job("spotty").preempting_since
        assert dying.failed and "interruption" not in env.kinds("spotty")
        # When it is retried, and retried again after it answered
        env.clock.advance(5)
        assert interrupt(d.store) == {"interrupting": True, "again": True}
        env.clock.advance(10)
        assert interrupt(d.store)["again"] is True
        # Then the job was marked once, and its line is written once, at the mark's time
        [line] = [e for e in d.store.history("spotty") if e["kind"] == "interruption"]
        assert line["at"] == marked_at
