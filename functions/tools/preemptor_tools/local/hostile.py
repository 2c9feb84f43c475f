"""A world that says no: the emulated AWS answering as real AWS does on a bad day.

Given a scenario's `chaos:` rates and `faults:`, `HostileWorld` makes the emulated stack
- throttle AWS calls the controller makes (`throttle_rate`), with each service's own
  throttling error (DynamoDB `ThrottlingException`/`ProvisionedThroughputExceededException`,
  SageMaker `ThrottlingException`, Batch `TooManyRequestsException`, S3 `SlowDown`, SNS
  `Throttled`, ...). A function's call is throttled attempt by attempt, in place of moto's
  answer (nothing is carried out) and as the service sends it over the wire (its protocol's
  error body, status and headers), so botocore parses it and retries it as it would AWS's,
  by the client's own retry settings: a call fails only when every attempt was throttled (or
  the service's throttle is one botocore does not retry, SNS's). Step Functions' service
  integrations (`states:startExecution`, `sns:publish`) are throttled call by call, from a
  botocore `before-call` hook on their clients: the workflow's task sees the error;
- cancel DynamoDB transactions (`transaction_conflict_rate`) with
  `TransactionCanceledException`, one item's reason `TransactionConflict`;
- deliver events twice (`duplicate_rate`: the copy, same `id`, arrives after newer events)
  and late (`reorder_rate`: held back behind the events of the next delivery round);
- kill a workflow step's Lambda after its work and before it returns (`crash_rate`):
  Step Functions sees `Lambda.Unknown`;
- answer a query of a DynamoDB index as the index stood a moment ago (`index_lag_rate`,
  `index_lag.py`): the writes of the last simulated second not in it yet;
- lose the answer of a call AWS applied (`answer_lost_rate`): the request reached AWS and
  was carried out, and the connection then failed (`ReadTimeoutError` or
  `ConnectionClosedError`). Each attempt is drawn on its own, once moto has carried it out,
  so botocore retries as it would on AWS, by the client's own retry settings: the retry's
  answer is the one the caller sees (DynamoDB's for a transaction with the same
  `ClientRequestToken`: success, and nothing written again; a conditional write's: its
  condition failed, on its own first write), or the connection error when every attempt
  lost its answer. botocore's backoff between attempts takes no time here. Only the
  functions' own calls: Step Functions' calls to AWS are AWS's own;
- `stop_denied` a job's stops (AccessDeniedException) for `duration` seconds;
  `stopped_by_hand` (someone stops the job's run outside the controller, done by the demo
  driver); `workflow_crash` (the next execution dies, ABORTED, after its first step).

Stops of runs the controller did not launch (no `preemptor:managed=true` tag), and of runs
of another stack (its name in `preemptor:controller`), are refused with AccessDeniedException,
as the template's IAM conditions on `aws:ResourceTag` do.

Every decision comes from the seed: a draw is a hash of (seed, what, key, n-th draw for that
key), so a run does not depend on the order threads happen to call in beyond what the key
already fixes. What was injected is kept in `injected` (and counted by kind).
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import json
import re
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

import botocore.endpoint
import botocore.handlers
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectionClosedError, ReadTimeoutError
from moto.core.botocore_stubber import MockRawResponse

from . import moto_patches
from .clock import SimClock
from .index_lag import LaggingIndex
from .moto_patches import batch as batch_patches
from .moto_patches import sagemaker as sagemaker_patches
from .moto_patches._core import replace
from .scenario import Chaos, Fault, StopDenied, WorkflowCrash

# Who is calling AWS: the function whose handler runs in this context (set by the stack).
ACTOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("preemptor_actor", default=None)
_PARAMS_KEY = "preemptor_hostile_params"
_ACTOR_KEY = "preemptor_hostile_actor"
_SEEN_KEY = "preemptor_hostile_seen"

MANAGED_TAG = "preemptor:managed"
CONTROLLER_TAG = "preemptor:controller"

# service -> [(error code, HTTP status, message)]: what each throttles with.
_THROTTLING: dict[str, list[tuple[str, int, str]]] = {
    "dynamodb": [
        ("ThrottlingException", 400, "Rate of requests exceeds the allowed throughput."),
        (
            "ProvisionedThroughputExceededException",
            400,
            "The level of configured provisioned throughput for the table was exceeded. "
            "Consider increasing your provisioning level with the UpdateTable API.",
        ),
    ],
    "sagemaker": [("ThrottlingException", 400, "Rate exceeded")],
    "batch": [("TooManyRequestsException", 429, "Too Many Requests")],
    "s3": [("SlowDown", 503, "Please reduce your request rate.")],
    "stepfunctions": [("ThrottlingException", 400, "Rate exceeded")],
    "sns": [("Throttled", 429, "Rate exceeded")],
    "ecs": [("ThrottlingException", 400, "Rate exceeded")],
    "ec2": [("RequestLimitExceeded", 503, "Request limit exceeded.")],
    "lambda": [("TooManyRequestsException", 429, "Rate Exceeded.")],
    "cloudwatch": [("Throttling", 400, "Rate exceeded")],
}
_DEFAULT_THROTTLING = [("ThrottlingException", 400, "Rate exceeded")]

_STOP_OPERATIONS = {("sagemaker", "StopTrainingJob"), ("batch", "TerminateJob"), ("batch", "CancelJob")}


@dataclass
class Injection:
    at: float
    kind: str
    actor: str
    detail: str


@dataclass
class StopAttempt:
    """A stop the controller asked AWS for, and whether AWS refused it."""

    at: float
    actor: str
    run: str
    managed: bool
    refused: str | None  # the reason it was refused, None if AWS accepted it
    job_id: str = ""  # the run's id: a training job's name, a Batch job's id (Batch's names are not unique)


@dataclass
class HostileWorld:
    clock: SimClock
    start: float  # the scenario's time 0: fault times count from it
    chaos: Chaos = field(default_factory=Chaos)
    faults: list[Fault] = field(default_factory=list)
    injected: list[Injection] = field(default_factory=list)
    stops: list[StopAttempt] = field(default_factory=list)
    aborted_executions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._draws: Counter = Counter()
        self._held: list[dict] = []
        self._seen_executions: set[str] = set()
        self._crashed: set[int] = set()  # workflow_crash faults already spent (by id)
        self._installed: list[tuple[str, Callable]] = []
        self._services: dict[str, tuple[str, str]] = {}  # service id (as in event names) -> (name, protocol)
        self._unsubscribe: list[Callable[[], None]] = []
        self._stop_execution: Callable[[str], None] | None = None
        self._controller = ""
        self._index = LaggingIndex(self.clock)

    # ------------------------------------------------------------------ install

    def install(self, stop_execution: Callable[[str, str, str], None], controller: str = "") -> None:
        """Hook botocore (sessions created from now on) and the workflows' Lambda steps.
        `controller`: the stack's name, which IAM lets its functions stop runs of (or of none)."""
        self._stop_execution = stop_execution
        self._controller = controller
        handlers = [("before-parameter-build", self._stash_params), ("before-call", self._before_call)]
        replace(botocore.endpoint, "time", _NoBackoff())
        self._unsubscribe.append(moto_patches.around_send(self._attempt))
        for event, handler in handlers:
            botocore.handlers.BUILTIN_HANDLERS.append((event, handler))
            self._installed.append((event, handler))
        self._unsubscribe.append(moto_patches.on_lambda_task_returned(self._lambda_task_returned))
        _hook_service_integrations(self)

    def uninstall(self) -> None:
        for spec in self._installed:
            if spec in botocore.handlers.BUILTIN_HANDLERS:
                botocore.handlers.BUILTIN_HANDLERS.remove(spec)
        self._installed.clear()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    @staticmethod
    @contextmanager
    def acting_as(actor: str) -> Iterator[None]:
        token = ACTOR.set(actor)
        try:
            yield
        finally:
            ACTOR.reset(token)

    # ------------------------------------------------------------------ draws

    def _draw(self, what: str, key: str) -> float:
        with self._lock:
            n = self._draws[(what, key)]
            self._draws[(what, key)] = n + 1
        digest = hashlib.sha256(f"{self.chaos.seed}|{what}|{key}|{n}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    def _record(self, kind: str, actor: str, detail: str) -> None:
        with self._lock:
            self.injected.append(Injection(self.clock.now(), kind, actor, detail))

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(i.kind for i in self.injected).items()))

    # ------------------------------------------------------------------ AWS calls

    def _stash_params(self, params: dict, context: dict, **_: Any) -> None:
        context[_PARAMS_KEY] = copy.deepcopy(params) if isinstance(params, dict) else {}

    def _before_call(self, model: Any, context: dict, **_: Any) -> tuple[AWSResponse, dict] | None:
        seen = f"{_SEEN_KEY}-{id(self)}"
        if context.get(seen):
            return None  # a client that has the hook twice (session and client): decide once
        context[seen] = True
        service = model.service_model.service_name
        operation = model.name
        protocol = model.service_model.resolved_protocol
        self._services[model.service_model.service_id.hyphenize()] = (service, protocol)  # for its attempts
        params = context.get(_PARAMS_KEY) or {}
        region = context.get("client_region") or ""
        if service == "dynamodb" and self.chaos.index_lag_rate:
            self._index.note_write(region, operation, params)  # whoever writes: the index lags behind every writer
        integration = context.get(_ACTOR_KEY)
        actor = integration or ACTOR.get()
        if actor is None:
            return None  # the test harness, the fleet, the demo driver: AWS as usual
        if (service, operation) in _STOP_OPERATIONS:
            refused = self._refuse_stop(actor, service, operation, params)
            if refused is not None:
                return refused
        key = f"{actor}|{service}|{operation}"
        if (
            service == "dynamodb"
            and operation == "TransactWriteItems"
            and self.chaos.transaction_conflict_rate
            and self._draw("conflict", key) < self.chaos.transaction_conflict_rate
        ):
            return self._transaction_conflict(actor, params)
        # A function's calls are throttled attempt by attempt (`_throttled_attempt`); Step
        # Functions' integrations, and a protocol whose error body is not written here, by call.
        by_call = integration is not None or protocol not in _ERROR_BODIES
        if by_call and self.chaos.throttle_rate and self._draw("throttle", key) < self.chaos.throttle_rate:
            code, status, message = self._throttle(service, key)
            self._record("throttle", actor, f"{service}:{operation} {code}")
            return _error(status, code, message)
        if (
            service == "dynamodb"
            and operation == "Query"
            and self.chaos.index_lag_rate
            and params.get("IndexName")
            and self._draw("index-lag", key) < self.chaos.index_lag_rate
        ):
            lagging = self._index.lagging_answer(region, params)
            if lagging is not None:
                self._record("index-lag", actor, f"dynamodb:Query {params['IndexName']} {_partition(params)}")
                return _answer(200, lagging)
        return None

    def _attempt(self, event_name: str, request: Any, carry_out: Callable[[], AWSResponse | None]) -> AWSResponse | None:
        """One attempt of a call, as moto would answer it: throttled in moto's place, or
        carried out and its answer lost."""
        throttled = self._throttled_attempt(event_name, request)
        if throttled is not None:
            return throttled
        answer = carry_out()
        self._lose_answer(event_name, request)
        return answer

    def _throttle(self, service: str, key: str) -> tuple[str, int, str]:
        choices = _THROTTLING.get(service, _DEFAULT_THROTTLING)
        return choices[int(self._draw("throttle-code", key) * len(choices))]

    def _throttled_attempt(self, event_name: str, request: Any) -> AWSResponse | None:
        """The service's throttling answer to this attempt of a function's call, as it comes
        over the wire, or None to let moto carry the attempt out."""
        actor = ACTOR.get()
        if actor is None or not self.chaos.throttle_rate:
            return None  # the harness, the fleet, the demo driver, Step Functions itself
        _, service_id, operation = (event_name.split(".") + ["", "", ""])[:3]
        service, protocol = self._services.get(service_id, (service_id, ""))
        body = _ERROR_BODIES.get(protocol)
        key = f"{actor}|{service}|{operation}"
        if body is None or self._draw("throttle", key) >= self.chaos.throttle_rate:
            return None
        code, status, message = self._throttle(service, key)
        self._record("throttle", actor, f"{service}:{operation} {code}")
        return body(getattr(request, "url", "") or "https://emulated.invalid/", service, status, code, message)

    def _lose_answer(self, event_name: str, request: Any) -> None:
        actor = ACTOR.get()
        if actor is None or not self.chaos.answer_lost_rate:
            return  # the harness, the fleet, the demo driver, Step Functions itself
        _, service, operation = (event_name.split(".") + ["", "", ""])[:3]
        key = f"{actor}|{service}|{operation}"
        if self._draw("answer-lost", key) >= self.chaos.answer_lost_rate:
            return
        error = ReadTimeoutError if self._draw("answer-lost-how", key) < 0.5 else ConnectionClosedError
        self._record("answer-lost", actor, f"{service}:{operation} {error.__name__}")
        raise error(endpoint_url=getattr(request, "url", "") or "https://emulated.invalid/")

    def _refuse_stop(self, actor: str, service: str, operation: str, params: dict) -> tuple[AWSResponse, dict] | None:
        now = self.clock.now()
        if service == "sagemaker":
            run = str(params.get("TrainingJobName", ""))
            tags = _safe(lambda: sagemaker_patches.training_job_tags(run), {})
            resource = f"training-job/{run}"
        else:
            job_id = str(params.get("jobId", ""))
            described = _safe(lambda: batch_patches.get_batch_job(job_id), {})
            run = described.get("jobName", job_id)
            tags = described.get("tags") or {}
            resource = f"job/{job_id}"
        managed = tags.get(MANAGED_TAG) == "true"
        reason = None
        if not managed:
            reason = "not launched by the controller (no preemptor:managed=true tag)"
        elif tags.get(CONTROLLER_TAG, self._controller) != self._controller:
            reason = f"another stack's run (preemptor:controller={tags[CONTROLLER_TAG]})"
        for fault in self.faults:
            if isinstance(fault, StopDenied) and _run_of(run, fault.job) and fault.at <= now - self.start < fault.at + fault.duration:
                reason = f"stop_denied fault on {fault.job}"
        with self._lock:
            self.stops.append(StopAttempt(now, actor, run, managed, reason, run if service == "sagemaker" else job_id))
        if reason is None:
            return None
        self._record("stop-denied", actor, f"{service}:{operation} {run}: {reason}")
        action = f"{'sagemaker' if service == 'sagemaker' else 'batch'}:{operation}"
        message = (
            f"User: arn:aws:sts::123456789012:assumed-role/{actor}-role/{actor} is not authorized to "
            f"perform: {action} on resource: arn:aws:{service}:us-east-1:123456789012:{resource} "
            f"because no identity-based policy allows the {action} action"
        )
        return _error(400 if service == "sagemaker" else 403, "AccessDeniedException", message)

    def _transaction_conflict(self, actor: str, params: dict) -> tuple[AWSResponse, dict]:
        items = params.get("TransactItems") or [{}]
        conflicting = int(self._draw("conflict-item", actor) * len(items))
        reasons = [
            {"Code": "TransactionConflict", "Message": "Transaction is ongoing for the item"}
            if i == conflicting
            else {"Code": "None"}
            for i in range(len(items))
        ]
        codes = ", ".join(r["Code"] for r in reasons)
        self._record("transaction-conflict", actor, f"TransactWriteItems item {conflicting} of {len(items)}")
        response = _error(
            400,
            "TransactionCanceledException",
            f"Transaction cancelled, please refer cancellation reasons for specific reasons [{codes}]",
        )
        response[1]["CancellationReasons"] = reasons
        return response

    # ------------------------------------------------------------------ Lambda steps

    def crash_after_step(self, function_name: str, event: Any) -> bool:
        """Whether this workflow step's Lambda dies after doing its work (crash_rate)."""
        if not self.chaos.crash_rate:
            return False
        key = f"{function_name}|{json.dumps(event, sort_keys=True, default=str)[:512]}"
        if self._draw("crash", key) < self.chaos.crash_rate:
            self._record("lambda-crash", function_name, "runtime exited after the step's work")
            return True
        return False

    def _lambda_task_returned(self, execution_arn: str, state_name: str) -> None:
        with self._lock:
            first = execution_arn not in self._seen_executions
            self._seen_executions.add(execution_arn)
            elapsed = self.clock.now() - self.start
            armed = sorted(
                (f for f in self.faults if isinstance(f, WorkflowCrash) and id(f) not in self._crashed and f.at <= elapsed),
                key=lambda f: f.at,
            )
            due = first and bool(armed)
            if due:
                self._crashed.add(id(armed[0]))
        if not due:
            return
        self._record("workflow-crash", "states", f"{execution_arn} after {state_name!r}")
        self.aborted_executions.append(execution_arn)
        assert self._stop_execution is not None
        self._stop_execution(execution_arn, "Preemptor.EmulatedCrash", f"the execution died after {state_name!r}")

    # ------------------------------------------------------------------ events

    def release_held(self) -> list[dict]:
        """Events held back by the last delivery round: delivered after the new ones."""
        with self._lock:
            held, self._held = self._held, []
        return held

    def deliver(self, event: dict) -> bool:
        """Decide the fate of `event` about to be delivered: False if it is held back for the
        next round (late); a duplicate may be queued for the next round too."""
        key = str(event.get("id"))
        late = event.get("_preemptor_late", False)
        if not late and self.chaos.reorder_rate and self._draw("reorder", key) < self.chaos.reorder_rate:
            held = dict(event)
            held["_preemptor_late"] = True
            with self._lock:
                self._held.append(held)
            self._record("event-late", "events", f"{event.get('detail-type')} {key}")
            return False
        if not event.get("_preemptor_copy") and self.chaos.duplicate_rate and self._draw("duplicate", key) < self.chaos.duplicate_rate:
            copy_ = copy.deepcopy(event)
            copy_["_preemptor_copy"] = True
            copy_["_preemptor_late"] = True
            with self._lock:
                self._held.append(copy_)
            self._record("event-duplicate", "events", f"{event.get('detail-type')} {key}")
        event.pop("_preemptor_late", None)
        event.pop("_preemptor_copy", None)
        return True


