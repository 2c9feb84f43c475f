"""A workflow step whose Lambda dies after its work, before it answers (an out-of-memory
kill, a timeout: Step Functions sees `Lambda.Unknown`), is retried, and the retry finds the
work done and answers as the first attempt would have: nothing is done twice, and the
workflow goes on instead of alerting and leaving the pool to the reconcile.

Executed on moto through the real state machines; the hostile world kills the Lambda of
the first step that matches, once."""

from __future__ import annotations

import json

import pytest
from aws_faults import answer_lost_after_applied
from emulation import G5, START, batch_queues, emulation

from preemptor.core.model import JobState
from preemptor_tools.local.hostile import HostileWorld


def _hostile(clock) -> HostileWorld:
    return HostileWorld(clock, START)


def kill_after_work(env, action: str | None = None, function: str | None = None, times: int | None = 1) -> list[dict]:
    """The first `times` workflow steps (None: every one) of `action` (a control or
    checkpoint step) or of `function` (a Lambda's name contains it) die after their work;
    returns the events they crashed on."""
    crashed: list[dict] = []

    def crash(function_name: str, event) -> bool:
        hit = (action is None or (isinstance(event, dict) and event.get("action") == action)) and (
            function is None or function in function_name
        )
        if hit and (times is None or len(crashed) < times):
            crashed.append(event)
            return True
        return False

    env.stack.hostile.crash_after_step = crash
    return crashed


def test_a_launch_whose_lambda_died_after_creating_the_run_launches_it_once():
    with emulation(hostile=_hostile) as env:
        # Given the launch step's Lambda dies right after the training job was created
        crashed = kill_after_work(env, action="launch")
        # When a job is submitted into the empty pool
        env.submit(name="train", team="a", priority=200, pool="p5", instances=2, duration=1200)
        # Then the retried step found the run its first attempt created, and took it
        assert crashed and crashed[0]["job"] == "train"
        job = env.job("train")
        assert job.status is JobState.RUNNING and job.run_name == "train"
        names = [j["TrainingJobName"] for j in env.stack.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]]
        assert names == ["train"]
        assert env.kinds("train").count("launched") == 1
        # And the cycle ended as any other: no "launch failed" alert, nothing left to reconcile
        [schedule] = [e for e in env.executions("ScheduleStateMachine") if e["status"] != "RUNNING"]
        assert schedule["status"] == "SUCCEEDED"
        assert "Launch failed" not in env.states_visited(schedule["executionArn"])


def test_a_batch_launch_whose_lambda_died_after_submitting_submits_once():
    with emulation(pools=[G5], hostile=_hostile) as env:
        batch_queues(env)
        # Given the launch step's Lambda dies right after SubmitJob (Batch job names are not
        # unique: only the retry's own look-up keeps a second job from being submitted)
        crashed = kill_after_work(env, action="launch")
        env.submit(name="train", team="a", priority=200, pool="g5", gpus=16, duration=1200)
        # Then the retried step found the live job of that name with this incarnation's
        # tags and took it: one job in the queue, the record on its id
        assert crashed and crashed[0]["job"] == "train"
        batch = env.stack.client("batch")
        jobs = [
            j for status in ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING")
            for j in batch.list_jobs(jobQueue="g5-queue", jobStatus=status)["jobSummaryList"]
        ]
        assert [j["jobName"] for j in jobs] == ["train"]
        job = env.job("train")
        assert job.status is JobState.RUNNING and job.run_id == jobs[0]["jobId"]
        assert env.kinds("train").count("launched") == 1


def test_a_plan_whose_lambda_died_after_reserving_returns_its_reservations_and_they_launch():
    with emulation(hostile=_hostile) as env:
        # Given the plan step's Lambda dies right after it reserved the pool for a job
        crashed = kill_after_work(env, function="Plan")
        env.submit(name="train", team="a", priority=200, pool="p5", instances=2, duration=1200)
        # Then the retried step of the same cycle returned what the first one reserved,
        # and the job was launched by that cycle
        assert crashed and "owner" in crashed[0]
        job = env.job("train")
        assert job.status is JobState.RUNNING
        assert env.store.pool("p5")["used_gpus"] == 16
        assert env.kinds("train").count("launched") == 1


