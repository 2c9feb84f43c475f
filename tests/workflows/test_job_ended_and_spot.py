"""The job-ended and spot-interruption workflows executed on moto."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from aws_faults import THROTTLING, aws_says_no
from emulation import G5, P5, batch_queues, emulation, team_training_job
from eventfiles import load_raw

from preemptor.config import PoolConfig
from preemptor.core.model import JobState, run_usage
from preemptor.service.reconcile import UNKNOWN_RUN_GRACE_S
from preemptor_tools.local.scenario import ROLE_ARN


def _end_reported(env, name: str, **end) -> str:
    """Run the job-ended workflow by hand on `end` (job, incarnation, outcome, reason), as
    the intake starts it for a run's end; returns the execution once it is over."""
    arn = env.stack.client("stepfunctions").start_execution(
        stateMachineArn=env.stack.state_machines["JobEndedStateMachine"], name=name, input=json.dumps({"pool": "p5", **end})
    )["executionArn"]
    env.stack.drain()
    return arn


def test_completion_frees_capacity_and_schedules_the_next_job():
    with emulation() as env:
        # Given a job holding the whole pool and one waiting behind it (equal priority)
        env.submit(name="first", team="a", priority=200, pool="p5", instances=8, duration=1200)
        env.submit(name="second", team="b", priority=200, pool="p5", instances=8, duration=1200)
        assert env.job("second").status is JobState.PENDING
        # When the first completes
        env.advance(1500)
        # Then the job-ended workflow recorded it, freed its GPUs and scheduled the pool
        ended = [e for e in env.executions("JobEndedStateMachine") if e["status"] == "SUCCEEDED"]
        assert ended
        states = env.states_visited(ended[0]["executionArn"])
        assert states == ["Record the outcome", "Waiting for capacity?", "Were GPUs freed?", "Schedule the pool"]
        assert env.job("first").status is JobState.COMPLETED
        assert env.job("second").status is JobState.RUNNING


def test_a_duplicate_end_event_frees_nothing_twice():
    with emulation() as env:
        env.submit(name="only", team="a", priority=200, pool="p5", instances=8, duration=600)
        env.advance(900)
        assert env.job("only").status is JobState.COMPLETED
        # When the same run's end is reported again under a new event id (EventBridge redelivery)
        arn = _end_reported(env, "duplicate-end", job="only", incarnation=1, outcome="completed", reason="dup")
        # Then nothing is freed twice: usage stays at zero and the record as it was
        assert env.store.pool("p5")["used_gpus"] == 0
        assert env.job("only").status is JobState.COMPLETED and env.kinds("only").count("completed") == 1
        # And the pool is planned again all the same: a step retried after its first
        # attempt recorded the end (its answer lost) finds the end recorded, and the plan
        # that attempt's workflow never started is not lost
        assert env.states_visited(arn)[-2:] == ["Were GPUs freed?", "Schedule the pool"]


def _writes_usage(params: dict) -> bool:
    """Whether a DynamoDB write touches a team's usage item (USAGE#<team>)."""
    keys = [params.get("Key", {})] + [next(iter(i.values())).get("Key", {}) for i in params.get("TransactItems", [])]
    return any(k.get("sk", {}).get("S", "").startswith("USAGE#") for k in keys)


def _reconcile(env) -> dict:
    result = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
    env.stack.drain()
    return result


def test_a_runs_end_counts_in_its_teams_usage_once_though_usage_writes_are_refused_when_it_ends():
    with emulation() as env:
        half_life = env.stack.deps().settings.policy.for_pool("p5").fair_share.half_life_s
        refuse = lambda params: THROTTLING["dynamodb"] if _writes_usage(params) else None  # noqa: E731
        # Given DynamoDB refusing every write of a team's usage while a run ends and
        # reconcile, which folds ended runs into the teams' usage, passes after it
        env.submit(name="first", team="a", priority=200, pool="p5", instances=8, duration=1200)
        with aws_says_no(env.store.client, "UpdateItem", refuse) as updates, aws_says_no(env.store.client, "TransactWriteItems", refuse) as folds:
            env.advance(1500)
            _reconcile(env)
            job = env.job("first")
            assert job.status is JobState.COMPLETED and env.store.pool("p5")["used_gpus"] == 0
            # Then the run counts in its team's usage all the same: its end was written
            # with the job's, and whoever reads the usage adds it until it is folded
            [usage] = env.store.team_usage("p5", half_life)
            assert usage.team == "a"
            assert usage.gpu_seconds == pytest.approx(run_usage(64, job.started_at, job.ended_at, half_life), rel=1e-9)
        assert not updates and len(folds) == 1  # the end was never refused: only reconcile's fold
        # And once the writes are accepted again, reconcile's next pass folds it, once
        env.advance(300)
        _reconcile(env)
        _reconcile(env)
        assert env.store.ended_runs("p5") == []
        [folded] = env.store.team_usage("p5", half_life)
        assert folded == usage


def test_a_stale_end_event_frees_nothing_and_plans_nothing():
    with emulation() as env:
        env.submit(name="only", team="a", priority=200, pool="p5", instances=8, duration=600)
        # When the end of an incarnation the job never had is reported
        arn = _end_reported(env, "stale-end", job="only", incarnation=7, outcome="completed", reason="stale")
        # Then the workflow stops at "Nothing freed": the running job keeps its GPUs
        assert env.states_visited(arn)[-1] == "Nothing freed"
        assert env.job("only").status is JobState.RUNNING and env.store.pool("p5")["used_gpus"] == 64


