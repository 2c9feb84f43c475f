"""Bounded, self-healing scheduling (issue 8, findings 3, 5 and the workflow part of 6),
executed on moto: the schedule and preempt workflows and the reconcile function."""

from __future__ import annotations

import json
import threading

import pytest

from aws_faults import THROTTLING, answer_lost_after_applied, aws_says_no, error_response, is_lease_taking
from emulation import P5, emulation
from notice_queues import received, subscribe

from preemptor.core.jobs import JobRecord
from preemptor.core.model import EndedRun, JobState, Notice
from preemptor.service.reconcile import STUCK_ADMISSION_S, UNKNOWN_RUN_GRACE_S, preemption_deadline_s
from preemptor.service.scheduling import MAX_CYCLES
from preemptor_tools.local.executions import wait_for_execution

RECONCILE = "preemptor-ReconcileFunction"
PLAN = "preemptor-PlanFunction"
STOP_DENIED = error_response(
    "AccessDeniedException",
    "User: arn:aws:sts::123456789012:assumed-role/preemptor-JobControl/x is not authorized to perform: "
    "sagemaker:StopTrainingJob because no identity-based policy allows the sagemaker:StopTrainingJob action",
    400,
)


def _executions(env, machine: str) -> list[dict]:
    return sorted(env.executions(machine), key=lambda e: e["startDate"])


def _preemption_of(env, job: str) -> dict:
    runs = [e for e in _executions(env, "PreemptStateMachine") if f"-{job}-" in e["name"]]
    assert runs, f"no preemption of {job} was started"
    return runs[-1]


def _history(env, execution_arn: str) -> list[dict]:
    sfn = env.stack.client("stepfunctions")
    events, token = [], None
    while True:
        page = sfn.get_execution_history(executionArn=execution_arn, maxResults=1000, **({"nextToken": token} if token else {}))
        events += page["events"]
        token = page.get("nextToken")
        if not token:
            return events


def _reconcile(env) -> dict:
    result = env.stack.invoke_lambda(RECONCILE, {})
    env.stack.drain()
    return result


def _sweep_then_prod(env, sweep_instances: int = 8) -> None:
    """A low job holding the pool (checkpoints every 5 min), then a critical job that needs it."""
    env.submit(name="sweep", team="research", priority="low", pool="p5", instances=sweep_instances, duration=30000, checkpoint_every=300)
    env.advance(600)


# -- finding 3: a victim the controller cannot stop -----------------------------------------


def test_a_victim_whose_stop_is_denied_is_spared_at_once_and_the_preemptor_runs_once_the_stop_is_allowed():
    with emulation() as env:
        _sweep_then_prod(env)
        sagemaker = env.stack.deps().runners["sagemaker"].client
        # Given IAM denies stopping the sweep
        with aws_says_no(sagemaker, "StopTrainingJob", STOP_DENIED) as refused:
            # When a critical job needs the sweep's GPUs
            env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        # Then the denial is not retried: the preemption gave up loudly (execution failed,
        # operators told with job, pool and error) and spared the sweep in the same run
        assert len(refused) == 1
        run = _preemption_of(env, "sweep")
        assert run["status"] == "FAILED"
        alerts = env.stack.alerts()
        assert any("sweep" in a and "p5" in a and "AccessDenied" in a for a in alerts), alerts
        sweep = env.job("sweep")
        assert sweep.status is JobState.RUNNING and sweep.spared_until > env.clock.now()
        assert ("preemption-cancelled", "stop-refused") in [(e["kind"], e["reason"]) for e in env.store.history("sweep")]
        assert "victim-spared" in env.kinds("prod")
        assert env.job("prod").status is JobState.PENDING
        assert env.store.pool("p5")["used_gpus"] == 64

        # When the protection has run out and the stop is allowed again
        env.advance(sweep.spared_until - env.clock.now() + 60)
        _reconcile(env)
        # Then the sweep is preempted for good and the preemptor runs
        assert env.job("prod").status is JobState.RUNNING
        sweep = env.job("sweep")
        assert sweep.status is JobState.PENDING and sweep.incarnation == 2
        assert env.store.pool("p5")["used_gpus"] == 64


def test_a_victim_whose_stop_never_takes_effect_is_spared_by_reconcile_past_its_waits():
    with emulation() as env:
        _sweep_then_prod(env)
        sagemaker = env.stack.deps().runners["sagemaker"].client
        # Given SageMaker accepts the stop of the sweep but the run goes on (it never stops)
        accepted = {"ResponseMetadata": {"HTTPStatusCode": 200, "RetryAttempts": 0}}
        with aws_says_no(sagemaker, "StopTrainingJob", accepted) as stops:
            # When a critical job needs the sweep's GPUs
            env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        # Then the stop wait ran out: the execution failed, the operators were told, and
        # the sweep is still PREEMPTING with its run alive
        assert stops
        assert _preemption_of(env, "sweep")["status"] == "FAILED"
        assert any("sweep" in a and "p5" in a for a in env.stack.alerts())
        assert env.job("sweep").status is JobState.PREEMPTING
        assert env.job("prod").status is JobState.PENDING

        # When reconcile runs before the preemption's waits are over, it leaves it alone
        assert not [r for r in _reconcile(env)["repairs"] if r.get("job") == "sweep"]
        # And when it runs past them, with the sweep still running
        env.advance(preemption_deadline_s(env.stack.deps().settings, "p5"))
        repairs = _reconcile(env)["repairs"]
        # Then the sweep is spared (running again, protected for a while), both jobs' logs say why
        assert {"job": "sweep", "pool": "p5", "repair": "stuck-preemption-spared", "preemptor": "prod"} in repairs
        sweep = env.job("sweep")
        assert sweep.status is JobState.RUNNING and sweep.spared_until > env.clock.now()
        # And the stop it was sent belongs to the abandoned preemption: a later one starts
        # with no signal sent (it is sent, logged and learned from again)
        assert sweep.stop_signal_at is None and not sweep.stop_at_once
        # And, having stopped nothing, its preemption left the pool's preemption budget
        assert env.store.preemptions_since("p5", 0) == []
        assert "preemption-abandoned" in env.kinds("sweep")
        assert "victim-not-stopped" in env.kinds("prod")
        assert env.job("prod").status is JobState.PENDING


