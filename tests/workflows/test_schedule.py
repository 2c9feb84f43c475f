"""The schedule workflow (statemachines/schedule.asl.json) and the preemption of each
victim (statemachines/preempt.asl.json) executed on moto."""

from __future__ import annotations

import json

import pytest
from botocore.exceptions import ReadTimeoutError

from aws_faults import answer_lost_after_applied, aws_says_no
from emulation import START, emulation

from preemptor.core.model import JobState
from preemptor.service import scheduling
from preemptor_tools.local.scenario import ScenarioJob, submission_event


def _last_schedule(env) -> dict:
    done = [e for e in env.executions("ScheduleStateMachine") if e["status"] != "RUNNING"]
    return max(done, key=lambda e: e["startDate"])


def _preemption_of(env, job: str) -> dict:
    """The (last) preempt execution of `job`."""
    runs = [e for e in env.executions("PreemptStateMachine") if f"-{job}-" in e["name"]]
    assert runs, f"no preemption of {job} was started"
    return max(runs, key=lambda e: e["startDate"])


def test_admits_and_launches_into_free_capacity():
    with emulation() as env:
        # When a job is submitted into an empty pool
        result = env.submit(name="train", team="research", priority=50, pool="p5", instances=4, duration=3600)
        # Then intake accepted it and the schedule workflow launched it
        assert result["outcome"] == "accepted"
        job = env.job("train")
        assert job.status is JobState.RUNNING and job.run_name == "train"
        run = _last_schedule(env)
        assert run["status"] == "SUCCEEDED"
        states = env.states_visited(run["executionArn"])
        assert states[:7] == [
            "Wait first?",
            "Let the submissions settle",
            "Start counting cycles",
            "Plan the pool",
            "Did we get the pool?",
            "Nothing given up yet",
            "Any jobs to launch?",
        ]
        assert "Launch the job" in states and "Backing off?" in states and "Plan again after the backoff" not in states
        assert "Start the preemptions" not in states
        assert env.store.pool("p5")["used_gpus"] == 32


def test_preempts_after_a_fresh_checkpoint_then_launches_the_preemptor():
    with emulation() as env:
        # Given a low job holding the whole pool, with a checkpoint every 5 minutes
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(600)
        # When a critical job arrives
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        # Then the sweep was stopped, in its own preempt execution, only after its checkpoint
        # was confirmed, and requeued
        run = _preemption_of(env, "sweep")
        states = env.states_visited(run["executionArn"])
        assert run["status"] == "SUCCEEDED"
        assert states.index("Confirm the checkpoint") < states.index("Stop the run") < states.index("Requeue the job")
        assert "Stop without a fresh checkpoint" not in states
        sweep = env.job("sweep")
        assert sweep.status is JobState.PENDING and sweep.incarnation == 2 and sweep.preemptions == 1
        assert sweep.stops_without_fresh_checkpoint == 0
        kinds = env.kinds("sweep")
        assert kinds.index("checkpoint-confirmed") < kinds.index("stop-requested") < kinds.index("requeued")
        # And the preemption scheduled the pool once the GPUs were free: the preemptor runs
        assert states[-2:] == ["Schedule the pool", "Done"]
        assert env.job("prod").status is JobState.RUNNING
        assert "Launch the job" in env.states_visited(_last_schedule(env)["executionArn"])
        # And the owners were told before the stop
        alerts = env.stack.alerts()
        assert any('"sweep"' in a and '"prod"' in a for a in alerts)