def test_failed_run_is_alerted():
    with emulation() as env:
        env.submit(name="doomed", team="a", priority=200, pool="p5", instances=2, duration=600)
        _end_reported(env, "failed-run", job="doomed", incarnation=1, outcome="failed", reason="CapacityError: Unable to provision")
        assert env.job("doomed").status is JobState.FAILED
        # And its team was told once (the attributes a team filters on: tests/workflows/test_notices.py)
        [notice] = [json.loads(a) for a in env.stack.alerts() if "CapacityError" in a]
        assert (notice["kind"], notice["team"], notice["job"]) == ("failed", "a", "doomed")


def test_spot_warning_checkpoints_stops_and_requeues_the_job():
    with emulation(pools=[G5]) as env:
        batch_queues(env)
        # Given a Batch job running on a spot instance (a checkpoint every 30 minutes)
        env.submit(name="spotty", team="a", priority=200, pool="g5", gpus=16, duration=7200, checkpoint_every=1800)
        env.advance(2400)
        assert "placed" in env.kinds("spotty")  # intake traced its container instance to EC2
        # When EC2 warns that the instance will be reclaimed in two minutes
        instance = env.fleet.spot_interrupt("spotty")
        env.stack.pump()
        # Then the warning reached the job through its instance
        run = env.executions("SpotInterruptionStateMachine")[0]
        assert run["status"] == "SUCCEEDED"
        states = env.states_visited(run["executionArn"])
        # And a checkpoint newer than the warning was written before the stop
        assert states.index("Ask for a checkpoint first") < states.index("Stop the run") < states.index("Requeue the job")
        assert "Stop with a fresh checkpoint" in states
        kinds = env.kinds("spotty")
        assert kinds.index("checkpoint-confirmed") < kinds.index("stop-requested") < kinds.index("requeued")
        requeued = [e for e in env.store.history("spotty") if e["kind"] == "requeued"][0]
        assert requeued["reason"] == "interrupted"
        # So little work was lost: the checkpoint came within a minute of the warning,
        # not the 40 minutes since the last periodic one
        assert requeued["extra"]["lost_gpu_seconds"] <= 16 * 120
        # And its GPUs went to the settle window's plan (a reclaim of several instances
        # is planned as one), which the workflow started
        assert states[-1] == "Schedule the pool"
        schedules = env.executions("ScheduleStateMachine")
        assert any(s["name"].startswith("settle-g5-") and s["startDate"] >= run["startDate"] for s in schedules)
        # And the job was relaunched from it on another instance
        env.advance(120)
        job = env.job("spotty")
        assert job.incarnation == 2 and job.status is JobState.RUNNING and job.run_name == "spotty-r2"
        assert env.store.runs_on_instance(instance) == [("spotty", 1)]


def test_every_job_on_a_reclaimed_instance_is_warned():
    with emulation(pools=[G5]) as env:
        batch_queues(env)
        # Given two Batch jobs of 8 GPUs placed on one spot instance (ECS packs containers)
        env.submit(name="left", team="a", priority=200, pool="g5", gpus=8, duration=7200, checkpoint_every=1800)
        env.submit(name="right", team="a", priority=200, pool="g5", gpus=8, duration=7200, checkpoint_every=1800)
        env.advance(600)
        [shared] = [e["detail"].rsplit(" ", 1)[-1] for e in env.store.history("left") if e["kind"] == "placed"]
        env.store.put_instance_alias(shared, "right", 1, env.clock.now())  # ECS placed "right" there too
        assert env.store.runs_on_instance(shared) == [("left", 1), ("right", 1)]
        # When EC2 warns that the instance will be reclaimed
        assert env.fleet.spot_interrupt("left") == shared
        env.stack.pump()
        env.advance(300)
        # Then both jobs were checkpointed, stopped and requeued, not only the last one placed
        for name in ("left", "right"):
            requeued = [e for e in env.store.history(name) if e["kind"] == "requeued"]
            assert [e["reason"] for e in requeued] == ["interrupted"], name
            assert env.job(name).incarnation == 2


def test_rebalance_recommendation_only_asks_for_a_checkpoint():
    with emulation(pools=[G5]) as env:
        batch_queues(env)
        env.submit(name="steady", team="a", priority=200, pool="g5", gpus=8, duration=7200, checkpoint_every=1800)
        env.advance(300)
        instance = env.fleet.jobs()[0]
        [placed] = [e for e in env.store.history("steady") if e["kind"] == "placed"]
        instance_id = placed["detail"].rsplit(" ", 1)[-1]
        event = json.loads(load_raw("ec2/amazon-ec2-user-guide__ec2-instance-rebalance-recommendation__b45f8b2a.json"))
        event["detail"]["instance-id"] = instance_id
        env.put(event)
        run = env.executions("SpotInterruptionStateMachine")[0]
        assert env.states_visited(run["executionArn"])[-1] == "Checkpoint requested only"
        assert env.job("steady").status is JobState.RUNNING and env.job("steady").incarnation == 1
        assert "checkpoint-requested" in env.kinds("steady")
        assert instance.status == "RUNNING"


def test_an_aws_health_scheduled_change_of_the_instance_asks_the_job_for_a_checkpoint():
    with emulation(pools=[G5]) as env:
        # Given a Batch job running on an EC2 instance
        batch_queues(env)
        env.submit(name="steady", team="a", priority=200, pool="g5", gpus=8, duration=7200, checkpoint_every=1800)
        env.advance(300)
        [placed] = [e for e in env.store.history("steady") if e["kind"] == "placed"]
        instance_id = placed["detail"].rsplit(" ", 1)[-1]
        # When AWS Health schedules maintenance of that instance (the real sample, aimed at it)
        event = json.loads(load_raw("other/aws-node-termination-handler__aws-health-event__6620a964.json"))
        event["detail"]["affectedEntities"][0]["entityValue"] = instance_id
        event["resources"] = [instance_id]
        routed = env.put(event)
        # Then the stack's rule routes it to the intake, which asks the job for a checkpoint
        # now, and the job keeps running (the change comes later; a stop then loses little)
        assert routed.matched and routed.results[0]["outcome"] == "accepted"
        run = env.executions("SpotInterruptionStateMachine")[0]
        assert env.states_visited(run["executionArn"])[-1] == "Checkpoint requested only"
        steady = env.job("steady")
        assert steady.status is JobState.RUNNING and steady.incarnation == 1
        requested = [e for e in env.store.history("steady") if e["kind"] == "checkpoint-requested"]
        assert requested and requested[-1]["reason"].startswith("scheduled-change: AWS_EC2_DEDICATED_HOST_NETWORK_MAINTENANCE")