# -- finding 5: unbounded loops and locks ---------------------------------------------------


def test_a_busy_pool_continues_in_fresh_executions_and_no_history_grows_with_the_work():
    plans_asked = 40
    with emulation() as env:
        store = env.store
        asked = []

        # Given a pool where, during every plan, another decision asks the holder to plan again
        # (a call's parameters and its answer are seen in the thread that makes it, while the
        # intake's own calls may run in another)
        lease_taken: dict[int, bool] = {}

        def note_lease_call(params, **_):
            lease_taken[threading.get_ident()] = params.get("UpdateExpression", "").startswith("SET lease_owner")

        def someone_wants_a_plan(http_response, parsed, **_):
            if lease_taken.pop(threading.get_ident(), False) and "Error" not in parsed and len(asked) < plans_asked:
                asked.append(True)
                store.client.update_item(
                    TableName=store.table,
                    Key={"pk": {"S": "POOL#p5"}, "sk": {"S": "POOL"}},
                    UpdateExpression="SET rerun = :t",
                    ExpressionAttributeValues={":t": {"BOOL": True}},
                )

        events = store.client.meta.events
        events.register("before-parameter-build.dynamodb.UpdateItem", note_lease_call, unique_id="busy-params")
        events.register("after-call.dynamodb.UpdateItem", someone_wants_a_plan, unique_id="busy")
        try:
            # When a job arrives
            env.submit(name="train", team="research", priority=50, pool="p5", instances=1, duration=3600)
        finally:
            events.unregister("before-parameter-build.dynamodb.UpdateItem", unique_id="busy-params")
            events.unregister("after-call.dynamodb.UpdateItem", unique_id="busy")
        # Then the pool was planned again as often as asked ...
        runs = _executions(env, "ScheduleStateMachine")
        plans = {r["executionArn"]: env.states_visited(r["executionArn"]).count("Plan the pool") for r in runs}
        assert sum(plans.values()) > plans_asked
        # ... by a chain of executions, none running more than the bound of cycles
        assert max(plans.values()) == MAX_CYCLES
        assert len(runs) > plans_asked // MAX_CYCLES
        assert all(r["status"] == "SUCCEEDED" for r in runs)
        assert sum(1 for r in runs if r["name"].startswith("more-p5-")) >= plans_asked // MAX_CYCLES
        # And no execution's history grows with the work (one cycle is a few dozen events)
        sizes = [len(_history(env, r["executionArn"])) for r in runs]
        assert max(sizes) < 40 * MAX_CYCLES
        assert env.job("train").status is JobState.RUNNING


def test_the_lease_is_not_held_while_a_victim_writes_its_checkpoint_and_another_decision_proceeds():
    # Unweighted checkpoint wait (issue 10): 600 s at risk x 8 instances outweighs the critical
    # job's expected 300 s wait on as many, so the victim is asked for a checkpoint
    policy = {"checkpoint_max_age_s": 60, "checkpoint_poll_s": 10, "checkpoint_wait_max_s": 300, "checkpoint_wait": {"priority_weighted": False}}
    with emulation(policy=policy, checkpoint_write_s=60) as env:
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=30000)
        env.advance(600)
        sfn = env.stack.client("stepfunctions")
        seen = []

        # Given a look at the pool while the victim is asked for a checkpoint (the marker's write)
        def meanwhile(params, **_):
            if seen:
                return
            pool = env.store.pool("p5")
            other = sfn.start_execution(
                stateMachineArn=env.stack.state_machines["ScheduleStateMachine"], name="meanwhile", input=json.dumps({"pool": "p5"})
            )["executionArn"]
            wait_for_execution(sfn, other, timeout_s=60)
            seen.append((pool, env.states_visited(other), _preemption_of(env, "sweep")["status"]))

        s3 = env.stack.deps().checkpoints.client
        s3.meta.events.register("before-call.s3.PutObject", meanwhile, unique_id="meanwhile")
        try:
            # When a critical job preempts the sweep, whose checkpoint takes a minute to write
            env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1800)
        finally:
            s3.meta.events.unregister("before-call.s3.PutObject", unique_id="meanwhile")
        # Then, during the checkpoint wait, nobody held the pool's lease, and another
        # scheduling decision of the pool took it and planned
        (pool, states, preemption_status), = seen
        assert "lease_owner" not in pool
        assert preemption_status == "RUNNING"
        assert "Another run holds the pool" not in states and "Nothing given up yet" in states
        # And the preemption went on to its end
        assert env.job("prod").status is JobState.RUNNING