def test_the_gpus_a_preemption_frees_go_to_its_preemptor_though_the_pool_index_still_shows_the_victim():
    from preemptor_tools.local.hostile import HostileWorld
    from preemptor_tools.local.scenario import Chaos

    with emulation(hostile=lambda clock: HostileWorld(clock, START)) as env:
        # Given a low job holding the whole pool
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(600)
        # And a pool index that answers every query as it stood a moment ago (DynamoDB's
        # global secondary indexes are eventually consistent)
        env.stack.hostile.chaos = Chaos(seed=5, index_lag_rate=0.999)
        # When a critical job preempts it: the preemption requeues the sweep and plans the
        # pool in the same moment, and that plan reads the index
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        env.advance(300)
        # Then the plan still saw the GPUs given back (the pool's own count, read
        # consistently, says the index lags), and the preemptor was launched at once, not
        # after reconcile's next look
        assert env.stack.hostile.counts().get("index-lag", 0) > 0
        requeued = next(e for e in env.store.history("sweep") if e["kind"] == "requeued")
        launched = next(e for e in env.store.history("prod") if e["kind"] == "launched")
        assert env.job("prod").status is JobState.RUNNING
        assert launched["at"] - requeued["at"] < 5, (requeued, launched)


@pytest.mark.parametrize(
    "write_s, told",
    [
        (60, "s after the stop signal: the work until the stop is kept)"),
        (200, "(no checkpoint in this run: its work is redone)"),
    ],
    ids=["saves-within-the-grace", "never-saved"],
)
def test_checkpoint_timeout_stops_anyway_and_records_it(write_s, told):
    # Given a policy that waits only 20 s for a checkpoint, and workloads that need 60 s
    # (or 200 s: more than SageMaker's 120 s stop grace) to write one
    policy = {"checkpoint_max_age_s": 60, "checkpoint_poll_s": 10, "checkpoint_wait_max_s": 20}
    with emulation(policy=policy, checkpoint_write_s=write_s) as env:
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200)
        env.advance(600)
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        run = _preemption_of(env, "sweep")
        states = env.states_visited(run["executionArn"])
        # Then the victim is stopped without a fresh checkpoint, and that is counted
        assert "Stop without a fresh checkpoint" in states
        sweep = env.job("sweep")
        assert sweep.stops_without_fresh_checkpoint == 1 and sweep.status is JobState.PENDING
        assert sweep.lost_gpu_seconds > 0
        assert env.job("prod").status is JobState.RUNNING
        # And the requeue says what the GPU-seconds lost are: since a checkpoint saved on
        # SIGTERM, which kept the work until the stop, or the whole run's
        (requeued,) = [e["detail"] for e in env.store.history("sweep") if e["kind"] == "requeued"]
        assert told in requeued, requeued


def test_checkpoint_timeout_spares_the_victim_when_policy_says_so():
    policy = {
        "checkpoint_max_age_s": 60,
        "checkpoint_poll_s": 10,
        "checkpoint_wait_max_s": 20,
        "on_checkpoint_timeout": "spare",
    }
    with emulation(policy=policy, checkpoint_write_s=60) as env:
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200)
        env.advance(600)
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        run = _preemption_of(env, "sweep")
        assert run["status"] == "SUCCEEDED"
        assert "Spare the victim" in env.states_visited(run["executionArn"])
        # Then the victim keeps running under its first incarnation and nothing was stopped
        sweep = env.job("sweep")
        assert sweep.incarnation == 1 and sweep.preemptions == 0
        assert "stop-requested" not in env.kinds("sweep")
        # And the critical job waits: the spared victim is protected for a checkpoint wait
        assert env.job("prod").status is JobState.PENDING
        assert env.job("sweep").spared_until > env.clock.now()
        assert "preemption-cancelled" in env.kinds("sweep")
        # And the preemption given up stopped nothing: the pool's budget no longer counts it
        assert env.store.preemptions_since("p5", 0.0) == []
        # When the protection has run out and the scheduled reconcile starts the next cycle
        env.advance(60)
        env.stack.invoke_lambda("preemptor-ReconcileFunction", {})
        env.stack.drain()
        # Then the checkpoint asked for meanwhile is fresh: the victim is stopped with it
        sweep = env.job("sweep")
        assert sweep.preemptions == 1 and sweep.stops_without_fresh_checkpoint == 0
        assert env.job("prod").status is JobState.RUNNING
        assert [p.victim for p in env.store.preemptions_since("p5", 0.0)] == ["sweep"]