def test_reconcile_stops_a_managed_batch_job_no_job_accounts_for():
    with emulation(pools=[G5]) as env:
        # Given a Batch job the controller runs, a second job of its incarnation (a SubmitJob
        # sent twice), a managed job of the same queue tagged for a job the table does not
        # know, and an unmanaged one
        batch_queues(env)
        env.submit(name="steady", team="a", priority=200, pool="g5", gpus=8, duration=30000)
        batch = env.stack.client("batch")
        [launched] = batch.describe_jobs(jobs=[env.job("steady").run_id])["jobs"]
        twice = launched["tags"]  # its run token too: the controller's own job
        assert twice["preemptor:run-token"] == env.job("steady").run_token_of(1)
        duplicate = batch.submit_job(jobName="steady", jobQueue="g5-queue", jobDefinition="g5-training", tags=twice)["jobId"]
        managed = {"preemptor:managed": "true", "preemptor:job": "gone", "preemptor:incarnation": "1"}
        ghost = batch.submit_job(jobName="gone", jobQueue="g5-queue", jobDefinition="g5-training", tags=managed)["jobId"]
        foreign = batch.submit_job(jobName="theirs", jobQueue="g5-queue", jobDefinition="g5-training", tags={"owner": "x"})["jobId"]
        env.advance(UNKNOWN_RUN_GRACE_S + 120)
        # When reconcile runs
        result = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then only the unaccounted managed jobs were terminated, each with the reason
        stopped = {r["run"]: r["why"] for r in result["repairs"] if r["repair"] == "unknown-run-stopped"}
        assert stopped == {duplicate: "its job steady is RUNNING on incarnation 1", ghost: "the controller launched no such run"}
        assert "unknown-run-stopped" in env.kinds("steady")
        env.advance(60)  # Batch's stop timeout
        status = {j["jobId"]: j["status"] for j in batch.describe_jobs(jobs=[duplicate, ghost, foreign])["jobs"]}
        assert status[duplicate] == status[ghost] == "FAILED"
        assert status[foreign] == "RUNNING"
        assert env.job("steady").status is JobState.RUNNING


@contextmanager
def _hotfix_runnable_past_its_limit() -> Iterator:
    """A Batch pool whose own queue finds no instances for two hours (its fallback queue has
    them), and a job RUNNABLE there 700 s, past the pool's limit (600 s)."""
    pool = PoolConfig(
        name="g5", service="batch", gpus=32, job_queue="g5-queue", fallback_job_queues=("g5-ondemand",), runnable_timeout_s=600
    )
    with emulation(pools=[pool], classify=lambda service, request: ("g5", 16)) as env:
        batch_queues(env, "g5-queue", "g5-ondemand")
        env.fleet.capacity_outage("g5", env.clock.now(), env.clock.now() + 7200, "g5-queue")
        env.submit(name="hotfix", team="a", priority=1000, pool="g5", gpus=16, duration=1200)
        env.advance(700)
        yield env


def test_a_batch_job_stuck_runnable_is_a_capacity_wait_and_relaunches_on_the_fallback_queue():
    # Given a Batch pool whose own queue finds no instances for two hours, and a job in it
    with _hotfix_runnable_past_its_limit() as env:
        first_run = env.job("hotfix").run_id
        assert env.job("hotfix").status is JobState.RUNNING  # RUNNABLE in Batch: the controller waits
        # When reconcile runs past the pool's RUNNABLE limit (600 s)
        result = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then the run was terminated once and the job waits out a capacity backoff
        [stuck] = [r for r in result["repairs"] if r["repair"] == "stuck-runnable-requeued"]
        assert stuck["run_id"] == first_run and 0 < stuck["wait_s"] <= 60
        assert not [r for r in result["repairs"] if r["repair"] == "unknown-run-stopped"]
        terminated = [c for c in env.stack.calls.calls if c.api_action == "batch:TerminateJob"]
        assert len(terminated) == 1
        # And once the backoff is over, a schedule started by reconcile launched it on the
        # fallback queue (the pool's own queue is remembered as unavailable), where it runs
        env.advance(120)
        job = env.job("hotfix")
        assert (job.status, job.incarnation, job.launched_instance_type) == (JobState.RUNNING, 2, "g5-ondemand")
        assert env.fleet.job(job.run_id).status == "RUNNING"
        waits = [e for e in env.executions("ScheduleStateMachine") if "Wait out the backoff" in env.states_visited(e["executionArn"])]
        assert waits
        kinds = env.kinds("hotfix")
        assert kinds.index("stuck-runnable") < kinds.index("capacity-wait") < kinds.index("relaunched")