def test_reconcile_clears_a_lease_whose_holder_died_and_schedules_the_pool():
    with emulation() as env:
        # Given a schedule execution that took the pool's lease and died
        env.store.acquire_lease("p5", "dead-execution", env.clock.now(), 300)
        # And a job that arrived meanwhile (its schedule found the pool held)
        env.submit(name="train", team="research", priority=50, pool="p5", instances=1, duration=3600)
        assert env.job("train").status is JobState.PENDING
        # When reconcile runs after the lease expired
        env.advance(400)
        repairs = _reconcile(env)["repairs"]
        # Then the orphaned lease is cleared, reported, and the job was scheduled
        assert {"pool": "p5", "repair": "orphaned-lease-cleared", "holder": "dead-execution"} in repairs
        assert "lease_owner" not in env.store.pool("p5")
        assert env.job("train").status is JobState.RUNNING


def test_a_plan_step_that_fails_lets_the_pool_go_fails_its_execution_and_tells_the_operators():
    with emulation() as env:
        store = env.store
        # Given DynamoDB refuses the queue's read for good (not a retryable error)
        refusal = error_response("ValidationException", "One or more parameter values were invalid", 400)
        with aws_says_no(store.client, "Query", refusal) as refused:
            # When a job arrives and its schedule plans the pool
            env.submit(name="train", team="research", priority=50, pool="p5", instances=1, duration=3600)
        # Then the plan gave up after taking the lease: the execution failed, the lease
        # was let go (the next cycle is not locked out) and the operators were told
        assert refused
        runs = _executions(env, "ScheduleStateMachine")
        assert runs and runs[-1]["status"] == "FAILED"
        assert "lease_owner" not in store.pool("p5")
        assert any("p5" in a and "ValidationException" in a for a in env.stack.alerts()), env.stack.alerts()
        # And once DynamoDB answers again, the next schedule admits the job
        _reconcile(env)
        assert env.job("train").status is JobState.RUNNING


def test_a_plan_asked_for_while_a_failing_cycle_held_the_pool_is_planned_after_a_pause_not_by_reconcile():
    from preemptor.service.scheduling import FAILED_CYCLE_RETRY_S

    with emulation() as env:
        store = env.store
        refusal = error_response("ValidationException", "One or more parameter values were invalid", 400)
        asked: list[bool] = []

        def refuse_once_asked_meanwhile(params: dict) -> dict | None:
            if asked:
                return None  # DynamoDB answers again
            # Another execution (a submission's, freed GPUs') finds the lease held, and
            # leaves its request to plan on it
            asked.append(store.acquire_lease("p5", "another-execution", env.clock.now(), 300))
            return refusal

        # Given a plan step that fails for good while another plan is asked for
        failed_at = env.clock.now()
        with aws_says_no(store.client, "Query", refuse_once_asked_meanwhile) as refused:
            env.submit(name="train", team="research", priority=50, pool="p5", instances=1, duration=3600)
        assert len(refused) == 1 and asked == [False]
        # Then the failing cycle let the pool go, failed its execution, told the operators,
        # and started a fresh execution for the request it held
        [failed] = [e for e in _executions(env, "ScheduleStateMachine") if e["status"] == "FAILED"]
        assert "Plan again after a pause" in env.states_visited(failed["executionArn"])
        assert any("p5" in a and "ValidationException" in a for a in env.stack.alerts())
        [retried] = [e for e in _executions(env, "ScheduleStateMachine") if e["name"].startswith("retry-p5-")]
        assert retried["status"] == "SUCCEEDED" and "Wait out the backoff" in env.states_visited(retried["executionArn"])
        # which, once the pause was over, planned the pool: the job runs, and no reconcile ran
        assert env.job("train").status is JobState.RUNNING
        [admitted] = [e for e in env.store.history("train") if e["kind"] == "admitted"]
        assert admitted["at"] >= failed_at + FAILED_CYCLE_RETRY_S
        assert not [e for e in _executions(env, "ScheduleStateMachine") if e["name"].startswith("reconcile-")]
        # And every call of it, the fresh execution's start included, is allowed by IAM
        from iam_policy import StackPolicies

        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []


def test_the_victims_of_a_plan_step_that_failed_after_marking_them_are_preempted_at_once_not_by_reconcile(monkeypatch):
    from preemptor.service.reconcile import PREEMPT_START_GRACE_S
    from preemptor.service.scheduling import preemption_names

    with emulation() as env:
        _sweep_then_prod(env)  # a low job holds the whole pool
        store = env.stack.deps().store
        failures: list[str] = []

        def fail_after_marking(pool, waiting, now, original=store.remember_waits):
            # Given a plan step that fails for good (an error no Retry of it names) after
            # it marked its victim, before it answered
            monkeypatch.setattr(store, "remember_waits", original)
            failures.append(pool)
            raise ValueError("the plan step broke after marking its victims")

        monkeypatch.setattr(store, "remember_waits", fail_after_marking)
        failed_at = env.clock.now()
        env.submit(name="incident", team="production", priority="critical", pool="p5", instances=8, duration=600)
        assert failures == ["p5"]
        # Then the failed cycle let the pool go, told the operators, and started the
        # victim's preemption itself, under the name the plan gave it, at once
        [failed] = [e for e in _executions(env, "ScheduleStateMachine") if e["status"] == "FAILED"]
        visited = env.states_visited(failed["executionArn"])
        assert visited.index("Let go of the pool") < visited.index("Hand the marked victims on") < visited.index("Start the preemption")
        assert any("p5" in a and "ValueError" in a for a in env.stack.alerts())
        [marked] = [e for e in env.store.history("sweep") if e["kind"] == "preemption-started"]
        name, _ = preemption_names("sweep", 1, marked["at"])
        [preemption] = _executions(env, "PreemptStateMachine")
        [stop] = [e for e in env.store.history("sweep") if e["kind"] == "stop-requested"]
        assert preemption["name"] == name and stop["at"] < failed_at + 60
        # And the sweep was stopped after its checkpoint and the incident runs, long before
        # reconcile would have found the victim (its grace, then its next run)
        env.advance(60)
        assert [e["status"] for e in env.executions("PreemptStateMachine")] == ["SUCCEEDED"]
        assert env.job("incident").status is JobState.RUNNING
        [admitted] = [e for e in env.store.history("incident") if e["kind"] == "admitted"]
        assert admitted["at"] < failed_at + PREEMPT_START_GRACE_S
        assert env.job("sweep").status is JobState.PENDING and env.job("sweep").incarnation == 2
        # And every call, the preemption's start included, is allowed by IAM
        from iam_policy import StackPolicies

        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []


