"""Step Functions: waits and retries in simulated time; service-integration casing.

Gaps filled, each by patching the hook moto itself provides:
- `WaitFunction._wait_interval` blocks on a real Event for the state's seconds; the product's
  Wait states (`SecondsPath`: checkpoint and stop polls) advance the SimClock instead.
- Retry sleeps with `time.sleep(interval)` in `retrier_decl`; that module's `time` advances
  the SimClock by the interval instead.
- Both advance the clock of the emulated AWS that started the execution, and only while it
  is the one installed: an execution thread that outlived its stack (a step still running
  when the stack stopped, moto's threads are not killed) would otherwise move a later
  stack's time on by its Wait's or retry interval's seconds, in the middle of that stack's
  story, and carry out its next task there. It fails where it stands (`StaleExecution`; a
  task: States.Runtime, which no Catch routes on). `ExecutionWorker.start` records the clock
  in StartExecution's thread.
- A Map's items run in threads of their own (one per item up to `MaxConcurrency`), so two
  items waiting were counted as two workflows waiting, and a turn was taken while another
  workflow was still busy (its 30 s wait then ended at the items' 240 s). Each item's thread
  is counted as acting for its workflow from before it starts until it is done
  (`SimClock.join`), and the execution's own thread stands aside while it awaits them
  (`InlineIterationComponent._launch_worker`, `JobPool.await_jobs`).
- A Retry's `JitterStrategy: FULL` draws its interval from the process's `random`, so two
  replays of one story waited differently and which draw a retry got depended on the order
  threads happened to retry in. The draw is a hash of the retry itself (the execution, the
  state, the Map item, and how many times that state of that item retried before), the
  same on every replay and in any order (`JitterStrategyDecl._eval_body`).
- `StateTaskService._normalise_parameters` / `_normalise_response` are no-ops in moto, so a
  `states:startExecution` task hands botocore `StateMachineArn` where it wants
  `stateMachineArn` and fails. They are filled in with moto's own `_to_boto_request` /
  `_from_boto_response` over botocore's shapes of the operation, as AWS maps them
  (`sns:publish` needs nothing: its API is PascalCase already).
- `AmazonStateLanguageParser.parse` lexes and parses the definition with ANTLR, and builds
  its evaluation components, on every CreateStateMachine and in every execution's thread
  (50-110 ms for ours, more than the rest of a short execution; the components alone were
  8% of the workflow tests' time, py-spy, half of it spent writing out the whole definition's
  text for error messages that are never raised). The program of a definition that parsed
  is kept and every execution of it runs the same one. That is safe because a component
  keeps nothing of an evaluation: each is built from the definition and never assigned to
  after, and what an evaluation changes lives in its `Environment` (Map and Parallel build
  their worker pools, run records and threads afresh in each evaluation). The one exception
  is `EvalComponent.heap_key`, the id an execution's retry counters are filed under, made
  on first use: two executions could each make one and one of them lose its counters, so
  it is made under a lock. A broken definition fails every time as before.
  CreateStateMachine's validation (`StepFunctionsParserBackend._validate_definition`) of a
  definition that parsed before does nothing more.
- JSONPaths are compiled by `jsonpath_ng`, which builds a PLY parser (its tables and
  grammar) for every path it parses, once per path per state per execution: 4% of the
  workflow tests' time. A compiled path is a tree of objects assigned to only when built, so
  each path string is compiled once.
- A task state's AWS client (`boto_client_for`) is made anew for every Lambda, SNS and
  Step Functions task, through boto3's default session: 4% of a workflow test's time
  (py-spy), and boto3 documents a session as unsafe to make clients from in several threads
  at once, which moto's executions do (no failure of it was seen here). One client per
  region and service is made once per installation, under a lock, from a session of its
  own, as moto makes it; clients are safe to share between threads. (Made after the stack
  installs its call recorder and hostile world, whose botocore handlers a client takes at
  creation.)
- `StateTaskLambda._eval_execution` is wrapped only to tell listeners (the hostile emulator)
  that a Lambda step returned, with its execution, so they can make that execution die there.
- A JSONPath of a task's `Parameters` or `ResultSelector` that the state's input does not
  have is, in moto, an ordinary task failure (`States.TaskFailed`, or a Lambda "Exception")
  that `States.ALL` catches. On AWS it is `States.Runtime`, which no Retry or Catch matches
  (`States.ALL` included): the execution fails there. `ExecutionState._evaluate_with_timeout`
  raises it as AWS does, and `ErrorEqualsDecl` matches it with nothing, so a path the input
  does not have fails the workflow in the tests as it would on AWS.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import threading
import time as _real_time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import boto3
import botocore.session
from botocore import xform_name
from botocore.config import Config
from botocore.exceptions import UnknownServiceError
from moto.core.models import botocore_stubber
from moto.settings import moto_server_port
from moto.stepfunctions.parser.api import HistoryEventType, TaskFailedEventDetails
from moto.stepfunctions.parser.asl.component.common.error_name.error_equals_decl import ErrorEqualsDecl
from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
    FailureEvent,
    FailureEventException,
)
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import StatesErrorNameType
from moto.stepfunctions.parser.asl.component.common.path import result_path
from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl
from moto.stepfunctions.parser.asl.component.common.retry.jitter_strategy_decl import JitterStrategy, JitterStrategyDecl
from moto.stepfunctions.parser.asl.component.common.retry.retrier_decl import RetrierDecl
from moto.stepfunctions.parser.asl.component.common.timeouts.timeout import TimeoutSeconds
from moto.stepfunctions.parser.asl.component.eval_component import EvalComponent
from moto.stepfunctions.parser.asl.component.state.exec.execute_state import ExecutionState
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.inline_iteration_component import (
    InlineIterationComponent,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.job import JobPool
from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_sfn,
    state_task_service_sns,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service import (
    StateTaskService,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task_lambda import StateTaskLambda
from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import WaitFunction
from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser
from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
from moto.stepfunctions.parser.asl.utils import boto_client as task_clients
from moto.stepfunctions.parser.asl.utils import json_path
from moto.stepfunctions.parser.asl.utils.json_path import NoSuchJsonPathError
from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker
from moto.stepfunctions.parser.models import StepFunctionsParserBackend
from moto.stepfunctions.parser.utils import TMP_THREADS, long_uid

from preemptor_tools.local.clock import SimClock

from ._core import _STATE, notify, replace, subscribe

LambdaTaskReturned = Callable[[str, str], None]
_LAMBDA_TASK_RETURNED = "lambda_task_returned"


def patch() -> None:
    replace(ExecutionWorker, "start", _start_worker)
    replace(ExecutionWorker, "_get_evaluation_environment", _evaluation_environment)
    replace(WaitFunction, "_wait_interval", _wait_interval)
    replace(retrier_decl, "time", _SimTime())
    replace(RetrierDecl, "_eval_body", _retrier_eval_body)
    replace(InlineIterationComponent, "_launch_worker", _launch_map_worker)
    replace(JobPool, "await_jobs", _await_map_items)
    replace(JitterStrategyDecl, "_eval_body", _full_jitter)
    replace(StateTaskService, "_normalise_parameters", _normalise_parameters)
    replace(StateTaskService, "_normalise_response", _normalise_response)
    replace(StateTaskLambda, "_eval_execution", _lambda_eval_execution)
    replace(AmazonStateLanguageParser, "parse", staticmethod(_parse))
    replace(EvalComponent, "heap_key", property(_heap_key))
    replace(json_path, "parse", _compiled_path)
    replace(result_path, "parse", _compiled_update_path)
    replace(StepFunctionsParserBackend, "_validate_definition", staticmethod(_validate_definition))
    replace(ExecutionState, "_evaluate_with_timeout", _evaluate_with_timeout)
    replace(ErrorEqualsDecl, "_eval_body", _error_equals)
    forget_task_clients()
    for module in _TASK_CLIENT_USERS:
        replace(module, "boto_client_for", _task_client)


def on_lambda_task_returned(callback: LambdaTaskReturned) -> Callable[[], None]:
    """`callback(execution_arn, state_name)` after a Lambda task's function returned, before the
    execution moves on; returns unsubscribe."""
    return subscribe(_LAMBDA_TASK_RETURNED, callback)


# --------------------------------------------------------------------------- task clients

_TASK_CLIENT_USERS = (lambda_eval_utils, state_task_service_sfn, state_task_service_sns, task_clients)
_TASK_CLIENTS: dict[tuple[str, str], Any] = {}
_TASK_CLIENTS_LOCK = threading.Lock()
_TASK_SESSION: list[boto3.session.Session] = []  # made on first use after the patch


def _task_client(region: str, service: str, state_credentials: Any = None) -> Any:
    """moto's `boto_client_for`, made once per region and service."""
    client = _TASK_CLIENTS.get((region, service))
    if client is not None:
        return client
    with _TASK_CLIENTS_LOCK:
        client = _TASK_CLIENTS.get((region, service))
        if client is None:
            if not _TASK_SESSION:
                _TASK_SESSION.append(boto3.session.Session())
            endpoint = {} if botocore_stubber.enabled else {"endpoint_url": f"http://localhost:{moto_server_port()}"}
            client = _TASK_CLIENTS[(region, service)] = _TASK_SESSION[0].client(
                service,
                region_name=region,
                aws_access_key_id="ak",
                aws_secret_access_key="sk",
                config=Config(
                    parameter_validation=False,
                    retries={"max_attempts": 0, "total_max_attempts": 1},
                    connect_timeout=TimeoutSeconds.DEFAULT_TIMEOUT_SECONDS,
                    read_timeout=TimeoutSeconds.DEFAULT_TIMEOUT_SECONDS,
                ),
                **endpoint,
            )
    return client