def test_a_batch_job_terminated_stuck_runnable_whose_wait_was_not_written_waits_when_its_end_is_told():
    # Given a Batch job RUNNABLE in a queue that finds no instances, past the pool's limit
    with _hotfix_runnable_past_its_limit() as env:
        # When reconcile terminates the run and DynamoDB then refuses its capacity wait's
        # write (every transaction of the pass throttled through its retries)
        with aws_says_no(env.store.client, "TransactWriteItems", THROTTLING["dynamodb"]):
            result = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        assert [c for c in env.stack.calls.calls if c.api_action == "batch:TerminateJob"]
        assert any(e.get("job") == "hotfix" for e in result["errors"]) and env.job("hotfix").status is JobState.RUNNING
        env.stack.drain()
        # Then the run's end (Batch: FAILED, the controller's own reason) is a capacity wait,
        # not the job's failure (before: Failed for good, a critical job lost to a throttle),
        # and the job relaunches on the fallback queue
        env.advance(300)
        job = env.job("hotfix")
        assert (job.status, job.incarnation, job.launched_instance_type) == (JobState.RUNNING, 2, "g5-ondemand"), env.kinds("hotfix")
        kinds = env.kinds("hotfix")
        assert "failed" not in kinds and kinds.index("stuck-runnable") < kinds.index("capacity-wait") < kinds.index("relaunched")


def test_a_batch_job_a_queue_time_limit_cancelled_for_capacity_waits_instead_of_failing():
    with emulation(pools=[G5]) as env:
        # Given a Batch job in the pool
        batch_queues(env)
        env.submit(name="eval", team="a", priority=500, pool="g5", gpus=8, duration=1200)
        record = env.job("eval")
        # When its queue's state time limit action cancels it in RUNNABLE for want of instances
        # (the real Batch event, with the reason the queue was configured with)
        event = json.loads(load_raw("batch/aws-batch-user-guide__batch-job-state-change__e31f552e.json"))
        event["detail"].update(
            jobId=record.run_id, jobName=record.run_name, status="FAILED", statusReason="CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY",
            tags={"preemptor:managed": "true", "preemptor:job": "eval", "preemptor:incarnation": "1"},
        )
        env.put(event)
        env.stack.drain()
        # Then the job is not failed: it waits for capacity and is launched again
        job = env.job("eval")
        assert job.status is not JobState.FAILED and job.capacity_retries == 1 and job.incarnation == 2
        assert "capacity-wait" in env.kinds("eval")


def test_a_reclaimed_batch_run_whose_every_event_was_lost_is_requeued_by_reconcile_not_failed():
    with emulation(pools=[G5]) as env:
        batch_queues(env)
        # Given a Batch job running on a spot instance (a checkpoint every 30 minutes)
        env.submit(name="spotty", team="a", priority=200, pool="g5", gpus=16, duration=7200, checkpoint_every=1800)
        env.advance(2400)
        # When EC2 reclaims its instance, and neither the warning nor the run's end (FAILED,
        # "Host EC2 ... terminated") reaches the controller
        env.fleet.spot_interrupt("spotty")
        env.clock.advance(300)
        env.stack.outbox.clear()
        assert env.stack.client("batch").describe_jobs(jobs=[env.job("spotty").run_id])["jobs"][0]["status"] == "FAILED"
        # And reconcile finds the run ended
        env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then the job is requeued as its end event would have had it (interrupted), not
        # failed for good, and relaunched from its checkpoint
        [requeued] = [e for e in env.store.history("spotty") if e["kind"] == "requeued"]
        assert requeued["reason"] == "interrupted" and "spot reclaim: Host EC2" in requeued["detail"] + json.dumps(requeued["extra"])
        assert "failed" not in env.kinds("spotty")
        env.advance(120)
        job = env.job("spotty")
        assert (job.status, job.incarnation) == (JobState.RUNNING, 2)


