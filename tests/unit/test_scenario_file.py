"""The scenario format speaks the user's language: pools as bought, faults by name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from preemptor_tools.local.scenario import Scenario, SpotInterruption

BATCH_BY_INSTANCES = {"name": "g5", "service": "batch", "instance_type": "g5.12xlarge", "instances": 4, "gpus_per_instance": 4}


def _scenario(pool: dict, job: dict, **extra) -> Scenario:
    base = {"name": "j", "team": "t", "priority": 50, "pool": pool["name"], "submit_at": 0, "duration": 60}
    return Scenario.model_validate({"pools": [pool], "jobs": [{**base, **job}], **extra})


def test_a_batch_pool_described_by_instances_takes_instances_on_jobs():
    # Given a Batch pool of 4 x 4-GPU instances, when a job asks for 2 instances
    [job] = _scenario(BATCH_BY_INSTANCES, {"instances": 2}).jobs
    # Then its GPUs are its instances' GPUs
    assert job.gpus == 8


@pytest.mark.parametrize(
    "pool, job, message",
    [
        (BATCH_BY_INSTANCES, {"instances": 2, "gpus": 3}, "contradicts 2 instances x 4 GPUs"),
        ({"name": "g5", "service": "batch", "gpus": 16}, {"instances": 2}, "give 'gpus'"),
        (BATCH_BY_INSTANCES, {}, "give 'gpus' (or 'instances'"),
    ],
    ids=["gpus-contradict-instances", "instances-on-a-pool-of-gpus", "neither"],
)
def test_a_job_that_misstates_its_size_is_refused_with_the_reason(pool, job, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace("'", "'")):
        _scenario(pool, job)


def test_a_spot_interruption_fault_is_an_interruption_of_the_job():
    scenario = _scenario(BATCH_BY_INSTANCES, {"instances": 1}, faults=[{"type": "spot_interruption", "at": 100, "job": "j"}])
    assert scenario.interruptions == [SpotInterruption(at=100, job="j")]
    assert scenario.hostile


def test_a_spot_interruption_takes_a_batch_jobs_instance_or_a_sagemaker_spot_jobs_for_a_while():
    spot = {"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 2, "capacity_type": "spot"}
    # Managed spot: for `duration` seconds, on a SageMaker spot pool only
    cut = {"type": "spot_interruption", "at": 100, "job": "j", "duration": 900}
    assert _scenario(spot, {"instances": 1}, faults=[cut]).interruptions == [SpotInterruption(at=100, job="j", duration=900)]
    with pytest.raises(ValidationError, match="is not a job of a Batch pool or of a SageMaker spot pool"):
        _scenario({**spot, "capacity_type": "on-demand"}, {"instances": 1}, faults=[cut])
    # EC2 reclaims a Batch job's instance for good: no duration
    with pytest.raises(ValidationError, match="'duration' is managed spot's"):
        _scenario(BATCH_BY_INSTANCES, {"instances": 1}, faults=[cut])


def test_a_spot_interruption_tried_until_a_time_keeps_it_and_may_not_end_before_it_starts():
    cut = {"type": "spot_interruption", "at": 100, "job": "j", "until": 3700}
    assert _scenario(BATCH_BY_INSTANCES, {"instances": 1}, faults=[cut]).interruptions == [SpotInterruption(at=100, job="j", until=3700)]
    with pytest.raises(ValidationError, match="'until' \\(50.0\\) is before 'at'"):
        _scenario(BATCH_BY_INSTANCES, {"instances": 1}, interruptions=[{"at": 100, "job": "j", "until": 50}])


def test_fallback_instance_types_are_offered_after_the_pools_own_and_only_on_sagemaker():
    from preemptor.config import PoolConfig

    pool = PoolConfig(name="p5", instance_type="ml.p5.48xlarge", instances=2, fallback_instance_types=("ml.p5e.48xlarge",))
    assert pool.offerings == ("ml.p5.48xlarge", "ml.p5e.48xlarge")
    with pytest.raises(ValidationError, match="needs a SageMaker pool"):
        PoolConfig(name="g5", service="batch", gpus=8, fallback_instance_types=("g6.12xlarge",))


G5 = {"name": "g5", "service": "batch", "gpus": 16}


@pytest.mark.parametrize(
    "pools, job, message",
    [
        ([G5], {"gpus": 8, "job_queue": "research-queue"}, "'job_queue' is a team's own Batch run's"),
        ([{"name": "p5", "instances": 2}], {"instances": 1, "launched_by": "team", "job_queue": "q"}, "'job_queue' is a team's own Batch run's"),
        ([G5, {**G5, "name": "g6"}], {"gpus": 8, "launched_by": "team", "job_queue": "g6-queue"}, "job queue 'g6-queue' is on pool 'g6'"),
    ],
    ids=["a-controllers-job", "a-sagemaker-run", "another-pools-queue"],
)
def test_a_teams_own_queue_is_a_team_batch_runs_and_on_its_pools_compute_environment(pools, job, message):
    base = {"name": "j", "team": "t", "priority": 50, "pool": pools[0]["name"], "submit_at": 0, "duration": 60}
    with pytest.raises(ValidationError, match=message):
        Scenario.model_validate({"pools": pools, "jobs": [{**base, **job}]})


def test_a_teams_own_queue_is_accepted_on_its_batch_run():
    scenario = _scenario(G5, {"gpus": 8, "launched_by": "team", "job_queue": "research-queue"})
    assert scenario.jobs[0].job_queue == "research-queue"


def test_a_run_name_is_a_team_runs_and_names_the_run_its_team_creates():
    with pytest.raises(ValidationError, match="'run_name' is a team's own run's"):
        _scenario(G5, {"gpus": 8, "run_name": "other-job"})
    # A team's run named as another job's first run: the call its team makes bears that name
    from preemptor_tools.local.scenario import team_launch_request

    scenario = _scenario(G5, {"gpus": 8, "launched_by": "team", "run_name": "other-job"})
    assert team_launch_request(scenario.jobs[0], scenario.pools[0], "bucket")["jobName"] == "other-job"
    p5 = {"name": "p5", "instances": 2}
    scenario = _scenario(p5, {"instances": 1, "launched_by": "team", "run_name": "other-job-r2"})
    assert team_launch_request(scenario.jobs[0], scenario.pools[0], "bucket")["TrainingJobName"] == "other-job-r2"


@pytest.mark.parametrize(
    "unpooled, message",
    [
        ({"g6": 8}, "unpooled: unknown pool 'g6'"),
        ({"g5": -8}, "unpooled.g5: -8 is negative"),
    ],
    ids=["another-pool", "negative"],
)
def test_what_the_account_has_beyond_a_pool_is_named_by_its_pool(unpooled, message):
    with pytest.raises(ValidationError, match=message):
        _scenario(G5, {"gpus": 8}, unpooled=unpooled)


def test_what_the_account_has_beyond_a_pool_raises_the_accounts_quota_and_compute_environments():
    from preemptor_tools.local.demo import instance_quotas

    p5 = {"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 8, "gpus_per_instance": 8}
    assert instance_quotas(_scenario(p5, {"instances": 1}, unpooled={"p5": 2})) == {"ml.p5.48xlarge": 10}
    assert instance_quotas(_scenario(p5, {"instances": 1})) == {"ml.p5.48xlarge": 8}
    # Below it: a quota not raised yet to what the pool is configured with, but not below none
    assert instance_quotas(_scenario(p5, {"instances": 1}, unpooled={"p5": -2})) == {"ml.p5.48xlarge": 6}
    with pytest.raises(ValidationError, match="unpooled.p5: -9 is negative \\(only a SageMaker pool's may be: a quota below the pool, down to -8\\)"):
        _scenario(p5, {"instances": 1}, unpooled={"p5": -9})
    with pytest.raises(ValidationError, match="give the pool 'instance_type' and 'instances'"):
        _scenario({"name": "p5", "gpus": 64}, {"instances": 1}, unpooled={"p5": 1})