def forget_task_clients() -> None:
    """Drop the task clients and their session: each stack makes its own, after its recorder
    and hostile world installed their handlers (a session registers botocore's handlers when it
    is made; one kept from an earlier stack, or from a test without a recorder, would call AWS
    unrecorded and unrefused)."""
    with _TASK_CLIENTS_LOCK:
        _TASK_CLIENTS.clear()
        _TASK_SESSION.clear()


# --------------------------------------------------------------------------- time


_ORIGINAL_WORKER_START = ExecutionWorker.start
_ORIGINAL_EVALUATION_ENVIRONMENT = ExecutionWorker._get_evaluation_environment
_ORIGINAL_RETRIER_EVAL = RetrierDecl._eval_body
# The clock of the emulated AWS that started each running execution, by its event manager
# (the one object an execution's frames, its Map items and Parallel branches, all share).
_CLOCKS: weakref.WeakKeyDictionary[Any, SimClock] = weakref.WeakKeyDictionary()
_RETRYING = threading.local()  # the environment whose retry interval this thread waits out
_ORIGINAL_AWAIT_JOBS = JobPool.await_jobs
_MAP_WAITER = threading.local()  # the clock of the Map items this thread launched and awaits


class StaleExecution(RuntimeError):
    """An execution thread of an emulated AWS that is gone (its stack stopped, its patches
    were removed or installed again with another clock) reached a Wait, a Retry interval or
    a task: it must not move the clock of, or act in, the emulated AWS running now."""


