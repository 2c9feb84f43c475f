"""The emulated AWS: simulated clock, moto patches and simulated fleet.

Each test runs in its own `mock_aws(config=MOTO_CONFIG)` with the patches installed on a fresh
SimClock. Nothing sleeps for real: simulated waits advance the SimClock, and executions are
awaited with `wait_for_execution` (which only polls moto's execution thread).
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import threading
import time
import logging
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from preemptor import clock as clock_module
from preemptor.adapters.runners import SageMakerRunner
from preemptor_tools.local import moto_patches
from preemptor_tools.local.clock import SimClock
from preemptor_tools.local.executions import running_executions, wait_for_execution
from preemptor_tools.local.fleet import SimulatedFleet
from preemptor_training.s3 import S3Location, S3Mirror

START = 1_700_000_000.0  # 2023-11-14T22:13:20Z
REGION = "us-east-1"
ACCOUNT_ID = "123456789012"  # moto's default account
BUCKET = "preemptor-test-checkpoints"
EVENT_SAMPLES = Path("/work/shared/data/events")
SAGEMAKER_SAMPLE = (
    EVENT_SAMPLES
    / "sagemaker/amazon-sagemaker-developer-g__sagemaker-training-job-state-change__8a0a8aaf.json"
)
BATCH_SAMPLE = EVENT_SAMPLES / "batch/aws-batch-user-guide__batch-job-state-change__e31f552e.json"


class CheckpointNotReady(Exception):
    """Stands in for the domain error a handler raises while a victim has no fresh checkpoint."""


# --------------------------------------------------------------------------- fixtures


@dataclass
class Emulation:
    clock: SimClock
    handlers: dict[str, Callable[[dict], Any]]
    role_arn: str
    events: list[dict] = field(default_factory=list)

    def client(self, service: str) -> Any:
        return boto3.client(service, region_name=REGION)

    def fleet(self, **kwargs: Any) -> SimulatedFleet:
        """A fleet whose job events these tests read; S3 events are off unless asked for."""
        ids = (f"event-{n}" for n in itertools.count(1))
        kwargs.setdefault("s3_events", False)
        return SimulatedFleet(
            self.clock, self.client("s3"), self.events.append, id_factory=lambda: next(ids), **kwargs
        )


@pytest.fixture
def emulation(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulation]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    clock = SimClock(START)
    handlers: dict[str, Callable[[dict], Any]] = {}

    def invoke(function_name: str, event: dict) -> Any:
        return handlers[function_name](event)

    moto_patches.install(clock, invoke)
    previous_clock = clock_module.use_clock(clock)
    try:
        with mock_aws(config=moto_patches.MOTO_CONFIG):
            iam = boto3.client("iam", region_name=REGION)
            role = iam.create_role(RoleName="preemptor-test", AssumeRolePolicyDocument="{}")
            boto3.client("s3", region_name=REGION).create_bucket(Bucket=BUCKET)
            yield Emulation(clock, handlers, role["Role"]["Arn"])
    finally:
        clock_module.use_clock(previous_clock)
        moto_patches.uninstall()


def _dummy_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("app.py", "def handler(event, context):\n    raise RuntimeError('not run')\n")
    return buffer.getvalue()


def create_function(env: Emulation, name: str, handler: Callable[[dict], Any]) -> str:
    env.handlers[name] = handler
    created = env.client("lambda").create_function(
        FunctionName=name,
        Runtime="python3.11",
        Role=env.role_arn,
        Handler=f"preemptor.handlers.{name}.handler",
        Code={"ZipFile": _dummy_zip()},
    )
    return created["FunctionArn"]


def run_state_machine(env: Emulation, name: str, definition: dict, payload: dict | None = None) -> dict:
    sfn = env.client("stepfunctions")
    arn = sfn.create_state_machine(
        name=name, roleArn=env.role_arn, definition=json.dumps(definition)
    )["stateMachineArn"]
    started = sfn.start_execution(
        stateMachineArn=arn, name=f"{name}-run-1", input=json.dumps(payload or {})
    )
    return wait_for_execution(sfn, started["executionArn"])


def history(env: Emulation, description: dict) -> list[dict]:
    return env.client("stepfunctions").get_execution_history(
        executionArn=description["executionArn"]
    )["events"]


def create_training_job(env: Emulation, name: str, environment: dict[str, str], prefix: str) -> str:
    return env.client("sagemaker").create_training_job(
        TrainingJobName=name,
        AlgorithmSpecification={"TrainingImage": "123.dkr.ecr/train:1", "TrainingInputMode": "File"},
        RoleArn=env.role_arn,
        OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/output"},
        ResourceConfig={"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100},
        StoppingCondition={"MaxRuntimeInSeconds": 86_400},
        Environment=environment,
        CheckpointConfig={"S3Uri": f"s3://{BUCKET}/{prefix}"},
        Tags=[{"Key": "preemptor:team", "Value": "vision"}],
    )["TrainingJobArn"]


def checkpoints(env: Emulation, prefix: str) -> list[tuple[str, float]]:
    """(step directory, manifest time) of the complete checkpoints under `prefix`, found as
    the training helper finds them, oldest first."""
    mirror = S3Mirror(S3Location(BUCKET, prefix), client=env.client("s3"))
    return sorted((f"{prefix}/{m.path}", m.time) for m in mirror.complete()[0])


def request_checkpoint(env: Emulation, prefix: str) -> None:
    env.client("s3").put_object(
        Bucket=BUCKET,
        Key=f"{prefix}/_preemptor/checkpoint-request.json",
        Body=json.dumps({"requested_at": env.clock.now(), "reason": "preemption"}).encode(),
    )


def batch_queue(env: Emulation) -> tuple[str, str]:
    """What moto's Batch needs before SubmitJob: compute environment, queue, job definition."""
    batch = env.client("batch")
    compute = batch.create_compute_environment(
        computeEnvironmentName="gpu-ce", type="UNMANAGED", state="ENABLED", serviceRole=env.role_arn
    )
    queue = batch.create_job_queue(
        jobQueueName="gpu-queue",
        state="ENABLED",
        priority=1,
        computeEnvironmentOrder=[{"order": 1, "computeEnvironment": compute["computeEnvironmentArn"]}],
    )
    definition = batch.register_job_definition(
        jobDefinitionName="trainer",
        type="container",
        containerProperties={"image": "trainer:1", "vcpus": 8, "memory": 65_536},
    )
    return queue["jobQueueArn"], definition["jobDefinitionArn"]


def sample_keys(path: Path) -> tuple[set[str], set[str]]:
    sample = json.loads(path.read_text())
    return set(sample), set(sample["detail"])