def test_a_teams_tagged_run_whose_events_never_came_is_adopted_by_reconcile_not_stopped():
    from emulation import START
    from iam_policy import StackPolicies

    with emulation() as env:
        # Given a run research launched itself on the pool's instance type, tagged to be
        # adopted (and preempted: managed), whose every event was lost (no fleet to tell)
        env.fleet.close()
        tags = {"preemptor:team": "research", "preemptor:priority": "medium", "preemptor:pool": "p5", "preemptor:managed": "true"}
        team_training_job(env, "research-own-run", tags)
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        assert env.store.get("research-own-run") is None
        # When reconcile runs
        result = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then the run is not stopped as unknown (before: "its job is unknown", stopped,
        # a team's work thrown away): it is adopted as its event would have, and counted
        assert not [r for r in result["repairs"] if r["repair"] == "unknown-run-stopped"]
        [adopted] = [r for r in result["repairs"] if r["repair"] == "run-adopted"]
        assert (adopted["run"], adopted["job"], adopted["pool"]) == ("research-own-run", "research-own-run", "p5")
        job = env.job("research-own-run")
        assert job.adopted and job.status is JobState.RUNNING and job.priority == 200 and job.gpus == 16
        # (running since its creation, as SageMaker says, not since reconcile found it)
        assert job.started_at == job.first_started_at == pytest.approx(START, abs=1)
        assert env.store.pool("p5")["used_gpus"] == 16 and env.kinds("research-own-run") == ["adopted"]
        status = env.stack.client("sagemaker").describe_training_job(TrainingJobName="research-own-run")["TrainingJobStatus"]
        assert status == "InProgress"
        # And the next pass finds it known: nothing more to do
        again = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        assert not [r for r in again["repairs"] if r["repair"] in ("run-adopted", "unknown-run-stopped")]
        # And reconcile did it with the rights it has (its IAM policy allows every call)
        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []
        assert START < env.clock.now()


@pytest.mark.parametrize(
    "stack",
    ["", "preemptor-staging", "preemptor-shadow"],
    ids=["a-team-wearing-the-controllers-tags", "a-second-stacks-run", "a-team-wearing-a-stack-not-listed"],
)
def test_reconcile_never_stops_a_run_whose_controller_tags_this_controller_did_not_put_there(stack):
    from iam_policy import StackPolicies

    with emulation(parameters={"OtherControllers": "preemptor-staging"}) as env:
        # Given a live run, whose events were lost, tagged as a run the controller launched
        # for a job "ghost" (managed, job, incarnation, team, priority), older than the grace:
        # a team's own run wearing those tags, or a run of a second stack in the account,
        # which carries its own name (before: both stopped as "its job is unknown")
        env.fleet.close()
        tags = {
            "preemptor:team": "research", "preemptor:priority": "medium", "preemptor:pool": "p5",
            "preemptor:managed": "true", "preemptor:job": "ghost", "preemptor:incarnation": "1",
        }
        team_training_job(env, "ghost", {**tags, **({"preemptor:controller": stack} if stack else {})})
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        # When reconcile runs
        result = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then it is not stopped
        assert not [r for r in result["repairs"] if r["repair"] == "unknown-run-stopped"]
        status = env.stack.client("sagemaker").describe_training_job(TrainingJobName="ghost")["TrainingJobStatus"]
        assert status == "InProgress"
        adopted = [r for r in result["repairs"] if r["repair"] == "run-adopted"]
        if stack == "preemptor-staging":
            # And another stack's run is left to it: neither adopted nor counted here
            assert adopted == [] and env.store.get("ghost") is None
        elif stack:
            # And a run claiming a stack that is not listed is the team's: adopted, counted,
            # its claim refused, never a victim (IAM keeps this stack off it)
            assert [(r["run"], r["refused"]) for r in adopted] == [("ghost", "controller-tags")]
            assert env.store.pool("p5")["used_gpus"] == 16 and env.job("ghost").stoppable is False
        else:
            # And the team's run is adopted, counted, its controller claim refused
            assert [(r["run"], r["refused"]) for r in adopted] == [("ghost", "controller-tags")]
            assert env.job("ghost").adopted and env.store.pool("p5")["used_gpus"] == 16
        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []


def test_an_adopted_run_that_meets_no_capacity_ends_failed_and_is_never_planned_for_a_relaunch():
    p5_runs = lambda service, request: ("p5", 8 * int(request["ResourceConfig"]["InstanceCount"]))  # noqa: E731
    with emulation(classify=p5_runs) as env:
        # Given SageMaker out of p5 capacity, and a run research launched itself there, tagged
        # critical and managed: adopted while it starts, then Failed with CapacityError
        env.fleet.capacity_outage("p5", env.clock.now(), env.clock.now() + 7200)
        tags = {"preemptor:team": "research", "preemptor:priority": "critical", "preemptor:pool": "p5", "preemptor:managed": "true"}
        team_training_job(env, "research-own-run", tags)
        env.advance(60)
        assert env.job("research-own-run").adopted
        env.advance(300)
        # Then the run's end ends the job, failed with the reason, its GPUs freed (before: a
        # capacity wait sent it back to the queue; the next plan preempted a running job for
        # it, and its launch of nothing was refused three times)
        job = env.job("research-own-run")
        assert job.status is JobState.FAILED and "CapacityError" in job.outcome_reason and "its team relaunches it" in job.outcome_reason
        assert env.store.pool("p5")["used_gpus"] == 0
        kinds = env.kinds("research-own-run")
        assert "capacity-wait" not in kinds and "launch-failed" not in kinds and kinds[-1] == "failed"


def test_an_adopted_batch_run_back_in_its_queue_is_neither_terminated_nor_requeued_by_reconcile():
    from preemptor_tools.local import moto_patches

    pool = PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue", runnable_timeout_s=600)
    with emulation(pools=[pool]) as env:
        # Given a Batch job a team submitted itself with the scheduler's tags, running, whose
        # events never came (no fleet to tell): reconcile adopts it
        batch_queues(env)
        env.fleet.close()
        tags = {"preemptor:team": "research", "preemptor:priority": "high", "preemptor:pool": "g5", "preemptor:gpus": "8"}
        batch = env.stack.client("batch")
        job_id = batch.submit_job(jobName="team-eval", jobQueue="g5-queue", jobDefinition="g5-training", tags=tags)["jobId"]
        moto_patches.set_batch_job_status(job_id, "RUNNING")
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        first = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        assert [r["job"] for r in first["repairs"] if r["repair"] == "run-adopted"] == ["team-eval"]
        assert env.job("team-eval").adopted and env.store.pool("g5")["used_gpus"] == 8
        # When Batch puts it back in its queue (its next attempt) past the pool's RUNNABLE limit
        moto_patches.set_batch_job_status(job_id, "RUNNABLE")
        env.advance(700)
        second = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then reconcile leaves it to its team and Batch: not terminated, not requeued into a
        # capacity wait (the controller holds no request to launch it again)
        assert not [r for r in second["repairs"] if r["repair"] in ("stuck-runnable-requeued", "unknown-run-stopped")]
        assert batch.describe_jobs(jobs=[job_id])["jobs"][0]["status"] == "RUNNABLE"
        assert env.job("team-eval").status is JobState.RUNNING and "capacity-wait" not in env.kinds("team-eval")


def test_reconcile_adopts_a_teams_lost_batch_job_in_a_queue_sharing_the_pools_compute_environment_and_no_other():
    from iam_policy import StackPolicies
    from preemptor_tools.local import moto_patches

    pool = PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue")
    with emulation(pools=[pool]) as env:
        # Given research's own queue on the pool's compute environment, and eval's on one of its own
        batch_queues(env, "g5-queue", "research-queue")
        batch = env.stack.client("batch")
        [role] = [r["Arn"] for r in env.stack.client("iam").list_roles()["Roles"] if r["RoleName"] == "batch"]
        eval_fleet = batch.create_compute_environment(computeEnvironmentName="eval-ce", type="UNMANAGED", state="ENABLED", serviceRole=role)
        batch.create_job_queue(
            jobQueueName="eval-queue", state="ENABLED", priority=1,
            computeEnvironmentOrder=[{"order": 1, "computeEnvironment": eval_fleet["computeEnvironmentArn"]}],
        )
        # And a tagged job of each team running there, whose events never came (no fleet to tell)
        env.fleet.close()
        tags = {"preemptor:priority": "high", "preemptor:pool": "g5", "preemptor:gpus": "8"}
        for team, queue in (("research", "research-queue"), ("eval", "eval-queue")):
            job_id = batch.submit_job(
                jobName=f"{team}-run", jobQueue=queue, jobDefinition="g5-training", tags={**tags, "preemptor:team": team}
            )["jobId"]
            moto_patches.set_batch_job_status(job_id, "RUNNING")
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        before = len(env.stack.calls.calls)
        # When reconcile runs
        result = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then research's job, on the pool's instances, is adopted and counted (before: its
        # queue was never listed, and its GPUs never counted); eval's, on instances of its
        # own, is left alone
        assert [(r["job"], r["pool"]) for r in result["repairs"] if r["repair"] == "run-adopted"] == [("research-run", "g5")]
        assert env.store.pool("g5")["used_gpus"] == 8 and env.store.get("eval-run") is None
        assert not result.get("errors")
        # And reconcile did it with the rights it has
        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls[before:]) == []


def test_reconcile_refused_the_job_queues_still_scans_the_pools_own_queues_and_says_so():
    from preemptor_tools.local import moto_patches

    pool = PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue")
    with emulation(pools=[pool]) as env:
        batch_queues(env, "g5-queue", "research-queue")
        env.fleet.close()
        batch = env.stack.client("batch")
        tags = {"preemptor:team": "research", "preemptor:priority": "high", "preemptor:gpus": "8"}
        for name, queue in (("in-the-pools-queue", "g5-queue"), ("in-a-sharing-queue", "research-queue")):
            moto_patches.set_batch_job_status(batch.submit_job(jobName=name, jobQueue=queue, jobDefinition="g5-training", tags=tags)["jobId"], "RUNNING")
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        # When Batch throttles reconcile's look-up of the job queues through every retry
        with aws_says_no(env.stack.deps().runners["batch"].client, "DescribeJobQueues", THROTTLING["batch"]):
            result = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then the pool's own queue is scanned all the same, and the look-up's failure is reported
        assert [r["job"] for r in result["repairs"] if r["repair"] == "run-adopted"] == ["in-the-pools-queue"]
        assert [e["error"] for e in result["errors"]] == ["Throttled"]
        # And the next pass, answered, adopts the other
        again = env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        assert [r["job"] for r in again["repairs"] if r["repair"] == "run-adopted"] == ["in-a-sharing-queue"]


P5_SPOT = PoolConfig(name="p5", service="sagemaker", instance_type="ml.p5.48xlarge", instances=8, gpus_per_instance=8, capacity_type="spot")


class _Losing(deque):
    """The stack's outbox, losing the fleet's events that `lose` picks (EventBridge delivered
    them to no function: dead-lettered, say); they are kept in `lost`."""

    def __init__(self, lose) -> None:
        super().__init__()
        self.lose, self.lost = lose, []

    def append(self, event: dict) -> None:
        if self.lose(event):
            self.lost.append(event)
        else:
            super().append(event)


def _secondary(status: str):
    return lambda event: event.get("detail", {}).get("SecondaryStatus") == status


def test_a_managed_spot_interruption_whose_event_never_came_is_counted_by_reconcile_once():
    from iam_policy import StackPolicies

    with emulation(pools=[P5_SPOT]) as env:
        # Given a job on managed spot that checkpoints every 10 minutes
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200, checkpoint_every=600)
        env.advance(900)
        # When managed spot takes its instances for an hour, and its Interrupted event never
        # reaches the controller
        env.stack.outbox = outbox = _Losing(_secondary("Interrupted"))
        interrupted_at = env.clock.now()
        env.fleet.managed_spot_interrupt(env.job("spotty").run_id, capacity_back_s=3600)
        env.advance(120)
        [lost_event] = outbox.lost
        before = env.job("spotty")
        assert not before.spot_paused and before.lost_gpu_seconds == 0
        # Then reconcile reads it from the training job: the run is held paused since the
        # interruption, and the work it lost (since its checkpoint) is counted on the job
        calls = len(env.stack.calls.calls)
        repairs = [r for r in _reconcile(env)["repairs"] if r["job"] == "spotty"]
        assert [r["repair"] for r in repairs] == ["missed-spot-interruption"]
        job = env.job("spotty")
        assert job.spot_paused and job.spot_interrupted_at == pytest.approx(interrupted_at, abs=1)
        since = max(job.last_checkpoint_at, job.started_at)
        assert job.lost_gpu_seconds == pytest.approx(16 * (interrupted_at - since), abs=16) and job.lost_gpu_seconds > 0
        [line] = [e for e in env.store.history("spotty") if e["kind"] == "spot-interrupted"]
        assert "reconcile" in line["detail"]
        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls[calls:]) == []
        # And neither reconcile's next pass nor the event, delivered at last, counts it again
        assert not [r for r in _reconcile(env)["repairs"] if r["job"] == "spotty"]
        assert env.put(lost_event).results[0]["outcome"] == "duplicate"
        assert env.job("spotty").lost_gpu_seconds == job.lost_gpu_seconds
        assert env.kinds("spotty").count("spot-interrupted") == 1


