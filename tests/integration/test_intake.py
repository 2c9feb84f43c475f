"""Intake on the emulated stack, fed with the real event samples in events/."""

from __future__ import annotations

import copy
import json

from emulation import emulation
from eventfiles import all_event_files, load_raw

from preemptor.handlers import intake
from preemptor.core.model import JobState
from preemptor_tools.local.stack import LambdaContext

CONTEXT = LambdaContext(function_name="intake")


def test_rejections_are_counted_by_the_metric_alone(monkeypatch):
    # Given the intake's metrics recorded as they are added
    added: list[tuple[str, float]] = []
    monkeypatch.setattr(intake.metrics, "add_metric", lambda name, unit, value: added.append((name, value)))
    with emulation() as env:
        # When the malformed samples arrive
        for path in all_event_files():
            if path.parent.name == "malformed":
                intake.handler(path.read_text(), CONTEXT)
        # Then each is counted once by the RejectedEvents metric, and no counter item is
        # written to the jobs table (a hot key under exactly that storm)
        assert sum(v for n, v in added if n == "RejectedEvents") == 7
        assert env.store.client.get_item(TableName=env.store.table, Key={"pk": {"S": "STATS"}, "sk": {"S": "STATS"}}).get("Item") is None


def test_unmanaged_training_job_is_ignored():
    with emulation() as env:
        event = json.loads(load_raw("sagemaker/amazon-sagemaker-developer-g__sagemaker-training-job-state-change__8a0a8aaf.json"))
        result = env.put(event).results[0]
        assert result["outcome"] == "ignored" and "not managed" in result["reason"]


def test_tagged_job_started_outside_is_adopted_once():
    with emulation() as env:
        event = json.loads(load_raw("sagemaker/constructed__sagemaker-training-job-state-change__inprogress-tagged.json"))
        # When its InProgress event arrives (twice: EventBridge delivers at least once)
        first = env.put(event).results[0]
        second = env.put(event).results[0]
        # Then it is adopted once and counted against the pool
        assert first["outcome"] == "accepted" and first["reason"] == "adopted"
        assert second["outcome"] == "duplicate"
        job = env.job(first["job"])
        assert job.adopted and job.status is JobState.RUNNING and job.priority == 500
        assert env.store.pool("p5")["used_gpus"] == job.gpus


def test_submission_sample_is_accepted_and_launched_and_resubmission_is_a_duplicate():
    with emulation() as env:
        event = json.loads(load_raw("preemptor/job-submitted-sagemaker.json"))
        assert env.put(event).results[0]["outcome"] == "accepted"
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING
        again = copy.deepcopy(event)
        again["id"] = "another-delivery-of-the-same-job"
        result = env.put(again).results[0]
        assert result["outcome"] == "duplicate"
        # Exactly one SageMaker training job exists for it
        jobs = env.stack.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]
        assert [j["TrainingJobName"] for j in jobs] == ["llm-pretrain-7b"]


def test_submission_to_an_unknown_pool_is_rejected_with_a_reason():
    with emulation() as env:
        event = json.loads(load_raw("preemptor/job-submitted-sagemaker.json"))
        event["detail"]["pool"] = "nowhere"
        result = env.put(event).results[0]
        assert result["outcome"] == "rejected" and "nowhere" in result["reason"]


def test_cancel_of_a_pending_job():
    with emulation() as env:
        env.submit(name="big", team="a", priority=500, pool="p5", instances=8, duration=3600)
        env.submit(name="waiting", team="a", priority=200, pool="p5", instances=8, duration=3600)
        cancel = json.loads(load_raw("preemptor/job-cancelled.json"))
        cancel["detail"]["name"] = "waiting"
        assert env.put(cancel).results[0]["reason"] == "cancelled-pending"
        assert env.job("waiting").status is JobState.CANCELLED


def test_cancel_of_a_running_job_stops_it_and_frees_its_gpus():
    with emulation() as env:
        env.submit(name="running", team="a", priority=200, pool="p5", instances=8, duration=3600)
        env.advance(300)
        cancel = json.loads(load_raw("preemptor/job-cancelled.json"))
        cancel["detail"]["name"] = "running"
        assert env.put(cancel).results[0]["reason"] == "stopping-for-cancel"
        env.advance(300)
        job = env.job("running")
        assert job.status is JobState.CANCELLED and job.outcome_reason == "cancelled"
        assert env.store.pool("p5")["used_gpus"] == 0


def test_stale_events_of_an_old_incarnation_are_ignored():
    with emulation() as env:
        env.submit(name="low", team="a", priority=50, pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(600)
        env.submit(name="high", team="b", priority=1000, pool="p5", instances=8, duration=600)
        env.advance(300)
        # The Stopped event of the preempted first run arrived after the requeue
        assert env.job("low").incarnation == 2
        history = env.store.history("low")
        assert "requeued" in [e["kind"] for e in history]
        assert env.store.pool("p5")["used_gpus"] == 64


def test_checkpoint_writes_announced_by_s3_keep_the_last_checkpoint_time():
    with emulation() as env:
        # Given a job whose checkpoints live under s3://preemptor-checkpoints/research/llm-pretrain-7b
        env.put(json.loads(load_raw("preemptor/job-submitted-sagemaker.json")))
        created = json.loads(load_raw("s3/constructed__s3-object-created__checkpoint.json"))
        created["time"] = "2026-11-30T09:00:00Z"
        # When S3 announces a checkpoint written below that prefix
        result = env.put(created).results[0]
        # Then the job's last checkpoint time is that of the event
        assert result["outcome"] == "accepted" and result["job"] == "llm-pretrain-7b"
        assert env.job("llm-pretrain-7b").last_checkpoint_at == env.clock.now()
        # And the controller's own markers and other jobs' objects are not checkpoints of it
        marker = copy.deepcopy(created)
        marker["id"] = "marker"
        marker["detail"]["object"]["key"] = "research/llm-pretrain-7b/_preemptor/checkpoint-request.json"
        assert env.put(marker).results[0]["outcome"] == "ignored"
        other = copy.deepcopy(created)
        other["id"] = "other"
        other["detail"]["object"]["key"] = "research/another-job/ckpt.pt"
        assert env.put(other).results[0]["outcome"] == "ignored"
