"""One replay of the demo and of each example scenario per `make test`, with every AWS call it
made, shared by the tests that read them (`tests/workflows/test_scenarios.py` asserts on the
stories, `tests/unit/test_iam.py` on the calls, `tests/unit/test_dashboard.py` on the
metrics).

The test processes share them through the folder conftest.py makes for the run (named by
`SHARED_ENV`): the first worker to need a replay runs it under the replay's
file lock and leaves it there, pickled; the others wait on the lock and read it. The tests
that read every replay (`replays`) run first the ones no other worker is running, so the
workers run the replays between them instead of one worker running them all.

Each replay ends with the scheduled reconcile, as EventBridge Scheduler invokes it, and the
malformed samples of events/malformed/ delivered to the intake, after the report was taken:
their calls and metrics are recorded, the story is the scenario's own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from iam_policy import StackPolicies

from preemptor_tools import ops
from preemptor_tools.local import demo, server
from preemptor_tools.local.aws_calls import AwsCall
from preemptor_tools.local.scenario import DEFAULT_SCENARIO, Scenario
from preemptor_tools.local.stack import EmulatedStack

SCENARIOS = Path(__file__).resolve().parents[1] / "examples" / "scenarios"
MALFORMED = Path(__file__).resolve().parents[1] / "events" / "malformed"
RUNS = ["demo", *sorted(p.stem for p in SCENARIOS.glob("*.yaml"))]
SHARED_ENV = "PREEMPTOR_TEST_REPLAYS"  # the folder the workers of one test run share the replays in


@dataclass(frozen=True)
class Replay:
    result: demo.DemoResult
    calls: list[AwsCall]
    policies: StackPolicies
    failed_executions: list[tuple[str, ...]]  # (state machine, error, cause, failed steps...) of each failed workflow run
    metrics: list[dict]  # every EMF document the functions emitted
    history: list[dict]  # the decision log as `preemptor history --json` reads it (ops.history)


_runs: dict[str, Replay] = {}  # this process's, by name


def replay(name: str) -> Replay:
    """The demo ("demo") or `examples/scenarios/<name>.yaml`, replayed once per test run."""
    if name not in _runs:
        shared = _shared()
        if shared is None:
            _runs[name] = _replay(name)
        else:
            with _lock(shared, name, wait=True):
                _runs[name] = _load_or_replay(shared, name)
    return _runs[name]


def replays() -> Iterator[tuple[str, Replay]]:
    """Every replay, by name: first those no other worker is running, then the others."""
    shared = _shared()
    later = []
    for name in RUNS:
        if name in _runs or shared is None:
            yield name, replay(name)
            continue
        with _lock(shared, name, wait=False) as held:
            if held:
                _runs[name] = _load_or_replay(shared, name)
        if held:
            yield name, _runs[name]
        else:
            later.append(name)
    for name in later:
        yield name, replay(name)


def _shared() -> Path | None:
    folder = os.environ.get(SHARED_ENV)
    return Path(folder) if folder else None


@contextlib.contextmanager
def _lock(folder: Path, name: str, *, wait: bool) -> Iterator[bool]:
    """The replay's file lock in the shared folder: False when `wait` is False and another
    worker holds it. Closing the file releases it."""
    with (folder / f"{name}.lock").open("w") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _load_or_replay(folder: Path, name: str) -> Replay:
    """Under the replay's lock: the replay another worker left, or this one's, left for them."""
    path = folder / f"{name}.pickle"
    if path.exists():
        return pickle.loads(path.read_bytes())
    run = _replay(name)
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(run))
    partial.replace(path)
    return run


def _replay(name: str) -> Replay:
    scenario = DEFAULT_SCENARIO if name == "demo" else Scenario.load(SCENARIOS / f"{name}.yaml")
    seen: list[EmulatedStack] = []

    failed: list[tuple[str, str, str]] = []
    log: list[dict] = []

    def at_start_and_end(stack: EmulatedStack) -> None:
        if seen:
            stack.invoke_lambda(stack.resources["ReconcileFunction"], scheduled_event(stack))
            # And what the intake must refuse: the malformed events AWS itself published.
            target = ops.Target(stack.stack_name, server.stack_outputs(stack), dict(stack.parameters), stack.session)
            log.extend(ops.history(target))
            for path in sorted(MALFORMED.glob("*.json")):
                stack.invoke_lambda(stack.resources["IntakeFunction"], _as_delivered(path.read_text(encoding="utf-8")))
            sfn = stack.client("stepfunctions")
            for logical in stack.state_machines:
                for execution in stack.executions(logical):
                    if execution["status"] == "FAILED":
                        described = sfn.describe_execution(executionArn=execution["executionArn"])
                        failed.append((logical, described.get("error", ""), described.get("cause", ""), *_failed_steps(sfn, execution)))
        seen.append(stack)

    emitted: list[dict] = []
    result = demo.run(scenario, on_stack=at_start_and_end, metrics=emitted)
    stack = seen[0]
    return Replay(result, list(stack.calls.calls), StackPolicies.of(stack), failed, emitted, log)


def _failed_steps(sfn, execution: dict) -> list[str]:
    """"<state>: <error>: <cause>" of each step that failed in a failed workflow run, in order
    (what an assertion on the run needs to say: which step failed, and how)."""
    events = sfn.get_execution_history(executionArn=execution["executionArn"], maxResults=1000)["events"]
    entered = ""
    out = []
    for event in events:
        if "stateEnteredEventDetails" in event:
            entered = event["stateEnteredEventDetails"]["name"]
        for key, details in event.items():
            if key.endswith("FailedEventDetails") or key.endswith("TimedOutEventDetails"):
                out.append(f"{entered}: {details.get('error', '')}: {str(details.get('cause', ''))[:600]}")
    return out


def _as_delivered(text: str) -> object:
    """A sample as a Lambda would receive it: its JSON, or the raw text when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def scheduled_event(stack: EmulatedStack) -> dict:
    return {
        "version": "0",
        "id": "00000000-0000-0000-0000-000000000000",
        "detail-type": "Scheduled Event",
        "source": "aws.events",
        "account": "123456789012",
        "time": "2026-12-01T00:00:00Z",
        "region": stack.region,
        "resources": [f"arn:aws:events:{stack.region}:123456789012:rule/preemptor-reconcile"],
        "detail": {},
    }
