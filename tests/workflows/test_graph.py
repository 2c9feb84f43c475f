"""Every workflow's graph is well formed (executing them is the other tests' job)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

MACHINES = sorted((Path(__file__).resolve().parents[2] / "statemachines").glob("*.asl.json"))
TERMINAL = {"Succeed", "Fail"}


def _graphs(definition: dict, where: str = ""):
    yield where or "top", definition
    for name, state in definition["States"].items():
        for key in ("ItemProcessor", "Iterator"):
            if key in state:
                yield from _graphs(state[key], f"{where}/{name}")
        for i, branch in enumerate(state.get("Branches", [])):
            yield from _graphs(branch, f"{where}/{name}[{i}]")


def _targets(state: dict) -> list[str]:
    out = [state[k] for k in ("Next", "Default") if k in state]
    out += [c["Next"] for c in state.get("Choices", [])]
    out += [c["Next"] for c in state.get("Catch", [])]
    return out


@pytest.mark.parametrize("path", MACHINES, ids=lambda p: p.name)
def test_graph_is_well_formed(path):
    definition = json.loads(path.read_text())
    for where, graph in _graphs(definition):
        states = graph["States"]
        assert graph["StartAt"] in states, where
        for name, state in states.items():
            # every target exists
            for target in _targets(state):
                assert target in states, f"{path.name}{where}: {name} -> {target}"
            # every state ends or moves on
            if state["Type"] not in TERMINAL and state["Type"] != "Choice":
                assert state.get("End") or "Next" in state, f"{path.name}{where}: {name} is a dead end"
            # every task retries, with named errors
            if state["Type"] == "Task":
                assert state.get("Retry"), f"{path.name}{where}: task {name} has no Retry"
        # every state is reachable from the start
        seen, todo = set(), [graph["StartAt"]]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += _targets(states[name])
        assert seen == set(states), f"{path.name}{where}: unreachable {set(states) - seen}"


@pytest.mark.parametrize("path", MACHINES, ids=lambda p: p.name)
def test_state_names_are_plain_english(path):
    for _, graph in _graphs(json.loads(path.read_text())):
        for name in graph["States"]:
            assert re.fullmatch(r"[A-Z][a-z]+( [a-z]+| [A-Z][A-Za-z]*)*\??", name.replace("'", "")), name


@pytest.mark.parametrize("path", MACHINES, ids=lambda p: p.name)
def test_every_lambda_step_is_retried_a_bounded_number_of_times_after_a_crash(path):
    # A Lambda that dies after its work (Lambda.Unknown: out of memory, a timeout) is
    # retried: every step is idempotent and answers its retry as the first attempt would
    # (tests/workflows/test_crashed_steps.py); twice at most, then the Catch reports it.
    for where, graph in _graphs(json.loads(path.read_text())):
        for name, state in graph["States"].items():
            if state["Type"] == "Task" and state["Resource"].endswith("FunctionArn}"):
                crashes = [r for r in state["Retry"] if "Lambda.Unknown" in r["ErrorEquals"]]
                assert len(crashes) == 1 and 1 <= crashes[0]["MaxAttempts"] <= 2, f"{path.name}{where}: {name}"