def _start_worker(self: ExecutionWorker) -> None:
    self.sim_clock = _STATE.require_clock()  # in StartExecution's thread: the stack starting it
    _ORIGINAL_WORKER_START(self)


def _evaluation_environment(self: ExecutionWorker) -> Any:
    env = _ORIGINAL_EVALUATION_ENVIRONMENT(self)
    clock = getattr(self, "sim_clock", None)
    if clock is not None:
        _CLOCKS[env.event_manager] = clock
    return env


def _own_clock(env: Any) -> SimClock:
    """The clock of the emulated AWS that started `env`'s execution, if it is the one running;
    StaleExecution otherwise (a thread that outlived its stack: without this, its next Wait
    would move a later stack's time on by the Wait's seconds)."""
    clock = _CLOCKS.get(env.event_manager)
    if clock is None or clock is not _STATE.clock:
        execution = env.states.context_object.context_object_data["Execution"]["Id"]
        raise StaleExecution(f"{execution} outlived the emulated AWS that started it")
    return clock


def _wait_interval(self: WaitFunction, env: Any, wait_seconds: int) -> None:
    clock = _own_clock(env)
    if wait_seconds > 0:
        clock.sleep(wait_seconds)


def _launch_map_worker(self: InlineIterationComponent, env: Any, eval_input: Any, job_pool: JobPool) -> Any:
    """moto's, with the worker's thread counted by the clock as acting for its workflow
    (`SimClock.join`) from before it starts until it is done, and the execution's own thread
    standing aside while it waits for the items (`_await_map_items`)."""
    clock = _own_clock(env)
    worker = self._create_worker(env=env, eval_input=eval_input, job_pool=job_pool)
    leave = clock.join()

    def work() -> None:
        try:
            worker.eval()
        finally:
            leave()

    thread = threading.Thread(target=work, daemon=True)
    TMP_THREADS.append(thread)
    _MAP_WAITER.clock = clock
    thread.start()
    return worker


