"""The SAM application on emulated AWS: template.yaml loaded into moto, in-process.

`EmulatedStack` reads the real template and creates, in moto, what the controller uses: the
jobs table with its key schema and index, the checkpoint bucket, the alerts topic (with a
queue subscribed, so alerts can be read back), the dead-letter queue, one Lambda function per
`AWS::Serverless::Function` (invoking it runs our handler in-process), every state machine
from its `DefinitionUri` with its `DefinitionSubstitutions` resolved, and the EventBridge rule
patterns of every function, used to route events to their targets (moto's `put_events`
cannot invoke Lambda targets). Nothing here is used on AWS.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
import warnings
import zipfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import boto3
from moto import mock_aws
from moto.dynamodb.models import dynamodb_backends
from moto.events.models import EventPattern

from preemptor import clock as clock_module
from preemptor.adapters.store import item_to_record
from preemptor.core.jobs import JobRecord
from preemptor.handlers import config_check, wiring
from . import aws_calls, moto_patches, retry_quota
from .clock import SimClock
from .executions import ExecutionStillRunning, running_executions
from .hostile import HostileWorld
from .state import DeployFailed

from ..paths import REPO_ROOT as ROOT
TEMPLATE = ROOT / "template.yaml"
CONFIG_CHECK = "Custom::PreemptorConfigCheck"
ACCOUNT = "123456789012"
_DRAIN_POLL_S = 0.002

# Quiet moto and the AWS SDK: they log whole requests and objects.
for _noisy in ("moto", "botocore", "boto3", "urllib3", "aws_xray_sdk"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)


def load_template(path: Path = TEMPLATE) -> dict:
    """Parse a CloudFormation/SAM template, short-form intrinsics (!Ref, !Sub...) included.
    Each caller gets its own copy; the parse (~0.3 s) is done once per file version."""
    stat = Path(path).stat()
    return json.loads(_parsed_template(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _parsed_template(path: str, _mtime_ns: int, _size: int) -> str:
    """The template as JSON text: each copy is one `json.loads` of plain data, where a deep
    copy of cfn-lint's parse (its nodes carry their source positions, and copy themselves
    in Python) cost a quarter of a stack's start."""
    from cfnlint.decode.cfn_yaml import load

    return json.dumps(load(path))


@dataclass
class LambdaContext:
    """The attributes of the Lambda context object that Powertools reads."""

    function_name: str
    memory_limit_in_mb: int = 512
    function_version: str = "$LATEST"
    invoked_function_arn: str = ""
    aws_request_id: str = "local"
    log_group_name: str = ""
    log_stream_name: str = ""

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 60_000


@dataclass
class Rule:
    name: str
    pattern: EventPattern
    function: str
    bus: str = "default"  # the rule's EventBusName (physical name)


@dataclass
class DeployedFunction:
    name: str
    arn: str
    handler: str
    environment: dict[str, str]
    on_failure: str | None = None  # the queue (URL) its failed asynchronous invocations go to


@dataclass
class RoutedEvent:
    """What happened to one event put on the emulated bus."""

    event: dict
    at: float = 0.0  # simulated time of delivery
    results: list[dict] = field(default_factory=list)

    @property
    def matched(self) -> bool:
        return bool(self.results)