class _NoBackoff:
    """botocore's endpoint module's `time`, whose `sleep` (the backoff between a call's
    attempts) takes no time: simulated time does not move inside one call."""

    @staticmethod
    def sleep(_seconds: float) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _run_of(run: str, job: str) -> bool:
    """A run belongs to a job when it is named after it (`job`, `job-r2`, ...)."""
    return re.fullmatch(re.escape(job) + r"(-r\d+)?", run) is not None


def _safe(get: Callable[[], Any], default: Any) -> Any:
    try:
        return get()
    except KeyError:
        return default


def _partition(params: dict) -> str:
    values = params.get("ExpressionAttributeValues") or {}
    return ", ".join(str(next(iter(v.values()), "")) for v in values.values() if isinstance(v, dict))


def _error(status: int, code: str, message: str) -> tuple[AWSResponse, dict]:
    """An error response as AWS sends it."""
    return _answer(status, {"Error": {"Code": code, "Message": message}})


def _answer(status: int, body: dict) -> tuple[AWSResponse, dict]:
    """A response with `body`, as botocore hands it on: every response carries a request id
    (Step Functions' service integrations put it in an error's cause, and fail without it)."""
    request_id = str(uuid.uuid4())
    http = AWSResponse("https://emulated.invalid/", status, {"x-amzn-requestid": request_id}, None)
    metadata = {"RequestId": request_id, "HTTPStatusCode": status, "HTTPHeaders": {"x-amzn-requestid": request_id}, "RetryAttempts": 0}
    return http, {**body, "ResponseMetadata": metadata}