def _await_map_items(self: JobPool) -> None:
    """moto's, its thread standing aside in the clock of the items it launched in this
    thread (`_launch_map_worker`): while its items run, they act and wait for the workflow,
    and a workflow whose items all wait counts as waiting, once."""
    clock, _MAP_WAITER.clock = getattr(_MAP_WAITER, "clock", None), None
    if clock is None:
        _ORIGINAL_AWAIT_JOBS(self)
        return
    with clock.aside():
        _ORIGINAL_AWAIT_JOBS(self)


def _retrier_eval_body(self: RetrierDecl, env: Any) -> None:
    _RETRYING.env = env
    try:
        _ORIGINAL_RETRIER_EVAL(self, env)
    finally:
        _RETRYING.env = None


# Each execution's retries so far, per (state, Map item): what a retry's jitter is drawn from.
_JITTER_DRAWS: weakref.WeakKeyDictionary[Any, Counter] = weakref.WeakKeyDictionary()
_JITTER_LOCK = threading.Lock()


def _full_jitter(self: JitterStrategyDecl, env: Any) -> None:
    """FULL jitter: the interval on the stack, scaled by a draw in [0, 1) that the retry
    itself decides."""
    if self.jitter_strategy == JitterStrategy.NONE:
        return
    interval = env.stack.pop()
    data = env.states.context_object.context_object_data
    map_data = data.get("Map") or {}
    where = (data["State"]["Name"], (map_data.get("Item") or {}).get("Index"))
    with _JITTER_LOCK:
        draws = _JITTER_DRAWS.setdefault(env.event_manager, Counter())
        n = draws[where]
        draws[where] = n + 1
    key = f"{data['Execution']['Id']}|{where[0]}|{where[1]}|{n}"
    draw = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    env.stack.append(interval * draw)


class _SimTime:
    """Stands in for the `time` module inside `retrier_decl`: `sleep` advances the SimClock of
    the execution whose retry it is."""

    def sleep(self, seconds: float) -> None:
        env = getattr(_RETRYING, "env", None)
        clock = _own_clock(env) if env is not None else _STATE.require_clock()
        clock.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(_real_time, name)


# --------------------------------------------------------------------------- definitions

_ORIGINAL_PARSE = AmazonStateLanguageParser.parse
_PROGRAMS: dict[str, tuple[Any, Any]] = {}  # definition -> (program, ANTLR syntax tree)
_PROGRAMS_LOCK = threading.Lock()


def _parse(definition: str) -> tuple[Any, Any]:
    parsed = _PROGRAMS.get(definition)
    if parsed is None:
        parsed = _ORIGINAL_PARSE(definition)  # raises ASLParserException, as moto does
        with _PROGRAMS_LOCK:
            parsed = _PROGRAMS.setdefault(definition, parsed)
    return parsed


_HEAP_KEY_LOCK = threading.Lock()


def _heap_key(self: EvalComponent) -> str:
    """`EvalComponent.heap_key`, made once even when executions sharing the component ask at once."""
    key = self.__dict__.get("_EvalComponent__heap_key")
    if key is None:
        with _HEAP_KEY_LOCK:
            key = self.__dict__.get("_EvalComponent__heap_key")
            if key is None:
                key = self.__dict__["_EvalComponent__heap_key"] = long_uid()
    return key


_ORIGINAL_COMPILE_PATH = json_path.parse
_ORIGINAL_COMPILE_UPDATE_PATH = result_path.parse


@functools.lru_cache(maxsize=1024)
def _compiled_path(path: str) -> Any:
    return _ORIGINAL_COMPILE_PATH(path)


@functools.lru_cache(maxsize=256)
def _compiled_update_path(path: str) -> Any:
    return _ORIGINAL_COMPILE_UPDATE_PATH(path)


_ORIGINAL_VALIDATE = StepFunctionsParserBackend._validate_definition


def _validate_definition(definition: str) -> None:
    if definition not in _PROGRAMS:
        _ORIGINAL_VALIDATE(definition)  # raises InvalidDefinition, as moto does


# --------------------------------------------------------------------------- Lambda tasks

_ORIGINAL_LAMBDA_EVAL_EXECUTION = StateTaskLambda._eval_execution


