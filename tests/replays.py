"""One replay of the demo and of each example scenario per test process, with every AWS call
it made, shared by the tests that read them (`tests/workflows/test_scenarios.py` asserts on
the stories, `tests/unit/test_iam.py` on the calls); both modules are one xdist group, so a
replay runs once per `make test`.

Each replay ends with the scheduled reconcile, as EventBridge Scheduler invokes it, after
the report was taken: its calls are recorded, the story is the scenario's own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from iam_policy import StackPolicies

from preemptor_tools.local import demo
from preemptor_tools.local.aws_calls import AwsCall
from preemptor_tools.local.scenario import DEFAULT_SCENARIO, Scenario
from preemptor_tools.local.stack import EmulatedStack

SCENARIOS = Path(__file__).resolve().parents[1] / "examples" / "scenarios"
RUNS = ["demo", *sorted(p.stem for p in SCENARIOS.glob("*.yaml"))]
GROUP = "scenario-replays"  # the xdist group of the modules that share the replays


@dataclass(frozen=True)
class Replay:
    result: demo.DemoResult
    calls: list[AwsCall]
    policies: StackPolicies


@functools.cache
def replay(name: str) -> Replay:
    """The demo ("demo") or `examples/scenarios/<name>.yaml`, replayed once per process."""
    scenario = DEFAULT_SCENARIO if name == "demo" else Scenario.load(SCENARIOS / f"{name}.yaml")
    seen: list[EmulatedStack] = []

    def at_start_and_end(stack: EmulatedStack) -> None:
        if seen:
            stack.invoke_lambda(stack.resources["ReconcileFunction"], scheduled_event(stack))
        seen.append(stack)

    result = demo.run(scenario, on_stack=at_start_and_end)
    stack = seen[0]
    return Replay(result, list(stack.calls.calls), StackPolicies.of(stack))


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