def test_a_stop_whose_lambda_died_after_the_signal_is_recorded_once():
    with emulation(hostile=_hostile) as env:
        # Given a low job on the whole pool with a fresh checkpoint, and the stop step's
        # Lambda dying right after the stop went out
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(900)
        crashed = kill_after_work(env, action="stop")
        # When a critical job needs the pool
        env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=600)
        env.advance(600)
        # Then the retried step sent the stop again (harmless) but recorded it once: the
        # signal's time, which tells whether a checkpoint came in the grace, is the first
        assert crashed and crashed[0]["job"] == "sweep"
        history = env.store.history("sweep")
        assert [e["kind"] for e in history].count("stop-requested") == 1
        assert [e["kind"] for e in history].count("requeued") == 1
        # And the preemption went through: the critical job runs, the sweep waits its turn
        assert env.job("incident").status is JobState.RUNNING
        assert env.job("sweep").status is JobState.PENDING and env.job("sweep").incarnation == 2
        [preemption] = env.executions("PreemptStateMachine")
        assert preemption["status"] == "SUCCEEDED"


def test_a_checkpoint_request_whose_lambda_died_after_asking_is_asked_once():
    with emulation(hostile=_hostile) as env:
        # Given a low sweep on the whole pool whose checkpoint is 30 minutes old (it writes
        # one every 2 hours), a bucket that keeps every version of the request marker, and
        # the request step's Lambda dying right after it asked
        s3, bucket = env.stack.client("s3"), env.stack.parameters["CheckpointBucketName"]
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=14400, checkpoint_every=7200)
        env.advance(1800)
        crashed = kill_after_work(env, action="request")
        # When a medium job needs half the pool (the work at risk outweighs its wait)
        env.submit(name="tuning", team="ml", priority="medium", pool="p5", instances=4, duration=1800, checkpoint_every=300)
        env.advance(900)
        # Then the retried step answered with its first attempt's request: the marker
        # written again with the same time (one request to the helper, which answers once
        # per time), one line, the time the wait counts from the first
        assert crashed and crashed[0]["job"] == "sweep" and crashed[0]["execution"]
        key = "research/sweep/_preemptor/checkpoint-request.json"
        versions = s3.list_object_versions(Bucket=bucket, Prefix=key).get("Versions", [])
        assert versions
        times = {json.loads(s3.get_object(Bucket=bucket, Key=key, VersionId=v["VersionId"])["Body"].read())["requested_at"] for v in versions}
        [asked] = [e for e in env.store.history("sweep") if e["kind"] == "checkpoint-requested"]
        assert times == {asked["at"]} == {env.job("sweep").checkpoint_requested_at}
        # And the preemption went on: the sweep was stopped and requeued, the medium job runs
        assert env.job("tuning").status is JobState.RUNNING
        assert env.job("sweep").incarnation == 2 and env.kinds("sweep").count("requeued") == 1
        [preemption] = env.executions("PreemptStateMachine")
        assert preemption["status"] == "SUCCEEDED"


def test_a_finish_whose_lambda_died_after_recording_the_end_still_plans_the_pool():
    with emulation(hostile=_hostile) as env:
        # Given a job on the whole pool, one waiting behind it, and the finish step's
        # Lambda dying right after it recorded the end
        env.submit(name="first", team="a", priority=200, pool="p5", instances=8, duration=1200)
        env.submit(name="second", team="b", priority=200, pool="p5", instances=8, duration=1200)
        crashed = kill_after_work(env, action="finish")
        # When the first completes
        env.advance(1500)
        # Then the retried step found the end recorded and the workflow planned the freed
        # GPUs: the second job runs, without the reconcile or a failure report
        assert crashed and crashed[0]["job"] == "first"
        assert env.job("first").status is JobState.COMPLETED and env.kinds("first").count("completed") == 1
        assert env.job("second").status is JobState.RUNNING
        [ended] = env.executions("JobEndedStateMachine")
        states = env.states_visited(ended["executionArn"])
        assert states[-1] == "Schedule the pool" and "Report the failure" not in states