def test_a_managed_spot_restart_whose_event_never_came_is_read_by_reconcile_and_its_work_is_at_risk_again():
    with emulation(pools=[P5_SPOT]) as env:
        # Given a job on managed spot, interrupted for 10 minutes (its Interrupted event came)
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200, checkpoint_every=3600)
        env.advance(900)
        env.stack.outbox = outbox = _Losing(_secondary("Restarting"))
        env.fleet.managed_spot_interrupt(env.job("spotty").run_id, capacity_back_s=600)
        env.advance(60)
        assert env.job("spotty").spot_paused
        # When it restarts and trains again, and its Restarting event never reaches the controller
        restarted_at = env.clock.now() + 540
        env.advance(1800)
        [lost_event] = outbox.lost
        assert [r["status"] for r in env.fleet.runs() if r["name"] == env.job("spotty").run_id] == ["InProgress/Training"]
        # Then, before reconcile, the controller still holds it paused: a stop would throw
        # its 20 minutes of training away as if nothing were at risk
        now = env.clock.now()
        assert env.job("spotty").checkpoint_fresh(None, now, 300)
        # And reconcile reads the restart from the training job: its work since the restart
        # is at risk again, and a stop needs the checkpoint the policy demands
        repairs = [r for r in _reconcile(env)["repairs"] if r["job"] == "spotty"]
        assert [r["repair"] for r in repairs] == ["missed-spot-restart"]
        job = env.job("spotty")
        assert not job.spot_paused and job.work_started_at == pytest.approx(restarted_at, abs=30)
        assert job.as_running().work_at_risk_s(now) == pytest.approx(now - restarted_at, abs=30)
        assert not job.checkpoint_fresh(job.last_checkpoint_at, now, 300)
        # And the event, delivered at last, changes nothing
        assert env.put(lost_event).results[0]["outcome"] == "duplicate"
        assert env.kinds("spotty").count("spot-restarting") == 1


