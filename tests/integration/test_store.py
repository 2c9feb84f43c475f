"""The jobs table adapter on moto: conditional transitions, capacity, the scheduler lease."""

from __future__ import annotations

import boto3
import pytest
from moto import mock_aws
from template_support import table_key_schema

from preemptor.adapters.store import JobsStore
from preemptor.core.errors import CapacityExhausted, ConflictError
from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState


@pytest.fixture
def store():
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        client.create_table(TableName="jobs", BillingMode="PAY_PER_REQUEST", **table_key_schema())
        s = JobsStore("jobs", client)
        s.ensure_pool("p5", 64)
        yield s


def _job(name: str, gpus: int = 32, priority: int = 50, submitted_at: float = 0.0) -> JobRecord:
    return JobRecord(
        name=name,
        team="t",
        priority=priority,
        pool="p5",
        service="sagemaker",
        gpus=gpus,
        request={},
        checkpoint_s3_uri="s3://b/c",
        submitted_at=submitted_at,
    )


def _admit(store: JobsStore, record: JobRecord) -> JobRecord:
    return store.transition(
        record, record.with_changes(status=JobState.ADMITTED), [JobState.PENDING], usage_delta=record.gpus, pool_limit=64
    )


def test_admission_never_oversubscribes_the_pool(store):
    # Given three 32-GPU jobs for a 64-GPU pool
    jobs = [_job(f"j{i}") for i in range(3)]
    for j in jobs:
        assert store.put_new(j)
    # When all three are admitted, as concurrent cycles would try
    _admit(store, jobs[0])
    _admit(store, jobs[1])
    # Then the third is refused for capacity, and nothing changed for it
    with pytest.raises(CapacityExhausted):
        _admit(store, jobs[2])
    assert store.get("j2").status is JobState.PENDING
    assert store.pool("p5")["used_gpus"] == 64


def test_a_transition_from_a_stale_status_is_refused(store):
    record = _job("a")
    store.put_new(record)
    _admit(store, record)
    # When a second cycle, holding the old PENDING copy, tries to admit it again
    with pytest.raises(ConflictError):
        _admit(store, record)
    # Then the GPUs were counted once
    assert store.pool("p5")["used_gpus"] == 32


def test_release_happens_once_whatever_the_number_of_end_events(store):
    record = _job("a")
    store.put_new(record)
    admitted = _admit(store, record)
    done = admitted.with_changes(status=JobState.COMPLETED)
    store.transition(admitted, done, [JobState.ADMITTED, JobState.RUNNING], usage_delta=-32)
    with pytest.raises(ConflictError):
        store.transition(admitted, done, [JobState.ADMITTED, JobState.RUNNING], usage_delta=-32)
    assert store.pool("p5")["used_gpus"] == 0


def test_pending_index_returns_the_best_ranked_first_with_a_limit(store):
    store.put_new(_job("low-old", priority=50, submitted_at=1))
    store.put_new(_job("crit-new", priority=1000, submitted_at=9))
    store.put_new(_job("crit-old", priority=1000, submitted_at=2))
    store.put_new(_job("high", priority=500, submitted_at=0))
    assert [j.name for j in store.pending("p5", 3)] == ["crit-old", "crit-new", "high"]


def test_duplicate_submission_is_refused(store):
    assert store.put_new(_job("a"))
    assert not store.put_new(_job("a", gpus=8))
    assert store.get("a").gpus == 32


def test_lease_serialises_cycles_and_asks_the_holder_to_run_again(store):
    # Given one cycle holding the pool's lease
    assert store.acquire_lease("p5", "cycle-1", now=100, ttl_s=60)
    # When another cycle starts meanwhile, it does not get the lease
    assert not store.acquire_lease("p5", "cycle-2", now=110, ttl_s=60)
    # Then the holder is told to plan again instead of letting go
    assert store.release_lease("p5", "cycle-1") is True
    assert store.release_lease("p5", "cycle-1") is False
    # And once free, the lease can be taken again
    assert store.acquire_lease("p5", "cycle-2", now=120, ttl_s=60)


def test_an_expired_lease_can_be_taken_over(store):
    assert store.acquire_lease("p5", "crashed", now=100, ttl_s=60)
    assert store.acquire_lease("p5", "next", now=200, ttl_s=60)
    assert store.release_lease("p5", "crashed") is False  # the crashed holder no longer owns it


def test_run_alias_maps_a_run_to_its_job_and_incarnation(store):
    record = _job("a")
    store.put_new(record)
    admitted = _admit(store, record)
    running = admitted.with_changes(status=JobState.RUNNING, run_id="a-r2", run_name="a-r2", incarnation=1)
    store.transition(admitted, running, [JobState.ADMITTED], alias=True)
    assert store.find_run("sagemaker", "a-r2") == ("a", 1)
    assert store.find_run("sagemaker", "unknown") is None