class EmulatedStack:
    """Deploy template.yaml into moto and run it. Use as a context manager."""

    def __init__(
        self,
        clock: SimClock,
        *,
        parameters: dict[str, str] | None = None,
        stack_name: str = "preemptor",
        region: str = "us-east-1",
        template_path: Path = TEMPLATE,
        hostile: HostileWorld | None = None,
        metrics: list[dict] | None = None,
    ):
        self.clock = clock
        self.hostile = hostile
        # When given, the functions' metrics are on and every EMF document they print is
        # appended here instead (tests/unit/test_dashboard.py reads what was emitted).
        self.metrics = metrics
        self.dead_letters: list[tuple[dict, str]] = []  # events a function failed on, after retries
        self.async_retries: list[tuple[float, int, str, dict]] = []  # (due, attempt, function, event)
        # Who runs an asynchronous Invoke made to moto (`_invoke_async`): None, the caller's thread.
        self.async_handoff: Callable[[str, dict], None] | None = None
        self.stack_name = stack_name
        self.region = region
        self.template_path = template_path
        self.overrides = parameters or {}
        self.functions: dict[str, DeployedFunction] = {}
        self.state_machines: dict[str, str] = {}
        self.rules: list[Rule] = []
        self.resources: dict[str, str] = {}
        self.types: dict[str, str] = {}
        self.parameters: dict[str, str] = {}
        self.schedules: list[ScheduledRule] = []  # the functions' `Schedule` events
        self.outbox: deque[dict] = deque()  # events emitted by the fleet, routed by `pump` (and `drain`)
        self.routed = 0  # events routed from the outbox so far
        self._router = threading.Lock()  # one thread routes the outbox at a time
        self._on_event: Callable[[RoutedEvent], None] | None = None  # the `pump` under way's
        self._mock = mock_aws(config=moto_patches.MOTO_CONFIG)
        self._env_backup: dict[str, str | None] = {}
        self._lock = threading.RLock()
        # Every AWS call of a function or workflow, with its IAM checks (tests/unit/test_iam.py).
        self.calls = aws_calls.CallRecorder.for_stack(self)

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedStack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._set_env(
            {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_SESSION_TOKEN": "testing",
                "AWS_DEFAULT_REGION": self.region,
                "AWS_REGION": self.region,
                "POWERTOOLS_TRACE_DISABLED": "true",
                "POWERTOOLS_METRICS_DISABLED": "false" if self.metrics is not None else "true",
                "POWERTOOLS_LOG_LEVEL": "ERROR",
                "POWERTOOLS_DEV": "false",
                # moto's catalogue of public AMIs, thousands given random ids with every EC2
                # backend (a third of a second, twice a stack): nothing here reads one, and
                # the fleet registers the image its instances run.
                "MOTO_EC2_LOAD_DEFAULT_AMIS": "false",
            }
        )
        self._mock.start()
        if self.metrics is not None:
            _capture_emf(self.metrics)
        # Functions that emitted no metric in an invocation say so; locally that is noise.
        warnings.filterwarnings("ignore", message="No application metrics to publish")
        clock_module.use_clock(self.clock)
        moto_patches.install(self.clock, self._invoke_from_workflow, self._invoke_async)
        retry_quota.install()  # each function spends its own retries, as its containers do
        # After the patches: the recorder wraps moto's Task states as patched.
        self.calls.install()
        if self.hostile is not None:
            self.hostile.install(stop_execution=self._abort_execution, controller=self.stack_name)
        wiring.reset()
        self.session = boto3.session.Session(region_name=self.region)
        self._clients: dict[str, Any] = {}
        self._clients_lock = threading.Lock()
        try:
            self._deploy(load_template(self.template_path))
        except Exception:
            self.stop()  # as CloudFormation rolls back: nothing of the stack is left running
            raise
        # Concurrent workflows wait their turns: each Wait or Retry interval ends in the order
        # of their ends, once every running execution waits too (`SimClock.take_turns`).
        # Nor while an event the fleet emitted waits to be routed (`drain` routes it): a run
        # that ends while a workflow waits is delivered at its time, as EventBridge would.
        self.clock.take_turns(lambda sleeping: not self.outbox and len(self._running_executions()) <= sleeping)
        wiring.reset()
        self._quiet_function_logs()
        self._configure_function_metrics()

    def _quiet_function_logs(self) -> None:
        """Function logs go to stderr at the stack's LogLevel (ERROR unless overridden), so
        the CLI's own output stays readable; on AWS they go to CloudWatch Logs."""
        from preemptor.handlers.observability import logger

        logger.setLevel(self.parameters["LogLevel"])
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(_CurrentStderr())

    def _configure_function_metrics(self) -> None:
        """On Lambda the functions' module-level Metrics read their namespace and service from
        the environment at import; here the package may have been imported before the stack
        set that environment (another test, the CLI), so they are set now."""
        from preemptor.handlers.observability import metrics

        metrics.namespace = os.environ.get("POWERTOOLS_METRICS_NAMESPACE")
        metrics.service = os.environ.get("POWERTOOLS_SERVICE_NAME")

    def stop(self) -> None:
        try:
            self.clock.take_turns(None)
            self._end_executions()
            if self.metrics is not None:
                _capture_emf(None)
            self.calls.uninstall()
            if self.hostile is not None:
                self.hostile.uninstall()
            moto_patches.uninstall()
            clock_module.use_clock(clock_module.SystemClock())
            wiring.reset()
        finally:
            self._mock.stop()
            for key, value in self._env_backup.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _set_env(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self._env_backup.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def client(self, service: str) -> Any:
        """One client per service for the stack's life (botocore clients are thread-safe,
        and each costs ~10 ms to build); made after the recorder's and the hostile world's
        hooks are installed, so every one carries them."""
        with self._clients_lock:
            if service not in self._clients:
                self._clients[service] = self.session.client(service)
            return self._clients[service]

    # -- deployment -----------------------------------------------------------------------
    def _deploy(self, template: dict) -> None:
        self.parameters = {
            name: str(spec.get("Default", "")) for name, spec in template.get("Parameters", {}).items()
        }
        self.parameters["LogLevel"] = "ERROR"
        self.parameters.update(self.overrides)
        if not self.parameters.get("CheckpointBucketName"):
            self.parameters["CheckpointBucketName"] = f"{self.stack_name}-checkpoints"
        if not self.parameters.get("ManagedRoleArnForTraining"):
            self.parameters["ManagedRoleArnForTraining"] = f"arn:aws:iam::{ACCOUNT}:role/{self.stack_name}-training"
        resources = template["Resources"]
        globals_env = template.get("Globals", {}).get("Function", {}).get("Environment", {}).get("Variables", {})

        # Names and ARNs first, so intrinsics resolve whatever the order of creation.
        for logical, res in resources.items():
            self.resources[logical] = self._physical_id(logical, res)
            self.types[logical] = res["Type"]

        # The configuration check CloudFormation runs before any function (`ConfigCheck`):
        # a configuration the functions could not run fails this deploy too, named.
        for logical, res in resources.items():
            if res["Type"] == CONFIG_CHECK:
                # (Its code version is CloudFormation's to compare: the emulator deploys once.)
                skipped = {"ServiceToken", config_check.CODE_VERSION}
                properties = {k: self.resolve(v) for k, v in res["Properties"].items() if k not in skipped}
                found = config_check.problem(properties)
                if found:
                    raise DeployFailed(f"{logical}: CREATE_FAILED: {found}")

        for logical, res in resources.items():
            kind, props = res["Type"], res.get("Properties", {})
            if kind == "AWS::DynamoDB::Table":
                self._create_table(logical, props)
            elif kind == "AWS::SNS::Topic":
                self._create_topic(logical)
            elif kind == "AWS::SQS::Queue":
                # Its Ref is its URL, as CloudFormation's (`_get_att` makes its ARN).
                self.resources[logical] = self.client("sqs").create_queue(QueueName=self.resources[logical])["QueueUrl"]
            elif kind == "AWS::Events::EventBus":
                # Only so that PutEvents on it is accepted (the local stack's HTTP endpoint):
                # routing to the functions is `put_event`'s, by the functions' rules.
                self.client("events").create_event_bus(Name=self.resources[logical])
        self.client("s3").create_bucket(Bucket=self.parameters["CheckpointBucketName"])

        role = self.client("iam").create_role(
            RoleName=f"{self.stack_name}-local-role",
            AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": []}),
        )["Role"]["Arn"]
        functions = {k: v for k, v in resources.items() if v["Type"] == "AWS::Serverless::Function"}
        shared_env: dict[str, str] = {}
        for logical, res in functions.items():
            props = res["Properties"]
            env = {k: str(self.resolve(v)) for k, v in globals_env.items()}
            env.update({k: str(self.resolve(v)) for k, v in props.get("Environment", {}).get("Variables", {}).items()})
            name = self.resources[logical]
            self.client("lambda").create_function(
                FunctionName=name,
                Runtime="python3.11",
                Role=role,
                Handler=props["Handler"],
                Code={"ZipFile": _empty_zip()},
                Environment={"Variables": env},
            )
            self.functions[name] = DeployedFunction(
                name, self.resolve({"Fn::GetAtt": [logical, "Arn"]}), props["Handler"], env, self._on_failure_queue(props)
            )
            shared_env.update(env)
            for event_name, event in props.get("Events", {}).items():
                if event["Type"] == "Schedule":
                    period = _rate_seconds(str(self.resolve(event["Properties"]["Schedule"])))
                    if period:
                        self.schedules.append(ScheduledRule(f"{logical}{event_name}", name, period))
                if event["Type"] == "EventBridgeRule":
                    pattern = json.dumps(self.resolve(event["Properties"]["Pattern"]))
                    bus = str(self.resolve(event["Properties"].get("EventBusName", "default")))
                    self.rules.append(Rule(f"{logical}{event_name}", EventPattern.load(pattern), name, bus))
        # Functions share one process here, so they share one environment: the union of theirs.
        self._set_env(shared_env)

        sfn = self.client("stepfunctions")
        for logical, res in resources.items():
            if res["Type"] != "AWS::Serverless::StateMachine":
                continue
            props = res["Properties"]
            definition = (self.template_path.parent / props["DefinitionUri"]).read_text()
            subs = {k: str(self.resolve(v)) for k, v in props.get("DefinitionSubstitutions", {}).items()}
            definition = re.sub(r"\$\{(\w+)\}", lambda m: subs[m.group(1)], definition)
            arn = sfn.create_state_machine(name=self.resources[logical].rsplit(":", 1)[-1], definition=definition, roleArn=role)[
                "stateMachineArn"
            ]
            self.state_machines[logical] = arn

    def _physical_id(self, logical: str, res: dict) -> str:
        kind, props = res["Type"], res.get("Properties", {})
        if kind == "AWS::Serverless::StateMachine":
            name = self.resolve(props["Name"]) if "Name" in props else f"{self.stack_name}-{logical}"
            return f"arn:aws:states:{self.region}:{ACCOUNT}:stateMachine:{name}"
        if kind == "AWS::SNS::Topic":
            return f"arn:aws:sns:{self.region}:{ACCOUNT}:{self.stack_name}-{logical}"
        return f"{self.stack_name}-{logical}"

    def _on_failure_queue(self, props: dict) -> str | None:
        """The URL of the SQS queue a function's `EventInvokeConfig` sends its failed
        asynchronous invocations to (None: Lambda discards them)."""
        on_failure = props.get("EventInvokeConfig", {}).get("DestinationConfig", {}).get("OnFailure", {})
        if on_failure.get("Type") != "SQS":
            return None
        arn = str(self.resolve(on_failure["Destination"]))
        return self.client("sqs").get_queue_url(QueueName=arn.rsplit(":", 1)[-1])["QueueUrl"]

    def _create_table(self, logical: str, props: dict) -> None:
        kwargs = {
            "TableName": self.resources[logical],
            "KeySchema": props["KeySchema"],
            "AttributeDefinitions": props["AttributeDefinitions"],
            "BillingMode": props.get("BillingMode", "PAY_PER_REQUEST"),
        }
        if props.get("GlobalSecondaryIndexes"):
            kwargs["GlobalSecondaryIndexes"] = props["GlobalSecondaryIndexes"]
        self.client("dynamodb").create_table(**kwargs)

    def _create_topic(self, logical: str) -> None:
        sns, sqs = self.client("sns"), self.client("sqs")
        arn = sns.create_topic(Name=f"{self.stack_name}-{logical}")["TopicArn"]
        queue = sqs.create_queue(QueueName=f"{self.stack_name}-{logical}-inbox")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=arn, Protocol="sqs", Endpoint=queue_arn, Attributes={"RawMessageDelivery": "true"})
        self.resources[f"{logical}#inbox"] = queue

    # -- intrinsics -----------------------------------------------------------------------
    def resolve(self, value: Any) -> Any:
        """Resolve the intrinsic functions the template uses, against this emulated stack."""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) != 1 or not next(iter(value)).startswith(("Ref", "Fn::")):
            return {k: self.resolve(v) for k, v in value.items()}
        (fn, arg), = value.items()
        if fn == "Ref":
            return self._ref(arg)
        if fn == "Fn::GetAtt":
            logical, attr = arg if isinstance(arg, list) else arg.split(".", 1)
            return self._get_att(logical, attr)
        if fn == "Fn::Sub":
            return self._sub(arg)
        if fn == "Fn::If":
            return self.resolve(arg[1])  # conditions only toggle optional extras locally
        if fn == "Fn::Join":
            delimiter, items = arg
            items = self.resolve(items)
            if isinstance(items, str):  # a CommaDelimitedList parameter (kept as its text here)
                items = [i.strip() for i in items.split(",")]
            return delimiter.join(str(i) for i in items)
        return value

    def _ref(self, name: str) -> str:
        pseudo = {
            "AWS::StackName": self.stack_name,
            "AWS::StackId": f"arn:aws:cloudformation:{self.region}:{ACCOUNT}:stack/{self.stack_name}/"
            + str(uuid.uuid5(uuid.NAMESPACE_URL, self.stack_name)),
            "AWS::Region": self.region,
            "AWS::AccountId": ACCOUNT,
            "AWS::Partition": "aws",
        }
        if name in pseudo:
            return pseudo[name]
        if name in self.parameters:
            return self.parameters[name]
        return self.resources[name]

    def _get_att(self, logical: str, attr: str) -> str:
        physical = self.resources[logical]
        if attr == "TopicName":
            return physical.rsplit(":", 1)[-1]
        if attr != "Arn" or physical.startswith("arn:"):
            return physical
        service = _ARN_SERVICE.get(self.types.get(logical, ""))
        if service == "lambda":
            return f"arn:aws:lambda:{self.region}:{ACCOUNT}:function:{physical}"
        if service == "dynamodb":
            return f"arn:aws:dynamodb:{self.region}:{ACCOUNT}:table/{physical}"
        if service == "kms":
            return f"arn:aws:kms:{self.region}:{ACCOUNT}:key/{physical}"
        if service == "sqs":  # its name, the last part of its URL
            return f"arn:aws:sqs:{self.region}:{ACCOUNT}:{physical.rsplit('/', 1)[-1]}"
        if service == "events":
            return f"arn:aws:events:{self.region}:{ACCOUNT}:event-bus/{physical}"
        return f"arn:aws:{service or 'local'}:{self.region}:{ACCOUNT}:{physical}"

    def _sub(self, template: Any) -> str:
        text, variables = (template, {}) if isinstance(template, str) else (template[0], template[1])

        def replace(match: re.Match) -> str:
            name = match.group(1)
            if name.startswith("!"):  # ${!Literal}: written as ${Literal} (an IAM policy variable)
                return "${" + name[1:] + "}"
            if name in variables:
                return str(self.resolve(variables[name]))
            if "." in name:
                logical, attr = name.split(".", 1)
                return self._get_att(logical, attr)
            return self._ref(name)

        return re.sub(r"\$\{(![^}]*|[\w:.]+)\}", replace, text)

    # -- running ---------------------------------------------------------------------------
    def invoke_lambda(self, function_name: str, event: dict) -> Any:
        """Run a function's handler in-process (moto's Lambda calls this)."""
        fn = self.functions[function_name.rsplit(":", 1)[-1]]
        module_name, attr = fn.handler.rsplit(".", 1)
        handler: Callable = getattr(importlib.import_module(module_name), attr)
        try:
            with self.calls.acting_as(fn.name), HostileWorld.acting_as(fn.name):
                return handler(event, LambdaContext(function_name=fn.name, invoked_function_arn=fn.arn))
        finally:
            # With metrics disabled Powertools keeps what it did not publish; a Lambda
            # container would have flushed it. Drop it, so nothing piles up or prints at exit.
            from preemptor.handlers.observability import metrics

            metrics.clear_metrics()

    def _invoke_from_workflow(self, function_name: str, event: dict) -> Any:
        """A workflow step's Lambda (moto's Lambda calls this); in a hostile world it may die
        after its work, before it returns."""
        result = self.invoke_lambda(function_name, event)
        if self.hostile is not None and self.hostile.crash_after_step(function_name, event):
            raise moto_patches.LambdaRuntimeExited(
                f"RequestId: emulated Error: Runtime exited with error: signal: killed ({function_name})"
            )
        return result

    def _abort_execution(self, execution_arn: str, error: str, cause: str) -> None:
        # The hostile world kills the execution (a crash), not one of the stack's principals.
        with self.calls.unattributed():
            self.client("stepfunctions").stop_execution(executionArn=execution_arn, error=error, cause=cause)

    def _invoke_async(self, function_name: str, event: dict) -> None:
        """An `InvocationType=Event` invocation (`preemptor redrive` makes them): handed to
        `async_handoff` when set (the local stack's driver thread runs it), else run now."""
        if self.async_handoff is not None:
            self.async_handoff(function_name, event)
        else:
            self.invoke_async(function_name, event)

    def invoke_async(self, function_name: str, event: dict) -> Any:
        """Lambda's asynchronous invocation of one function: a failure is Lambda's to retry
        and then dead-letter, never raised to the caller."""
        return self._deliver(function_name, event, raises=False)

    # Lambda's asynchronous invocation (EventBridge targets): two retries, a minute after
    # the failure and two minutes after that, then the function's dead-letter queue.
    ASYNC_RETRY_DELAYS_S = (60.0, 120.0)
    ASYNC_ATTEMPTS = 1 + len(ASYNC_RETRY_DELAYS_S)

    @property
    def submission_bus(self) -> str:
        """The stack's own event bus, where teams put "Job Submitted", "Job Cancelled" and "Job Priority Lowered"."""
        return self.resources["SubmissionBus"]

    def sender_bus(self, event: dict) -> str:
        """The bus an event's sender puts it on: a team's `preemptor.<team>` events go to
        the stack's bus, AWS services' events to the account's default bus."""
        source = event.get("source") if isinstance(event, dict) else None
        if isinstance(source, str) and source.startswith("preemptor"):
            return self.submission_bus
        return "default"

    def put_event(self, event: dict, bus: str | None = None) -> RoutedEvent:
        """Deliver an event put on `bus` (default: `sender_bus`) to every function whose
        EventBridge rule on that bus matches it.

        Without a hostile world a function's error is raised to the caller (a test wants to
        see it); in a hostile world it is retried as Lambda retries an asynchronous
        invocation, then recorded in `dead_letters` and as the result."""
        routed = RoutedEvent(event, self.clock.now())
        bus = bus or self.sender_bus(event)
        for rule in self.rules:
            if rule.bus == bus and rule.pattern.matches_event(event):
                routed.results.append(self._deliver(rule.function, event))
        return routed

    def _deliver(self, function_name: str, event: dict, attempt: int = 1, *, raises: bool | None = None) -> Any:
        """One asynchronous invocation's attempt (`raises`: a handler's error goes to the
        caller instead; by default, without a hostile world)."""
        if raises is None:
            raises = self.hostile is None
        try:
            return self.invoke_lambda(function_name, event)
        except Exception as e:  # noqa: BLE001 - what Lambda's async retries see
            if raises:
                raise
            error = e
        reason = f"{type(error).__name__}: {error}"
        if attempt < self.ASYNC_ATTEMPTS:
            delay = self.ASYNC_RETRY_DELAYS_S[attempt - 1]
            self.async_retries.append((self.clock.now() + delay, attempt + 1, function_name, event))
            return {"outcome": "retrying", "reason": f"attempt {attempt} failed, Lambda retries in {delay:.0f} s: {reason}"}
        self._dead_letter(function_name, event, error)
        return {"outcome": "failed", "reason": f"dead-lettered after {self.ASYNC_ATTEMPTS} attempts: {reason}"}

    def _dead_letter(self, function_name: str, event: dict, error: Exception) -> None:
        """What Lambda does with an event whose attempts all failed: the invocation record
        it sends to the function's on-failure destination, an SQS queue here (Lambda
        developer guide, "Capturing records of Lambda asynchronous invocations"); without
        one, it is discarded. Sent as Lambda sends it, so no function's call."""
        self.dead_letters.append((event, f"{type(error).__name__}: {error}"))
        fn = self.functions[function_name.rsplit(":", 1)[-1]]
        if fn.on_failure is None:
            return
        now = self.clock.now()
        record = {
            "version": "1.0",
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z",
            "requestContext": {
                "requestId": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{fn.arn}/{len(self.dead_letters)}")),
                "functionArn": f"{fn.arn}:$LATEST",
                "condition": "RetriesExhausted",
                "approximateInvokeCount": self.ASYNC_ATTEMPTS,
            },
            "requestPayload": event,
            "responseContext": {"statusCode": 200, "executedVersion": "$LATEST", "functionError": "Unhandled"},
            "responsePayload": {"errorMessage": str(error), "errorType": getattr(error, "error_type", type(error).__name__)},
        }
        with self.calls.unattributed():
            self.client("sqs").send_message(QueueUrl=fn.on_failure, MessageBody=json.dumps(record))

    def _retry_due(self) -> int:
        """Lambda's retries of failed deliveries whose time has come (each to the one
        function that failed, not to every rule's)."""
        due = [r for r in self.async_retries if r[0] <= self.clock.now()]
        for retry in due:
            self.async_retries.remove(retry)
            _, attempt, function_name, event = retry
            self._deliver(function_name, event, attempt)
            self._until_parked()
        return len(due)

    def fire_schedules(self, on_event: Callable[[RoutedEvent], None] | None = None) -> int:
        """Invoke every scheduled function whose rate has come round since the stack started
        (EventBridge's "Scheduled Event"), letting the workflows it starts finish; returns how many.
        What the fleet emits meanwhile is routed by `drain`, told to `on_event` too."""
        self._on_event = on_event
        try:
            return self._fire_schedules(on_event)
        finally:
            self._on_event = None

    def _fire_schedules(self, on_event: Callable[[RoutedEvent], None] | None) -> int:
        fired = 0
        for rule in self.schedules:
            if rule.next_at is None:
                rule.next_at = self.clock.now() + rule.period_s
            while rule.next_at <= self.clock.now():
                event = {
                    "version": "0",
                    "id": f"{rule.name}-{int(rule.next_at)}",
                    "detail-type": "Scheduled Event",
                    "source": "aws.events",
                    "account": ACCOUNT,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rule.next_at)),
                    "region": self.region,
                    "resources": [f"arn:aws:events:{self.region}:{ACCOUNT}:rule/{self.stack_name}-{rule.name}"],
                    "detail": {},
                }
                routed = RoutedEvent(event, self.clock.now(), [self._deliver(rule.function, event)])
                self.drain()
                rule.next_at += rule.period_s
                fired += 1
                if on_event:
                    on_event(routed)
        return fired

    def emit(self, event: dict) -> None:
        """Queue an event from the simulated fleet; `pump` routes it."""
        self.outbox.append(event)

    def pump(self, on_event: Callable[[RoutedEvent], None] | None = None) -> int:
        """Route the queued events, all of one moment together, as AWS delivers them: the
        clock stands still while they are routed one by one, each after the workflows the
        ones before it started have gone as far as they can without time passing (to their
        first wait: a settle window, a checkpoint poll, a retry's interval). Then time runs
        again and the workflows finish; what the fleet emits meanwhile (a run that ends
        during a checkpoint wait) is routed by `drain` at its time, each Wait moving time
        only as far as the fleet's next transition first (`SimClock.on_due`): before, it
        was routed once every workflow had finished, up to a checkpoint wait late. Routed
        with a drain between them, the runs that ended together would be planned one by
        one, each plan's wait moving time past the others' events. Returns how many events
        were routed (by `drain` too)."""
        before, self._on_event = self.routed, on_event
        try:
            if self.hostile is not None:
                with self.clock.held():
                    self.routed += self._retry_due()
                if self.routed > before:
                    self.drain()
                self.outbox.extend(self.hostile.release_held())
            while self.outbox:
                with self._router:
                    self._route()
                self.drain()
        finally:
            self._on_event = None
        return self.routed - before

    def _route(self) -> None:
        """Route the queued events of one moment, the clock held (`pump`); the caller holds
        `_router`."""
        with self.clock.held():
            while self.outbox:
                event = self.outbox.popleft()
                if self.hostile is not None and not self.hostile.deliver(event):
                    continue  # held back: delivered late, after the next round's events
                routed = self.put_event(event)
                self._until_parked()
                self.routed += 1
                if self._on_event:
                    self._on_event(routed)

    def _until_parked(self, timeout_s: float = 120.0) -> None:
        """While this thread holds the clock: wait until every running workflow execution
        waits for time to pass (its threads parked in an advance; a Map's items counted as
        their one execution, `SimClock.idle`)."""
        deadline = time.monotonic() + timeout_s
        while len(running := self._running_executions()) > self.clock.idle():
            if time.monotonic() >= deadline:
                raise ExecutionStillRunning(f"{running[0]} still going after {timeout_s:g} real seconds of a held clock")
            time.sleep(_DRAIN_POLL_S)

    def _end_executions(self, timeout_s: float = 30.0) -> None:
        """No workflow outlives the stack: let the running ones finish, and stop those that
        do not (their threads would go on calling a torn-down moto, and be recorded by the
        next stack as calls of an unknown principal)."""
        if not self.state_machines:
            return
        try:
            self.drain(timeout_s)
        except Exception:  # noqa: BLE001 - still running past the bound: stopped below
            pass
        sfn = self.client("stepfunctions")
        with self.calls.unattributed():
            for arn in self.state_machines.values():
                for e in sfn.list_executions(stateMachineArn=arn, statusFilter="RUNNING")["executions"]:
                    sfn.stop_execution(executionArn=e["executionArn"], error="StackStopped", cause="the emulated stack stopped")

    def drain(self, timeout_s: float = 120.0, but: str | None = None) -> None:
        """Wait until no workflow execution is running (executions run in moto's threads),
        `but` that one (the execution a caller runs in, e.g. a listener of its steps),
        routing what the fleet emits meanwhile: the waits do not go on while an event
        waits to be routed (`take_turns`)."""
        deadline = time.monotonic() + timeout_s
        # `but`'s thread waits here for the others: it does not hold up their turns.
        with self.clock.aside() if but is not None else contextlib.nullcontext():
            while running := [arn for arn in self._running_executions() if arn != but]:
                # What the fleet emitted while they wait (a run ended during a checkpoint
                # wait) is routed now, at its time: the waits go on once it is.
                if self.outbox and self._router.acquire(blocking=False):
                    try:
                        self._route()
                    finally:
                        self._router.release()
                    continue
                if time.monotonic() >= deadline:
                    raise ExecutionStillRunning(f"{running[0]} still RUNNING after {timeout_s:g} real seconds")
                time.sleep(_DRAIN_POLL_S)

    def _running_executions(self) -> list[str]:
        return running_executions(ACCOUNT, self.region, set(self.state_machines.values()))

    def executions(self, logical: str) -> list[dict]:
        sfn = self.client("stepfunctions")
        return sfn.list_executions(stateMachineArn=self.state_machines[logical])["executions"]

    def alerts(self) -> list[str]:
        """Messages published to the alerts topic so far (read back through its queue)."""
        sqs = self.client("sqs")
        out = []
        while True:
            messages = sqs.receive_message(
                QueueUrl=self.resources["AlertsTopic#inbox"], MaxNumberOfMessages=10
            ).get("Messages", [])
            if not messages:
                return out
            for m in messages:
                out.append(m["Body"])
                sqs.delete_message(QueueUrl=self.resources["AlertsTopic#inbox"], ReceiptHandle=m["ReceiptHandle"])

    def deps(self) -> wiring.Deps:
        """The same settings and adapters the functions use."""
        return wiring.deps()

    def jobs(self) -> list[JobRecord]:
        """Every job record, read from the emulated table itself: for the emulator's own
        observers (the demo loop, the wait alarm), which look after every event. A scan
        through boto3 and moto's wire format costs ~20 ms a look, this a fraction of it; and no
        fault the hostile world injects into the controller's calls reaches it."""
        table = dynamodb_backends[ACCOUNT][self.region].get_table(self.resources["JobsTable"])
        items = [item for by_sort in list(table.items.values()) for item in list(by_sort.values())]  # unsorted
        return [item_to_record(i.to_json()["Attributes"]) for i in items if i.range_key.value == "JOB"]


