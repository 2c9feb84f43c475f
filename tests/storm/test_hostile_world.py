"""The hostile emulator says no the way AWS does: each failure's shape, scope and seed.

One emulated stack serves the module; each test sets the world's rates and faults it needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from emulation import START, Emulation, emulation, team_training_job
from storm import steps

from preemptor.handlers.wiring import CLIENT_CONFIG
from preemptor_tools.local.executions import wait_for_execution
from preemptor_tools.local.hostile import HostileWorld
from preemptor_tools.local.scenario import Chaos, StopDenied, WorkflowCrash
from preemptor_tools.local.stack import DeployedFunction, _empty_zip

ALWAYS = 0.999  # rates are < 1: "always" is as close as a rate gets


@pytest.fixture(scope="module")
def env() -> Iterator[Emulation]:
    with emulation(hostile=lambda clock: HostileWorld(clock, START)) as emulated:
        yield emulated


@pytest.fixture
def world(env: Emulation) -> Iterator[HostileWorld]:
    world = env.stack.hostile
    yield world
    world.chaos = Chaos()
    world.faults = []


def _code(error: ClientError) -> tuple[str, int]:
    return error.response["Error"]["Code"], error.response["ResponseMetadata"]["HTTPStatusCode"]


THROTTLED_CALLS = [
    ("dynamodb", "list_tables", {}, {("ThrottlingException", 400), ("ProvisionedThroughputExceededException", 400)}),
    ("sagemaker", "list_training_jobs", {}, {("ThrottlingException", 400)}),
    ("batch", "describe_job_queues", {}, {("TooManyRequestsException", 429)}),
    ("s3", "list_buckets", {}, {("SlowDown", 503)}),
    ("stepfunctions", "list_state_machines", {}, {("ThrottlingException", 400)}),
    ("sns", "list_topics", {}, {("Throttled", 429)}),
    ("ec2", "describe_regions", {}, {("RequestLimitExceeded", 503)}),
    ("lambda", "list_functions", {}, {("TooManyRequestsException", 429)}),
]


@pytest.mark.parametrize(
    "service,operation,params,expected", THROTTLED_CALLS, ids=[c[0] for c in THROTTLED_CALLS]
)
def test_a_throttled_call_fails_with_its_services_own_throttling_error(
    env: Emulation, world: HostileWorld, service: str, operation: str, params: dict, expected: set
) -> None:
    # Given a world that throttles every call
    world.chaos = Chaos(seed=1, throttle_rate=ALWAYS)
    client = env.stack.session.client(service, config=CLIENT_CONFIG)  # the functions' retries: three attempts

    # When a function calls the service
    with HostileWorld.acting_as("preemptor-ScheduleFunction"), pytest.raises(ClientError) as raised:
        getattr(client, operation)(**params)

    # Then it sees the service's throttling error, as botocore raises it from the service's
    # own wire format, once its retries ran out (SNS's throttle is one botocore does not retry)
    assert _code(raised.value) in expected
    retried = raised.value.response["ResponseMetadata"]["RetryAttempts"]
    assert retried == (0 if service == "sns" else client.meta.config.retries["total_max_attempts"] - 1)
    # And the harness (no function acting) is never throttled: the world targets the controller
    getattr(client, operation)(**params)


def test_each_function_spends_its_own_retry_quota_through_the_clients_they_share(env: Emulation, world: HostileWorld) -> None:
    dynamodb = env.stack.deps().store.client  # one client, as every function's handler uses it here
    # Given a function whose calls are throttled until botocore's retry quota for them is
    # spent (500 tokens, 5 a retry: fifty calls of two retries each)
    world.chaos = Chaos(seed=3, throttle_rate=ALWAYS)
    retried = []
    with HostileWorld.acting_as("preemptor-DrainedFunction"):
        for _ in range(60):
            with pytest.raises(ClientError) as raised:
                dynamodb.list_tables()
            retried.append(raised.value.response["ResponseMetadata"]["RetryAttempts"])
    # Then its calls were retried, and then no more: the quota is a circuit breaker
    assert retried[0] == 2 and retried[-1] == 0
    # And another function's calls through the same client are still retried, as its own
    # containers' clients would be on AWS
    with HostileWorld.acting_as("preemptor-OtherFunction"), pytest.raises(ClientError) as raised:
        dynamodb.list_tables()
    assert raised.value.response["ResponseMetadata"]["RetryAttempts"] == 2


def test_a_throttled_attempt_is_not_carried_out_and_botocore_sends_it_again(env: Emulation, world: HostileWorld) -> None:
    dynamodb = env.store.client  # the functions' client: botocore's standard retries, three attempts
    table = env.stack.deps().settings.jobs_table
    add = {"TableName": table, "Key": {"pk": {"S": "THROTTLED#1"}, "sk": {"S": "X"}}, "UpdateExpression": "ADD n :one",
           "ExpressionAttributeValues": {":one": {"N": "1"}}}
    # Given, for some seed, a write whose first attempt is throttled and whose second is not
    for seed in range(64):
        world.chaos = Chaos(seed=seed, throttle_rate=0.5)
        before = world.counts().get("throttle", 0)
        with HostileWorld.acting_as("preemptor-PlanFunction"):
            try:
                answer = dynamodb.update_item(**add, ReturnValues="UPDATED_NEW")
            except ClientError:
                answer = None  # every attempt throttled: not the case sought
        if answer is not None and world.counts()["throttle"] - before == 1:
            break
    else:
        pytest.fail("no seed in 64 throttled exactly one attempt of a call that went through")
    # Then the caller sees the second attempt's answer, and DynamoDB carried the write out
    # once: the throttled attempt never reached it
    assert answer["ResponseMetadata"]["RetryAttempts"] == 1
    assert answer["Attributes"]["n"] == {"N": "1"}
    assert _counter(env, "THROTTLED#1") == 1


def test_a_transaction_is_cancelled_with_one_item_in_transaction_conflict(env: Emulation, world: HostileWorld) -> None:
    # Given a world whose DynamoDB cancels every transaction as conflicting
    world.chaos = Chaos(seed=2, transaction_conflict_rate=ALWAYS)
    dynamodb = env.stack.client("dynamodb")
    table = env.stack.deps().settings.jobs_table
    items = [{"Put": {"TableName": table, "Item": {"pk": {"S": f"STORM#{i}"}, "sk": {"S": "X"}}}} for i in range(3)]

    # When a function writes a transaction
    with HostileWorld.acting_as("preemptor-PlanFunction"), pytest.raises(ClientError) as raised:
        dynamodb.transact_write_items(TransactItems=items)

    # Then DynamoDB's cancellation names one conflicting item and writes nothing
    assert _code(raised.value)[0] == "TransactionCanceledException"
    reasons = [r["Code"] for r in raised.value.response["CancellationReasons"]]
    assert sorted(reasons) == ["None", "None", "TransactionConflict"]
    assert dynamodb.get_item(TableName=table, Key={"pk": {"S": "STORM#0"}, "sk": {"S": "X"}}).get("Item") is None


def test_stops_of_runs_the_controller_did_not_launch_are_refused(env: Emulation, world: HostileWorld) -> None:
    # Given a run someone launched with the scheduler's tags but not the managed tag, and one
    # the controller launched
    team_training_job(env, "adopted-run", {"preemptor:team": "vision", "preemptor:priority": "50"})
    team_training_job(env, "managed-run", {"preemptor:managed": "true", "preemptor:job": "managed-run", "preemptor:controller": "preemptor"})
    # and one of a second stack in the account (its name on the run)
    team_training_job(env, "staging-run", {"preemptor:managed": "true", "preemptor:job": "x", "preemptor:controller": "preemptor-staging"})
    sagemaker = env.stack.client("sagemaker")

    # When the controller stops all three
    refusals = {}
    with HostileWorld.acting_as("preemptor-JobControlFunction"):
        for run in ("adopted-run", "staging-run"):
            with pytest.raises(ClientError) as refused:
                sagemaker.stop_training_job(TrainingJobName=run)
            refusals[run] = refused.value
        sagemaker.stop_training_job(TrainingJobName="managed-run")

    # Then IAM's conditions refuse the first two only, and every attempt is on record
    for run, error in refusals.items():
        assert _code(error) == ("AccessDeniedException", 400)
        assert "sagemaker:StopTrainingJob" in error.response["Error"]["Message"]
        assert sagemaker.describe_training_job(TrainingJobName=run)["TrainingJobStatus"] == "InProgress"
    assert sagemaker.describe_training_job(TrainingJobName="managed-run")["TrainingJobStatus"] == "Stopping"
    attempts = {a.run: a for a in world.stops}
    assert attempts["adopted-run"].refused and not attempts["adopted-run"].managed
    assert attempts["staging-run"].refused == "another stack's run (preemptor:controller=preemptor-staging)"
    assert attempts["managed-run"].refused is None


def test_stop_denied_refuses_every_run_of_the_job_for_its_duration_only(env: Emulation, world: HostileWorld) -> None:
    # Given two managed runs of job "victim" and a stop_denied fault on it from now for 600 s
    elapsed = env.clock.now() - START
    world.faults = [StopDenied(type="stop_denied", at=elapsed, job="victim", duration=600)]
    team_training_job(env, "victim-r2", {"preemptor:managed": "true"})
    team_training_job(env, "victim-r3", {"preemptor:managed": "true"})
    sagemaker = env.stack.client("sagemaker")

    # When the controller stops one during the window and the other after it
    with HostileWorld.acting_as("preemptor-JobControlFunction"):
        with pytest.raises(ClientError) as denied:
            sagemaker.stop_training_job(TrainingJobName="victim-r2")
        env.clock.advance(600)
        sagemaker.stop_training_job(TrainingJobName="victim-r3")

    # Then the first is AccessDenied and the second goes through
    assert _code(denied.value)[0] == "AccessDeniedException"
    assert sagemaker.describe_training_job(TrainingJobName="victim-r3")["TrainingJobStatus"] == "Stopping"


def test_events_arrive_twice_and_late_but_every_one_arrives(env: Emulation, world: HostileWorld) -> None:
    # Given a world that duplicates and delays half the events
    world.chaos = Chaos(seed=3, duplicate_rate=0.5, reorder_rate=0.5)
    delivered: list[str] = []
    events = [{"id": f"storm-{i}", "source": "test.storm", "detail-type": "Ping", "detail": {}} for i in range(40)]

    # When 40 events are emitted in two rounds, each round then pumped, and a last empty round
    for batch in (events[:20], events[20:], []):
        for event in batch:
            env.stack.emit(dict(event))
        env.stack.pump(lambda routed: delivered.append(routed.event["id"]))
    env.stack.pump(lambda routed: delivered.append(routed.event["id"]))

    # Then every event arrived, some twice (same id), and some after events emitted later
    # (the fleet's own events of the runs other tests made are in the stream too)
    delivered = [event_id for event_id in delivered if event_id.startswith("storm-")]
    ids = [e["id"] for e in events]
    assert set(delivered) == set(ids)
    assert len(delivered) > len(ids)
    position = {event_id: delivered.index(event_id) for event_id in ids}
    assert any(position[a] > position[b] for a, b in zip(ids, ids[1:]))
    assert world.counts()["event-duplicate"] > 0 and world.counts()["event-late"] > 0


def test_the_same_seed_makes_the_same_decisions() -> None:
    # Given two worlds with one seed and a third with another
    from preemptor_tools.local.clock import SimClock

    worlds = [HostileWorld(SimClock(START), START, chaos=Chaos(seed=seed)) for seed in (7, 7, 8)]

    # When each draws the same sequence of decisions
    draws = [[w._draw("throttle", f"fn|dynamodb|{i % 3}") for i in range(50)] for w in worlds]

    # Then the first two agree draw for draw, and the third does not
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def _two_step_workflow(env: Emulation, name: str) -> str:
    """A workflow of two Lambda steps of the `storm.steps.record` function, errors caught."""
    stack = env.stack
    function = f"{name}-steps"
    arn = stack.client("lambda").create_function(
        FunctionName=function,
        Runtime="python3.11",
        Role="arn:aws:iam::123456789012:role/preemptor-local-role",
        Handler="storm.steps.record",
        Code={"ZipFile": _empty_zip()},
    )["FunctionArn"]
    stack.functions[function] = DeployedFunction(function, arn, "storm.steps.record", {})
    step = lambda n, next_: {  # noqa: E731
        "Type": "Task",
        "Resource": arn,
        "Parameters": {"step": n},
        "ResultPath": f"$.step{n}",
        "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Failed"}],
        **({"Next": next_} if next_ else {"End": True}),
    }
    definition = {
        "StartAt": "First",
        "States": {"First": step(1, "Second"), "Second": step(2, None), "Failed": {"Type": "Pass", "End": True}},
    }
    return stack.client("stepfunctions").create_state_machine(
        name=name, definition=json.dumps(definition), roleArn="arn:aws:iam::123456789012:role/x"
    )["stateMachineArn"]


def _run(env: Emulation, machine: str, name: str) -> dict:
    sfn = env.stack.client("stepfunctions")
    started = sfn.start_execution(stateMachineArn=machine, name=name, input="{}")
    return wait_for_execution(sfn, started["executionArn"])


def test_a_crashed_step_did_its_work_and_step_functions_sees_lambda_unknown(env: Emulation, world: HostileWorld) -> None:
    # Given a world where every workflow step's Lambda dies before returning
    world.chaos = Chaos(seed=4, crash_rate=ALWAYS)
    machine = _two_step_workflow(env, "crashing")
    steps.CALLS.clear()

    # When the workflow runs
    result = _run(env, machine, "crashing-1")

    # Then the first step ran (its work is done) but Step Functions saw Lambda.Unknown
    assert steps.CALLS == [{"step": 1}]
    assert json.loads(result["output"])["error"]["Error"] == "Lambda.Unknown"


def test_a_workflow_crash_kills_the_next_execution_after_its_first_step(env: Emulation, world: HostileWorld) -> None:
    # Given a workflow_crash fault due now
    world.faults = [WorkflowCrash(type="workflow_crash", at=env.clock.now() - START)]
    machine = _two_step_workflow(env, "doomed")
    steps.CALLS.clear()

    # When two executions run one after the other
    first = _run(env, machine, "doomed-1")
    second = _run(env, machine, "doomed-2")

    # Then the first died after its first step (ABORTED), and the fault hit only once
    assert first["status"] == "ABORTED"
    assert second["status"] == "SUCCEEDED"
    assert steps.CALLS == [{"step": 1}, {"step": 1}, {"step": 2}]
    assert world.aborted_executions == [first["executionArn"]]



def _queued(name: str, pool: str = "lagging", gpus: int = 8):
    from preemptor.core.jobs import JobRecord

    return JobRecord(name=name, team="t", priority=50, pool=pool, service="sagemaker", gpus=gpus, request={},
                     checkpoint_s3_uri=f"s3://b/{name}", submitted_at=0.0)


def test_a_query_of_the_pools_index_answers_as_the_index_stood_a_moment_ago(env: Emulation, world: HostileWorld) -> None:
    from preemptor.core.model import JobState

    store = env.store
    # Given two jobs queued a while ago, one of them admitted since
    old, moved = store.put_new(_queued("queued-old")), store.put_new(_queued("queued-moved"))
    assert old and moved
    env.clock.advance(5)
    # And, this very moment, a job submitted and the other one admitted (its status leaves
    # the pending partition of the index for the active one)
    world.chaos = Chaos(seed=3, index_lag_rate=ALWAYS)
    store.put_new(_queued("queued-new"))
    record = store.require("queued-moved")
    store.transition(record, record.with_changes(status=JobState.ADMITTED), [JobState.PENDING])

    # When a function reads the pool's queue and active jobs now, and again a moment later
    with HostileWorld.acting_as("preemptor-PlanFunction"):
        pending_now, active_now = [r.name for r in store.pending("lagging", 10)], [r.name for r in store.active("lagging")]
        env.clock.advance(2)
        pending_later, active_later = [r.name for r in store.pending("lagging", 10)], [r.name for r in store.active("lagging")]

    # Then it first sees the index as it stood before those writes, then as it is
    assert sorted(pending_now) == ["queued-moved", "queued-old"] and active_now == []
    assert sorted(pending_later) == ["queued-new", "queued-old"] and active_later == ["queued-moved"]
    assert world.counts().get("index-lag", 0) >= 2
    # And the harness, and any read of an item itself, see the table as it is
    assert sorted(r.name for r in store.pending("lagging", 10)) == ["queued-new", "queued-old"]
    with HostileWorld.acting_as("preemptor-PlanFunction"):
        assert store.get("queued-moved").status is JobState.ADMITTED


def test_a_lagging_index_keeps_its_order_and_its_page_size_and_shows_a_deleted_item(env: Emulation, world: HostileWorld) -> None:
    store = env.store
    # Given three jobs queued a while ago (the index orders them by rank)
    for name in ("rank-a", "rank-b", "rank-c"):
        store.put_new(_queued(name, pool="ranked"))
    env.clock.advance(5)
    expected = [r.name for r in store.pending("ranked", 10)]
    # And, this very moment, the first of them deleted (a cancelled job's item, say)
    world.chaos = Chaos(seed=4, index_lag_rate=ALWAYS)
    dynamodb = env.stack.client("dynamodb")
    table = env.stack.deps().settings.jobs_table
    dynamodb.delete_item(TableName=table, Key={"pk": {"S": f"JOB#{expected[0]}"}, "sk": {"S": "JOB"}})

    # When a function reads the first two of the queue
    with HostileWorld.acting_as("preemptor-PlanFunction"):
        first_two = dynamodb.query(TableName=table, IndexName="ByPoolStatus", KeyConditionExpression="gsi1pk = :p",
                                   ExpressionAttributeValues={":p": {"S": "ranked#PENDING"}}, Limit=2)

    # Then it sees the deleted job still, in the index's order, two of them, and where to go on
    assert [i["pk"]["S"] for i in first_two["Items"]] == [f"JOB#{n}" for n in expected[:2]]
    assert first_two["Count"] == 2 and first_two["LastEvaluatedKey"]["pk"] == {"S": f"JOB#{expected[1]}"}


def _counter(env: Emulation, key: str) -> int:
    item = env.stack.client("dynamodb").get_item(
        TableName=env.stack.deps().settings.jobs_table, Key={"pk": {"S": key}, "sk": {"S": "X"}}, ConsistentRead=True
    ).get("Item")
    return int(item["n"]["N"]) if item else 0


def test_an_answer_lost_after_the_call_was_carried_out_is_sent_again_by_botocore(env: Emulation, world: HostileWorld) -> None:
    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

    # Given a world that loses every answer, after AWS carried the call out
    world.chaos = Chaos(seed=5, answer_lost_rate=ALWAYS)
    lost_before = world.counts().get("answer-lost", 0)
    dynamodb = env.store.client  # the functions' client: botocore's standard retries, three attempts
    table = env.stack.deps().settings.jobs_table
    add = {"TableName": table, "Key": {"pk": {"S": "LOST#1"}, "sk": {"S": "X"}}, "UpdateExpression": "ADD n :one",
           "ExpressionAttributeValues": {":one": {"N": "1"}}}

    # When a function adds one to a counter (a write that is not idempotent)
    with HostileWorld.acting_as("preemptor-PlanFunction"), pytest.raises((ReadTimeoutError, ConnectionClosedError)):
        dynamodb.update_item(**add)

    # Then botocore sent it three times, and each was carried out, as on AWS; the caller saw
    # only that no answer came
    assert _counter(env, "LOST#1") == 3
    assert world.counts()["answer-lost"] - lost_before == 3
    # And the harness's own calls are answered
    dynamodb.update_item(**add)
    assert _counter(env, "LOST#1") == 4


def test_a_conditional_write_whose_answer_was_lost_is_refused_on_its_own_first_write(env: Emulation, world: HostileWorld) -> None:
    dynamodb = env.store.client
    table = env.stack.deps().settings.jobs_table
    # Given, for some seed, a put whose first answer is lost and whose second is not
    for seed in range(64):
        world.chaos = Chaos(seed=seed, answer_lost_rate=0.5)
        before = world.counts().get("answer-lost", 0)
        key = {"pk": {"S": f"ONCE#{seed}"}, "sk": {"S": "X"}}
        with HostileWorld.acting_as("preemptor-IntakeFunction"):
            try:
                dynamodb.put_item(TableName=table, Item=key, ConditionExpression="attribute_not_exists(pk)")
                answer = "written"
            except ClientError as e:
                answer = e.response["Error"]["Code"]
            except Exception as e:  # noqa: BLE001 - every attempt lost: not the case sought
                answer = type(e).__name__
        if world.counts()["answer-lost"] - before == 1:
            break
    else:
        pytest.fail("no seed in 64 lost exactly one answer")
    # Then the caller sees the second attempt's answer: its condition failed, on the item
    # its own first attempt wrote (what DynamoDB answers; the caller must look before it
    # concludes someone else wrote it)
    assert answer == "ConditionalCheckFailedException"
    assert "Item" in dynamodb.get_item(TableName=table, Key=key, ConsistentRead=True)


def test_a_transaction_sent_again_with_its_token_is_carried_out_once(env: Emulation, world: HostileWorld) -> None:
    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

    # Given a world that loses every answer
    world.chaos = Chaos(seed=6, answer_lost_rate=ALWAYS)
    lost_before = world.counts().get("answer-lost", 0)
    dynamodb = env.store.client
    table = env.stack.deps().settings.jobs_table

    def add(key: str) -> list[dict]:
        return [{"Update": {"TableName": table, "Key": {"pk": {"S": key}, "sk": {"S": "X"}}, "UpdateExpression": "ADD n :one",
                            "ExpressionAttributeValues": {":one": {"N": "1"}}}}]

    # When a function's transaction is sent three times (botocore's retries, one token)
    with HostileWorld.acting_as("preemptor-PlanFunction"), pytest.raises((ReadTimeoutError, ConnectionClosedError)):
        dynamodb.transact_write_items(TransactItems=add("TOKEN#1"))
    # Then DynamoDB carried it out once: the resends had its ClientRequestToken
    assert world.counts()["answer-lost"] - lost_before == 3
    assert _counter(env, "TOKEN#1") == 1

    # And with a token of the caller's: the same request again succeeds and writes nothing
    world.chaos = Chaos()
    dynamodb.transact_write_items(TransactItems=add("TOKEN#2"), ClientRequestToken="token-2")
    dynamodb.transact_write_items(TransactItems=add("TOKEN#2"), ClientRequestToken="token-2")
    assert _counter(env, "TOKEN#2") == 1
    # and another request with that token is refused, as DynamoDB refuses it
    with pytest.raises(ClientError) as raised:
        dynamodb.transact_write_items(TransactItems=add("TOKEN#3"), ClientRequestToken="token-2")
    assert raised.value.response["Error"]["Code"] == "IdempotentParameterMismatchException"
    assert _counter(env, "TOKEN#3") == 0
    # And ten minutes later the token is forgotten: the same request is a new one
    env.clock.advance(601)
    dynamodb.transact_write_items(TransactItems=add("TOKEN#2"), ClientRequestToken="token-2")
    assert _counter(env, "TOKEN#2") == 2