def _lambda_eval_execution(self: StateTaskLambda, env: Any) -> None:
    _ORIGINAL_LAMBDA_EVAL_EXECUTION(self, env)
    if not _STATE.listeners.get(_LAMBDA_TASK_RETURNED):
        return
    context = env.states.context_object.context_object_data
    notify(_LAMBDA_TASK_RETURNED, context["Execution"]["Id"], context["State"]["Name"])


# --------------------------------------------------------------------------- States.Runtime

_ORIGINAL_EVALUATE_WITH_TIMEOUT = ExecutionState._evaluate_with_timeout
_ORIGINAL_ERROR_EQUALS = ErrorEqualsDecl._eval_body
_RUNTIME = StatesErrorNameType.StatesRuntime


def _evaluate_with_timeout(self: ExecutionState, env: Any) -> None:
    try:
        _own_clock(env)
    except StaleExecution as e:
        # A task of a stale execution (a Lambda, a StartExecution, a Publish) is not carried
        # out in the emulated AWS running now; States.Runtime: no Catch routes it on.
        raise FailureEventException(
            FailureEvent(
                env=env,
                error_name=StatesErrorName(typ=_RUNTIME),
                event_type=HistoryEventType.TaskFailed,
                event_details=EventDetails(taskFailedEventDetails=TaskFailedEventDetails(error=_RUNTIME.to_name(), cause=str(e))),
            )
        ) from None
    try:
        _ORIGINAL_EVALUATE_WITH_TIMEOUT(self, env)
    except NoSuchJsonPathError as e:
        cause = f"The JSONPath '{e.json_path}' could not be found in the input of state '{self.name}'"
        raise FailureEventException(
            FailureEvent(
                env=env,
                error_name=StatesErrorName(typ=_RUNTIME),
                event_type=HistoryEventType.TaskFailed,
                event_details=EventDetails(taskFailedEventDetails=TaskFailedEventDetails(error=_RUNTIME.to_name(), cause=cause)),
            )
        ) from None


def _error_equals(self: ErrorEqualsDecl, env: Any) -> None:
    error_name = env.stack[-1]
    if isinstance(error_name, StatesErrorName) and error_name.typ == _RUNTIME:
        env.stack.pop()
        env.stack.append(False)  # no Retry or Catch matches States.Runtime
        return
    _ORIGINAL_ERROR_EQUALS(self, env)


# --------------------------------------------------------------------------- service tasks

_BOTOCORE_SESSION = botocore.session.get_session()
_OPERATIONS: dict[tuple[str, str], Any] = {}
_OPERATIONS_LOCK = threading.Lock()


def _operation_model(service_name: str, action: str) -> Any | None:
    """botocore's model of `service_name`'s `action` (any casing), cached; None if unknown."""
    key = (service_name, xform_name(action))
    with _OPERATIONS_LOCK:
        if key not in _OPERATIONS:
            _OPERATIONS[key] = None
            try:
                model = _BOTOCORE_SESSION.get_service_model(service_name)
            except UnknownServiceError:
                model = None
            for name in model.operation_names if model else ():
                if xform_name(name) == key[1]:
                    _OPERATIONS[key] = model.operation_model(name)
        return _OPERATIONS[key]


def _operation(self: StateTaskService, boto_service_name: str | None, action: str | None) -> Any | None:
    return _operation_model(
        self._get_boto_service_name(boto_service_name), action or self.resource.api_action
    )


def _normalise_parameters(
    self: StateTaskService,
    parameters: dict,
    boto_service_name: str | None = None,
    service_action_name: str | None = None,
) -> None:
    operation = _operation(self, boto_service_name, service_action_name)
    if operation is not None and operation.input_shape is not None:
        self._to_boto_request(parameters, operation.input_shape)


def _normalise_response(
    self: StateTaskService,
    response: Any,
    boto_service_name: str | None = None,
    service_action_name: str | None = None,
) -> None:
    operation = _operation(self, boto_service_name, service_action_name)
    if operation is not None and operation.output_shape is not None:
        self._from_boto_response(response, operation.output_shape)
    _timestamps_to_iso(response)


def _timestamps_to_iso(value: Any) -> None:
    """botocore returns datetimes (StartDate), which moto cannot put into the state's output."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in list(items):
        if isinstance(item, (dt.datetime, dt.date)):
            value[key] = item.isoformat()
        else:
            _timestamps_to_iso(item)