def test_a_teams_run_adopted_late_has_its_work_since_its_checkpoint_at_risk_not_since_its_adoption():
    from emulation import START

    with emulation(policy={"checkpoint_max_age_s": 300}) as env:
        # Given research's own run of 16 GPUs, tagged to be adopted, checkpointing every 1200 s
        # of work, whose state changes were all lost (its checkpoints' S3 events came):
        # reconcile adopts it 25 minutes after its creation
        lost = lambda event: event.get("source") == "aws.sagemaker" and "research-own-run" in json.dumps(event)  # noqa: E731
        env.fleet._emit = lambda event: None if lost(event) else env.stack.emit(event)
        bucket = env.stack.parameters["CheckpointBucketName"]
        env.stack.client("sagemaker").create_training_job(
            TrainingJobName="research-own-run",
            AlgorithmSpecification={"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1", "TrainingInputMode": "File"},
            RoleArn=ROLE_ARN,
            OutputDataConfig={"S3OutputPath": "s3://research-output/out"},
            ResourceConfig={"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100},
            StoppingCondition={"MaxRuntimeInSeconds": 86_400},
            CheckpointConfig={"S3Uri": f"s3://{bucket}/research/research-own-run"},
            Environment={"PREEMPTOR_SIM_DURATION_S": "20000", "PREEMPTOR_SIM_CHECKPOINT_EVERY_S": "1200"},
            Tags=[{"Key": k, "Value": v} for k, v in {
                "preemptor:team": "research", "preemptor:priority": "low", "preemptor:pool": "p5", "preemptor:managed": "true",
            }.items()],
        )
        env.advance(1500)
        _reconcile(env)
        job = env.job("research-own-run")
        assert job.adopted and job.started_at == pytest.approx(START, abs=1)
        # (its newest checkpoint, written before it was adopted, read as it was: before, only
        # at the next pass, its plan meanwhile counting all 1,500 s of its work at risk)
        assert job.last_checkpoint_at == pytest.approx(START + 1320, abs=5)
        # When production's critical job needs the whole pool a little later
        env.advance(200)
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=600)
        # Then the run is judged by its work since its last checkpoint (written 1320 s in: 120 s
        # of start-up, then 1200 s of work), as any run's: ~380 s old, not fresh (before: it
        # was taken as running since its adoption, 200 s of work at risk, and stopped as
        # "fresh-checkpoint", 380 s of 16 GPUs' work thrown away)
        [started] = [e for e in env.store.history("research-own-run") if e["kind"] == "preemption-started"]
        assert started["extra"]["checkpoint_age_s"] == pytest.approx(380, abs=30)
        assert started["extra"]["lost_gpu_seconds"] == pytest.approx(16 * started["extra"]["checkpoint_age_s"], rel=0.01)
        env.advance(900)
        # And stopped as fresh only with a checkpoint confirmed for it
        history = env.store.history("research-own-run")
        stops = [e for e in history if e["kind"] == "stop-requested"]
        assert stops
        for stop in stops:
            if stop["reason"] == "fresh-checkpoint":
                assert any(e["kind"] == "checkpoint-confirmed" and e["at"] <= stop["at"] for e in history), history


def test_a_queue_whose_listing_is_refused_leaves_reconcile_scanning_the_others():
    from aws_faults import THROTTLING
    from preemptor_tools.local import moto_patches

    pool = PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue", fallback_job_queues=("g5-fallback",))
    with emulation(pools=[pool]) as env:
        # Given a team's own Batch job on the pool's fallback queue, running, whose events
        # never came (no fleet to tell)
        batch_queues(env, "g5-queue", "g5-fallback")
        env.fleet.close()
        tags = {"preemptor:team": "research", "preemptor:priority": "high", "preemptor:pool": "g5", "preemptor:gpus": "8"}
        job_id = env.stack.client("batch").submit_job(jobName="team-eval", jobQueue="g5-fallback", jobDefinition="g5-training", tags=tags)["jobId"]
        moto_patches.set_batch_job_status(job_id, "RUNNING")
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        # When reconcile runs while Batch throttles every listing of the pool's own queue
        own_queue = lambda params: THROTTLING["batch"] if params.get("jobQueue") == "g5-queue" else None  # noqa: E731
        with aws_says_no(env.stack.deps().runners["batch"].client, "ListJobs", own_queue) as refused:
            result = _reconcile(env)
        # Then that queue's refusal is the pass's error, and the other queue is scanned: the
        # team's job is adopted, its GPUs counted (before: the refusal ended the whole scan)
        assert refused
        assert [(e["part"], e["queue"], e["error"]) for e in result["errors"] if e.get("part") == "unknown-runs"] == [
            ("unknown-runs", "g5-queue", "Throttled")
        ]
        assert [r["job"] for r in result["repairs"] if r["repair"] == "run-adopted"] == ["team-eval"]
        assert env.store.pool("g5")["used_gpus"] == 8