def test_two_concurrent_cycles_never_oversubscribe_the_pool():
    with emulation() as env:
        # Given many jobs submitted at once (each submission starts a schedule execution)
        bucket = env.stack.parameters["CheckpointBucketName"]
        for i in range(6):
            job = ScenarioJob(name=f"j{i}", team="t", priority=50, pool="p5", instances=3, submit_at=0, duration=3600)
            env.stack.put_event(submission_event(job, env.pools[0], bucket, env.clock.now(), env.stack.region))
        env.stack.drain()
        # Then only what fits was admitted (2 x 24 GPUs of 64), each job at most once
        running = [j for j in env.store.all_jobs() if j.status.holds_capacity]
        assert sum(j.gpus for j in running) <= 64
        assert len(running) == 2
        assert env.store.pool("p5")["used_gpus"] == sum(j.gpus for j in running)


def test_a_save_on_sigterm_whose_s3_event_never_arrives_is_still_learned_at_the_requeue():
    # Given a low job that runs the training helper (it declares that it saves on SIGTERM,
    # and does), 40 minutes in with no checkpoint, and S3 events that never reach the
    # controller (EventBridge delivers them late or, past its retries, never)
    with emulation() as env:
        emit = env.stack.emit
        env.fleet._emit = lambda event: None if event.get("source") == "aws.s3" else emit(event)
        env.submit(
            name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200,
            runs_training_helper=True,
        )
        env.advance(2400)
        # When a critical job preempts it
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        run = _preemption_of(env, "sweep")
        states = env.states_visited(run["executionArn"])
        # Then, the stop over, the newest checkpoint is read from S3 itself before the requeue
        assert states.index("Has it stopped?") < states.index("Note the newest checkpoint") < states.index("Requeue the job")
        sweep = env.job("sweep")
        # And the checkpoint the sweep wrote on SIGTERM counts: it is trusted to save on its
        # next stop, and what the stop lost counts from that checkpoint, not from its start
        assert sweep.status is JobState.PENDING and sweep.incarnation == 2
        assert sweep.saved_on_stop and sweep.declares_save_on_stop
        assert sweep.last_checkpoint_at is not None and sweep.last_checkpoint_at > START + 2400
        assert sweep.lost_gpu_seconds <= 120 * 64


def _stale_cycle(env, interference: str) -> tuple[dict, list[dict]]:
    """A cycle of p5 whose lease goes from under it after it planned and before its first
    write (its plan step outlived Step Functions' wait, which gave the cycle up and
    released the lease; or its lease expired and another cycle took it). Returns the
    cycle's result and the writes the interference saw."""
    deps = env.stack.deps()
    owner, now = "schedule-p5-stale", env.clock.now()
    writes: list[dict] = []

    def lease_goes(params: dict) -> None:
        if not writes:
            if interference == "released":
                deps.store.release_lease("p5", owner)
            else:
                assert deps.store.acquire_lease("p5", "schedule-p5-next", now + scheduling.LEASE_TTL_S + 1, scheduling.LEASE_TTL_S)
        writes.append(params)
        return None  # the write itself goes out, and meets the lease's condition

    with aws_says_no(deps.store.client, "TransactWriteItems", lease_goes):
        result = scheduling.plan_cycle(store=deps.store, settings=deps.settings, pool_name="p5", owner=owner, now=now)
    return result.to_dict(), writes


def _held_back(env) -> None:
    """Submissions wait (the pool drained) and nothing plans the pool once it is undrained
    (the flag cleared in the table, no cycle started): the test's cycle is the one that plans."""
    env.store.set_drained("p5", True, env.clock.now())