def at(offset: float) -> str:
    return datetime.fromtimestamp(START + offset, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- clock


def test_sim_clock_only_moves_forward_and_notifies_listeners_in_order() -> None:
    # Given a clock with two listeners
    clock = SimClock(START)
    calls: list[tuple[str, float, float]] = []
    clock.on_advance(lambda old, new: calls.append(("first", old, new)))
    clock.on_advance(lambda old, new: calls.append(("second", old, new)))

    # When it advances, is asked to go back, then advances by a duration
    clock.advance_to(START + 10)
    clock.advance_to(START + 5)
    clock.advance(2.5)

    # Then time never went back and each move was reported to both, in registration order
    assert clock.now() == START + 12.5
    assert calls == [
        ("first", START, START + 10),
        ("second", START, START + 10),
        ("first", START + 10, START + 12.5),
        ("second", START + 10, START + 12.5),
    ]


def test_pinned_clock_reports_the_pinned_time_in_this_thread_only() -> None:
    # Given a clock at +100
    clock = SimClock(START + 100)

    # When a block runs pinned to +40
    with clock.pinned(START + 40):
        inside = clock.now()

    # Then the block saw +40 and the clock is back at +100 afterwards
    assert (inside, clock.now()) == (START + 40, START + 100)


def test_an_advance_during_a_hold_is_parked_until_the_hold_ends() -> None:
    # Given a held clock and another thread that wants 5 s to pass (a Wait state)
    clock = SimClock(START)
    done = threading.Event()
    with clock.held():
        waiter = threading.Thread(target=lambda: (clock.advance(5), done.set()))
        waiter.start()
        # Then that thread is parked and time stands still, however long the hold lasts
        while clock.parked() == 0:
            pass
        assert not done.wait(0.05)
        assert clock.now() == START and clock.parked() == 1
        # (the holder itself may move time: its advance is never parked)
        clock.advance(1)
    # When the hold ends, the parked advance goes on, counted from where it was entered
    waiter.join(5)
    assert done.is_set() and clock.parked() == 0
    assert clock.now() == START + 5


def test_sleepers_taking_turns_wake_in_the_order_of_their_ends_once_every_actor_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from preemptor_tools.local import clock as clock_impl

    # Given a clock whose sleepers take turns among three actors (say, running workflows)
    clock = SimClock(START)
    acting = {"n": 3}
    clock.take_turns(lambda sleeping: acting["n"] <= sleeping)
    woke: list[tuple[str, float]] = []

    def actor(name: str, seconds: float) -> None:
        clock.sleep(seconds)
        woke.append((name, clock.now() - START))
        acting["n"] -= 1  # done: it acts no more

    long = threading.Thread(target=actor, args=("long", 240))
    long.start()
    # When the first sleeps 240 s while the others still act: time stands still
    assert not _joined(long, 0.05) and clock.now() == START
    # and one of the others stands aside, waiting for the rest rather than for time
    with clock.aside():
        assert not _joined(long, 0.05) and clock.now() == START
        # When the last sleeps 30 s
        short = threading.Thread(target=actor, args=("short", 30))
        short.start()
        # Then the shorter sleep ends first, then the longer, each at its own end
        assert _joined(short, 5) and _joined(long, 5)
    assert woke == [("short", 30), ("long", 240)] and clock.parked() == 0

    # And a sleeper whose others never settle (a thread blocked outside the clock) goes
    # after the give-up time, as a plain advance
    monkeypatch.setattr(clock_impl, "_TURN_GIVE_UP_S", 0.1)
    acting["n"] = 2
    clock.sleep(10)
    assert clock.now() == START + 250


def test_a_sleep_stops_where_the_fleet_is_due_and_goes_on_once_what_it_emitted_is_routed() -> None:
    # Given a workflow's 100 s wait taking turns, and a fleet whose run ends 40 s in and
    # emits its event, which waits to be routed (the stack's outbox)
    clock = SimClock(START)
    outbox: list[str] = []
    due = [START + 40.0]
    clock.take_turns(lambda sleeping: not outbox and sleeping >= 1)
    clock.on_due(lambda: due[0] if due else None)
    advances: list[float] = []

    def fleet(_old: float, new: float) -> None:
        advances.append(new - START)
        if due and new >= due[0]:
            outbox.append(f"ended at {due.pop() - START:.0f}")

    clock.on_advance(fleet)
    sleeper = threading.Thread(target=clock.sleep, args=(100,))

    # When the wait starts
    sleeper.start()

    # Then time goes to the run's end, not past it, and stands there while its event waits
    deadline = time.monotonic() + 5
    while not outbox and time.monotonic() < deadline:
        time.sleep(0.002)
    assert outbox == ["ended at 40"] and not _joined(sleeper, 0.05)
    assert clock.now() == START + 40

    # And once it is routed, the wait goes on to its end
    outbox.clear()
    assert _joined(sleeper, 5)
    assert advances == [40, 100] and clock.now() == START + 100


def _joined(thread: threading.Thread, timeout_s: float) -> bool:
    thread.join(timeout_s)
    return not thread.is_alive()


def test_use_clock_replaces_the_process_clock() -> None:
    # Given the process clock
    sim = SimClock(START)

    # When the local runtime installs a SimClock
    previous = clock_module.use_clock(sim)
    try:
        # Then handlers reading preemptor.clock.CLOCK get simulated time
        assert clock_module.CLOCK.now() == START
    finally:
        clock_module.use_clock(previous)
    assert isinstance(clock_module.CLOCK, clock_module.SystemClock)


# --------------------------------------------------------------------------- patches: lifecycle


def test_install_is_idempotent_and_uninstall_restores_moto() -> None:
    # Given pristine moto
    from moto.awslambda_simple.models import LambdaSimpleBackend
    from moto.sagemaker.models import SageMakerModelBackend
    from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl

    original_invoke = LambdaSimpleBackend.invoke
    assert not hasattr(SageMakerModelBackend, "stop_training_job")

    # When the patches are installed twice
    moto_patches.install(SimClock(START), lambda name, event: None)
    moto_patches.install(SimClock(START), lambda name, event: None)
    try:
        # Then they are in place once, and moto's step-by-step logging is quiet
        assert LambdaSimpleBackend.invoke is not original_invoke
        assert hasattr(SageMakerModelBackend, "stop_training_job")
        assert logging.getLogger("moto.stepfunctions").getEffectiveLevel() >= logging.WARNING
    finally:
        moto_patches.uninstall()
        moto_patches.uninstall()

    # And uninstall puts moto back as it was
    assert LambdaSimpleBackend.invoke is original_invoke
    assert not hasattr(SageMakerModelBackend, "stop_training_job")
    assert retrier_decl.time.sleep.__module__ == "time"


def test_a_task_states_client_is_made_once_per_service_from_a_session_of_its_own(emulation: Emulation) -> None:
    # moto makes each task state's client anew with boto3.client, from boto3's default
    # session, which is not safe to make clients from in several threads at once (and moto
    # runs each execution in its own thread)
    from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
    from moto.stepfunctions.parser.asl.utils import boto_client

    from preemptor_tools.local.moto_patches import stepfunctions as patched

    # When sixteen executions' threads ask for their clients at once
    start = threading.Barrier(16)
    made: list[Any] = []
    errors: list[BaseException] = []

    def ask() -> None:
        start.wait()
        try:
            made.append((lambda_eval_utils.boto_client_for(REGION, "lambda"), boto_client.boto_client_for(REGION, "sns")))
        except BaseException as e:  # noqa: BLE001 - the race shows as any error
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then none failed, and all share one client per service, which works
    assert errors == [] and len(made) == 16
    assert len({id(lam) for lam, _ in made}) == 1 and len({id(sns) for _, sns in made}) == 1
    assert made[0][1].list_topics()["Topics"] == []
    # And the next installation makes its own (after its stack's recorder and hostile world)
    moto_patches.uninstall()
    assert patched._TASK_CLIENTS == {}


def test_clients_of_one_service_share_their_methods_not_their_classes_nor_their_emitters() -> None:
    import botocore.client
    import botocore.hooks

    original_create_methods = botocore.client.ClientCreator._create_methods
    original_aliaser_init = botocore.hooks.EventAliaser.__init__
    moto_patches.install(SimClock(START), lambda name, event: None)
    try:
        with mock_aws():
            # Given two sessions, as the stack and the functions each make one
            first, second = (boto3.session.Session(region_name=REGION) for _ in range(2))
            one, two = first.client("sagemaker"), second.client("sagemaker")
            # Then their methods were built once, each client has a class of its own, and
            # boto3's additions to a class (S3's managed transfers) are still made
            assert type(one).list_training_jobs is type(two).list_training_jobs
            assert type(one) is not type(two)
            assert hasattr(first.client("s3"), "upload_file") and hasattr(second.client("s3"), "upload_file")
            # and a handler of one session extends its own clients' classes only
            first.events.register("creating-client-class.sagemaker", lambda class_attributes, **_: class_attributes.update(extra=1))
            assert hasattr(first.client("sagemaker"), "extra") and not hasattr(second.client("sagemaker"), "extra")
            # And each client hears only its own handlers: an event alias cache is shared,
            # the handlers are not
            calls: list[str] = []
            one.meta.events.register("before-call.sagemaker.ListTrainingJobs", lambda **_: calls.append("one"))
            two.list_training_jobs()
            assert calls == []
            one.list_training_jobs()
            assert calls == ["one"]
            # and an emitter with other aliases keeps a cache of its own
            custom = botocore.hooks.EventAliaser(botocore.hooks.HierarchicalEmitter(), {"old": "new"})
            assert custom._alias_event_name("before-call.old.Op") == "before-call.new.Op"
            assert one.meta.events._alias_event_name("before-call.old.Op") == "before-call.old.Op"
    finally:
        moto_patches.uninstall()
    # And uninstalling puts botocore back
    assert botocore.client.ClientCreator._create_methods is original_create_methods
    assert botocore.hooks.EventAliaser.__init__ is original_aliaser_init


def test_a_request_carries_its_signatures_scope_s3_its_whole_signature_and_no_credentials_still_fail() -> None:
    import botocore.exceptions
    from botocore import UNSIGNED
    from botocore.awsrequest import AWSRequest
    from botocore.config import Config

    from preemptor_tools.local.moto_patches import sdk

    moto_patches.install(SimClock(START), lambda name, event: None)
    try:
        with mock_aws():
            session = boto3.session.Session(region_name="eu-west-1")
            sent: dict[str, str] = {}

            def seen(request, **_):
                sent[request.url.split("/")[2]] = request.headers["Authorization"].decode()

            dynamodb, s3 = session.client("dynamodb"), session.client("s3")
            for client in (dynamodb, s3):
                client.meta.events.register("before-send", seen)
            # Given a DynamoDB and an S3 request in another region than moto's default
            assert dynamodb.list_tables()["TableNames"] == []
            s3.create_bucket(Bucket="signed", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
            s3.put_object(Bucket="signed", Key="k", Body=b"x")
            # Then DynamoDB's carries the access key and the scope (what moto reads: the
            # account, the region), not a hash; S3's is signed in full, and moto found the
            # region of each
            ddb = sent["dynamodb.eu-west-1.amazonaws.com"]
            assert ddb.startswith("AWS4-HMAC-SHA256 Credential=") and "/eu-west-1/dynamodb/aws4_request" in ddb
            assert ddb.endswith("Signature=" + "0" * 64)
            assert not next(v for k, v in sent.items() if "s3" in k).endswith("0" * 64)
            assert s3.get_bucket_location(Bucket="signed")["LocationConstraint"] == "eu-west-1"
            assert s3.get_object(Bucket="signed", Key="k")["Body"].read() == b"x"
            # And a client without credentials fails as it would, one left unsigned is not signed
            for signer in sdk._header_signers():
                with pytest.raises(botocore.exceptions.NoCredentialsError):
                    signer(None, "dynamodb", "eu-west-1").add_auth(AWSRequest("POST", "https://dynamodb.eu-west-1.amazonaws.com/"))
            unsigned = session.client("dynamodb", config=Config(signature_version=UNSIGNED))
            unsigned.meta.events.register("before-send", lambda request, **_: sent.update(unsigned=request.headers.get("Authorization")))
            unsigned.list_tables()
            assert sent["unsigned"] is None
    finally:
        moto_patches.uninstall()


def test_a_user_agent_is_built_once_per_client_and_features_and_is_the_one_botocore_builds() -> None:
    import botocore.useragent
    import moto.core.responses

    from preemptor_tools.local.moto_patches import sdk

    original_to_string = botocore.useragent.UserAgentString.to_string
    original_method_names = moto.core.responses.method_names_from_class
    moto_patches.install(SimClock(START), lambda name, event: None)
    try:
        with mock_aws():
            sent: list[str] = []
            dynamodb = boto3.session.Session(region_name=REGION).client("dynamodb")
            dynamodb.meta.events.register("before-send", lambda request, **_: sent.append(request.headers["User-Agent"].decode()))

            def calls() -> list[str]:
                # a plain call and a paginated one (the paginator adds a feature to the
                # request's context), each made twice
                sent.clear()
                for _ in range(2):
                    dynamodb.list_tables()
                    list(dynamodb.get_paginator("list_tables").paginate())
                return list(sent)

            # Given the calls made with the User-Agent kept, and made with botocore's own
            kept = calls()
            botocore.useragent.UserAgentString.to_string = original_to_string
            try:
                built = calls()
            finally:
                botocore.useragent.UserAgentString.to_string = sdk._user_agent
            # Then each sent the User-Agent botocore builds for it, and the two kinds differ
            # where their features do
            assert kept == built
            plain, paginated = kept[0], kept[1]
            assert kept == [plain, paginated, plain, paginated] and plain != paginated
            # And moto's list of a response class's actions is the one it makes itself
            from moto.dynamodb.responses import DynamoHandler

            assert sdk._method_names(DynamoHandler) == original_method_names(DynamoHandler)
    finally:
        moto_patches.uninstall()
    # And uninstalling puts both back
    assert botocore.useragent.UserAgentString.to_string is original_to_string
    assert moto.core.responses.method_names_from_class is original_method_names


def test_patches_refuse_an_unpinned_moto_version(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given another moto release
    import moto

    monkeypatch.setattr(moto, "__version__", "5.3.0")
    spec = importlib.util.spec_from_file_location("moto_patches_copy", moto_patches.__file__)
    module = importlib.util.module_from_spec(spec)

    # When the patch module is imported, Then it refuses with a clear error
    with pytest.raises(RuntimeError, match="moto 5.2.5"):
        spec.loader.exec_module(module)


# --------------------------------------------------------------------------- patches: Step Functions


def test_an_hour_long_wait_advances_the_sim_clock_instead_of_sleeping(
    emulation: Emulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a workflow that waits an hour, then as many seconds as its input says (the
    # product's polls use SecondsPath), and moto's real waiting made unusable
    real_wait = threading.Event.wait

    def no_real_wait(self: threading.Event, timeout: float | None = None) -> bool:
        if timeout is not None and timeout >= 30:
            raise AssertionError("a Wait state waited for real")
        return real_wait(self, timeout)

    monkeypatch.setattr(threading.Event, "wait", no_real_wait)
    definition = {
        "StartAt": "Wait an hour",
        "States": {
            "Wait an hour": {"Type": "Wait", "Seconds": 3600, "Next": "Wait for the poll"},
            "Wait for the poll": {"Type": "Wait", "SecondsPath": "$.poll_s", "End": True},
        },
    }

    # When it runs
    result = run_state_machine(emulation, "waits", definition, {"poll_s": 30})

    # Then it succeeded and simulated time moved by exactly those waits
    assert result["status"] == "SUCCEEDED"
    assert emulation.clock.now() == START + 3630


def test_a_full_jitter_retry_waits_what_the_retry_itself_draws_the_same_on_every_replay(emulation: Emulation) -> None:
    import hashlib

    # Given a step that fails twice, retried 100 s and then 200 s later with full jitter
    failures = iter([RuntimeError("first"), RuntimeError("second")])

    def flaky(event: dict) -> dict:
        error = next(failures, None)
        if error is not None:
            raise error
        return event

    definition = {
        "StartAt": "Flaky",
        "States": {
            "Flaky": {
                "Type": "Task",
                "Resource": create_function(emulation, "flaky", flaky),
                "Retry": [{"ErrorEquals": ["States.ALL"], "IntervalSeconds": 100, "BackoffRate": 2, "MaxAttempts": 2, "JitterStrategy": "FULL"}],
                "End": True,
            }
        },
    }

    # When it runs
    result = run_state_machine(emulation, "jittered", definition)

    # Then each retry waited its interval scaled by a draw of the retry itself (execution,
    # state, Map item, how many retries before), not by the process's random numbers: a
    # replay of the story waits the same, whatever order its threads retry in
    def draw(n: int) -> float:
        digest = hashlib.sha256(f"{result['executionArn']}|Flaky|None|{n}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    assert result["status"] == "SUCCEEDED"
    assert emulation.clock.now() - START == pytest.approx(100 * draw(0) + 200 * draw(1))
    assert emulation.clock.now() - START < 300


@pytest.mark.parametrize("after", ["retry interval", "wait", "task"])
def test_an_execution_that_outlives_its_emulated_aws_neither_moves_nor_acts_in_the_next(emulation: Emulation, after: str) -> None:
    # Given a workflow whose first Lambda step is still running when its emulated AWS gives way
    # to the next one (a later test's or replay's stack: the patches installed again with a new
    # clock), and whose next move is a 240 s retry interval, a 240 s Wait or another Lambda step
    entered, release = threading.Event(), threading.Event()
    later: list[dict] = []

    def slow(event: dict) -> dict:
        entered.set()
        release.wait(30)
        if after == "retry interval":
            raise RuntimeError("failed: retried after 240 s")
        return event

    later_step = {"Type": "Task", "Resource": create_function(emulation, "later", later.append), "End": True}
    next_step = {
        "retry interval": {"Type": "Succeed"},  # not reached: the retry interval comes first
        "wait": {"Type": "Wait", "Seconds": 240, "Next": "Later"},
        "task": later_step,
    }[after]
    definition = {
        "StartAt": "Slow",
        "States": {
            "Slow": {
                "Type": "Task",
                "Resource": create_function(emulation, "slow", slow),
                "Retry": [{"ErrorEquals": ["States.ALL"], "IntervalSeconds": 240, "MaxAttempts": 1}],
                "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Later"}],
                "Next": "Next",
            },
            "Next": next_step,
            "Later": later_step,
        },
    }
    sfn = emulation.client("stepfunctions")
    arn = sfn.create_state_machine(name="outlived", roleArn=emulation.role_arn, definition=json.dumps(definition))["stateMachineArn"]
    started = sfn.start_execution(stateMachineArn=arn, name="outlived-run-1", input="{}")
    assert entered.wait(30)

    # When the next emulated AWS starts, and only then the old step returns
    successor = SimClock(START + 10_000)
    moto_patches.install(successor, lambda name, event: emulation.handlers[name](event))
    release.set()
    described = wait_for_execution(sfn, started["executionArn"])

    # Then the old execution ends there: the new clock did not move, no later step ran
    assert successor.now() == START + 10_000 and emulation.clock.now() == START
    assert later == []
    assert described["status"] == "FAILED" and "outlived the emulated AWS that started it" in described.get("cause", "")


def _busy_then_short_wait_beside(emulation: Emulation, other: dict) -> list[float]:
    """Start two workflows together: one first runs a step that takes a while (real time),
    then waits 30 s and notes the time; the other is `other` (its input has two items). Runs
    both to their ends; returns the times noted (since START)."""
    noted: list[float] = []

    def slow(event: dict) -> dict:
        time.sleep(0.3)
        return event

    def note(event: dict) -> dict:
        noted.append(emulation.clock.now() - START)
        return event

    waits_short = {
        "StartAt": "Slow",
        "States": {
            "Slow": {"Type": "Task", "Resource": create_function(emulation, "slow-step", slow), "Next": "Wait"},
            "Wait": {"Type": "Wait", "Seconds": 30, "Next": "Note"},
            "Note": {"Type": "Task", "Resource": create_function(emulation, "note-time", note), "End": True},
        },
    }
    sfn = emulation.client("stepfunctions")
    started = []
    for name, definition in (("waits-short", waits_short), ("waits-long", other)):
        arn = sfn.create_state_machine(name=name, roleArn=emulation.role_arn, definition=json.dumps(definition))["stateMachineArn"]
        started.append(sfn.start_execution(stateMachineArn=arn, name=f"{name}-1", input='{"items": [1, 2]}')["executionArn"])
    assert [wait_for_execution(sfn, arn)["status"] for arn in started] == ["SUCCEEDED", "SUCCEEDED"]
    return noted


@pytest.mark.parametrize("turns", [True, False], ids=["taking turns", "first come"])
def test_concurrent_workflows_wait_their_turns_each_acting_when_its_own_wait_ends(emulation: Emulation, turns: bool) -> None:
    # Given two workflows started together: one first runs a step that takes a while (real
    # time), then waits 30 s and notes the time; the other waits 240 s
    if turns:
        emulation.clock.take_turns(lambda sleeping: len(running_executions(ACCOUNT_ID, REGION)) <= sleeping)
    waits_long = {"StartAt": "Wait", "States": {"Wait": {"Type": "Wait", "Seconds": 240, "End": True}}}

    # When both run to their ends
    noted = _busy_then_short_wait_beside(emulation, waits_long)

    # Then, taking turns, the short wait ended 30 s in, before the long one moved time to
    # 240 s, as on AWS; first come, the long wait moved time while the other was busy, and
    # the short one ended 30 s after that
    if turns:
        assert noted == [30] and emulation.clock.now() == START + 240
    else:
        assert noted == [270] and emulation.clock.now() == START + 270


def test_a_maps_items_waiting_count_as_their_one_workflow_waiting_not_as_others(emulation: Emulation) -> None:
    # Given two workflows taking turns: one busy, then waiting 30 s; the other running a Map
    # whose two items each wait 240 s (two threads of one execution waiting, as many as
    # both executions)
    emulation.clock.take_turns(lambda sleeping: len(running_executions(ACCOUNT_ID, REGION)) <= sleeping)
    items_wait_long = {
        "StartAt": "Items",
        "States": {
            "Items": {
                "Type": "Map",
                "ItemsPath": "$.items",
                "ItemProcessor": {
                    "ProcessorConfig": {"Mode": "INLINE"},
                    "StartAt": "Wait",
                    "States": {"Wait": {"Type": "Wait", "Seconds": 240, "End": True}},
                },
                "End": True,
            }
        },
    }

    # When both run to their ends
    noted = _busy_then_short_wait_beside(emulation, items_wait_long)

    # Then the Map's two waiting items were one workflow waiting while the other was still
    # busy: the short wait ended 30 s in, before the items moved time to 240 s
    assert noted == [30] and emulation.clock.now() == START + 240
    assert emulation.clock.idle() == 0


def test_a_lambda_that_outlives_its_emulated_aws_is_refused_what_it_asks_of_the_next(emulation: Emulation) -> None:
    # Given a workflow's Lambda step still running when its emulated AWS gives way to the next
    # one, and about to write an object
    entered, release = threading.Event(), threading.Event()
    refused: list[Exception] = []
    s3 = emulation.client("s3")
    s3.create_bucket(Bucket="outlived")

    def slow(event: dict) -> dict:
        entered.set()
        release.wait(30)
        try:
            s3.put_object(Bucket="outlived", Key="written-late", Body=b"x")
        except moto_patches.StaleInvocation as e:
            refused.append(e)
            raise
        return event

    definition = {"StartAt": "Slow", "States": {"Slow": {"Type": "Task", "Resource": create_function(emulation, "slow-writer", slow), "End": True}}}
    sfn = emulation.client("stepfunctions")
    arn = sfn.create_state_machine(name="outlived-writer", roleArn=emulation.role_arn, definition=json.dumps(definition))["stateMachineArn"]
    started = sfn.start_execution(stateMachineArn=arn, name="outlived-writer-1", input="{}")
    assert entered.wait(30)

    # When the next emulated AWS starts, and only then the old handler writes
    moto_patches.install(SimClock(START + 10_000), lambda name, event: emulation.handlers[name](event))
    release.set()
    described = wait_for_execution(sfn, started["executionArn"])

    # Then its write is refused before it reaches the emulated AWS: nothing was written
    assert len(refused) == 1 and "invoked by an emulated AWS that is gone" in str(refused[0])
    assert s3.list_objects_v2(Bucket="outlived").get("KeyCount") == 0
    assert described["status"] == "FAILED"
    # And the calls of the handlers the running emulated AWS invokes go through
    emulation.handlers["slow-writer"] = lambda event: s3.put_object(Bucket="outlived", Key="written", Body=b"x") and event
    moto_patches.install(emulation.clock, lambda name, event: emulation.handlers[name](event))
    again = sfn.start_execution(stateMachineArn=arn, name="outlived-writer-2", input="{}")
    assert wait_for_execution(sfn, again["executionArn"])["status"] == "SUCCEEDED"
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="outlived")["Contents"]] == ["written"]


def test_a_lambda_task_runs_the_in_process_handler_for_both_resource_forms(
    emulation: Emulation,
) -> None:
    # Given a Lambda function created in moto (dummy zip, Handler string) backed by a callable
    seen: list[dict] = []

    def handler(event: dict) -> dict:
        seen.append(event)
        return {"doubled": event["n"] * 2}

    function_arn = create_function(emulation, "double", handler)
    definition = {
        "StartAt": "Plain ARN",
        "States": {
            "Plain ARN": {
                "Type": "Task",
                "Resource": function_arn,
                "ResultPath": "$.plain",
                "Next": "Invoke",
            },
            "Invoke": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Parameters": {"FunctionName": function_arn, "Payload": {"n.$": "$.plain.doubled"}},
                "ResultSelector": {"doubled.$": "$.Payload.doubled"},
                "ResultPath": "$.invoked",
                "End": True,
            },
        },
    }

    # When a workflow calls it through a plain function ARN and through lambda:invoke
    result = run_state_machine(emulation, "lambda-forms", definition, {"n": 3})

    # Then our callable ran in-process for both, with the task's payload
    assert result["status"] == "SUCCEEDED"
    assert seen == [{"n": 3}, {"n": 6}]
    assert json.loads(result["output"])["invoked"] == {"doubled": 12}
    configuration = emulation.client("lambda").get_function(FunctionName="double")["Configuration"]
    assert configuration["Handler"] == "preemptor.handlers.double.handler"


@pytest.mark.parametrize(
    "resource_form", ["plain function ARN", "lambda:invoke"], ids=["plain-arn", "lambda-invoke"]
)
def test_retry_on_a_lambda_error_named_by_its_class_advances_the_sim_clock(
    emulation: Emulation, resource_form: str
) -> None:
    # Given a handler that raises CheckpointNotReady twice, then succeeds
    calls: list[float] = []

    def handler(event: dict) -> dict:
        calls.append(emulation.clock.now())
        if len(calls) < 3:
            raise CheckpointNotReady("victim has no fresh checkpoint yet")
        return {"ready": True}

    function_arn = create_function(emulation, "confirm", handler)
    task: dict[str, Any] = (
        {"Resource": function_arn}
        if resource_form == "plain function ARN"
        else {
            "Resource": "arn:aws:states:::lambda:invoke",
            "Parameters": {"FunctionName": function_arn, "Payload.$": "$"},
            "OutputPath": "$.Payload",
        }
    )
    definition = {
        "StartAt": "Confirm checkpoint",
        "States": {
            "Confirm checkpoint": {
                "Type": "Task",
                **task,
                "Retry": [
                    {
                        "ErrorEquals": ["CheckpointNotReady"],
                        "IntervalSeconds": 30,
                        "BackoffRate": 2.0,
                        "MaxAttempts": 3,
                    }
                ],
                "End": True,
            }
        },
    }

    # When the workflow runs
    result = run_state_machine(emulation, "retry", definition)

    # Then Step Functions saw the error under the class name and retried after 30 s and 60 s
    # of simulated time
    assert result["status"] == "SUCCEEDED"
    assert json.loads(result["output"]) == {"ready": True}
    assert calls == [START, START + 30, START + 90]
    errors = [
        details["error"]
        for event in history(emulation, result)
        for key, details in event.items()
        if key in ("lambdaFunctionFailedEventDetails", "taskFailedEventDetails")
    ]
    assert errors == ["CheckpointNotReady", "CheckpointNotReady"]


def test_executions_of_one_definition_run_one_program_and_keep_their_own_retry_counts(emulation: Emulation) -> None:
    # Given a task whose handler always fails, retried twice, in a definition built once
    from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser

    calls: dict[int, int] = {}
    lock = threading.Lock()

    def handler(event: dict) -> dict:
        with lock:
            calls[event["run"]] = calls.get(event["run"], 0) + 1
        raise CheckpointNotReady("never ready")

    function_arn = create_function(emulation, "confirm", handler)
    definition = json.dumps(
        {
            "StartAt": "Confirm",
            "States": {
                "Confirm": {
                    "Type": "Task",
                    "Resource": "arn:aws:states:::lambda:invoke",
                    "Parameters": {"FunctionName": function_arn, "Payload.$": "$"},
                    "Retry": [{"ErrorEquals": ["CheckpointNotReady"], "IntervalSeconds": 5, "MaxAttempts": 2}],
                    "End": True,
                }
            },
        }
    )
    sfn = emulation.client("stepfunctions")
    arn = sfn.create_state_machine(name="shared", roleArn=emulation.role_arn, definition=definition)["stateMachineArn"]
    assert AmazonStateLanguageParser.parse(definition)[0] is AmazonStateLanguageParser.parse(definition)[0]

    # When twelve executions of it run at once
    started = [
        sfn.start_execution(stateMachineArn=arn, name=f"run-{i}", input=json.dumps({"run": i}))["executionArn"]
        for i in range(12)
    ]
    results = [wait_for_execution(sfn, execution) for execution in started]

    # Then each tried three times, its own retries counted apart from the others'
    assert [r["status"] for r in results] == ["FAILED"] * 12
    assert calls == {i: 3 for i in range(12)}


def test_catch_routes_a_lambda_error_by_class_name(emulation: Emulation) -> None:
    # Given a task whose handler always raises CheckpointNotReady, caught by name
    def handler(event: dict) -> dict:
        raise CheckpointNotReady("still writing")

    function_arn = create_function(emulation, "confirm", handler)
    definition = {
        "StartAt": "Confirm checkpoint",
        "States": {
            "Confirm checkpoint": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Parameters": {"FunctionName": function_arn, "Payload.$": "$"},
                "Retry": [{"ErrorEquals": ["States.Timeout"], "MaxAttempts": 1}],
                "Catch": [
                    {
                        "ErrorEquals": ["CheckpointNotReady"],
                        "ResultPath": "$.error",
                        "Next": "Pick another victim",
                    }
                ],
                "End": True,
            },
            "Pick another victim": {"Type": "Pass", "End": True},
        },
    }

    # When the workflow runs
    result = run_state_machine(emulation, "catch", definition)

    # Then the Catch on the class name took it
    assert result["status"] == "SUCCEEDED"
    error = json.loads(result["output"])["error"]
    assert error["Error"] == "CheckpointNotReady"
    assert json.loads(error["Cause"])["errorMessage"] == "still writing"