def test_a_quota_refusal_at_launch_is_waited_out_not_counted_as_a_refusal():
    with emulation() as env:
        sagemaker = env.stack.deps().runners["sagemaker"].client
        quota = error_response(
            "ResourceLimitExceeded",
            "The account-level service limit 'ml.p5.48xlarge for training job usage' is 8 Instances, with current utilization "
            "of 8 Instances and a request delta of 1 Instances.",
            400,
        )
        # Given the account's quota for the pool's instances (the pool's 8) is used up, once
        with aws_says_no(sagemaker, "CreateTrainingJob", quota, times=1) as refused:
            # When a job is admitted and launched
            env.submit(name="train", team="research", priority=50, pool="p5", instances=1, duration=3600)
        # Then it waited for capacity: back in the queue with a backoff, its GPUs released,
        # the same incarnation (no run was created), no refusal counted against it
        assert refused
        history = env.store.history("train")
        [wait] = [e for e in history if e["kind"] == "capacity-wait"]
        assert wait["extra"]["retries"] == 1 and not wait["extra"]["run_created"]
        # And the schedule woke the pool once the backoff was over (nothing else would have),
        # which launched it on the same incarnation, no refusal counted against it
        [launched] = [e for e in history if e["kind"] == "launched"]
        assert launched["at"] >= wait["extra"]["not_before"]
        job = env.job("train")
        assert job.status is JobState.RUNNING and job.incarnation == 1 and job.launch_attempts == 0
        assert env.store.pool("p5")["used_gpus"] == 8
        woken = [e for e in _executions(env, "ScheduleStateMachine") if "Wait out the backoff" in env.states_visited(e["executionArn"])]
        assert len(woken) == 1


def test_a_retried_plan_step_returns_what_its_cycle_reserved_and_reserves_nothing_twice():
    with emulation() as env:
        # Given a pending job that no schedule has seen yet
        env.store.put_new(_pending_record("train", gpus=16))
        step = {"pool": "p5", "owner": "schedule-x", "cycle": 0}
        # When the plan step runs, and Step Functions retries it (its answer was lost)
        first = env.stack.invoke_lambda(PLAN, step)
        again = env.stack.invoke_lambda(PLAN, step)
        # Then the retry hands over the same admission, without admitting twice
        assert [a["job"] for a in first["admits"]] == ["train"]
        assert again["admits"] == first["admits"] and again["retried"] is True
        assert env.store.pool("p5")["used_gpus"] == 16
        assert env.kinds("train").count("admitted") == 1
        # And the lease was given back both times
        assert "lease_owner" not in env.store.pool("p5")


def test_a_retried_plan_step_that_reads_a_lagging_index_still_hands_over_its_admission(monkeypatch):
    with emulation() as env:
        env.store.put_new(_pending_record("train", gpus=16))
        step = {"pool": "p5", "owner": "schedule-x", "cycle": 0}
        store = env.stack.deps().store
        stale_pending, stale_active = store.pending("p5", 100), store.active("p5")
        first = env.stack.invoke_lambda(PLAN, step)
        # Given the retry reads the pool's index before it caught up with the first attempt
        # (the index is eventually consistent): the admitted job still shows as pending
        monkeypatch.setattr(store, "pending", lambda pool, window=None: [r for r in stale_pending if r.pool == pool])
        monkeypatch.setattr(store, "active", lambda pool: [r for r in stale_active if r.pool == pool])
        again = env.stack.invoke_lambda(PLAN, step)
        # Then the retry still hands over the admission its cycle made (nothing admitted
        # twice, and the job is not left admitted with no launch for reconcile to find)
        assert again["admits"] == first["admits"] == [{"job": "train", "incarnation": 1, "gpus": 16}]
        assert env.store.pool("p5")["used_gpus"] == 16
        assert env.kinds("train").count("admitted") == 1


def test_a_plan_step_hands_over_what_an_earlier_attempt_admitted_while_it_ran(monkeypatch):
    from preemptor.service import scheduling

    with emulation() as env:
        env.store.put_new(_pending_record("train", gpus=16))
        step = {"pool": "p5", "owner": "schedule-x", "cycle": 0}
        store, settings = env.stack.deps().store, env.stack.deps().settings
        earlier: list[dict] = []

        def earlier_attempt_goes_on(pool, waiting, now, original=store.remember_waits):
            # Given the attempt Step Functions gave up (its Lambda went on) admits a job
            # that arrived meanwhile, after this attempt read the pool and before it gives
            # the lease back (same execution, same cycle: the same owner, the same mark)
            monkeypatch.setattr(store, "remember_waits", original)
            original(pool, waiting, now)
            store.put_new(_pending_record("late", gpus=8))
            result = scheduling.plan_cycle(store=store, settings=settings, pool_name="p5", owner="schedule-x", now=now, cycle=0)
            earlier.extend(result.admits)

        monkeypatch.setattr(store, "remember_waits", earlier_attempt_goes_on)
        # When this attempt answers (the earlier attempt's answer is lost: the workflow
        # launches what this one hands over)
        answer = env.stack.invoke_lambda(PLAN, step)
        # Then it hands over both admissions of its cycle, each once
        assert "late" in [a["job"] for a in earlier]
        assert sorted(a["job"] for a in answer["admits"]) == ["late", "train"]
        assert answer["retried"] is True
        assert env.store.pool("p5")["used_gpus"] == 24
        assert env.kinds("late").count("admitted") == 1 and env.kinds("train").count("admitted") == 1