def test_a_spot_interruption_whose_mark_step_died_goes_on_to_stop_and_requeue():
    with emulation(pools=[G5], hostile=_hostile) as env:
        batch_queues(env)
        env.submit(name="spotty", team="a", priority=200, pool="g5", gpus=16, duration=7200, checkpoint_every=1800)
        env.advance(2400)
        # Given the step that marks the job interrupted dies right after its mark
        crashed = kill_after_work(env, action="interrupt")
        # When EC2 warns that the instance will be reclaimed
        env.fleet.spot_interrupt("spotty")
        env.stack.pump()
        # Then the retried step knew its own execution's mark: the workflow went on to
        # checkpoint, stop and requeue the job, not to "Already handled"
        assert crashed and crashed[0]["execution"]
        [run] = env.executions("SpotInterruptionStateMachine")
        states = env.states_visited(run["executionArn"])
        assert "Already handled" not in states
        assert states.index("Stop the run") < states.index("Requeue the job")
        assert env.kinds("spotty").count("interruption") == 1
        # And a second notice of the same run (another instance of the job, another event)
        # is still told the job is handled
        sfn = env.stack.client("stepfunctions")
        second = sfn.start_execution(
            stateMachineArn=env.stack.state_machines["SpotInterruptionStateMachine"],
            name="second-notice",
            input=sfn.describe_execution(executionArn=run["executionArn"])["input"],
        )["executionArn"]
        env.stack.drain()
        assert env.states_visited(second)[-1] == "Already handled"
        env.advance(120)
        job = env.job("spotty")
        assert job.incarnation == 2 and job.status is JobState.RUNNING


def test_the_retry_is_bounded_a_step_that_always_dies_is_reported():
    with emulation(hostile=_hostile) as env:
        # Given a finish step whose Lambda dies on every attempt (a function that runs out
        # of memory on this input, say)
        dead = kill_after_work(env, action="finish", times=None)
        env.submit(name="first", team="a", priority=200, pool="p5", instances=8, duration=600)
        env.advance(900)
        # Then it was tried three times (two retries), and the failure was reported
        assert len(dead) == 3
        [ended] = env.executions("JobEndedStateMachine")
        assert env.states_visited(ended["executionArn"])[-2:] == ["Report the failure", "Recording failed"]
        assert any("Lambda.Unknown" in a for a in env.stack.alerts()), [json.loads(a).get("kind") for a in env.stack.alerts()]


def test_an_admission_whose_plan_step_died_for_good_goes_back_to_the_queue_and_launches_at_the_next_cycle():
    with emulation(hostile=_hostile) as env:
        # Given a plan step that dies after its work on every attempt: it admits the job
        # into free capacity each time, and its cycle gives up before launching it
        dead = kill_after_work(env, function="Plan", times=None)
        env.submit(name="train", team="a", priority=200, pool="p5", instances=2, duration=1200)
        assert len(dead) == 3
        [failed] = env.executions("ScheduleStateMachine")
        assert failed["status"] == "FAILED"
        # Then the failed cycle gave its admission back: nothing holds GPUs unlaunched
        job = env.job("train")
        assert job.status is JobState.PENDING and not job.run_id
        assert env.store.pool("p5")["used_gpus"] == 0
        assert "admission-released" in env.kinds("train")
        env.stack.hostile.crash_after_step = lambda function_name, event: False
        # When the next cycle runs (reconcile plans every pool every 5 minutes), long
        # before reconcile would call an admission stuck
        env.advance(300)
        repairs = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})["repairs"]
        env.stack.drain()
        # Then the job runs, launched once
        assert not [r for r in repairs if r.get("job") == "train"]
        assert env.job("train").status is JobState.RUNNING
        assert env.kinds("train").count("launched") == 1
        assert env.store.pool("p5")["used_gpus"] == 16
        # And every call of the failed cycle's release was one its function may make
        from iam_policy import StackPolicies

        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []


