"""The dashboard and the alarms read metrics the functions really emit.

Every metric a dashboard widget or an alarm query names (namespace, name, and the
dimensions it filters or groups by) must be one that the functions emitted, with those
dimensions, in the scenario replays (tests/replays.py: the demo and every example, run with
the functions' metrics captured as EMF documents). AWS/States metrics must name the stack's
own state machines.
"""

from __future__ import annotations

import json
import re

import pytest
from replays import GROUP, RUNS, replay

from tests.template_support import load_template

pytestmark = pytest.mark.xdist_group(GROUP)

_QUERY = re.compile(
    r"SELECT\s+(?P<fn>\w+)\((?P<metric>\w+)\)\s+FROM\s+(?P<ns>[\w/]+)"
    r"(?:\s+WHERE\s+(?P<where>.+?))?(?:\s+GROUP BY\s+(?P<group>[\w, ]+))?\s*$"
)


def _emitted() -> dict[tuple[str, str], list[frozenset[str]]]:
    """(namespace, metric) -> the dimension sets it was emitted with, over every replay."""
    out: dict[tuple[str, str], list[frozenset[str]]] = {}
    for name in RUNS:
        for document in replay(name).metrics:
            for directive in document["_aws"]["CloudWatchMetrics"]:
                for metric in directive["Metrics"]:
                    for dims in directive["Dimensions"]:
                        out.setdefault((directive["Namespace"], metric["Name"]), []).append(frozenset(dims))
    return out


def _dashboard() -> dict:
    body = load_template()["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    return json.loads(re.sub(r"\$\{([\w:]+)\}", r"<\1>", body))


def _queries(expression: str) -> tuple[str, str, set[str]]:
    match = _QUERY.fullmatch(expression.strip())
    assert match, f"not a Metrics Insights query this test reads: {expression!r}"
    where = set(re.findall(r"(\w+)\s*=", match["where"] or ""))
    group = {g.strip() for g in (match["group"] or "").split(",") if g.strip()}
    return match["ns"], match["metric"], where | group


def _widget_metrics() -> list[tuple[str, dict]]:
    out = []
    for widget in _dashboard()["widgets"]:
        if widget["type"] == "metric":
            out += [(widget["properties"]["title"], m) for m in widget["properties"]["metrics"]]
    return out


def _alarm_queries() -> list[tuple[str, str]]:
    out = []
    for logical, resource in load_template()["Resources"].items():
        if resource["Type"] != "AWS::CloudWatch::Alarm":
            continue
        for metric in resource["Properties"].get("Metrics", []):
            expression = metric.get("Expression")
            if isinstance(expression, dict):  # Fn::Sub [text, {Tiers: ...}]
                expression = expression["Fn::Sub"][0].replace("${Tiers}", "critical")
            if expression and expression.startswith("SELECT"):
                out.append((logical, expression))
    return out


@pytest.fixture(scope="module")
def emitted():
    return _emitted()


@pytest.mark.parametrize("where, expression", [
    *[(title, m[0]["expression"]) for title, m in _widget_metrics() if isinstance(m[0], dict)],
    *_alarm_queries(),
])
def test_every_query_of_the_dashboard_and_the_alarms_reads_a_metric_the_code_emits(emitted, where, expression):
    namespace, metric, dimensions = _queries(expression)
    # Then the functions emitted that metric, in that namespace, with those dimensions
    assert (namespace, metric) in emitted, f"{where}: nothing emits {namespace}/{metric}"
    assert any(dimensions <= dims for dims in emitted[(namespace, metric)]), (
        f"{where}: {metric} is never emitted with the dimensions {sorted(dimensions)}; emitted with {emitted[(namespace, metric)][:3]}"
    )


def test_the_workflow_failure_widget_watches_every_state_machine_of_the_stack():
    state_machines = {k for k, r in load_template()["Resources"].items() if r["Type"] == "AWS::Serverless::StateMachine"}
    watched = {m[3].strip("<>") for _, m in _widget_metrics() if isinstance(m[0], str) and m[0] == "AWS/States"}
    assert watched == state_machines
    assert {m[1] for _, m in _widget_metrics() if isinstance(m[0], str)} == {"ExecutionsFailed"}


def test_the_dashboard_covers_what_an_operator_asks_first():
    titles = " | ".join(w["properties"].get("title", "") for w in _dashboard()["widgets"]).lower()
    for topic in (
        "queue depth", "oldest wait", "admissions", "preemptions by reason", "lost gpu-seconds",
        "checkpoint age at preemption", "relaunches", "pool gpus", "decision latency", "rejected events", "workflow failures",
    ):
        assert topic in titles
