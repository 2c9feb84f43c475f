"""The jobs table adapter on moto: conditional transitions, capacity, the scheduler lease."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import boto3
import pytest
from botocore.exceptions import ReadTimeoutError
from moto import mock_aws
from template_support import table_key_schema

from aws_faults import answer_lost, answer_lost_after_applied, aws_says_no, is_lease_taking, transaction_conflict
from preemptor.adapters.store import ALIAS_TTL_S, CYCLE_RESERVATION_TTL_S, EVENT_CLAIM_S, GSI, USAGE_SETTLE_S, JobsStore, LogLine, record_to_item
from preemptor.core.errors import CapacityExhausted, ConflictError, EventInProgress, Retryable, TransactionConflict
from preemptor.core.jobs import JobRecord
from preemptor.core.model import EndedRun, JobState, TeamUsage


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
    # (a release sent again, its answer lost, repeats that answer: a plan is never dropped)
    assert store.release_lease("p5", "cycle-1") is True
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


def test_a_cycles_reservations_are_recorded_with_them_read_back_consistently_and_expire(store):
    # Given two jobs a cycle admits, and a third it tries to admit beyond the capacity
    jobs = [_job(f"j{i}") for i in range(3)]
    for j in jobs:
        store.put_new(j)
    for j in jobs[:2]:
        store.transition(j, j.with_changes(status=JobState.ADMITTED, admitted_at=1000.0, decided_by="schedule-x#3"),
                         [JobState.PENDING], usage_delta=32, pool_limit=64, reserved_by="schedule-x#3")
    with pytest.raises(CapacityExhausted):
        store.transition(jobs[2], jobs[2].with_changes(status=JobState.ADMITTED, admitted_at=1000.0, decided_by="schedule-x#3"),
                         [JobState.PENDING], usage_delta=32, pool_limit=64, reserved_by="schedule-x#3")
    # Then the cycle reads back exactly the admissions written (the refused one is not:
    # one transaction), and no other cycle's, not even one whose mark it begins
    assert store.cycle_reservations("p5", "schedule-x#3") == [("j0", 1, "admitted"), ("j1", 1, "admitted")]
    assert store.cycle_reservations("p5", "schedule-x#30") == []
    assert store.cycle_reservations("p5", "schedule-x#4") == []
    # And each record is an item the table's TTL removes a day after its admission
    item = store.client.get_item(TableName="jobs", Key={"pk": {"S": "POOL#p5"}, "sk": {"S": "CYCLE#schedule-x#3#j0"}})["Item"]
    assert int(item["expires_at"]["N"]) == 1000 + CYCLE_RESERVATION_TTL_S


def test_a_runs_instance_and_service_job_aliases_expire_after_any_run_could_have_ended(store):
    # Given a run placed on an EC2 instance and a Batch service job mapped to its training job
    store.put_instance_alias("i-0abc", "a", 2, now=1000.0)
    store.put_service_job_alias("svc-1", "a-r2", now=1000.0)
    assert store.runs_on_instance("i-0abc") == [("a", 2)]
    assert store.service_job_training_job("svc-1") == "a-r2"
    # Then both are items the table's TTL removes, and not before SageMaker's longest run (28 days)
    for key in ({"pk": "RUN#instance#i-0abc", "sk": "RUN#a"}, {"pk": "RUN#batch-service#svc-1", "sk": "RUN"}):
        item = store.client.get_item(TableName="jobs", Key={k: {"S": v} for k, v in key.items()})["Item"]
        assert int(item["expires_at"]["N"]) == 1000 + ALIAS_TTL_S
        assert ALIAS_TTL_S > 28 * 24 * 3600


# -- nothing lost (issue 8, finding 4) -----------------------------------------------------


def _running(store: JobsStore, name: str = "a", gpus: int = 32) -> JobRecord:
    record = _job(name, gpus=gpus)
    store.put_new(record)
    admitted = _admit(store, record)
    running = admitted.with_changes(status=JobState.RUNNING, run_id=f"{name}-run", run_name=name, started_at=10.0)
    return store.transition(admitted, running, [JobState.ADMITTED], alias=True)


def test_a_transition_from_an_older_read_keeps_a_checkpoint_noted_meanwhile(store):
    # Given a running job read by the scheduling cycle
    seen = _running(store)
    # And a checkpoint noted by the S3 event handler after that read
    store.note_checkpoint("a", 500.0)
    # When the cycle marks it as a victim from its older read
    store.transition(seen, seen.with_changes(status=JobState.PREEMPTING, preempted_by="b"), [JobState.RUNNING])
    # Then the checkpoint time is still there (a whole-item put would have erased it)
    stored = store.get("a")
    assert stored.status is JobState.PREEMPTING
    assert stored.last_checkpoint_at == 500.0


def test_a_transition_from_an_older_read_never_undoes_a_cancel_requested_meanwhile(store):
    # Given a running job read by the scheduling cycle
    seen = _running(store)
    # And a cancel recorded after that read
    assert store.request_cancel(store.get("a"), 20.0)
    # When the cycle tries to mark it as a victim from its older read
    try:
        store.transition(seen, seen.with_changes(status=JobState.PREEMPTING, preempted_by="b"), [JobState.RUNNING])
    except ConflictError:
        pass  # refused: the cycle re-reads and judges
    # Then the cancel is not lost
    assert store.get("a").cancel_requested is True


def test_a_transaction_conflict_is_retried_never_taken_as_done(store):
    # Given a running job holding 32 GPUs
    seen = _running(store)
    # When DynamoDB cancels the release once for a concurrent transaction
    with aws_says_no(store.client, "TransactWriteItems", transaction_conflict(2), times=1) as refused:
        store.transition(seen, seen.with_changes(status=JobState.COMPLETED), [JobState.RUNNING], usage_delta=-32)
    # Then it was retried: the job is completed and its GPUs are free
    assert len(refused) == 1
    assert store.get("a").status is JobState.COMPLETED
    assert store.pool("p5")["used_gpus"] == 0


def test_a_transaction_conflict_that_persists_is_a_retryable_error_not_a_conflict(store):
    seen = _running(store)
    # When every attempt is cancelled for a concurrent transaction
    with aws_says_no(store.client, "TransactWriteItems", transaction_conflict(2)):
        with pytest.raises(TransactionConflict) as raised:
            store.transition(seen, seen.with_changes(status=JobState.COMPLETED), [JobState.RUNNING], usage_delta=-32)
    # Then the caller sees a retryable error (the workflow retries it), not "already done"
    assert not isinstance(raised.value, ConflictError)
    assert store.get("a").status is JobState.RUNNING
    assert store.pool("p5")["used_gpus"] == 32


def test_an_event_is_claimed_by_one_handler_only(store):
    # Given two deliveries of one event handled at the same time
    assert store.claim_event("evt-1", now=100.0, owner="first")
    # When the second tries to claim it while the first is at it
    # Then it is told to come back (Lambda retries it), not that the event was handled
    with pytest.raises(EventInProgress) as raised:
        store.claim_event("evt-1", now=100.5, owner="second")
    assert isinstance(raised.value, Retryable)
    # And once the first finished, any later delivery is a duplicate
    store.finish_event("evt-1", now=101.0, outcome="accepted")
    assert store.claim_event("evt-1", now=101.5, owner="third") is False
    assert store.claim_event("evt-1", now=5000.0, owner="fourth") is False


def test_a_claim_whose_answer_was_lost_is_this_handlings_own(store):
    # Given the put of a claim reached DynamoDB but its answer was lost, so botocore sent it
    # again and the second put found the first one's item
    with answer_lost(store.client, "PutItem") as resent:
        claimed = store.claim_event("evt-5", now=100.0, owner="me")
    assert resent == [1]
    # Then the handling has its claim (the event is not dropped as handled by somebody else)
    assert claimed is True


def test_a_claim_whose_every_answer_was_lost_is_still_this_handlings_own(store):
    # Given the claim's put applied, and no answer through botocore's every retry
    with answer_lost_after_applied(store.client, "PutItem") as lost:
        claimed = store.claim_event("evt-6", now=100.0, owner="me")
    # Then a consistent read told the handling the claim is its own: it goes on, instead of
    # its claim holding the event past Lambda's first retry
    assert lost == [1] and claimed is True
    store.finish_event("evt-6", now=101.0, outcome="accepted")
    assert store.claim_event("evt-6", now=102.0, owner="a-redelivery") is False


def test_a_claim_that_got_no_answer_and_was_not_applied_is_put_once_more(store):
    with _dropped_once(store.client, "PutItem") as dropped:
        claimed = store.claim_event("evt-7", now=100.0, owner="me")
    assert dropped == [1] and claimed is True
    with pytest.raises(EventInProgress):
        store.claim_event("evt-7", now=101.0, owner="another-handling")


def test_a_claim_held_by_another_handling_whose_answer_was_lost_is_still_in_progress(store):
    assert store.claim_event("evt-8", now=100.0, owner="first")
    with answer_lost_after_applied(store.client, "PutItem"), pytest.raises(EventInProgress):
        store.claim_event("evt-8", now=101.0, owner="second")


def test_a_claim_given_back_after_a_failure_lets_the_retry_handle_the_event(store):
    assert store.claim_event("evt-2", now=100.0, owner="first")
    # When handling failed and the claim is given back
    store.release_event("evt-2", owner="first")
    # Then Lambda's retry of the event is handled
    assert store.claim_event("evt-2", now=160.0, owner="retry")


def test_only_its_own_claim_is_given_back(store):
    # Given a handling that outlived its claim, taken over by a retry
    assert store.claim_event("evt-4", now=100.0, owner="slow")
    assert store.claim_event("evt-4", now=100.0 + EVENT_CLAIM_S + 1, owner="retry")
    # When the slow one fails and gives its claim back
    store.release_event("evt-4", owner="slow")
    # Then the retry's claim holds: a third delivery waits for it
    with pytest.raises(EventInProgress):
        store.claim_event("evt-4", now=100.0 + EVENT_CLAIM_S + 2, owner="third")
    # And a finished event is never given back
    store.finish_event("evt-4", now=200.0, outcome="accepted")
    store.release_event("evt-4", owner="retry")
    assert store.claim_event("evt-4", now=201.0, owner="late") is False


def test_a_claim_of_a_crashed_handler_expires_before_lambdas_retries_end(store):
    # Given a handling killed at the intake function's timeout, holding its claim
    assert store.claim_event("evt-3", now=100.0, owner="killed")
    # Then a delivery while it might still run is retried, not dropped
    with pytest.raises(EventInProgress):
        store.claim_event("evt-3", now=100.0 + 30, owner="early")
    # And the claim outlives the 60 s timeout but ends before Lambda's second retry (3 min)
    assert 60 < EVENT_CLAIM_S < 180
    assert store.claim_event("evt-3", now=100.0 + EVENT_CLAIM_S + 1, owner="retry")


def _ended(job: str, started_at: float, ended_at: float, team: str = "research", incarnation: int = 1) -> EndedRun:
    return EndedRun("p5", team, job, incarnation, 8, started_at, ended_at)


def _end_recorded(store: JobsStore, run: EndedRun) -> None:
    """A running job's end written with its run's end, as `finish` writes them."""
    record = _job(run.job, gpus=run.gpus).with_changes(team=run.team, incarnation=run.incarnation)
    store.put_new(record)
    running = store.transition(record, record.with_changes(status=JobState.RUNNING, started_at=run.started_at), [JobState.PENDING])
    store.transition(
        running, running.with_changes(status=JobState.COMPLETED, ended_at=run.ended_at), [JobState.RUNNING], ended_run=run
    )


def test_a_runs_end_counts_in_its_teams_usage_before_and_after_it_is_folded(store):
    # Given a run's end written with its job's end
    run = _ended("train", 0.0, 3600.0)
    _end_recorded(store, run)
    # Then the team's usage counts it before anyone folds it: 8 GPUs x 1 hour
    [before] = store.team_usage("p5", 1e12)
    assert before.gpu_seconds == pytest.approx(8 * 3600, rel=1e-6)
    # And once folded, it counts the same, once: the end is forgotten with the fold
    assert store.ended_runs("p5") == [run]
    assert store.fold_ended_run(run, 1e12) is True
    assert store.ended_runs("p5") == []
    [after] = store.team_usage("p5", 1e12)
    assert after.gpu_seconds == pytest.approx(before.gpu_seconds, rel=1e-9)


def test_a_run_is_folded_once_when_the_fold_is_retried_after_its_answer_was_lost(store):
    run = _ended("train", 0.0, 3600.0)
    _end_recorded(store, run)
    # Given a fold applied whose answer is lost (the step folding it fails there)
    with answer_lost_after_applied(store.client, "TransactWriteItems") as lost, pytest.raises(ReadTimeoutError):
        store.fold_ended_run(run, 1e12)
    assert lost == [1]
    # When it is retried, and another cycle folds the same run as well
    assert store.fold_ended_run(run, 1e12) is False
    assert store.fold_ended_run(run, 1e12) is False
    # Then the run counts once
    [usage] = store.team_usage("p5", 1e12)
    assert usage.gpu_seconds == pytest.approx(8 * 3600, rel=1e-6)


def test_runs_folded_out_of_order_count_as_folded_in_order(store):
    # Given two runs of a team that ended an hour apart, with a one-hour half-life
    early, late = _ended("a", 0.0, 3600.0), _ended("b", 3600.0, 7200.0)
    _end_recorded(store, early)
    _end_recorded(store, late)
    in_order = TeamUsage("research", 0.0, 0.0).with_run(8, 0.0, 3600.0, 3600.0).with_run(8, 3600.0, 7200.0, 3600.0)
    # When the later one is folded first
    assert store.fold_ended_run(late, 3600.0) and store.fold_ended_run(early, 3600.0)
    # Then the usage is the same as folded in order, as of the later end
    [usage] = store.team_usage("p5", 3600.0)
    assert (usage.gpu_seconds, usage.at) == (pytest.approx(in_order.gpu_seconds, rel=1e-9), 7200.0)


def test_a_release_resent_after_its_answer_was_lost_still_says_to_plan_again(store):
    store.ensure_pool("p5", 64)
    # Given a holder of the lease, and a plan asked for while it held it
    assert store.acquire_lease("p5", "cycle-1", now=100.0, ttl_s=60)
    assert not store.acquire_lease("p5", "cycle-2", now=101.0, ttl_s=60)
    # When its release is applied and the answer lost (the resend finds the lease gone)
    with answer_lost(store.client, "UpdateItem") as resent:
        rerun = store.release_lease("p5", "cycle-1")
    assert resent == [1]
    # Then the holder is still told to plan again: the request is not lost
    assert rerun is True and "lease_owner" not in store.pool("p5")
    # And the next holder starts with no request pending
    assert store.acquire_lease("p5", "cycle-3", now=102.0, ttl_s=60)
    assert store.release_lease("p5", "cycle-3") is False


def test_a_lease_taken_whose_answer_was_lost_is_known_to_its_taker(store):
    # Given the lease's write applied, and no answer through botocore's every retry
    with answer_lost_after_applied(store.client, "UpdateItem", when=is_lease_taking) as lost:
        # When a cycle takes the pool's lease
        taken = store.acquire_lease("p5", "cycle-1", now=100.0, ttl_s=300)
    assert lost == [1]
    # Then it knows it holds it (a consistent read told), and can give it back
    assert taken is True and store.lease_holder("p5") == "cycle-1"
    store.release_lease("p5", "cycle-1")
    assert store.acquire_lease("p5", "cycle-2", now=101.0, ttl_s=300)


def test_a_lease_not_taken_whose_answer_was_lost_is_still_an_error(store):
    # Given another cycle holding the lease, and the taking's answer lost (the condition
    # refused the write, which nobody heard)
    assert store.acquire_lease("p5", "holder", now=100.0, ttl_s=300)
    with answer_lost_after_applied(store.client, "UpdateItem", when=is_lease_taking):
        # Then the taker is told it got no answer, and the lease is still the holder's
        with pytest.raises(ReadTimeoutError):
            store.acquire_lease("p5", "cycle-1", now=101.0, ttl_s=300)
    assert store.lease_holder("p5") == "holder"


@pytest.mark.parametrize("operation", ["TransactWriteItems", "PutItem"])
def test_a_submission_inserted_whose_answer_was_lost_is_known_to_be_its_own(store, operation):
    # Given a submission's insert (with its decision-log line: one transaction; without:
    # one put) applied, and no answer through botocore's every retry
    record = _job("train").with_changes(submitted_by="event-1")
    line = LogLine("train", 0.0, "submitted", "job-submitted", "submitted") if operation == "TransactWriteItems" else None
    with answer_lost_after_applied(store.client, operation) as lost:
        inserted = store.put_new(record, log=line)
    # Then a consistent read told the inserter that the job is its own (not a duplicate, and
    # not an error that would leave the submission to Lambda's retry a minute later)
    assert lost == [1] and inserted is True
    assert store.get("train").submitted_by == "event-1"
    assert [e["kind"] for e in store.history("train")] == (["submitted"] if line else [])


def test_a_submission_whose_insert_got_no_answer_and_was_not_applied_is_inserted_once_more(store):
    # Given the insert never reached DynamoDB (the connection dropped before it was sent)
    with _dropped_once(store.client, "PutItem") as dropped:
        inserted = store.put_new(_job("train").with_changes(submitted_by="event-1"))
    # Then the read found nothing, and the insert was made once more
    assert dropped == [1] and inserted is True and store.get("train").submitted_by == "event-1"


def test_another_submissions_job_found_after_a_lost_answer_is_a_duplicate(store):
    # Given a job of that name submitted by another event, and the new insert's answer lost
    assert store.put_new(_job("train").with_changes(submitted_by="event-1"))
    with answer_lost_after_applied(store.client, "PutItem") as lost:
        inserted = store.put_new(_job("train", gpus=8).with_changes(submitted_by="event-2"))
    # Then it is a duplicate, and the first job is untouched
    assert lost == [1] and inserted is False
    assert store.get("train").submitted_by == "event-1" and store.get("train").gpus == 32


def test_a_location_taken_whose_answer_was_lost_still_names_the_job_it_was_taken_from(store):
    # Given an adopted run using a checkpoint location, and a submission taking it whose
    # write is applied but gets no answer through botocore's every retry
    assert store.claim_checkpoint_alias("s3://ckpt-bucket/team/train", "adopted-run") is None
    with answer_lost_after_applied(store.client, "UpdateItem") as lost:
        previous = store.put_checkpoint_alias("s3://ckpt-bucket/team/train", "train")
    # Then a consistent read told the taker the location is its own, and whose it was (the
    # job that must give it up), where Lambda's retry a minute later would have told it
    assert lost == [1] and previous == "adopted-run"
    assert store.find_checkpoint_owner("ckpt-bucket", "team/train/step-1/manifest.json") == "train"


def test_a_location_whose_take_got_no_answer_and_was_not_applied_is_taken_once_more(store):
    # Given the take never reached DynamoDB (the connection dropped before it was sent)
    with _dropped_once(store.client, "UpdateItem") as dropped:
        previous = store.put_checkpoint_alias("s3://ckpt-bucket/team/train", "train")
    # Then the read found no alias, and the location was taken once more
    assert dropped == [1] and previous is None
    assert store.find_checkpoint_owner("ckpt-bucket", "team/train/step-1/manifest.json") == "train"


@contextmanager
def _dropped_once(client, operation: str) -> Iterator[list[int]]:
    """The first call of `operation` never reaches DynamoDB: the connection drops before it
    is sent, and the caller sees botocore's `ReadTimeoutError` (nothing was applied)."""
    dropped: list[int] = []

    def drop_once(**_) -> None:
        if not dropped:
            dropped.append(1)
            raise ReadTimeoutError(endpoint_url="https://dynamodb.emulated")

    client.meta.events.register(f"before-call.dynamodb.{operation}", drop_once, unique_id="drop-once")
    try:
        yield dropped
    finally:
        client.meta.events.unregister(f"before-call.dynamodb.{operation}", unique_id="drop-once")