def test_a_plan_step_hands_over_a_victim_an_earlier_attempt_marked_while_it_ran(monkeypatch):
    from preemptor.service import scheduling

    with emulation() as env:
        # Given a low job running on the whole pool
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(600)
        store, settings = env.stack.deps().store, env.stack.deps().settings
        earlier: list[dict] = []

        def earlier_attempt_goes_on(pool, waiting, now, original=store.remember_waits):
            # And the attempt Step Functions gave up (its Lambda went on) marks it as the
            # victim of a critical job that arrived meanwhile, after this attempt read the
            # pool and before it gives the lease back
            monkeypatch.setattr(store, "remember_waits", original)
            original(pool, waiting, now)
            critical = _pending_record("incident", gpus=64)
            store.put_new(critical.with_changes(priority=1000, team="production"))
            result = scheduling.plan_cycle(store=store, settings=settings, pool_name="p5", owner="schedule-x", now=now, cycle=0)
            earlier.extend(result.preemptions)

        monkeypatch.setattr(store, "remember_waits", earlier_attempt_goes_on)
        # When this attempt answers (the workflow starts the preemptions it hands over)
        answer = env.stack.invoke_lambda(PLAN, {"pool": "p5", "owner": "schedule-x", "cycle": 0})
        # Then it hands over the victim of its cycle, once, for its preemptor
        assert [v["job"] for v in earlier] == ["sweep"]
        assert [(v["job"], v["preemptor"]) for v in answer["preemptions"]] == [("sweep", "incident")]
        assert answer["has_preemptions"] is True and answer["retried"] is True
        assert env.job("sweep").status is JobState.PREEMPTING
        assert env.kinds("sweep").count("preemption-started") == 1


def test_a_plan_step_whose_read_back_is_throttled_still_answers_with_what_it_admitted_and_the_rerun(monkeypatch):
    with emulation() as env:
        env.store.put_new(_pending_record("train", gpus=16))
        store = env.stack.deps().store

        def someone_asks_for_a_plan(pool, waiting, now, original=store.remember_waits):
            original(pool, waiting, now)
            assert not store.acquire_lease(pool, "schedule-z", now, 300)  # held: it asks the holder to plan again

        def read_back(params: dict) -> dict | None:
            prefix = (params.get("ExpressionAttributeValues") or {}).get(":s", {}).get("S", "")
            return THROTTLING["dynamodb"] if prefix.startswith("CYCLE#") else None

        # Given work arrives while the cycle holds the lease
        monkeypatch.setattr(store, "remember_waits", someone_asks_for_a_plan)
        # When the cycle's read-back of its admissions, once the lease is given back, is throttled
        with aws_says_no(store.client, "Query", read_back) as refused:
            answer = env.stack.invoke_lambda(PLAN, {"pool": "p5", "owner": "schedule-x", "cycle": 0})
        # Then the step still answers: its admission, and the request to plan again (a
        # retried step would have taken the lease anew, and the request with it)
        assert refused
        assert [a["job"] for a in answer["admits"]] == ["train"] and answer["rerun"] is True
        assert env.job("train").status is JobState.ADMITTED


def test_a_failed_cycle_gives_back_an_admission_the_index_does_not_show_yet(monkeypatch):
    with emulation() as env:
        env.store.put_new(_pending_record("train", gpus=16))
        store = env.stack.deps().store
        stale_active = store.active("p5")
        # Given a plan step that admitted a job, then failed for good (no answer)
        first = env.stack.invoke_lambda(PLAN, {"pool": "p5", "owner": "schedule-x", "cycle": 0})
        assert [a["job"] for a in first["admits"]] == ["train"]
        # And the pool's index not yet showing the admission (it is eventually consistent)
        monkeypatch.setattr(store, "active", lambda pool: [r for r in stale_active if r.pool == pool])
        # When the workflow's failure path lets the cycle go
        finished = env.stack.invoke_lambda("preemptor-FinishCycleFunction", {"pool": "p5", "owner": "schedule-x", "cycle": 0})
        # Then the admission goes back to the queue at once, not half an hour later
        assert finished["released"] == ["train"]
        assert env.job("train").status is JobState.PENDING
        assert env.store.pool("p5")["used_gpus"] == 0
        # And every call of both steps is one their functions may make
        from iam_policy import StackPolicies

        assert StackPolicies.of(env.stack).denials(env.stack.calls.calls) == []


def _pending_record(name: str, gpus: int, pool: str = "p5") -> JobRecord:
    return JobRecord(
        name=name,
        team="research",
        priority=50,
        pool=pool,
        service="sagemaker",
        gpus=gpus,
        request={},
        checkpoint_s3_uri=f"s3://preemptor-checkpoints/checkpoints/{name}",
        submitted_at=0.0,
    )


# -- reconcile repairs every stuck state ----------------------------------------------------