@pytest.mark.parametrize("registration", ["written", "throttled"])
def test_a_victim_whose_plan_step_and_release_died_for_good_after_marking_it_is_preempted_by_reconcile(registration):
    from aws_faults import THROTTLING, aws_says_no
    from preemptor.service.reconcile import PREEMPT_START_GRACE_S, preemption_deadline_s

    with emulation(hostile=_hostile) as env:
        # Given a low job on the whole pool, checkpointing every 5 minutes
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(900)
        # And a plan step that dies after its work on every attempt (it marks the sweep as
        # the victim each time; its cycle gives up before it starts the preemption)
        dead = kill_after_work(env, function="Plan", times=None)
        # and the failed cycle's release dies after its work on every attempt too (it gives
        # the lease back; its answer, the victim to hand on, is lost)
        released: list[dict] = []
        plan_dies = env.stack.hostile.crash_after_step

        def both_die(function_name: str, event) -> bool:
            if "FinishCycle" in function_name:
                released.append(event)
                return True
            return plan_dies(function_name, event)

        env.stack.hostile.crash_after_step = both_die
        env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=600)
        assert len(dead) == 3 and released and env.job("sweep").status is JobState.PREEMPTING
        assert env.executions("PreemptStateMachine") == []
        env.stack.hostile.crash_after_step = lambda function_name, event: False
        # When reconcile runs past the grace, long before the preemption deadline
        env.advance(PREEMPT_START_GRACE_S + 60)
        assert PREEMPT_START_GRACE_S + 60 < preemption_deadline_s(env.stack.deps().settings, "p5")
        # (with the pool's registration write throttled, the repair of its jobs goes on)
        pool_write = lambda params: THROTTLING if params["Key"]["pk"]["S"] == "POOL#p5" and "capacity_gpus" in params.get("UpdateExpression", "") else None  # noqa: E731
        with aws_says_no(env.store.client, "UpdateItem", pool_write if registration == "throttled" else lambda params: None) as refused:
            result = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
        assert bool(refused) is (registration == "throttled")
        assert [e.get("part") for e in result["errors"]] == (["registration"] if registration == "throttled" else [])
        repairs = result["repairs"]
        env.stack.drain()
        # Then it started the victim's preempt workflow under the plan's name, which stopped
        # and requeued the sweep; the critical job runs
        assert [r["repair"] for r in repairs if r.get("job") == "sweep"] == ["preemption-workflow-started"]
        env.advance(600)
        [preemption] = env.executions("PreemptStateMachine")
        assert preemption["status"] == "SUCCEEDED"
        assert env.job("sweep").status is JobState.PENDING and env.job("sweep").incarnation == 2
        assert env.job("incident").status is JobState.RUNNING
        # And a second reconcile starts nothing more
        again = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})["repairs"]
        assert not [r for r in again if r.get("repair") == "preemption-workflow-started"]


def test_a_victim_whose_preempt_workflow_failed_is_preempted_again_by_reconcile_long_before_the_deadline():
    from aws_faults import THROTTLING, aws_says_no

    from preemptor.service.reconcile import PREEMPT_START_GRACE_S, preemption_deadline_s

    with emulation(hostile=_hostile) as env:
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(900)
        # Given the victim's preempt workflow fails: S3 throttles every listing of its
        # checkpoints until the step's retries run out
        s3 = env.stack.deps().checkpoints.client
        with aws_says_no(s3, "ListObjectsV2", THROTTLING["s3"]):
            env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=600)
            env.advance(240)
        [failed] = env.executions("PreemptStateMachine")
        assert failed["status"] == "FAILED" and env.job("sweep").status is JobState.PREEMPTING
        # When reconcile runs past the grace, long before the preemption deadline
        env.advance(PREEMPT_START_GRACE_S)
        assert env.clock.now() - env.job("sweep").preempting_since < preemption_deadline_s(env.stack.deps().settings, "p5")
        repairs = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})["repairs"]
        env.stack.drain()
        # Then it started the workflow again, under the next name, which preempted the sweep
        assert [r["repair"] for r in repairs if r.get("job") == "sweep"] == ["preemption-workflow-restarted"]
        env.advance(600)
        statuses = sorted(e["status"] for e in env.executions("PreemptStateMachine"))
        assert statuses == ["FAILED", "SUCCEEDED"]
        assert env.job("sweep").status is JobState.PENDING and env.job("incident").status is JobState.RUNNING