@pytest.mark.parametrize(
    "refused",
    [("sagemaker", "ListTags"), ("batch", "ListJobs"), ("batch", "DescribeJobQueues")],
    ids=["a-run-check", "a-queue-listing", "the-sharing-queues-look-up"],
)
def test_a_listing_or_a_run_check_refused_once_is_tried_again_in_the_same_pass(refused):
    from preemptor_tools.local import moto_patches

    service, operation = refused
    pools = [PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue")] if service == "batch" else [P5]
    with emulation(pools=pools) as env:
        # Given a team's own run on the pool, running, whose events never came (no fleet to
        # tell): on SageMaker, on the pool's Batch queue, or on a queue sharing its compute
        # environment (found by DescribeJobQueues)
        env.fleet.close()
        tags = {"preemptor:team": "research", "preemptor:priority": "high", "preemptor:gpus": "8"}
        if service == "batch":
            batch_queues(env, "g5-queue", "research-queue")
            queue = "research-queue" if operation == "DescribeJobQueues" else "g5-queue"
            batch = env.stack.client("batch")
            job_id = batch.submit_job(jobName="team-eval", jobQueue=queue, jobDefinition="g5-training", tags={**tags, "preemptor:pool": "g5"})["jobId"]
            moto_patches.set_batch_job_status(job_id, "RUNNING")
        else:
            team_training_job(env, "team-eval", {**tags, "preemptor:pool": "p5"})
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        # When reconcile runs and the first such call (the run's tags, the queue's listing,
        # the look-up of the queues) is refused, throttled as after every retry
        client = env.stack.deps().runners[service].client
        with aws_says_no(client, operation, THROTTLING[service], times=1) as said_no:
            result = _reconcile(env)
        # Then what failed is tried again at the end of the pass, answered: the team's run is
        # adopted and counted in this pass (before: left to the next, 5 minutes later), and
        # the pass reports no error
        assert len(said_no) == 1
        assert [r["job"] for r in result["repairs"] if r["repair"] == "run-adopted"] == ["team-eval"]
        assert result["errors"] == []
        assert env.store.pool(pools[0].name)["used_gpus"] == (8 if service == "batch" else 16)


def test_the_second_look_at_a_run_whose_adoption_died_holding_its_claim_takes_the_claim_back():
    with emulation() as env:
        # Given a team's own run on the pool whose events never came (no fleet to tell)
        env.fleet.close()
        team_training_job(env, "team-eval", {"preemptor:team": "research", "preemptor:priority": "high", "preemptor:pool": "p5"})
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        store = env.stack.deps().store.client
        # When reconcile's first adoption dies after claiming the event (the insert throttled
        # through its retries) and DynamoDB refuses the claim's release too
        with (
            aws_says_no(store, "TransactWriteItems", THROTTLING["dynamodb"], times=1) as insert,
            aws_says_no(store, "DeleteItem", THROTTLING["dynamodb"], times=1) as release,
        ):
            result = _reconcile(env)
        # Then the second look, with the pass's own claim token, takes its claim back and
        # adopts the run in the same pass (before: EventInProgress, left to the next pass)
        assert len(insert) == len(release) == 1
        assert [r["job"] for r in result["repairs"] if r["repair"] == "run-adopted"] == ["team-eval"]
        assert result["errors"] == [] and env.job("team-eval").adopted


def test_reconcile_takes_no_second_look_with_too_little_of_its_invocation_left():
    from preemptor.service.reconcile import SECOND_LOOK_WITHIN_S, reconcile
    from preemptor_tools.local import moto_patches

    pool = PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue")
    with emulation(pools=[pool]) as env:
        # Given a team's own Batch run on the pool's queue whose events never came
        batch_queues(env, "g5-queue")
        env.fleet.close()
        tags = {"preemptor:team": "research", "preemptor:priority": "high", "preemptor:gpus": "8", "preemptor:pool": "g5"}
        job_id = env.stack.client("batch").submit_job(jobName="team-eval", jobQueue="g5-queue", jobDefinition="g5-training", tags=tags)["jobId"]
        moto_patches.set_batch_job_status(job_id, "RUNNING")
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        d = env.stack.deps()
        # When the queue's first listing is refused, and the invocation has less time left
        # than a call may take through its retries
        with aws_says_no(d.runners["batch"].client, "ListJobs", THROTTLING["batch"], times=1) as said_no:
            result = reconcile(
                store=d.store, runners=d.runners, workflows=d.workflows, checkpoints=d.checkpoints, settings=d.settings,
                now=env.clock.now(), time_left=lambda: SECOND_LOOK_WITHIN_S - 1,
            )
        # Then the pass ends without its second look (Lambda would kill it mid-call), says the
        # refusal, and leaves the run to the next pass
        assert len(said_no) == 1
        assert [(e["queue"], e["error"]) for e in result["errors"] if e.get("part") == "unknown-runs"] == [("g5-queue", "Throttled")]
        assert not [r for r in result["repairs"] if r["repair"] == "run-adopted"] and env.store.get("team-eval") is None
        assert [r["job"] for r in _reconcile(env)["repairs"] if r["repair"] == "run-adopted"] == ["team-eval"]