@pytest.mark.parametrize("resource", ["function", "lambda:invoke"])
def test_a_path_the_input_does_not_have_fails_the_execution_as_states_runtime(emulation: Emulation, resource: str) -> None:
    # Given a task whose Parameters read a path its input does not have, under a Retry and a
    # Catch of States.ALL (on AWS neither matches States.Runtime)
    calls: list[dict] = []
    function_arn = create_function(emulation, "note", lambda event: calls.append(event) or {})
    arn_or_invoke = (
        {"Resource": function_arn, "Parameters": {"job.$": "$.victim.job"}}
        if resource == "function"
        else {"Resource": "arn:aws:states:::lambda:invoke", "Parameters": {"FunctionName": function_arn, "Payload": {"job.$": "$.victim.job"}}}
    )
    definition = {
        "StartAt": "Note",
        "States": {
            "Note": {
                "Type": "Task",
                **arn_or_invoke,
                "Retry": [{"ErrorEquals": ["States.ALL"], "MaxAttempts": 2}],
                "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Go on"}],
                "End": True,
            },
            "Go on": {"Type": "Pass", "End": True},
        },
    }

    # When the workflow runs on an input without it
    result = run_state_machine(emulation, f"runtime-{resource.replace(':', '-')}", definition, {"job": "j"})

    # Then the execution fails there, once, and the function is never called
    assert result["status"] == "FAILED"
    assert result["error"] == "States.Runtime"
    assert "$.victim.job" in result["cause"]
    assert calls == []
    failures = [e for e in history(emulation, result) if e["type"] == "TaskFailed"]
    assert len(failures) == 1


