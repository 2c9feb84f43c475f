"""`preemptor local up`: the emulated stack, served on 127.0.0.1 until `local down` or Ctrl-C.

One process holds everything, so it all shares moto's backends and the patches:
- the `EmulatedStack` (template.yaml in moto: the table, the buses, the functions run
  in-process, the workflows executed by moto), as `preemptor demo` runs it;
- moto's HTTP server on 127.0.0.1 (loopback only), which the CLI (`--local`), boto3 and the
  AWS CLI (`--endpoint-url http://127.0.0.1:N`) talk to as to AWS, with fake credentials;
- the simulated fleet, on a clock that runs `speed` times real time (Wait states in the
  workflows still advance it at once, as in the demo);
- the template's `Schedule` events (reconcile every 5 simulated minutes).

moto cannot invoke Lambda targets, so PutEvents never reaches the intake by itself: the
`events` moto patch hands every event PutEvents accepted (over HTTP or not) to this
process, whose driver loop routes it by the template's rules (`EmulatedStack.put_event`),
one event at a time and letting its workflows finish, exactly as the demo routes the
fleet's events. The driver also advances the clock, routes what the fleet emits and fires
the schedules; moto's server threads only read and write moto's backends.

Bounded: it stops by itself after `max_lifetime_s` real seconds, routes at most `max_jobs`
submissions, and removes its state file when it exits. The state file (`state_path`) tells
`local down` and `--local` where it is: pid, endpoint, region, the stack's outputs and
parameters, and the simulated clock.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from preemptor.config import PoolConfig
from . import moto_patches
from .alarms import WaitAlarm
from .clock import SimClock
from .demo import create_batch_queues, pool_classifier
from .fleet import SimulatedFleet
from .scenario import ROLE_ARN, Scenario, local_pool
from .stack import EmulatedStack, RoutedEvent, load_template
from .state import DEFAULT_PORT, LOOPBACK, LocalStackError, LocalState

DEFAULT_SPEED = 60.0
DEFAULT_MAX_LIFETIME_S = 8 * 3600.0
DEFAULT_MAX_JOBS = 500
TICK_REAL_S = 0.1

# What `local up` runs without --scenario: a SageMaker pool of 4 x ml.p5.48xlarge (32 GPUs)
# shared by two teams with quotas (each may borrow the other's idle half), and a Batch pool
# of 16 GPUs (job queue g5-queue, job definition g5-training). examples/jobs/ fits it.
LOCAL_SCENARIO = Scenario(
    pools=[
        PoolConfig(name="p5", service="sagemaker", instance_type="ml.p5.48xlarge", instances=4, gpus_per_instance=8),
        PoolConfig(name="g5", service="batch", gpus=16),
    ],
    jobs=[],
    policy={
        "pools": {
            "p5": {
                "quotas": [
                    {"team": "production", "nominal_gpus": 16},
                    {"team": "research", "nominal_gpus": 16},
                ]
            }
        }
    },
)


@dataclass(frozen=True)
class _Invocation:
    """An asynchronous Invoke of `function` waiting in the driver's inbox (a bus's name otherwise)."""

    function: str


@dataclass
class Options:
    port: int = DEFAULT_PORT
    speed: float = DEFAULT_SPEED
    max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S
    max_jobs: int = DEFAULT_MAX_JOBS
    state_path: Path = Path(".preemptor/local.json")
    scenario: Scenario = field(default_factory=lambda: LOCAL_SCENARIO)
    stack_name: str = "preemptor"
    region: str = "us-east-1"


class _HttpServer:
    """moto's server app on a werkzeug server bound in the caller's thread (so a taken port
    is an error here, not a hang), served from a daemon thread."""

    def __init__(self, host: str, port: int):
        from werkzeug.serving import make_server
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self._server = make_server(
            host, port, DomainDispatcherApplication(create_backend_app), threaded=True, request_handler=MotoRequestHandler
        )
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)
        self._server.server_close()


class LocalStack:
    """The process behind `preemptor local up` (see the module docstring)."""

    def __init__(self, options: Options, out: TextIO, err: TextIO):
        self.options = options
        self.out = out
        self.err = err
        self.stopping = threading.Event()
        self._inbox: queue.SimpleQueue[tuple[str, dict]] = queue.SimpleQueue()
        self.submissions = 0
        self._published = 0.0

    def serve(self) -> None:
        """Run until `stop()` (a signal), the lifetime bound, or an error."""
        options = self.options
        if options.port and not 0 < options.port < 65536:
            raise LocalStackError(f"--port {options.port} is not a TCP port")
        if not options.speed > 0:
            raise LocalStackError(f"--speed must be positive, got {options.speed:g}")
        self._refuse_second_stack()
        started = time.time()
        clock = SimClock(started)
        scenario = options.scenario
        parameters = {
            "PoolsConfig": json.dumps([local_pool(p).model_dump(exclude_none=True) for p in scenario.pools]),
            "PolicyConfig": json.dumps(scenario.policy),
            "ManagedRoleArnForTraining": ROLE_ARN,
            "TrainingInstanceTypes": ",".join(
                sorted({t for p in scenario.pools if p.service == "sagemaker" for t in p.offerings})
            ) or "ml.p5.48xlarge",
            "LogLevel": "ERROR",
        }
        with EmulatedStack(clock, parameters=parameters, stack_name=options.stack_name, region=options.region) as stack:
            fleet = SimulatedFleet(
                clock,
                stack.client("s3"),
                stack.emit,
                ecs_client=stack.client("ecs"),
                ec2_client=stack.client("ec2"),
                classify=pool_classifier(scenario),
                id_factory=lambda: str(uuid.uuid4()),
            )
            unsubscribe = moto_patches.on_events_put(lambda bus, event: self._inbox.put((bus, event)))
            # An asynchronous Invoke over HTTP (`preemptor redrive`) runs on the driver too.
            stack.async_handoff = lambda function, event: self._inbox.put((_Invocation(function), event))
            http = None
            try:
                create_batch_queues(stack, scenario)
                http = _HttpServer(LOOPBACK, options.port)
                http.start()
                stops_at = started + options.max_lifetime_s
                self._state = LocalState(
                    pid=os.getpid(),
                    port=http.port,
                    region=stack.region,
                    stack=stack.stack_name,
                    outputs=stack_outputs(stack),
                    parameters=dict(stack.parameters),
                    speed=options.speed,
                    sim_now=clock.now(),
                    real_at=time.time(),
                    started_at=started,
                    stops_at=stops_at,
                )
                self._publish(clock, force=True)
                self.out.write(
                    f"local stack {stack.stack_name} on {self._state.endpoint_url} (pid {os.getpid()}, "
                    f"{options.speed:g}x real time, stops by itself at "
                    f"{dt.datetime.fromtimestamp(stops_at).strftime('%H:%M:%S')}); state in {options.state_path}\n"
                    f"pools: {', '.join(f'{p.name} ({p.capacity_gpus} GPUs, {p.service})' for p in scenario.pools)}\n"
                    "stop with `preemptor local down` or Ctrl-C\n"
                )
                self.out.flush()
                self._drive(stack, clock, stops_at)
            finally:
                unsubscribe()
                if http is not None:
                    http.stop()
                fleet.close()
                self._remove_state()
        self.out.write("local stack stopped\n")
        self.out.flush()

    def stop(self, *_args: Any) -> None:
        self.stopping.set()

    # -- the driver ------------------------------------------------------------------------
    def _drive(self, stack: EmulatedStack, clock: SimClock, stops_at: float) -> None:
        last = time.monotonic()
        alarm = WaitAlarm(stack)  # CloudWatch's part of the wait alarm: moto evaluates none
        while not self.stopping.is_set():
            if time.time() >= stops_at:
                self.out.write("local stack: its lifetime is over (--max-lifetime)\n")
                return
            self._route_inbox(stack)
            tick = time.monotonic()
            clock.advance_to(clock.now() + (tick - last) * self.options.speed)
            last = tick
            self._guarded(stack.pump, self._print_event)
            self._guarded(stack.fire_schedules, self._print_event)
            self._guarded(alarm.tick, self._print_event)
            stack.calls.calls.clear()  # the IAM call record is the tests'; a long run would hoard it
            self._publish(clock)
            self.stopping.wait(TICK_REAL_S)

    def _route_inbox(self, stack: EmulatedStack) -> None:
        while True:
            try:
                bus, event = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(bus, _Invocation):
                if self._guarded(stack.invoke_async, bus.function, event) is not None:
                    self._guarded(stack.drain)
                continue
            if event.get("detail-type") == "Job Submitted":
                if self.submissions >= self.options.max_jobs:
                    name = (event.get("detail") or {}).get("name", "?")
                    self.err.write(f"local stack: dropped the submission of {name}: --max-jobs {self.options.max_jobs} reached\n")
                    continue
                self.submissions += 1
            routed = self._guarded(stack.put_event, event, bus)
            if routed is not None:
                self._guarded(stack.drain)
                self._print_event(routed)

    def _guarded(self, step, *args):
        """Run one step of the driver; an error is reported and the stack keeps serving
        (on AWS one failed invocation does not take the account down)."""
        try:
            return step(*args)
        except Exception as e:  # noqa: BLE001 - reported, and the next event still routed
            self.err.write(f"local stack: {getattr(step, '__name__', 'step')} failed: {type(e).__name__}: {e}\n")
            self.err.flush()
            return None

    def _print_event(self, routed: RoutedEvent) -> None:
        event = routed.event
        if event.get("source") in ("aws.s3", "aws.events"):
            return  # routine: every checkpoint write, every reconcile
        detail = event.get("detail") or {}
        what = event.get("detail-type", "?")
        name = (
            detail.get("name")
            or detail.get("TrainingJobName")
            or detail.get("jobName")
            or detail.get("instance-id")
            or "?"
        )
        status = detail.get("TrainingJobStatus") or detail.get("status") or ""
        outcome = routed.results[0] if routed.results else {"outcome": "unrouted", "reason": "no rule matched"}
        at = dt.datetime.fromtimestamp(routed.at).strftime("%H:%M:%S")
        outcome_text = outcome.get("outcome", "?") if isinstance(outcome, dict) else str(outcome)
        reason = outcome.get("reason", "") if isinstance(outcome, dict) else ""
        self.out.write(f"{at}  {what:<36} {name:<28} {status:<10} {outcome_text}: {reason}\n")
        self.out.flush()

    # -- the state file ------------------------------------------------------------------
    def _refuse_second_stack(self) -> None:
        path = self.options.state_path
        try:
            running = LocalState.read(path)
        except LocalStackError:
            return
        raise LocalStackError(f"a local stack is already running (pid {running.pid}, {running.endpoint_url}; {path})")

    def _publish(self, clock: SimClock, force: bool = False) -> None:
        """Write the state file with the clock as it is now; only when the clock left the
        course the last file predicts (a Wait state jumped it) or once a second."""
        wall = time.time()
        drift = abs(self._state.now(wall) - clock.now())
        if not force and drift < self.options.speed * TICK_REAL_S and wall - self._published < 1.0:
            return
        self._state = LocalState(**{**self._state.__dict__, "sim_now": clock.now(), "real_at": wall})
        path = self.options.state_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self._state.to_dict(), f, indent=2)
        os.replace(tmp, path)
        self._published = wall

    def _remove_state(self) -> None:
        path = self.options.state_path
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (FileNotFoundError, ValueError):
            pass


def stack_outputs(stack: EmulatedStack) -> dict[str, str]:
    """The template's Outputs, resolved against the emulated stack (what DescribeStacks
    returns for a deployed one)."""
    outputs = load_template(stack.template_path).get("Outputs", {})
    return {name: str(stack.resolve(spec["Value"])) for name, spec in outputs.items()}


def serve(options: Options, out: TextIO, err: TextIO) -> None:
    """Serve the local stack in this process until a signal or the lifetime bound."""
    local = LocalStack(options, out, err)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, local.stop)
    local.serve()
