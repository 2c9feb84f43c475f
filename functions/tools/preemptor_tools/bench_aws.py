"""What a scheduling decision costs on the handler path, and what running the controller costs.

    python -m preemptor_tools.bench_aws [--sizes 100,1000,10000,100000] [--running 10000] [--jobs 200]

1. Decision cost: the Plan function (lease, one indexed query for the top-ranked pending
   jobs, one query for the pool's capacity-holding jobs, the pool item, team usage) invoked
   through the emulated stack with N pending and R running jobs in one pool. Reported per
   decision: DynamoDB items read and calls (counted on the function's own client), wall
   time on moto, and the planner's share. Moto is an in-process emulator: its query time
   grows with the table (it filters every item), DynamoDB's does not, so the item counts are
   the figure that carries over to AWS; the times are an upper bound for the code path.
2. Cold start: importing each function's handler module in a fresh interpreter.
3. Running cost: a replay of the first jobs of the Philly trace through the whole emulated
   controller (intake, three workflows, simulated fleet), counting Lambda invocations and
   their duration, Step Functions state transitions, DynamoDB request units and EventBridge
   events, scaled to 1,000 jobs and priced with the public on-demand prices below.

Writes bench/results/decision_cost.json, cold_start.json, running_cost.json and
bench/results/aws.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from .paths import REPO_ROOT as ROOT
RESULTS = ROOT / "bench" / "results"
TRACE = ROOT.parent / "shared" / "data" / "traces" / "philly" / "philly-jobs.csv"

# Public on-demand prices, us-east-1, as published on the AWS pricing pages (stored copies
# read on 2026-11-30; not re-checked live: this machine has no internet).
PRICES = {
    "date": "2026-11-30",
    "region": "us-east-1",
    "lambda_per_million_requests": 0.20,
    "lambda_per_gb_second_x86": 0.0000166667,
    "step_functions_standard_per_1000_transitions": 0.025,
    "dynamodb_on_demand_per_million_wru": 0.625,
    "dynamodb_on_demand_per_million_rru": 0.125,
    "eventbridge_custom_events_per_million": 1.00,
    "sns_per_million_publishes": 0.50,
}
LAMBDA_MEMORY_GB = 0.5  # template.yaml Globals MemorySize 512
HANDLERS = {
    "IntakeFunction": "preemptor.handlers.intake",
    "PlanFunction": "preemptor.handlers.schedule",
    "FinishCycleFunction": "preemptor.handlers.schedule",
    "CheckpointFunction": "preemptor.handlers.checkpoint",
    "JobControlFunction": "preemptor.handlers.control",
    "ReconcileFunction": "preemptor.handlers.reconcile",
}


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }


# ------------------------------------------------------------------------ decision cost


class DynamoCounter:
    """Counts calls and items read on a boto3 DynamoDB client (botocore event hooks)."""

    def __init__(self, client):
        self.calls: Counter = Counter()
        self.items_read = 0
        client.meta.events.register("after-call.dynamodb", self._after)

    def _after(self, http_response, parsed, model, **_):
        self.calls[model.name] += 1
        if model.name in ("Query", "Scan"):
            self.items_read += parsed.get("Count", 0)
        elif model.name == "GetItem" and parsed.get("Item"):
            self.items_read += 1
        elif model.name == "BatchGetItem":
            self.items_read += sum(len(v) for v in parsed.get("Responses", {}).values())

    def reset(self) -> None:
        self.calls.clear()
        self.items_read = 0


def decision_cost(sizes: list[int], running: int, repeats: int) -> dict:
    from preemptor.adapters.store import record_to_item
    from preemptor.core.jobs import JobRecord
    from preemptor.core.model import JobState
    from preemptor.core.planner import plan
    from .local.clock import SimClock
    from .local.demo import START
    from .local.stack import EmulatedStack
    from preemptor.service.scheduling import read_snapshot

    rows = []
    gpus_each = 8
    pools = [{"name": "big", "service": "sagemaker", "gpus": running * gpus_each}]
    clock = SimClock(START)
    with EmulatedStack(clock, parameters={"PoolsConfig": json.dumps(pools)}) as stack:
        d = stack.deps()
        client, table = d.store.client, d.store.table
        rng = random.Random(7)

        def put_all(records):
            batch = []
            for record in records:
                batch.append({"PutRequest": {"Item": record_to_item(record)}})
                if len(batch) == 25:
                    client.batch_write_item(RequestItems={table: batch})
                    batch = []
            if batch:
                client.batch_write_item(RequestItems={table: batch})

        def job(name, status, priority, **kw):
            return JobRecord(
                name=name, team=f"team-{rng.randrange(15)}", priority=priority, pool="big", service="sagemaker",
                gpus=gpus_each, request={}, checkpoint_s3_uri=f"s3://b/{name}", submitted_at=START - rng.uniform(0, 86400),
                status=status, **kw,
            )

        # Running jobs of high priority fill the pool; pending ones are lower, so the decision
        # is "wait" for all: no writes but the lease, only the reads a decision always makes.
        put_all(job(f"run-{i:06d}", JobState.RUNNING, 500, started_at=START - rng.uniform(0, 86400),
                    last_checkpoint_at=START - rng.uniform(0, 900), run_id=f"run-{i:06d}") for i in range(running))
        d.store.ensure_pool("big", running * gpus_each)
        d.store.set_pool_usage("big", running * gpus_each)
        counter = DynamoCounter(client)
        have = 0
        for n in sizes:
            put_all(job(f"pend-{i:07d}", JobState.PENDING, rng.choice([50, 200])) for i in range(have, n))
            have = n
            times, plan_times, reads, calls = [], [], [], []
            for r in range(repeats):
                counter.reset()
                started = time.perf_counter()
                stack.invoke_lambda(f"{stack.stack_name}-PlanFunction", {"pool": "big", "owner": f"bench-{n}-{r}"})
                times.append(time.perf_counter() - started)
                reads.append(counter.items_read)
                calls.append(sum(counter.calls.values()))
                stack.invoke_lambda(f"{stack.stack_name}-FinishCycleFunction", {"pool": "big", "owner": f"bench-{n}-{r}"})
                _, _, snapshot = read_snapshot(d.store, d.settings, "big", clock.now())
                t = time.perf_counter()
                plan(snapshot, d.settings.policy, clock.now())
                plan_times.append(time.perf_counter() - t)
            rows.append(
                {
                    "pending": n,
                    "running": running,
                    "pending_read_window": d.settings.pending_window,
                    "items_read_per_decision": statistics.median(reads),
                    "dynamodb_calls_per_decision": statistics.median(calls),
                    "handler_wall_s_on_moto_median": round(statistics.median(times), 4),
                    "planner_s_median": round(statistics.median(plan_times), 4),
                }
            )
            print(f"  pending {n:>7}: {rows[-1]}", file=sys.stderr)
    return {"repeats": repeats, "rows": rows}


# ------------------------------------------------------------------------ cold start


def cold_start(repeats: int) -> dict:
    rows = {}
    code = "import time,importlib,sys; t=time.perf_counter(); importlib.import_module(sys.argv[1]); print(time.perf_counter()-t)"
    for function, module in HANDLERS.items():
        samples = []
        for _ in range(repeats):
            out = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, check=True)
            samples.append(float(out.stdout.strip()))
        rows[function] = {"module": module, "import_s_median": round(statistics.median(samples), 4)}
    return {"repeats": repeats, "python": sys.executable, "rows": rows}


# ------------------------------------------------------------------------ running cost


def running_cost(jobs: int) -> dict:
    from .local import demo

    scenario = _trace_scenario(jobs)
    counts: Counter = Counter()
    durations: list[float] = []
    units = {"rru": 0.0, "wru": 0.0}
    state: dict = {}

    def instrument(stack) -> None:
        if "stack" in state:  # the end of the run: count the workflows' state transitions
            sfn = stack.client("stepfunctions")
            for arn in stack.state_machines.values():
                for e in _all_executions(sfn, arn):
                    history = sfn.get_execution_history(executionArn=e["executionArn"], maxResults=1000)["events"]
                    counts["sfn_transitions"] += sum(1 for h in history if h["type"].endswith("StateEntered"))
                    counts["sfn_executions"] += 1
            return
        state["stack"] = stack
        original = stack.invoke_lambda

        def counted(name, event):
            counts["lambda_invocations"] += 1
            started = time.perf_counter()
            try:
                return original(name, event)
            finally:
                durations.append(time.perf_counter() - started)

        stack.invoke_lambda = counted
        from .local import moto_patches

        moto_patches._STATE.lambda_invoker = counted  # the in-process Lambda backend calls this
        RequestUnits(units, counts).register(stack.deps().store.client)

    result = demo.run(scenario, on_stack=instrument)
    scale = 1000 / jobs
    lambda_gb_s = sum(math.ceil(d * 1000) / 1000 for d in durations) * LAMBDA_MEMORY_GB
    per_1000 = {
        "lambda_invocations": counts["lambda_invocations"] * scale,
        "lambda_gb_seconds_measured_here": lambda_gb_s * scale,
        "sfn_transitions": counts["sfn_transitions"] * scale,
        "dynamodb_rru": units["rru"] * scale,
        "dynamodb_wru": units["wru"] * scale,
        "eventbridge_custom_events": jobs * scale,  # one Job Submitted per job; AWS service events are free
    }
    dollars = {
        "lambda": per_1000["lambda_invocations"] / 1e6 * PRICES["lambda_per_million_requests"]
        + per_1000["lambda_gb_seconds_measured_here"] * PRICES["lambda_per_gb_second_x86"],
        "step_functions": per_1000["sfn_transitions"] / 1000 * PRICES["step_functions_standard_per_1000_transitions"],
        "dynamodb": per_1000["dynamodb_wru"] / 1e6 * PRICES["dynamodb_on_demand_per_million_wru"]
        + per_1000["dynamodb_rru"] / 1e6 * PRICES["dynamodb_on_demand_per_million_rru"],
        "eventbridge": per_1000["eventbridge_custom_events"] / 1e6 * PRICES["eventbridge_custom_events_per_million"],
    }
    dollars["total"] = sum(dollars.values())
    return {
        "jobs_replayed": jobs,
        "scenario": "first jobs of philly-jobs.csv, durations capped at 2 h, one 256-GPU pool",
        "report": {k: result.report[k] for k in ("preemptions", "relaunches", "lost_gpu_seconds")},
        "counted": dict(counts),
        "per_1000_jobs": {k: round(v, 3) for k, v in per_1000.items()},
        "usd_per_1000_jobs": {k: round(v, 4) for k, v in dollars.items()},
        "prices": PRICES,
        "notes": [
            "Lambda GB-seconds are the in-process handler times measured here, rounded up to 1 ms "
            "each; on AWS add cold starts (see cold_start.json) and network latency to AWS APIs.",
            "DynamoDB units: strongly consistent reads 1 RRU per 4 KB, eventually consistent half; "
            "writes 1 WRU per KB; transactional operations twice that.",
            "The scheduled reconcile (every 5 minutes) adds about 8,640 invocations a month, whatever the load.",
        ],
    }


def _all_executions(sfn, arn):
    kwargs = {"stateMachineArn": arn}
    while True:
        out = sfn.list_executions(**kwargs)
        yield from out["executions"]
        if not out.get("nextToken"):
            return
        kwargs["nextToken"] = out["nextToken"]


class RequestUnits:
    """Approximate DynamoDB request units of every call on a client (see the notes)."""

    def __init__(self, units: dict, counts: Counter):
        self.units, self.counts, self._params = units, counts, {}

    def register(self, client) -> None:
        client.meta.events.register("before-parameter-build.dynamodb", self._before)
        client.meta.events.register("after-call.dynamodb", self._after)

    def _before(self, params, model, **_):
        self._params[model.name] = params

    @staticmethod
    def _kb(item: dict) -> float:
        return len(json.dumps(item)) / 1024

    def _after(self, http_response, parsed, model, **_):
        name, params = model.name, self._params.get(model.name, {})
        self.counts[f"dynamodb_{name}"] += 1
        consistent = 1.0 if params.get("ConsistentRead") else 0.5
        if name == "GetItem" and parsed.get("Item"):
            self.units["rru"] += math.ceil(self._kb(parsed["Item"]) / 4) * consistent
        elif name in ("Query", "Scan"):
            self.units["rru"] += max(1, math.ceil(sum(self._kb(i) for i in parsed.get("Items", [])) / 4)) * consistent
        elif name in ("PutItem", "UpdateItem", "DeleteItem"):
            self.units["wru"] += max(1, math.ceil(self._kb(params.get("Item", {}))))
        elif name == "TransactWriteItems":
            for op in params.get("TransactItems", []):
                body = next(iter(op.values()))
                self.units["wru"] += 2 * max(1, math.ceil(self._kb(body.get("Item", {}))))


def _trace_scenario(jobs: int):
    from .local.scenario import Scenario

    rows = []
    with open(TRACE) as f:
        for row in csv.DictReader(f):
            if int(row["gpus"]) > 64:
                continue
            rows.append(row)
            if len(rows) == jobs:
                break
    t0 = float(rows[0]["submit_s"])
    return Scenario.model_validate(
        {
            "pools": [{"name": "philly", "service": "batch", "gpus": 256}],
            "jobs": [
                {
                    "name": r["job_id"],
                    "team": f"vc-{r['team']}",
                    "priority": int(r["priority"]),
                    "pool": "philly",
                    "gpus": int(r["gpus"]),
                    "submit_at": min(float(r["submit_s"]) - t0, 6 * 3600),
                    "duration": min(float(r["duration_s"]), 2 * 3600),
                    "checkpoint_every": 900,
                }
                for r in rows
            ],
        }
    )


# ------------------------------------------------------------------------ entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preemptor_tools.bench_aws", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000,100000")
    parser.add_argument("--running", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: decision,cold,cost")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python -m preemptor_tools.bench_aws " + " ".join(argv if argv is not None else sys.argv[1:])
    context = {"command": command.strip(), "machine": machine()}
    if "decision" not in skip:
        print("decision cost ...", file=sys.stderr)
        out = decision_cost([int(s) for s in args.sizes.split(",")], args.running, args.repeats)
        (RESULTS / "decision_cost.json").write_text(json.dumps({**context, **out}, indent=2) + "\n")
    if "cold" not in skip:
        print("cold start ...", file=sys.stderr)
        (RESULTS / "cold_start.json").write_text(json.dumps({**context, **cold_start(5)}, indent=2) + "\n")
    if "cost" not in skip:
        print("running cost ...", file=sys.stderr)
        (RESULTS / "running_cost.json").write_text(json.dumps({**context, **running_cost(args.jobs)}, indent=2) + "\n")
    write_markdown()
    return 0


def write_markdown() -> None:
    parts = ["# The controller on the AWS side: decision cost, cold start, running cost\n"]
    path = RESULTS / "decision_cost.json"
    if path.exists():
        d = json.loads(path.read_text())
        parts += [
            f"## Decision cost\n\nCommand: `{d['command']}`  \nMachine: {d['machine']}\n",
            "| pending | running | DynamoDB items read | DynamoDB calls | Plan handler on moto (s) | planner alone (s) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in d["rows"]:
            parts.append(
                f"| {r['pending']:,} | {r['running']:,} | {r['items_read_per_decision']:,.0f} | {r['dynamodb_calls_per_decision']:.0f} "
                f"| {r['handler_wall_s_on_moto_median']} | {r['planner_s_median']} |"
            )
        parts.append(
            "\nItems read per decision do not grow with the queue: the pending jobs are read from the "
            "`ByPoolStatus` index with a limit (the best-ranked window), the running ones are bounded by "
            "the pool's size. Moto's query time grows with the table (it filters every item); DynamoDB's "
            "does not, so on AWS the time follows the items read.\n"
        )
    path = RESULTS / "cold_start.json"
    if path.exists():
        c = json.loads(path.read_text())
        parts += [f"## Cold start (handler import)\n\nCommand: `{c['command']}`  \nMachine: {c['machine']}\n",
                  "| function | module | import (s, median of 5) |", "|---|---|---:|"]
        for fn, r in c["rows"].items():
            parts.append(f"| {fn} | `{r['module']}` | {r['import_s_median']} |")
        parts.append("")
    path = RESULTS / "running_cost.json"
    if path.exists():
        r = json.loads(path.read_text())
        parts += [
            f"## Running cost per 1,000 jobs\n\nCommand: `{r['command']}`  \nMachine: {r['machine']}  \n"
            f"Replay: {r['jobs_replayed']} jobs ({r['scenario']}); {r['report']}\n",
            "| item | per 1,000 jobs |", "|---|---:|",
        ]
        for k, v in r["per_1000_jobs"].items():
            parts.append(f"| {k} | {v:,.1f} |")
        parts += ["", "| service | USD per 1,000 jobs |", "|---|---:|"]
        for k, v in r["usd_per_1000_jobs"].items():
            parts.append(f"| {k} | {v:.4f} |")
        parts.append(f"\nPrices ({r['prices']['region']}, {r['prices']['date']}): " + ", ".join(
            f"{k} {v}" for k, v in r["prices"].items() if k not in ("date", "region")) + ".\n")
        parts += [f"- {n}" for n in r["notes"]]
    (RESULTS / "aws.md").write_text("\n".join(parts) + "\n")


if __name__ == "__main__":
    sys.exit(main())