@dataclass
class ScheduledRule:
    """A function's `Schedule` event: invoked every `period_s` simulated seconds."""

    name: str
    function: str
    period_s: float
    next_at: float | None = None


def _rate_seconds(expression: str) -> float | None:
    """Seconds of a `rate(N unit)` schedule expression; None for cron expressions."""
    match = re.fullmatch(r"rate\((\d+) (minute|minutes|hour|hours|day|days)\)", expression.strip())
    if match is None:
        return None
    unit = {"minute": 60, "hour": 3600, "day": 86400}[match.group(2).rstrip("s")]
    return int(match.group(1)) * unit


def _capture_emf(sink: list[dict] | None) -> None:
    """Powertools prints each EMF document (`print(json.dumps(...))` in its CloudWatch EMF
    provider and in `single_metric`): with a sink, those prints append the document to it;
    with None, printing is theirs again."""
    from aws_lambda_powertools.metrics import base
    from aws_lambda_powertools.metrics.provider.cloudwatch_emf import cloudwatch

    for module in (base, cloudwatch):
        if sink is None:
            module.__dict__.pop("print", None)
        else:
            module.print = lambda text, *_a, **_k: sink.append(json.loads(text)) if text and text != "null" else None


class _CurrentStderr:
    """Whatever `sys.stderr` is at the time of writing (test runners swap it per test)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_ARN_SERVICE = {
    "AWS::Serverless::Function": "lambda",
    "AWS::SQS::Queue": "sqs",
    "AWS::DynamoDB::Table": "dynamodb",
    "AWS::KMS::Key": "kms",
    "AWS::Events::EventBus": "events",
}

def _empty_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("handler.py", "# the local runtime runs the preemptor package in-process\n")
    return buf.getvalue()