def _json_error(url: str, service: str, status: int, code: str, message: str) -> AWSResponse:
    request_id = str(uuid.uuid4())
    headers = {"x-amzn-RequestId": request_id, "Content-Type": "application/x-amz-json-1.0"}
    return _wire(url, status, headers, json.dumps({"__type": f"com.amazonaws.{service}#{code}", "message": message}))


def _rest_json_error(url: str, service: str, status: int, code: str, message: str) -> AWSResponse:
    request_id = str(uuid.uuid4())
    headers = {"x-amzn-RequestId": request_id, "x-amzn-ErrorType": code, "Content-Type": "application/json"}
    return _wire(url, status, headers, json.dumps({"message": message}))


def _query_error(url: str, service: str, status: int, code: str, message: str) -> AWSResponse:
    request_id = str(uuid.uuid4())
    body = (
        f"<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>{escape(message)}</Message></Error>"
        f"<RequestId>{request_id}</RequestId></ErrorResponse>"
    )
    return _wire(url, status, {"x-amzn-RequestId": request_id, "Content-Type": "text/xml"}, body)


def _rest_xml_error(url: str, service: str, status: int, code: str, message: str) -> AWSResponse:
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{escape(message)}</Message>'
        f"<RequestId>{request_id}</RequestId></Error>"
    )
    return _wire(url, status, {"x-amz-request-id": request_id, "Content-Type": "application/xml"}, body)