def test_a_job_whose_pool_left_the_configuration_stays_pending_with_the_reason_logged_once():
    with emulation() as env:
        # Given a pool that was configured once and is no more, with a job waiting in it
        env.store.register_pool("retired")
        env.store.put_new(_pending_record("old", gpus=8, pool="retired"))
        # When reconcile runs, twice
        first = _reconcile(env)["repairs"]
        second = _reconcile(env)["repairs"]
        # Then the job is kept pending, its log says why, once
        assert {"job": "old", "pool": "retired", "repair": "pool-not-configured"} in first
        assert not [r for r in second if r.get("job") == "old"]
        assert env.job("old").status is JobState.PENDING
        assert env.kinds("old").count("pool-not-configured") == 1
        assert json.loads(env.store.pool("retired")["last_waits"])[0]["reason"] == "pool-not-configured"


def test_what_the_last_jobs_of_a_removed_pool_left_behind_is_still_folded_and_published():
    with emulation() as env:
        research = subscribe(env, "research-notices", {"team": ["research"]})
        # Given a pool that left the configuration while a job ran there: its run ended,
        # and its writer recorded the end and the team's notice but died before publishing it
        env.store.register_pool("retired")
        env.store.put_new(_pending_record("old", gpus=8, pool="retired"))
        record = env.job("old")
        now = env.clock.now()
        ended = EndedRun("retired", "research", "old", 1, 8, now - 3600, now)
        notice = Notice("retired", now, "failed", "old", "research", "Preemptor: job old failed", {"pool": "retired"})
        env.store.transition(record, record.with_changes(status=JobState.FAILED), [JobState.PENDING], ended_run=ended, notice=notice)
        # When reconcile runs, once the notice is past the grace its writer had to publish it
        env.clock.advance_to(now + 120)
        repairs = _reconcile(env)["repairs"]
        # Then the team is told, once, and the run's end is folded into the team's usage
        assert {"pool": "retired", "repair": "notice-published", "job": "old", "kind": "failed"} in repairs
        assert [n["attributes"]["kind"] for n in received(env, research)] == ["failed"]
        assert env.store.notices("retired") == [] and env.store.ended_runs("retired") == []
        [usage] = env.store.team_usage("retired", 86_400.0)
        assert usage.team == "research" and usage.gpu_seconds > 0


