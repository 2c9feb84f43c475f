"""Batch's own quota management preempting a service job whose training job the controller
adopted (executed on moto; constructed from the AWS documentation's event examples)."""

from __future__ import annotations

import json

from emulation import emulation
from eventfiles import load_raw

from preemptor.core.model import JobState

TRAINING_JOB = "AWSBatchfinetune88b610a69aa8380ca5b0a7aba3f81cb8"


def _event(name: str) -> dict:
    return json.loads(load_raw(f"batch/{name}.json"))


def _adopt(env) -> None:
    """The SageMaker event of the service job's training job, tagged for adoption."""
    event = json.loads(load_raw("sagemaker/constructed__sagemaker-training-job-state-change__inprogress-tagged.json"))
    event["id"] = "adopt-1"
    event["detail"]["TrainingJobName"] = TRAINING_JOB
    event["detail"]["TrainingJobArn"] = f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{TRAINING_JOB}"
    event["detail"]["CheckpointConfig"] = {"S3Uri": f"s3://{env.stack.parameters['CheckpointBucketName']}/research/finetune"}
    event["detail"]["ResourceConfig"] = {**event["detail"].get("ResourceConfig", {}), "InstanceType": "ml.p5.48xlarge", "InstanceCount": 2}
    result = env.put(event).results[0]
    assert result["outcome"] == "accepted" and result["reason"] == "adopted", result


def test_a_batch_preemption_asks_the_adopted_training_job_for_a_checkpoint_then_is_accounted():
    with emulation() as env:
        # Given a training job run by a Batch service queue, tagged for the controller, adopted
        _adopt(env)
        assert env.job(TRAINING_JOB).status is JobState.RUNNING
        # And Batch told which training job its service job runs
        mapped = env.put(_event("constructed__batch-service-job-state-change__running")).results[0]
        assert mapped["outcome"] == "accepted" and TRAINING_JOB in mapped["reason"]
        # When Batch starts preempting the service job (to reclaim borrowed capacity)
        started = env.put(_event("constructed__batch-service-job-preemption-started__docs")).results[0]
        env.stack.drain()
        # Then the training job, still running, was asked for a checkpoint at once
        assert started["outcome"] == "accepted" and started["job"] == TRAINING_JOB
        [run] = env.executions("SpotInterruptionStateMachine")
        assert env.states_visited(run["executionArn"])[-1] == "Checkpoint requested only"
        kinds = env.kinds(TRAINING_JOB)
        assert "batch-preempting" in kinds and "checkpoint-requested" in kinds
        s3 = env.stack.client("s3")
        marker = s3.get_object(Bucket=env.stack.parameters["CheckpointBucketName"], Key="research/finetune/_preemptor/checkpoint-request.json")
        assert json.loads(marker["Body"].read())["reason"].startswith("batch-preemption")
        # And when the preemption completes, the work at risk is accounted on the job
        completed = env.put(_event("constructed__batch-service-job-preemption-completed__docs")).results[0]
        assert completed["outcome"] == "accepted"
        [accounted] = [e for e in env.store.history(TRAINING_JOB) if e["kind"] == "batch-preempted"]
        assert accounted["reason"] == "batch-quota-reclaim" and accounted["extra"]["lost_gpu_seconds"] >= 0


def test_a_batch_preemption_of_a_service_job_the_controller_does_not_know_is_ignored_with_the_reason():
    with emulation() as env:
        started = env.put(_event("constructed__batch-service-job-preemption-started__docs")).results[0]
        completed = env.put(_event("constructed__batch-service-job-preemption-completed__docs")).results[0]
        assert started["outcome"] == completed["outcome"] == "ignored"
        assert "no job the controller knows" in started["reason"] and "no job the controller knows" in completed["reason"]
        assert env.executions("SpotInterruptionStateMachine") == []