def _sweep_then_prod_held_back(env) -> None:
    """A low sweep holding the whole pool (a checkpoint every 5 minutes), and a critical job
    waiting for it that no cycle has planned yet: the test's cycle is the one that plans."""
    env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
    env.advance(600)
    _held_back(env)
    env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
    env.store.set_drained("p5", False, env.clock.now())


@pytest.mark.parametrize("interference", ["released", "taken"])
def test_a_cycle_that_lost_its_lease_admits_nothing(interference):
    with emulation() as env:
        # Given a pending job that fits the free pool
        _held_back(env)
        env.submit(name="train", team="research", priority=200, pool="p5", instances=2, duration=1200)
        env.store.set_drained("p5", False, env.clock.now())
        assert env.job("train").status is JobState.PENDING
        # When a cycle that planned its admission loses the lease before writing it
        result, writes = _stale_cycle(env, interference)
        # Then the admission is refused: no GPUs held, no admission that no launch follows
        assert len(writes) == 1 and result["admits"] == []
        job = env.job("train")
        assert job.status is JobState.PENDING and not job.decided_by
        assert env.store.pool("p5")["used_gpus"] == 0
        [line] = [e for e in env.store.history("train") if e["kind"] == "admission-deferred"]
        assert line["reason"] == "lease-lost" and "schedule-p5-stale" in line["detail"]
        # And the pool's next cycle admits and launches it
        if interference == "taken":
            env.store.release_lease("p5", "schedule-p5-next")
        env.advance(300)
        env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
        env.stack.drain()
        assert env.job("train").status is JobState.RUNNING
        assert env.store.pool("p5")["used_gpus"] == 16


@pytest.mark.parametrize("interference", ["released", "taken"])
def test_a_cycle_that_lost_its_lease_marks_no_victim(interference):
    with emulation() as env:
        # Given a low job holding the whole pool and a critical job waiting for it
        _sweep_then_prod_held_back(env)
        # When a cycle that chose the sweep as its victim loses the lease before marking it
        result, writes = _stale_cycle(env, interference)
        # Then the sweep is not marked: nobody would stop it for a cycle no longer planning
        assert len(writes) == 1 and result["preemptions"] == []
        sweep = env.job("sweep")
        assert sweep.status is JobState.RUNNING and not sweep.preempted_by
        [line] = [e for e in env.store.history("sweep") if e["kind"] == "preemption-skipped"]
        assert line["reason"] == "lease-lost"
        assert "preemption-started" not in env.kinds("sweep")


def test_a_victim_marked_by_a_step_that_lost_its_answer_is_counted_once_in_the_budget():
    with emulation(policy={"budget": {"window_s": 3600, "max_preemptions": 4}}) as env:
        # Given a low job holding the whole pool and a critical job waiting for it
        _sweep_then_prod_held_back(env)
        deps, owner, now = env.stack.deps(), "schedule-p5-lost", env.clock.now()
        # When the plan step's mark of the sweep is written and its answer lost (the step
        # fails there, as a function killed right after the write would), and the step is retried
        with answer_lost_after_applied(deps.store.client, "TransactWriteItems") as lost:
            with pytest.raises(ReadTimeoutError):
                scheduling.plan_cycle(store=deps.store, settings=deps.settings, pool_name="p5", owner=owner, now=now)
        assert lost and env.job("sweep").status is JobState.PREEMPTING
        retried = scheduling.plan_cycle(store=deps.store, settings=deps.settings, pool_name="p5", owner=owner, now=now)
        # Then the retry hands over the victim its first attempt marked
        assert [v["job"] for v in retried.to_dict()["preemptions"]] == ["sweep"]
        # And the pool's budget counts that preemption, once (it was counted with the mark,
        # not after it, where the failed attempt never got to)
        [counted] = deps.store.preemptions_since("p5", now - 3600)
        assert (counted.victim, counted.gpus, counted.at) == ("sweep", 64, now)