def _extra_training_job(env, name: str, tags: dict[str, str]) -> None:
    """A training job created behind the controller's back (a lost launch record, a stale
    incarnation, a run somebody else started), on the fleet like any other."""
    env.stack.client("sagemaker").create_training_job(
        TrainingJobName=name,
        AlgorithmSpecification={"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/t:1", "TrainingInputMode": "File"},
        RoleArn="arn:aws:iam::123456789012:role/preemptor-training",
        OutputDataConfig={"S3OutputPath": f"s3://{env.stack.parameters['CheckpointBucketName']}/out/"},
        ResourceConfig={"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50},
        StoppingCondition={"MaxRuntimeInSeconds": 36000},
        Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
    )


def test_reconcile_stops_a_managed_run_no_job_accounts_for_and_nothing_else():
    with emulation() as env:
        sagemaker = env.stack.client("sagemaker")
        # Given a job running as the controller launched it
        env.submit(name="train", team="research", priority=50, pool="p5", instances=2, duration=30000)
        assert env.job("train").status is JobState.RUNNING
        managed = {"preemptor:managed": "true", "preemptor:team": "research", "preemptor:pool": "p5"}
        # And managed runs tagged as the controller's that no job accounts for, and no
        # priority tag lets anyone adopt: one of an incarnation the job never reached, one
        # of a job the table does not know
        _extra_training_job(env, "train-stale", {**managed, "preemptor:job": "train", "preemptor:incarnation": "7"})
        _extra_training_job(env, "ghost", {**managed, "preemptor:job": "ghost", "preemptor:incarnation": "1"})
        # And a run the controller did not launch (no managed tag): not its to stop
        _extra_training_job(env, "foreign", {"owner": "someone-else"})

        # When reconcile runs while they are young (a launch may still be recording them)
        assert not [r for r in _reconcile(env)["repairs"] if r["repair"] == "unknown-run-stopped"]
        # And again once they are past the grace
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        repairs = [r for r in _reconcile(env)["repairs"] if r["repair"] == "unknown-run-stopped"]

        # Then exactly the two unaccounted managed runs were stopped, each with the reason
        assert sorted(r["run"] for r in repairs) == ["ghost", "train-stale"]
        assert {r["why"] for r in repairs} == {"the controller launched no such run"}
        assert "unknown-run-stopped" not in env.kinds("train")  # not a run of train's
        status = {n: sagemaker.describe_training_job(TrainingJobName=n)["TrainingJobStatus"] for n in ("train", "train-stale", "ghost", "foreign")}
        assert status["train"] == "InProgress" and status["foreign"] == "InProgress"
        assert status["train-stale"] in ("Stopping", "Stopped") and status["ghost"] in ("Stopping", "Stopped")
        # And the job the controller accounts for is untouched
        assert env.job("train").status is JobState.RUNNING


def test_one_bad_checkpoint_location_never_stops_the_reconcile_run():
    with emulation() as env:
        env.submit(name="a", team="research", priority=50, pool="p5", instances=2, duration=30000)
        env.submit(name="b", team="research", priority=50, pool="p5", instances=2, duration=30000)
        # Given a job whose checkpoint location names a bucket that does not exist
        store = env.store
        store.client.update_item(
            TableName=store.table,
            Key={"pk": {"S": "JOB#a"}, "sk": {"S": "JOB"}},
            UpdateExpression="SET checkpoint_s3_uri = :u",
            ExpressionAttributeValues={":u": {"S": "s3://no-such-bucket-anywhere/checkpoints/a"}},
        )
        # And another whose run ended without the end event reaching the controller
        from preemptor_tools.local.moto_patches.sagemaker import set_training_job_status

        set_training_job_status("b", "Completed", "Completed")
        # When reconcile runs
        result = _reconcile(env)
        # Then the bad location is an error of that job, and the other job is still repaired
        assert [(e["job"], e["error"]) for e in result["errors"]] == [("a", "CheckpointLocationUnavailable")]
        assert any(r.get("job") == "b" and r["repair"] == "missed-end" for r in result["repairs"])
        assert env.job("b").status is JobState.COMPLETED
        assert env.job("a").status is JobState.RUNNING


def test_a_jobs_check_refused_once_gets_a_second_look_in_the_same_pass():
    from preemptor_tools.local.moto_patches.sagemaker import set_training_job_status

    with emulation() as env:
        # Given a job whose run completed without the end event reaching the controller
        env.submit(name="b", team="research", priority=50, pool="p5", instances=2, duration=30000)
        set_training_job_status("b", "Completed", "Completed")
        # When reconcile runs and SageMaker throttles its first look at the run (through
        # every retry)
        sagemaker = env.stack.deps().runners["sagemaker"].client
        with aws_says_no(sagemaker, "DescribeTrainingJob", THROTTLING["sagemaker"], times=1) as said_no:
            result = _reconcile(env)
        # Then the job is read again and looked at once more at the end of the pool's jobs:
        # its end is recorded in this pass (before: 5 minutes later at best), with no error
        assert len(said_no) == 1
        assert any(r.get("job") == "b" and r["repair"] == "missed-end" for r in result["repairs"])
        assert result["errors"] == [] and env.job("b").status is JobState.COMPLETED


def test_reconcile_recounts_usage_that_drifted_under_the_lease():
    with emulation(pools=[P5]) as env:
        env.submit(name="a", team="research", priority=50, pool="p5", instances=2, duration=30000)
        # Given a pool whose usage drifted from its holders (16 GPUs held, 40 recorded)
        env.store.set_pool_usage("p5", 40)
        # When reconcile sees the same drift twice, a settle time apart
        _reconcile(env)
        env.advance(600)
        repairs = _reconcile(env)["repairs"]
        # Then usage is recounted (under the lease, which is given back)
        assert {"pool": "p5", "recount": "repaired", "rerun": False, "repair": "usage-recounted", "from": 40, "to": 16} in repairs
        assert env.store.pool("p5")["used_gpus"] == 16
        assert "lease_owner" not in env.store.pool("p5")


def test_a_lease_reconcile_took_without_hearing_so_is_given_back_and_the_next_plan_runs():
    with emulation(pools=[P5]) as env:
        env.submit(name="a", team="research", priority=50, pool="p5", instances=2, duration=30000)
        store = env.stack.deps().store
        # Given reconcile's taking of the lease for its recount applied, its answer lost
        # through every retry, and the read that would tell refused too
        with answer_lost_after_applied(store.client, "UpdateItem", when=is_lease_taking) as lost, aws_says_no(
            store.client, "GetItem", lambda p: THROTTLING["dynamodb"] if lost and p.get("Key", {}).get("sk", {}).get("S") == "POOL" else None, times=1
        ) as refused:
            # When reconcile runs
            result = _reconcile(env)
        assert lost == [1]
        # Then the recount is an error of the pool, and the lease is not left held by nobody
        assert any(e.get("pool") == "p5" for e in result["errors"]), result["errors"]
        assert "lease_owner" not in env.store.pool("p5")
        assert len(refused) == 1  # (the read that would have told was refused)
        # And a job submitted now is planned at once, not told that another run holds the pool
        env.submit(name="b", team="research", priority=50, pool="p5", instances=1, duration=600)
        assert env.job("b").status in (JobState.ADMITTED, JobState.RUNNING)


def test_a_launch_that_gives_up_goes_back_to_the_queue_after_a_backoff_not_after_reconciles_half_hour():
    with emulation() as env:
        sagemaker = env.stack.deps().runners["sagemaker"].client
        # Given SageMaker throttles CreateTrainingJob through every retry of the launch step
        # (its first attempt and six retries)
        with aws_says_no(sagemaker, "CreateTrainingJob", THROTTLING["sagemaker"], times=7) as refused:
            # When a job is admitted into the empty pool and launched
            env.submit(name="train", team="research", priority=50, pool="p5", instances=1, duration=3600)
        assert len(refused) == 7
        first = _executions(env, "ScheduleStateMachine")[0]
        assert first["status"] == "FAILED" and "Give the launch up" in env.states_visited(first["executionArn"])
        # Then the operators were told the launch gave up
        assert any("train" in a and "gave up" in a and "Throttled" in a for a in env.stack.alerts()), env.stack.alerts()
        # And the job went back to the queue at once, its GPUs released, behind a backoff,
        # not held ADMITTED until reconcile's stuck-admission release half an hour later
        history = env.store.history("train")
        [released] = [e for e in history if e["kind"] == "admission-released"]
        assert "gave up (Throttled)" in released["detail"]
        admitted = [e for e in history if e["kind"] == "admitted"][0]
        assert released["at"] - admitted["at"] < STUCK_ADMISSION_S / 3
        # And the schedule woke the pool once the backoff was over, which launched it: the
        # same incarnation (no run had been created), its give-ups forgotten
        [launched] = [e for e in history if e["kind"] == "launched"]
        assert launched["at"] >= released["at"] + 60
        job = env.job("train")
        assert job.status is JobState.RUNNING and job.incarnation == 1 and job.launches_given_up == 0
        assert env.store.pool("p5")["used_gpus"] == 8
        names = [j["TrainingJobName"] for j in sagemaker.list_training_jobs()["TrainingJobSummaries"]]
        assert names == ["train"]


def test_a_launch_that_gives_up_after_creating_its_run_records_that_run_rather_than_queueing_the_job_again():
    with emulation() as env:
        sagemaker = env.stack.deps().runners["sagemaker"].client
        # Given the launch's CreateTrainingJob is applied but its answer lost, and SageMaker
        # then throttles the look-up of the name in use through every retry of the step
        with answer_lost_after_applied(sagemaker, "CreateTrainingJob") as lost, aws_says_no(
            sagemaker, "DescribeTrainingJob", THROTTLING["sagemaker"], times=6
        ) as refused:
            env.submit(name="train", team="research", priority=50, pool="p5", instances=1, duration=3600)
        assert lost and len(refused) == 6
        # Then giving the launch up found the run it had created and recorded it: one run,
        # the job running on it, its GPUs still counted, never queued to be launched again
        job = env.job("train")
        assert job.status is JobState.RUNNING and job.run_name == "train" and job.incarnation == 1
        names = [j["TrainingJobName"] for j in sagemaker.list_training_jobs()["TrainingJobSummaries"]]
        assert names == ["train"]
        kinds = env.kinds("train")
        assert "admission-released" not in kinds and kinds.count("launched") == 1
        [launched] = [e for e in env.store.history("train") if e["kind"] == "launched"]
        assert launched["reason"] == "stuck-admission-recorded"
        assert env.store.pool("p5")["used_gpus"] == 8
        first = _executions(env, "ScheduleStateMachine")[0]
        assert "Give the launch up" in env.states_visited(first["executionArn"])


def test_a_stop_at_once_of_a_job_trusted_to_save_on_sigterm_is_told_so_not_as_an_aged_checkpoint():
    from preemptor.core.jobs import SAVES_ON_STOP_LABEL

    with emulation() as env:
        # Given a victim seen to save on SIGTERM (and declaring it), its last checkpoint 1,000 s
        # of work old, that the plan said to stop at once: its check answers "fresh" (the
        # checkpoint comes with the stop)
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=30000)
        env.advance(1200)
        sweep, now = env.job("sweep"), env.clock.now()
        env.store.transition(
            sweep,
            sweep.with_changes(
                status=JobState.PREEMPTING, preempted_by="prod", preempting_since=now, last_checkpoint_at=now - 1000,
                stop_at_once=True, saved_on_stop=True, labels={**sweep.labels, SAVES_ON_STOP_LABEL: "true"},
            ),
            [JobState.RUNNING],
        )
        step = {"action": "stop", "job": "sweep", "incarnation": 1, "fresh": True, "since": now}
        assert env.stack.invoke_lambda(env.stack.resources["JobControlFunction"], step) == {"stopping": True, "fresh": False}
        # Then its line says why it went at once (before: "checkpoint-aged", a checkpoint
        # "fresh when checked" it never had, and "work since the last one is lost")
        [line] = [e for e in env.store.history("sweep") if e["kind"] == "stop-requested"]
        assert line["reason"] == "stop-at-once"
        assert line["detail"].endswith("WITHOUT a fresh checkpoint: it is trusted to save on SIGTERM within the grace")