def _lagging_index(params: dict) -> dict | None:
    """The pool's capacity index has not caught up yet: it answers with no job."""
    if params.get("IndexName") == GSI:
        return {"Items": [], "Count": 0, "ScannedCount": 0, "ResponseMetadata": {"HTTPStatusCode": 200}}
    return None


def _answer(client, operation, response_for):
    """Like aws_says_no, for a successful canned answer (an index that lags)."""
    return aws_says_no(client, operation, response_for)


def test_the_usage_recount_never_trusts_a_lagging_index(store):
    # Given a job just admitted (32 GPUs), which the eventually consistent index does not show yet
    _running(store)
    # When reconcile recounts while the index lags
    with _answer(store.client, "Query", _lagging_index):
        first = store.recount_usage("p5", now=1000.0)
    # Then usage is left alone (dropping it to 0 would let the next cycle oversubscribe)
    assert not first.applied
    assert store.pool("p5")["used_gpus"] == 32
    # And once the index has caught up, the next recount finds nothing to repair
    second = store.recount_usage("p5", now=1000.0 + USAGE_SETTLE_S + 1)
    assert (second.applied, second.counted, second.stored) == (False, 32, 32)
    assert store.pool("p5")["used_gpus"] == 32


def test_the_usage_recount_repairs_drift_seen_twice_a_settle_time_apart(store):
    # Given a pool whose usage says 40 GPUs while its only running job holds 32
    _running(store)
    store.set_pool_usage("p5", 40)
    # When reconcile recounts once, then again after the settle time
    first = store.recount_usage("p5", now=1000.0)
    assert not first.applied and store.pool("p5")["used_gpus"] == 40
    second = store.recount_usage("p5", now=1000.0 + USAGE_SETTLE_S + 1)
    # Then the second recount writes what it counted
    assert second.applied and (second.stored, second.counted) == (40, 32)
    assert store.pool("p5")["used_gpus"] == 32