def test_a_preemption_started_without_the_victims_mark_time_still_stops_and_requeues_it():
    # An execution of an earlier schedule definition, in flight while the stack is updated,
    # starts the preemption without `since`: it names no preemption, and its steps act on
    # the job as they read it, as they did before
    with emulation() as env:
        # Given a low job marked as a victim by a cycle whose own workflow never started
        _sweep_then_prod_held_back(env)
        deps = env.stack.deps()
        cycle = scheduling.plan_cycle(store=deps.store, settings=deps.settings, pool_name="p5", owner="old", now=env.clock.now())
        [item] = cycle.to_dict()["preemptions"]
        # When its preemption is started as an earlier definition of the schedule workflow did
        victim = {"job": item["job"], "incarnation": item["incarnation"], "preemptor": item["preemptor"], "reason": "preemption"}
        payload = {"victim": victim, "settings": deps.settings.policy.workflow_settings("p5"), "pool": "p5", "then": item["then"]}
        sfn = env.stack.client("stepfunctions")
        arn = env.stack.resources["PreemptStateMachine"]
        run = sfn.start_execution(stateMachineArn=arn, name=item["execution"], input=json.dumps(payload))
        env.stack.drain()
        env.advance(600)
        # Then it confirms the checkpoint, stops and requeues the sweep, and prod runs
        assert sfn.describe_execution(executionArn=run["executionArn"])["status"] == "SUCCEEDED"
        assert env.states_visited(run["executionArn"])[:2] == ["Does it name its preemption?", "Name no preemption"]
        assert env.job("sweep").preemptions == 1 and "requeued" in env.kinds("sweep")
        assert "launched" in env.kinds("prod")


def test_gpus_reclaimed_from_a_borrowing_team_go_to_the_reclaimer_not_back_to_the_borrower():
    # Given production's nominal quota is the whole pool and research borrows all of it for
    # its high sweep
    quotas = {"quotas": [{"team": "production", "nominal_gpus": 64}, {"team": "research", "nominal_gpus": 0, "borrowing_limit": 64}]}
    with emulation(policy=quotas) as env:
        env.submit(name="sweep", team="research", priority="high", pool="p5", instances=8, duration=14400, checkpoint_every=600)
        env.advance(3600)
        # When production's medium job, within its nominal quota, reclaims them
        env.submit(name="prod", team="production", priority="medium", pool="p5", instances=8, duration=1200)
        env.advance(3600)
        # Then the freed GPUs went to it, though the requeued sweep ranks higher: the sweep
        # borrows them again only once production's job is done (before, the sweep took them
        # back at once, its stop for nothing, and production's job waited)
        assert [e["kind"] for e in env.store.history("prod")][:3] == ["submitted", "preempting", "admitted"]
        [preempting] = [e for e in env.store.history("prod") if e["kind"] == "preempting"]
        assert preempting["reason"] == "reclaims-borrowed-capacity"
        prod, sweep = env.job("prod"), env.job("sweep")
        assert prod.status is JobState.COMPLETED and sweep.incarnation == 2 and sweep.started_at >= prod.ended_at


def test_a_retried_plan_that_reads_its_own_admission_still_pending_preempts_nobody_for_it(monkeypatch):
    from dataclasses import replace

    from preemptor.service import scheduling

    with emulation() as env:
        # Given a low job on half the pool and a critical one admitted into the other half
        env.submit(name="low", team="research", priority="low", pool="p5", instances=4, duration=7200, checkpoint_every=300)
        env.submit(name="crit", team="production", priority="critical", pool="p5", instances=4, duration=7200)
        env.advance(300)
        crit = env.job("crit")
        assert crit.status is JobState.RUNNING
        # And a pool index that still answers the critical job pending, as it was before its
        # admission (a plan step retried a moment after its first attempt admitted it)
        stale = replace(crit, status=JobState.PENDING, version=crit.version - 1, started_at=None)
        store = env.store
        monkeypatch.setattr(store, "pending", lambda pool, limit: [stale])
        # When the pool is planned
        result = scheduling.plan_cycle(store=store, settings=env.stack.deps().settings, pool_name="p5", owner="retried", now=env.clock.now())
        # Then the job is seen holding its GPUs, not waiting: nothing is admitted or preempted for it
        assert (result.admits, result.preemptions) == ([], [])
        assert env.job("low").status is JobState.RUNNING and env.job("crit").status is JobState.RUNNING
        # And the views are told apart by version: a copy newer than the holding one waits
        newer = replace(stale, version=crit.version + 1)
        assert scheduling.newest_views([newer], [crit]) == ([newer], [])


