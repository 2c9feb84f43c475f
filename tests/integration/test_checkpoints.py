"""Checkpoint freshness read from S3, as the training helper writes checkpoints."""

from __future__ import annotations

from emulation import emulation


def _put(env, key: str) -> float:
    s3 = env.stack.client("s3")
    s3.put_object(Bucket=env.stack.parameters["CheckpointBucketName"], Key=key, Body=b"x")
    return env.clock.now()


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