def test_start_execution_sns_publish_map_and_choice_tasks_run(emulation: Emulation) -> None:
    # Given a child workflow, an alerts topic with a queue subscribed, and a parent workflow
    # that maps over jobs, chooses, starts the child (fire and forget) and publishes an alert
    sfn, sns, sqs = (emulation.client(name) for name in ("stepfunctions", "sns", "sqs"))
    child = sfn.create_state_machine(
        name="child",
        roleArn=emulation.role_arn,
        definition=json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Pass", "End": True}}}),
    )["stateMachineArn"]
    topic = sns.create_topic(Name="alerts")["TopicArn"]
    queue_url = sqs.create_queue(QueueName="alerts-inbox")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn)
    definition = {
        "StartAt": "Each job",
        "States": {
            "Each job": {
                "Type": "Map",
                "ItemsPath": "$.jobs",
                "ItemProcessor": {
                    "ProcessorConfig": {"Mode": "INLINE"},
                    "StartAt": "Name it",
                    "States": {"Name it": {"Type": "Pass", "Parameters": {"job.$": "$"}, "End": True}},
                },
                "ResultPath": "$.mapped",
                "Next": "Anything to do?",
            },
            "Anything to do?": {
                "Type": "Choice",
                "Choices": [{"Variable": "$.jobs[0]", "IsPresent": True, "Next": "Start the child"}],
                "Default": "Nothing",
            },
            "Nothing": {"Type": "Fail", "Error": "Nothing"},
            "Start the child": {
                "Type": "Task",
                "Resource": "arn:aws:states:::states:startExecution",
                "Parameters": {
                    "StateMachineArn": child,
                    "Name": "child-run-1",
                    "Input": {"jobs.$": "$.jobs"},
                },
                "ResultPath": "$.child",
                "Next": "Alert",
            },
            "Alert": {
                "Type": "Task",
                "Resource": "arn:aws:states:::sns:publish",
                "Parameters": {"TopicArn": topic, "Message": {"preempted.$": "$.jobs[0]"}},
                "ResultPath": "$.alert",
                "End": True,
            },
        },
    }

    # When the parent runs
    result = run_state_machine(emulation, "parent", definition, {"jobs": ["a", "b"]})

    # Then every state worked: the map, the choice, the child start (PascalCase result, as on
    # AWS) and the alert
    assert result["status"] == "SUCCEEDED", result.get("cause")
    output = json.loads(result["output"])
    assert output["mapped"] == [{"job": "a"}, {"job": "b"}]
    assert output["child"]["ExecutionArn"].endswith(":child:child-run-1")
    assert "MessageId" in output["alert"]
    child_run = wait_for_execution(sfn, output["child"]["ExecutionArn"])
    assert json.loads(child_run["input"]) == {"jobs": ["a", "b"]}
    message = sqs.receive_message(QueueUrl=queue_url)["Messages"][0]
    assert json.loads(json.loads(message["Body"])["Message"]) == {"preempted": "a"}


