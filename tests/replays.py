"""One replay of the demo and of each example scenario per test process, with every AWS call
it made, shared by the tests that read them (`tests/workflows/test_scenarios.py` asserts on
the stories, `tests/unit/test_iam.py` on the calls); both modules are one xdist group, so a
replay runs once per `make test`.

Each replay ends with the scheduled reconcile, as EventBridge Scheduler invokes it, and the
malformed samples of events/malformed/ delivered to the intake, after the report was taken:
their calls and metrics are recorded, the story is the scenario's own.
"""

from __future__ import annotations

import functools
import json
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
GROUP = "scenario-replays"  # the xdist group of the modules that share the replays


@dataclass(frozen=True)
class Replay:
    result: demo.DemoResult
    calls: list[AwsCall]
    policies: StackPolicies
    failed_executions: list[tuple[str, ...]]  # (state machine, error, cause, failed steps...) of each failed workflow run
    metrics: list[dict]  # every EMF document the functions emitted
    history: list[dict]  # the decision log as `preemptor history --json` reads it (ops.history)


@functools.cache
def replay(name: str) -> Replay:
    """The demo ("demo") or `examples/scenarios/<name>.yaml`, replayed once per process."""
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