@pytest.mark.parametrize("checkpoint_age_s, told", [(100, "fresh-checkpoint"), (1000, "checkpoint-aged")])
def test_a_stop_step_that_comes_late_judges_the_checkpoint_again(checkpoint_age_s, told):
    emitted: list[dict] = []
    with emulation(metrics=emitted) as env:
        # Given a job being preempted whose workflow found its checkpoint fresh, and whose
        # stop step comes when that checkpoint is `checkpoint_age_s` of work old (a step
        # throttled and retried for minutes)
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=30000)
        env.advance(1200)
        sweep = env.job("sweep")
        now = env.clock.now()
        env.store.transition(
            sweep,
            sweep.with_changes(status=JobState.PREEMPTING, preempted_by="prod", preempting_since=now, last_checkpoint_at=now - checkpoint_age_s),
            [JobState.RUNNING],
        )
        # When the stop step runs with the check's "fresh"
        step = {"action": "stop", "job": "sweep", "incarnation": 1, "fresh": True, "since": now}
        result = env.stack.invoke_lambda(env.stack.resources["JobControlFunction"], step)
        # Then the stop goes, told as it is: fresh within checkpoint_max_age_s (900 s), else
        # aged past it and counted as a stop without a fresh checkpoint
        assert result == {"stopping": True, "fresh": told == "fresh-checkpoint"}
        [line] = [e for e in env.store.history("sweep") if e["kind"] == "stop-requested"]
        assert line["reason"] == told
        unfresh = sum(sum(v) if isinstance(v := d["StopsWithoutFreshCheckpoint"], list) else v for d in emitted if "StopsWithoutFreshCheckpoint" in d)
        assert unfresh == (0 if told == "fresh-checkpoint" else 1)
        # And the requeue with the check's "fresh" counts the stop as it went (before: fresh, as checked)
        requeue = {"action": "requeue", "job": "sweep", "incarnation": 1, "fresh": True, "phase": "stopped"}
        assert env.stack.invoke_lambda(env.stack.resources["JobControlFunction"], requeue)["requeued"] is True
        [requeued] = [e for e in env.store.history("sweep") if e["kind"] == "requeued"]
        assert requeued["extra"]["fresh_checkpoint"] is (told == "fresh-checkpoint")
        assert env.job("sweep").stops_without_fresh_checkpoint == (0 if told == "fresh-checkpoint" else 1)