# --------------------------------------------------------------------------- patches: SageMaker, S3


def test_stop_training_job_works_through_boto3(emulation: Emulation) -> None:
    # Given a training job created through boto3
    sagemaker = emulation.client("sagemaker")
    arn = create_training_job(emulation, "train-a", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/a")
    created = sagemaker.describe_training_job(TrainingJobName="train-a")

    # When it is stopped, and then stopped again
    emulation.clock.advance(45)
    sagemaker.stop_training_job(TrainingJobName="train-a")
    stopping = sagemaker.describe_training_job(TrainingJobName="train-a")
    with pytest.raises(ClientError) as second_stop:
        sagemaker.stop_training_job(TrainingJobName="train-a")

    # Then it was InProgress from the SimClock with the request's Environment and checkpoints,
    # became Stopping, and a second stop is refused as on AWS
    assert (created["TrainingJobStatus"], created["SecondaryStatus"]) == ("InProgress", "Starting")
    assert created["CreationTime"].timestamp() == START
    assert created["Environment"] == {"PREEMPTOR_SIM_DURATION_S": "600"}
    assert created["CheckpointConfig"] == {"S3Uri": f"s3://{BUCKET}/jobs/a"}
    assert (stopping["TrainingJobStatus"], stopping["SecondaryStatus"]) == ("Stopping", "Stopping")
    assert stopping["LastModifiedTime"].timestamp() == START + 45
    assert second_stop.value.response["Error"]["Code"] == "ValidationException"
    tags = sagemaker.list_tags(ResourceArn=arn)["Tags"]
    assert tags == [{"Key": "preemptor:team", "Value": "vision"}]
    # And the controller's runner takes that refusal for what it is, a stop already under
    # way (a retried stop step meets it): no error
    SageMakerRunner(sagemaker).stop("train-a", "preemptor: preempted")


def test_a_second_training_job_of_the_same_name_is_resource_in_use(emulation: Emulation) -> None:
    # Given a training job (moto alone would silently replace it with a second of its name)
    create_training_job(emulation, "train-once", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/once")

    # When a job of the same name is created again (a launch retried after it succeeded)
    with pytest.raises(ClientError) as raised:
        create_training_job(emulation, "train-once", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/once")

    # Then SageMaker refuses it as AWS does, and the first job is untouched
    assert raised.value.response["Error"]["Code"] == "ResourceInUse"
    sagemaker = emulation.client("sagemaker")
    assert sagemaker.describe_training_job(TrainingJobName="train-once")["TrainingJobStatus"] == "InProgress"


def test_a_training_job_over_the_accounts_instance_quota_is_refused_resource_limit_exceeded(emulation: Emulation) -> None:
    # Given an account that may run 2 ml.p5.48xlarge in training jobs at once, both held
    # (moto alone has no quota: a pool's owner would see more instances than it owns)
    fleet = emulation.fleet(instance_quotas={"ml.p5.48xlarge": 2})
    create_training_job(emulation, "holds-one", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/one")
    create_training_job(emulation, "holds-two", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/two")

    # When a third is created, whoever asks
    with pytest.raises(ClientError) as raised:
        create_training_job(emulation, "one-too-many", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/three")

    # Then SageMaker refuses it as AWS does, in its own words, and nothing is created
    error = raised.value.response["Error"]
    assert (raised.value.response["ResponseMetadata"]["HTTPStatusCode"], error["Code"]) == (400, "ResourceLimitExceeded")
    assert error["Message"].startswith(
        "The account-level service limit 'ml.p5.48xlarge for training job usage' is 2 Instances, "
        "with current utilization of 2 Instances and a request delta of 1 Instances."
    )
    with pytest.raises(ClientError):
        emulation.client("sagemaker").describe_training_job(TrainingJobName="one-too-many")
    assert [(r.run, r.holding) for r in fleet.quota_refusals] == [("one-too-many", {"holds-one": 1, "holds-two": 1})]
    # And once a run has ended (a stopped one holds its instance until Stopped), one fits again
    emulation.client("sagemaker").stop_training_job(TrainingJobName="holds-one")
    with pytest.raises(ClientError):
        create_training_job(emulation, "one-too-many", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/three")
    emulation.clock.advance(600)
    create_training_job(emulation, "one-too-many", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/three")


def test_stopping_an_unknown_training_job_is_a_validation_error(emulation: Emulation) -> None:
    # Given no training job, When one is stopped, Then SageMaker says ValidationException
    with pytest.raises(ClientError) as error:
        emulation.client("sagemaker").stop_training_job(TrainingJobName="nope")
    assert error.value.response["Error"]["Code"] == "ValidationException"


def test_s3_last_modified_follows_the_sim_clock(emulation: Emulation) -> None:
    # Given the SimClock at the start
    s3 = emulation.client("s3")

    # When objects are written before and after the clock advances
    s3.put_object(Bucket=BUCKET, Key="a.json", Body=b"{}")
    emulation.clock.advance(90)
    s3.put_object(Bucket=BUCKET, Key="b.json", Body=b"{}")

    # Then their LastModified are the simulated times of the writes
    assert s3.head_object(Bucket=BUCKET, Key="a.json")["LastModified"].timestamp() == START
    assert s3.head_object(Bucket=BUCKET, Key="b.json")["LastModified"].timestamp() == START + 90


# --------------------------------------------------------------------------- fleet: SageMaker


def test_a_training_job_checkpoints_at_its_interval_of_work(emulation: Emulation) -> None:
    # Given a job of 600 s of work that checkpoints every 100 s, after 120 s of provisioning
    fleet = emulation.fleet()
    create_training_job(
        emulation,
        "train-a",
        {"PREEMPTOR_SIM_DURATION_S": "600", "PREEMPTOR_SIM_CHECKPOINT_EVERY_S": "100"},
        "jobs/a",
    )

    # When 120 + 350 s pass in one step
    emulation.clock.advance(470)

    # Then three checkpoints were written, each stamped with the moment it was written, and
    # the two newest are kept, as the training helper prunes
    assert [line for _, _, line in fleet.history if "checkpoint:" in line] == [
        "periodic checkpoint: jobs/a/step-000000000100",
        "periodic checkpoint: jobs/a/step-000000000200",
        "periodic checkpoint: jobs/a/step-000000000300",
    ]
    assert checkpoints(emulation, "jobs/a") == [
        ("jobs/a/step-000000000200", START + 320),
        ("jobs/a/step-000000000300", START + 420),
    ]
    listed = emulation.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="jobs/a/")["Contents"]
    assert not [o["Key"] for o in listed if o["Key"].startswith("jobs/a/step-000000000100")]
    body = emulation.client("s3").get_object(Bucket=BUCKET, Key="jobs/a/step-000000000200/state.json")
    assert json.loads(body["Body"].read()) == {"progress_s": 200.0, "job": "train-a"}
    assert fleet.job("train-a").progress_s == 350
    # And the job reported Starting, then Training, in real EventBridge shape
    assert [(e["time"], e["detail"]["SecondaryStatus"]) for e in emulation.events] == [
        (at(0), "Starting"),
        (at(120), "Training"),
    ]


def test_a_training_job_event_has_the_real_event_shape(emulation: Emulation) -> None:
    # Given a job that has started
    emulation.fleet()
    arn = create_training_job(emulation, "train-a", {"PREEMPTOR_SIM_DURATION_S": "600"}, "jobs/a")

    # When its Training event is emitted
    emulation.clock.advance(120)
    event = emulation.events[-1]

    # Then it has the envelope and detail fields of the AWS sample
    envelope, detail = sample_keys(SAGEMAKER_SAMPLE)
    assert set(event) == envelope
    assert detail - {"TrainingEndTime"} <= set(event["detail"])
    assert event["id"] == "event-2"
    assert (event["source"], event["detail-type"]) == ("aws.sagemaker", "SageMaker Training Job State Change")
    assert (event["account"], event["region"], event["resources"]) == ("123456789012", REGION, [arn])
    assert event["detail"]["TrainingJobArn"] == arn
    assert event["detail"]["CreationTime"] == int(START * 1000)
    assert event["detail"]["TrainingStartTime"] == int((START + 120) * 1000)
    assert event["detail"]["Tags"] == {"preemptor:team": "vision"}
    assert event["detail"]["CheckpointConfig"] == {"S3Uri": f"s3://{BUCKET}/jobs/a"}


def test_a_training_job_honours_a_checkpoint_request(emulation: Emulation) -> None:
    # Given a running job whose own checkpoints are 1000 s of work apart
    fleet = emulation.fleet()
    create_training_job(
        emulation,
        "train-a",
        {"PREEMPTOR_SIM_DURATION_S": "5000", "PREEMPTOR_SIM_CHECKPOINT_EVERY_S": "1000"},
        "jobs/a",
    )
    emulation.clock.advance(320)

    # When the controller asks for a checkpoint and a minute and a half passes
    request_checkpoint(emulation, "jobs/a")
    emulation.clock.advance(90)

    # Then the job wrote one, checkpoint_write_s (60 s) after the request
    assert checkpoints(emulation, "jobs/a") == [("jobs/a/step-000000000260", START + 380)]
    assert fleet.job("train-a").last_checkpoint_at == START + 380


def test_a_training_job_completes_after_its_duration(emulation: Emulation) -> None:
    # Given a job of 300 s of work
    fleet = emulation.fleet()
    create_training_job(emulation, "train-a", {"PREEMPTOR_SIM_DURATION_S": "300"}, "jobs/a")

    # When an hour passes
    emulation.clock.advance(3600)

    # Then it completed after 120 s of startup and 300 s of work, and holds no capacity
    described = emulation.client("sagemaker").describe_training_job(TrainingJobName="train-a")
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Completed", "Completed")
    assert described["TrainingEndTime"].timestamp() == START + 420
    completed = emulation.events[-1]
    assert (completed["time"], completed["detail"]["TrainingJobStatus"]) == (at(420), "Completed")
    assert completed["detail"]["TrainingEndTime"] == int((START + 420) * 1000)
    assert fleet.running() == []


def test_a_stopped_training_job_resumes_from_its_checkpoint_in_its_next_incarnation(
    emulation: Emulation,
) -> None:
    # Given a job of 1000 s of work checkpointing every 100 s, stopped at 250 s of work
    fleet = emulation.fleet()
    workload = {"PREEMPTOR_SIM_DURATION_S": "1000", "PREEMPTOR_SIM_CHECKPOINT_EVERY_S": "100"}
    create_training_job(emulation, "train-a-r1", workload, "jobs/a")
    emulation.clock.advance(120 + 250)
    emulation.client("sagemaker").stop_training_job(TrainingJobName="train-a-r1")

    # When the stop has run its 120 s grace and a new incarnation gets the same checkpoints
    emulation.clock.advance(120)
    stopped = emulation.client("sagemaker").describe_training_job(TrainingJobName="train-a-r1")
    create_training_job(emulation, "train-a-r2", workload, "jobs/a")
    emulation.clock.advance(120)

    # Then the first ended Stopped at the end of the grace, having worked through it (its last
    # checkpoint is at 300 s of work) ...
    assert (stopped["TrainingJobStatus"], stopped["TrainingEndTime"].timestamp()) == ("Stopped", START + 490)
    assert [e["detail"]["TrainingJobStatus"] for e in emulation.events[:4]] == [
        "InProgress",
        "InProgress",
        "Stopping",
        "Stopped",
    ]
    assert checkpoints(emulation, "jobs/a")[-1] == ("jobs/a/step-000000000300", START + 420)
    # ... and the second resumed from 300 s of work, so it completes 700 s after it started
    assert fleet.job("train-a-r2").progress_s == 300
    emulation.clock.advance(700)
    described = emulation.client("sagemaker").describe_training_job(TrainingJobName="train-a-r2")
    assert (described["TrainingJobStatus"], described["TrainingEndTime"].timestamp()) == (
        "Completed",
        START + 490 + 120 + 700,
    )


@pytest.mark.parametrize(
    "on_stop, ends_after_s, written",
    [
        # the training helper's: a checkpoint 60 s into the grace, and the process exits then
        pytest.param("true", 60, [("jobs/a/step-000000000260", START + 380)], id="saves-on-sigterm-and-exits"),
        # any other script: it works on until it is killed at the end of the 120 s grace
        pytest.param("false", 120, [], id="killed-at-the-end-of-the-grace"),
    ],
)
def test_a_stopped_training_job_ends_when_its_sigterm_save_is_written_else_at_the_end_of_the_grace(
    emulation: Emulation, on_stop: str, ends_after_s: float, written: list
) -> None:
    # Given a running job with no periodic checkpoints, 200 s into its work
    fleet = emulation.fleet()
    create_training_job(
        emulation, "train-a", {"PREEMPTOR_SIM_DURATION_S": "1000", "PREEMPTOR_SIM_CHECKPOINT_ON_STOP": on_stop}, "jobs/a"
    )
    emulation.clock.advance(120 + 200)

    # When it is stopped
    emulation.client("sagemaker").stop_training_job(TrainingJobName="train-a")
    emulation.clock.advance(ends_after_s - 1)
    still_stopping = emulation.client("sagemaker").describe_training_job(TrainingJobName="train-a")
    emulation.clock.advance(1)
    stopped = emulation.client("sagemaker").describe_training_job(TrainingJobName="train-a")

    # Then it ends then (a job saving on SIGTERM frees its GPUs a minute before the grace is
    # out), with the checkpoint it wrote, if any
    assert still_stopping["TrainingJobStatus"] == "Stopping"
    assert (stopped["TrainingJobStatus"], stopped["TrainingEndTime"].timestamp()) == ("Stopped", START + 320 + ends_after_s)
    assert checkpoints(emulation, "jobs/a") == written
    assert fleet.running() == []


def test_a_training_job_stopped_before_it_started_stops_at_once(emulation: Emulation) -> None:
    # Given a job still provisioning
    fleet = emulation.fleet()
    create_training_job(emulation, "train-a", {"PREEMPTOR_SIM_DURATION_S": "1000"}, "jobs/a")
    emulation.clock.advance(30)

    # When it is stopped and the clock moves on
    emulation.client("sagemaker").stop_training_job(TrainingJobName="train-a")
    emulation.clock.advance(1)

    # Then it stopped at the request, without ever training
    described = emulation.client("sagemaker").describe_training_job(TrainingJobName="train-a")
    assert described["TrainingJobStatus"] == "Stopped"
    assert described["TrainingEndTime"].timestamp() == START + 30
    assert [e["detail"]["SecondaryStatus"] for e in emulation.events] == ["Starting", "Stopping", "Stopped"]
    assert fleet.running() == []


# --------------------------------------------------------------------------- fleet: Batch


def submit_batch_job(env: Emulation, queue: str, definition: str, environment: dict[str, str]) -> str:
    return env.client("batch").submit_job(
        jobName="train-b",
        jobQueue=queue,
        jobDefinition=definition,
        containerOverrides={"environment": [{"name": k, "value": v} for k, v in environment.items()]},
        tags={"preemptor:team": "nlp"},
    )["jobId"]


def submit_batch_work(env: Emulation, **workload: str) -> str:
    """A Batch job of 1000 s of work checkpointing to jobs/b (and `workload`) on a new queue."""
    queue, definition = batch_queue(env)
    environment = {"PREEMPTOR_SIM_DURATION_S": "1000", "PREEMPTOR_CHECKPOINT_S3_URI": f"s3://{BUCKET}/jobs/b", **workload}
    return submit_batch_job(env, queue, definition, environment)


def test_a_batch_job_with_no_room_in_its_compute_environments_waits_runnable_until_a_job_ends(emulation: Emulation) -> None:
    # Given a Batch pool of 32 GPUs (its compute environments'), whose jobs state their GPUs
    # (moto alone runs whatever is submitted: a pool's owner would see more than it owns)
    queue, definition = batch_queue(emulation)
    fleet = emulation.fleet(classify=lambda service, request: ("g5", _gpus(request)), batch_capacity={"g5": 32})
    batch = emulation.client("batch")

    def submit(name: str, gpus: int, seconds: int) -> str:
        return batch.submit_job(
            jobName=name, jobQueue=queue, jobDefinition=definition, tags={"preemptor:team": "nlp"},
            containerOverrides={
                "environment": [{"name": "PREEMPTOR_SIM_DURATION_S", "value": str(seconds)}],
                "resourceRequirements": [{"type": "GPU", "value": str(gpus)}],
            },
        )["jobId"]

    first, second = submit("first", 16, 600), submit("second", 16, 600)
    # When a third is submitted, whoever submits it, while the two run
    emulation.clock.advance(60)
    third = submit("third", 8, 600)
    emulation.clock.advance(120)

    # Then it waits RUNNABLE, holding nothing, and the wait is recorded with what held the room
    status = lambda job: batch.describe_jobs(jobs=[job])["jobs"][0]["status"]  # noqa: E731
    assert (status(first), status(second), status(third)) == ("RUNNING", "RUNNING", "RUNNABLE")
    assert fleet.gpus_in_use() == {"g5": 32}
    assert [(r.run, r.job_id, r.instance_type, r.requested, r.quota, r.holding) for r in fleet.quota_refusals] == [
        ("third", third, "GPUs", 8, 32, {first: 16, second: 16})  # by job id: Batch's names are not unique
    ]
    # And its detail states the GPUs it asked for, as AWS's DescribeJobs and events do
    requirements = batch.describe_jobs(jobs=[third])["jobs"][0]["container"]["resourceRequirements"]
    assert {r["type"]: r["value"] for r in requirements}["GPU"] == "8"
    # And once a job ends it starts (its startup done), and the pool never held more than its room
    emulation.clock.advance(600 - 180 + 30)
    assert (status(first), status(third)) == ("SUCCEEDED", "RUNNING")
    assert fleet.max_gpus_in_use() == {"g5": 32}


def _gpus(request: dict) -> int:
    overrides = (request.get("containerOverrides") or {}).get("resourceRequirements") or []
    return sum(int(r["value"]) for r in overrides if r["type"] == "GPU")


def test_a_terminated_batch_job_fails_after_the_grace_with_the_reason(emulation: Emulation) -> None:
    # Given a running Batch job (30 s startup) that checkpoints every 100 s of work
    fleet = emulation.fleet()
    job_id = submit_batch_work(emulation, PREEMPTOR_SIM_CHECKPOINT_EVERY_S="100")
    emulation.clock.advance(30 + 150)
    batch = emulation.client("batch")

    # When it is terminated
    batch.terminate_job(jobId=job_id, reason="Preempted by train-critical")
    emulation.clock.advance(29)
    still_running = batch.describe_jobs(jobs=[job_id])["jobs"][0]
    emulation.clock.advance(1)
    failed = batch.describe_jobs(jobs=[job_id])["jobs"][0]

    # Then it kept running for the 30 s grace, then FAILED with the terminate reason
    assert still_running["status"] == "RUNNING"
    assert (failed["status"], failed["statusReason"]) == ("FAILED", "Preempted by train-critical")
    assert failed["stoppedAt"] == int((START + 210) * 1000)
    assert checkpoints(emulation, "jobs/b") == [("jobs/b/step-000000000100", START + 130)]
    assert fleet.running() == []
    assert [(e["time"], e["detail"]["status"]) for e in emulation.events] == [
        (at(0), "RUNNABLE"),
        (at(30), "STARTING"),
        (at(30), "RUNNING"),
        (at(210), "FAILED"),
    ]
    # And the events have the real Batch shape
    envelope, detail = sample_keys(BATCH_SAMPLE)
    event = emulation.events[-1]
    assert set(event) == envelope
    assert detail - {"retryStrategy"} <= set(event["detail"])
    assert (event["source"], event["detail-type"]) == ("aws.batch", "Batch Job State Change")
    assert event["detail"]["statusReason"] == "Preempted by train-critical"
    assert event["detail"]["tags"] == {"preemptor:team": "nlp"}
    assert event["detail"]["createdAt"] == int(START * 1000)


def test_a_terminated_batch_job_whose_save_on_sigterm_outlasts_the_grace_is_killed_without_a_checkpoint(emulation: Emulation) -> None:
    # Given a running Batch job that checkpoints on SIGTERM, in 60 s, and the 30 s grace
    emulation.fleet()
    job_id = submit_batch_work(emulation, PREEMPTOR_SIM_CHECKPOINT_ON_STOP="true")
    emulation.clock.advance(30 + 150)

    # When it is terminated
    emulation.client("batch").terminate_job(jobId=job_id, reason="Preempted by train-critical")
    emulation.clock.advance(60)

    # Then it was killed at the end of the grace, its save cut short: no checkpoint (one
    # without its manifest is never resumed from, as the training helper writes them)
    failed = emulation.client("batch").describe_jobs(jobs=[job_id])["jobs"][0]
    assert (failed["status"], failed["stoppedAt"]) == ("FAILED", int((START + 210) * 1000))
    assert checkpoints(emulation, "jobs/b") == []


def test_checkpoint_writes_are_announced_as_s3_object_created_events(emulation: Emulation) -> None:
    # Given a fleet whose checkpoint bucket sends its events to EventBridge
    emulation.fleet(s3_events=True)
    create_training_job(
        emulation, "train-s3", {"PREEMPTOR_SIM_DURATION_S": "600", "PREEMPTOR_SIM_CHECKPOINT_EVERY_S": "100"}, "jobs/s3"
    )
    # When the job has written its first checkpoint
    emulation.clock.advance(230)
    # Then S3 announces each object of it, in the helper's upload order (state, the step's
    # manifest, the location's manifest), naming the bucket and stamped when written
    created = [e for e in emulation.events if e["source"] == "aws.s3"]
    assert [e["detail"]["object"]["key"] for e in created] == [
        "jobs/s3/step-000000000100/state.json",
        "jobs/s3/step-000000000100/manifest.json",
        "jobs/s3/manifest.json",
    ]
    assert {(e["detail-type"], e["detail"]["bucket"]["name"], e["time"]) for e in created} == {("Object Created", BUCKET, at(220))}


def test_clients_of_one_service_share_its_model_and_endpoint_rules_and_still_resolve_their_own_endpoints() -> None:
    import botocore.client
    import botocore.hooks
    import botocore.regions

    original_load_model = botocore.client.ClientCreator._load_service_model
    original_provider = botocore.regions.EndpointProvider
    original_accepts_kwargs = botocore.hooks.accepts_kwargs
    moto_patches.install(SimClock(START), lambda name, event: None)
    try:
        with mock_aws():
            # Given clients of two sessions, in two regions
            east = boto3.session.Session(region_name="us-east-1")
            west = boto3.session.Session(region_name="eu-west-1")
            one, two = east.client("sagemaker"), west.client("sagemaker")
            # Then they share one view of the service's model and one tree of its endpoint rules
            assert one.meta.service_model is two.meta.service_model
            assert one._ruleset_resolver._provider is two._ruleset_resolver._provider
            # and another service has its own
            assert east.client("dynamodb")._ruleset_resolver._provider is not one._ruleset_resolver._provider
            # And each still resolves its own region's endpoint, S3 (whose rules leave some
            # parameters out) included, and its calls are answered there
            assert one.meta.endpoint_url == "https://api.sagemaker.us-east-1.amazonaws.com"
            assert two.meta.endpoint_url == "https://api.sagemaker.eu-west-1.amazonaws.com"
            s3 = west.client("s3")
            s3.create_bucket(Bucket="rules", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
            assert s3.get_bucket_location(Bucket="rules")["LocationConstraint"] == "eu-west-1"
            assert two.list_training_jobs()["TrainingJobSummaries"] == []
            # And a handler that takes no keyword arguments is still refused, asked once or twice
            def no_kwargs(request):
                return None

            for _ in range(2):
                with pytest.raises(ValueError, match="must accept keyword arguments"):
                    one.meta.events.register("before-send", no_kwargs)
            one.meta.events.register("before-send", lambda request, **_: None)
    finally:
        moto_patches.uninstall()
    # And uninstalling puts botocore back
    assert botocore.client.ClientCreator._load_service_model is original_load_model
    assert botocore.regions.EndpointProvider is original_provider
    assert botocore.hooks.accepts_kwargs is original_accepts_kwargs