def _ec2_error(url: str, service: str, status: int, code: str, message: str) -> AWSResponse:
    request_id = str(uuid.uuid4())
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}</Code>'
        f"<Message>{escape(message)}</Message></Error></Errors><RequestID>{request_id}</RequestID></Response>"
    )
    return _wire(url, status, {"Content-Type": "text/xml;charset=UTF-8"}, body)


def _wire(url: str, status: int, headers: dict[str, str], body: str) -> AWSResponse:
    return AWSResponse(url, status, headers, MockRawResponse(body.encode()))


# protocol -> the error response a service of it sends, as botocore receives it
_ERROR_BODIES: dict[str, Callable[[str, str, int, str, str], AWSResponse]] = {
    "json": _json_error,
    "rest-json": _rest_json_error,
    "query": _query_error,
    "rest-xml": _rest_xml_error,
    "ec2": _ec2_error,
}


_INTEGRATION_MODULES = (
    "moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sfn",
    "moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sns",
)


def _hook_service_integrations(world: HostileWorld) -> None:
    """moto's service integrations build their clients with `boto_client_for` from the default
    session (created before the hooks); give those clients the hooks, acting as "states"."""
    import importlib

    def mark(context: dict, **_: Any) -> None:
        context[_ACTOR_KEY] = "states"

    hooked_clients: weakref.WeakSet = weakref.WeakSet()  # the task clients are kept (moto_patches.stepfunctions)

    for name in _INTEGRATION_MODULES:
        module = importlib.import_module(name)
        original = module.__dict__.get("boto_client_for")
        if original is None or getattr(original, "_preemptor_hostile", False):
            continue

        def hooked(*args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            client = _original(*args, **kwargs)
            if client not in hooked_clients:  # once a client: each call would add the hooks again
                hooked_clients.add(client)
                client.meta.events.register("before-parameter-build", mark)
                client.meta.events.register("before-parameter-build", world._stash_params)
                client.meta.events.register("before-call", world._before_call)
            return client

        hooked._preemptor_hostile = True  # type: ignore[attr-defined]
        replace(module, "boto_client_for", hooked)