def test_the_usage_recount_refuses_when_usage_moved_between_its_observations(store):
    # Given drift seen once
    _running(store)
    store.set_pool_usage("p5", 40)
    store.recount_usage("p5", now=1000.0)
    # When an admission changes usage before the second look
    late = _job("late", gpus=8)
    store.put_new(late)
    _admit(store, late)
    second = store.recount_usage("p5", now=1000.0 + USAGE_SETTLE_S + 1)
    # Then nothing is written on the strength of the old observation
    assert not second.applied
    assert store.pool("p5")["used_gpus"] == 48


def test_the_usage_recount_reads_each_holder_consistently(store):
    # Given a job that ended, which the lagging index still lists as holding capacity
    seen = _running(store)
    store.transition(seen, seen.with_changes(status=JobState.COMPLETED), [JobState.RUNNING], usage_delta=-32)
    stale_item = record_to_item(seen)

    def index_still_lists_it(params: dict) -> dict | None:
        if params.get("IndexName") == GSI:
            return {"Items": [stale_item], "Count": 1, "ScannedCount": 1, "ResponseMetadata": {"HTTPStatusCode": 200}}
        return None

    # When reconcile recounts
    with _answer(store.client, "Query", index_still_lists_it):
        result = store.recount_usage("p5", now=1000.0)
    # Then the ended job does not count
    assert result.counted == 0 and store.pool("p5")["used_gpus"] == 0


def test_a_jobs_first_line_comes_before_the_lines_of_its_millisecond(store):
    # Given a job submitted (its line keyed once, by its event) and lowered in the same
    # instant (the lowering handled in the millisecond of the submission: chaos sweep
    # sagemaker knobs seed 475, where the lowering's line sorted first by key alone)
    store.log("exp", 1000.0004, "submitted", "job-submitted", "team t, priority 1000 (critical)", once="submitted#event-1")
    store.log("exp", 1000.0004, "priority-changed", "team", "team priority 1000 -> 500 (high)")
    store.log("exp", 999.0, "checkpoint-written", "s3", "before it, in an earlier millisecond")
    # Then the history reads as it happened: the submission, then the lowering
    assert [e["kind"] for e in store.history("exp")] == ["checkpoint-written", "submitted", "priority-changed"]
    assert [e["kind"] for e in store.all_history()] == ["checkpoint-written", "submitted", "priority-changed"]
