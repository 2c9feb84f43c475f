"""`preemptor`: the command line.

  preemptor demo [--scenario FILE] [--report FILE]   the controller on emulated AWS
  preemptor replay-events FILE...                    feed captured events through the intake
  preemptor plan --snapshot FILE [--policy FILE]     what-if: print the decision as JSON
  preemptor explain JOB --snapshot FILE [--policy FILE] [--history FILE] [--json]
                                                     why a job waits, or who preempted it
  preemptor submit --file JOB.json [--bus NAME]      submit a job to a deployed stack
  preemptor sim --trace CSV --gpus N --policy NAME|FILE [--json]
                                                     replay a job trace (docs/simulator.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .inputs import InputFileError, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="preemptor", description="Priority scheduler with checkpoint-aware preemption")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="replay a scenario on emulated AWS and print the timeline")
    demo.add_argument("--scenario", type=Path, help="scenario YAML (default: the mission's story)")
    demo.add_argument("--report", type=Path, help="write the summary as JSON here")
    demo.add_argument("--quiet", action="store_true", help="print the summary only")
    demo.add_argument(
        "--explain", action="append", default=[], metavar="JOB", help="after the run, explain JOB (repeatable)"
    )

    replay = sub.add_parser("replay-events", help="feed captured EventBridge events through the intake")
    replay.add_argument("files", nargs="+", type=Path)
    replay.add_argument("--policy", type=Path, help="policy JSON the emulated stack runs with (teams and their ceilings)")

    plan = sub.add_parser("plan", help="print the decision for a snapshot, touching nothing")
    plan.add_argument("--snapshot", type=Path, required=True)
    plan.add_argument("--policy", type=Path)

    explain = sub.add_parser("explain", help="why a job waits, runs, or was preempted (from a snapshot)")
    explain.add_argument("job")
    source = explain.add_mutually_exclusive_group(required=True)
    source.add_argument("--snapshot", type=Path, help="snapshot JSON (the `plan` format)")
    source.add_argument("--stack", help="a deployed stack: read its jobs table and configuration")
    explain.add_argument("--policy", type=Path, help="policy JSON (default: the documented defaults)")
    explain.add_argument("--history", type=Path, help="the job's decision log as a JSON list of entries")
    explain.add_argument("--json", action="store_true", help="print the structured answer as JSON")

    submit = sub.add_parser("submit", help="submit a job request to a deployed stack (EventBridge)")
    submit.add_argument("--file", type=Path, required=True, help="job request JSON (see the README)")
    submit.add_argument(
        "--bus", required=True, help="the stack's submission bus (its SubmissionBusName output: <stack>-submissions)"
    )

    sim = sub.add_parser("sim", help="replay a job trace through our policy or a competitor's (docs/simulator.md)")
    from .sim.command import add_arguments as add_sim_arguments

    add_sim_arguments(sim)

    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except InputFileError as e:
        print(f"preemptor: {e}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    if args.command == "demo":
        return _demo(args)
    if args.command == "replay-events":
        return _replay(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "explain":
        return _explain(args)
    if args.command == "submit":
        return _submit(args)
    if args.command == "sim":
        return _sim(args)
    return 2


def _demo(args) -> int:
    from .local import demo
    from .local.scenario import DEFAULT_SCENARIO, Scenario

    scenario = load(args.scenario, "scenario", Scenario.model_validate) if args.scenario else DEFAULT_SCENARIO
    result = demo.run(scenario, explain=args.explain)
    if args.quiet:
        result.timeline = []
    demo.print_result(result, sys.stdout)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(result.report, indent=2) + "\n")
        print(f"report written to {args.report}")
    return 0


def _replay(args) -> int:
    from .local.replay import replay_files

    policy = _policy_text(args.policy) if args.policy else None
    missing = [p for p in args.files if not p.exists()]
    if missing:
        raise InputFileError(missing[0], "no such file or directory")
    counts = replay_files(args.files, sys.stdout, policy_config=policy)
    print(f"{counts['accepted']} accepted, {counts['ignored']} ignored, {counts['rejected']} rejected, {counts['duplicate']} duplicate")
    return 0


def _plan(args) -> int:
    from preemptor.core.planner import plan
    from preemptor.core.policy import Policy
    from .snapshot_file import load_snapshot

    policy = load(args.policy, "policy", lambda d: Policy(**_object(d))) if args.policy else Policy()
    now, snapshot = load(args.snapshot, "snapshot", lambda d: load_snapshot(_object(d), policy.tiers))
    print(json.dumps(plan(snapshot, policy, now).to_dict(), indent=2))
    return 0


def _explain(args) -> int:
    """Explain from a snapshot file (offline), or from a deployed stack's live state."""
    if args.stack:
        return _explain_stack(args)
    from preemptor.core.explain import explain_job
    from preemptor.core.planner import plan
    from preemptor.core.policy import Policy
    from .snapshot_file import load_snapshot

    policy = load(args.policy, "policy", lambda d: Policy(**_object(d))) if args.policy else Policy()
    now, snapshot = load(args.snapshot, "snapshot", lambda d: load_snapshot(_object(d), policy.tiers))
    history = load(args.history, "history", _history) if args.history else None
    answer = explain_job(args.job, plan(snapshot, policy, now), snapshot, policy, now, history)
    print(json.dumps(answer, indent=2) if args.json else answer["text"])
    return 0 if answer["status"] != "unknown" else 1