def _requeue(params: dict) -> bool:
    """Whether a TransactWriteItems call is a stopped victim's requeue (with its run's end)."""
    return any(i.get("Put", {}).get("Item", {}).get("sk", {}).get("S", "").startswith("RUNEND#") for i in params.get("TransactItems", []))


def test_a_step_whose_write_got_no_answer_is_retried_and_its_workflow_goes_on():
    with emulation() as env:
        # Given a low job on the whole pool with a fresh checkpoint
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(900)
        # When a critical job preempts it, and the requeue's write is applied but its answer
        # never comes (a read timeout once botocore's retries ran out: no AWS error code)
        with answer_lost_after_applied(env.store.client, "TransactWriteItems", when=_requeue) as lost:
            env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=600)
            env.advance(600)
        # Then the step failed as ServiceUnavailable, which the workflow retries (under its
        # own name, ReadTimeoutError, no Retry matched and the preemption failed), and the
        # retry found the requeue done: the preemption went through, once
        assert lost == [1]
        [preemption] = env.executions("PreemptStateMachine")
        assert preemption["status"] == "SUCCEEDED"
        assert env.kinds("sweep").count("requeued") == 1 and env.job("sweep").incarnation == 2
        assert env.job("incident").status is JobState.RUNNING
        history = env.stack.client("stepfunctions").get_execution_history(executionArn=preemption["executionArn"])["events"]
        failures = [
            details["error"] for e in history for key, details in e.items()
            if key in ("lambdaFunctionFailedEventDetails", "taskFailedEventDetails")
        ]
        assert failures == ["ServiceUnavailable"]


def test_a_stop_at_once_whose_workflow_is_restarted_after_the_signal_is_not_told_fresh_by_the_checkpoint_of_its_grace():
    from aws_faults import THROTTLING, aws_says_no

    from preemptor.service.reconcile import PREEMPT_START_GRACE_S

    with emulation(hostile=_hostile) as env:
        # Given a low sweep on the whole pool, 30 minutes of work since its start and no
        # checkpoint (it saves on SIGTERM, as the training helper does, but has not been
        # seen to: not trusted yet)
        env.submit(
            name="sweep", team="research", priority="low", pool="p5", instances=8, duration=14400, checkpoint_every=7200,
            runs_training_helper=True,
        )
        env.advance(1800)
        # When a critical job preempts it at once (its wait would cost more than the work at
        # risk), and the stop goes out but the write of its line is throttled through every
        # retry of the step: the workflow fails after the signal
        line = lambda params: THROTTLING["dynamodb"] if params.get("Item", {}).get("kind", {}).get("S") == "stop-requested" else None  # noqa: E731
        with aws_says_no(env.stack.deps().store.client, "PutItem", line) as refused:
            env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=600)
            env.advance(240)
        assert refused and [s.run for s in env.fleet.stops] == ["sweep"]
        [failed] = env.executions("PreemptStateMachine")
        assert failed["status"] == "FAILED"
        # And the sweep saved during the grace, after the signal
        assert env.job("sweep").last_checkpoint_at > env.job("sweep").stop_signal_at
        # When reconcile restarts its workflow, whose check finds that checkpoint
        env.advance(PREEMPT_START_GRACE_S)
        repairs = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})["repairs"]
        env.stack.drain()
        assert [r["repair"] for r in repairs if r.get("job") == "sweep"] == ["preemption-workflow-restarted"]
        env.advance(300)
        # Then the stop is told as it went: at once, without a fresh checkpoint (before:
        # "fresh-checkpoint", for a stop that threw away 30 minutes of 64 GPUs' work)
        [stop] = [e for e in env.store.history("sweep") if e["kind"] == "stop-requested"]
        assert stop["reason"] == "stop-at-once" and "WITHOUT a fresh checkpoint" in stop["detail"]
        # And it is counted so where the stop is accounted: the requeue, the job's record
        [requeued] = [e for e in env.store.history("sweep") if e["kind"] == "requeued"]
        assert requeued["extra"]["fresh_checkpoint"] is False and env.job("sweep").stops_without_fresh_checkpoint == 1
        assert env.job("sweep").status is JobState.PENDING and env.job("incident").status is JobState.RUNNING