def _p5_runs(service: str, request: dict) -> tuple[str, int] | None:
    """The fleet's pool of a run: every SageMaker run is in p5 (8 GPUs an instance)."""
    return ("p5", 8 * int(request["ResourceConfig"]["InstanceCount"])) if service == "sagemaker" else None


def test_while_the_service_has_no_capacity_a_plan_stops_nobody_for_instances_it_would_hand_back():
    with emulation(classify=_p5_runs) as env:
        # Given a low sweep holding half the pool, then SageMaker out of p5 capacity for an hour
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=4, duration=7200, checkpoint_every=300)
        env.advance(300)
        env.fleet.capacity_outage("p5", env.clock.now(), env.clock.now() + 3600)
        # And a medium job launched into the free half, whose run met no capacity
        env.submit(name="probe", team="applied", priority="medium", pool="p5", instances=4, duration=600)
        env.advance(150)
        assert "capacity-wait" in env.kinds("probe")
        # When a high job that needs the whole pool arrives
        env.submit(name="urgent", team="production", priority="high", pool="p5", instances=8, duration=1800)
        # Then nobody is stopped: the sweep's instances would go back to SageMaker, which has
        # none to give urgent (before: the sweep was stopped, urgent met no capacity, and the
        # sweep's relaunch met none either)
        assert env.job("sweep").status is JobState.RUNNING and "preemption-started" not in env.kinds("sweep")
        waits = {w["job"]: w for w in json.loads(env.store.pool("p5")["last_waits"])}
        assert waits["urgent"]["reason"] == "no-service-capacity"
        assert "the service has had no capacity for p5" in waits["urgent"]["detail"] and "sweep" in waits["urgent"]["detail"]


def _removals(env) -> int:
    """UpdateItems that removed a no-capacity mark from a pool item."""
    return sum(
        1 for c in env.stack.calls.calls
        if c.api_action == "dynamodb:UpdateItem" and "REMOVE no_capacity" in str(c.params.get("UpdateExpression", ""))
    )


def test_a_run_that_gets_its_instances_tells_the_pool_the_service_has_capacity_again():
    with emulation(classify=_p5_runs) as env:
        # Given a run's start in a pool with no mark: the pool item (admissions' hot item) is
        # read, not written
        env.submit(name="first", team="research", priority="low", pool="p5", instances=1, duration=3600)
        env.advance(150)
        assert _removals(env) == 0
        # Given a pool whose launches met no capacity a moment ago: its plans stop nobody
        env.store.mark_unavailable("p5", env.store.ANY_OFFERING, env.clock.now() + 600, cache="no_capacity")
        assert env.store.no_capacity_until(env.store.pool("p5"), ("*",), env.clock.now()) == env.clock.now() + 600
        # When a run of the pool gets its instances (SageMaker: InProgress/Training)
        env.submit(name="train", team="research", priority="low", pool="p5", instances=1, duration=3600)
        env.advance(150)
        # Then the mark is forgotten: the pool's plans may stop jobs again
        assert env.store.no_capacity_until(env.store.pool("p5"), ("*",), env.clock.now()) is None
        assert _removals(env) == 1