def _explain_stack(args) -> int:
    import time

    import boto3

    from preemptor.adapters.store import JobsStore
    from preemptor.config import Settings
    from preemptor.service.scheduling import explain

    stack = boto3.client("cloudformation").describe_stacks(StackName=args.stack)["Stacks"][0]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    params = {p["ParameterKey"]: p.get("ParameterValue", "") for p in stack.get("Parameters", [])}
    settings = Settings.from_env(
        {
            "JOBS_TABLE": outputs["JobsTableName"],
            "POOLS_CONFIG": params.get("PoolsConfig", "[]"),
            "POLICY_CONFIG": _policy_text(args.policy) if args.policy else params.get("PolicyConfig", "{}"),
        }
    )
    store = JobsStore(settings.jobs_table, boto3.client("dynamodb"))
    answer = explain(store=store, settings=settings, job=args.job, now=time.time())
    print(json.dumps(answer, indent=2, default=str) if args.json else answer["text"])
    return 0 if answer["status"] != "unknown" else 1


def _submit(args) -> int:
    import boto3

    from preemptor.core.requests import JobRequest

    request = load(args.file, "job request", JobRequest.model_validate)
    entry = {
        # The team is who sends: the bus lets a principal put only its own team's source.
        "Source": f"preemptor.{request.team}",
        "DetailType": "Job Submitted",
        "Detail": request.model_dump_json(exclude_none=True),
        "EventBusName": args.bus,
    }
    out = boto3.client("events").put_events(Entries=[entry])
    if out.get("FailedEntryCount"):
        print(json.dumps(out["Entries"], indent=2), file=sys.stderr)
        return 1
    print(f"submitted {request.name}: event {out['Entries'][0]['EventId']}")
    return 0


def _object(document):
    if not isinstance(document, dict):
        raise ValueError(f"the document must be an object, not {type(document).__name__}")
    return document


def _history(document) -> list[dict]:
    if not isinstance(document, list) or not all(isinstance(e, dict) for e in document):
        raise ValueError("the decision log must be a list of entries (objects)")
    return document


def _policy_text(path: Path) -> str:
    """A policy file, validated, as the JSON text the stack's PolicyConfig takes."""
    from preemptor.core.policy import Policy

    def validated_document(document):
        Policy(**_object(document))  # refused in one line if it is not a policy
        return document

    return json.dumps(load(path, "policy", validated_document))


def _sim(args) -> int:
    from .sim.command import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
