"""`preemptor`: the command line.

  preemptor demo [--scenario FILE] [--report FILE]   the controller on emulated AWS
  preemptor replay-events FILE...                    feed captured events through the intake
  preemptor plan --snapshot FILE [--policy FILE]     what-if: print the decision as JSON
  preemptor sim --trace CSV --gpus N --policy NAME|FILE [--json]
                                                     replay a job trace (docs/simulator.md)

  preemptor local up [--port N] [--speed X]          serve the emulated stack on 127.0.0.1
  preemptor local down | status                      stop it / where it is

The operator's commands, against a deployed stack (--stack NAME, or $PREEMPTOR_STACK; the
usual AWS profile and region settings, or --profile/--region) or the local one (--local);
each takes --json:
  preemptor submit --file JOB.json [--wait [--timeout S]]   (or --bus NAME: a bus by name)
  preemptor cancel JOB [--wait]
  preemptor queue                                    pending and running jobs per pool
  preemptor status JOB
  preemptor explain JOB                              why it waits, runs, or was preempted
                                                     (or --snapshot FILE: offline)
  preemptor history [JOB] [--limit N]                the decision log
  preemptor pools                                    capacity, used, borrowed, per team
  preemptor drain POOL [--note TEXT] | undrain POOL  admit nothing new, preempt nothing
  preemptor quota-raised POOL                        the account's quota a launch met was raised:
                                                     plan the pool at its size again
  preemptor priority JOB PRIORITY [--note TEXT]      the platform's call: another priority, within
                                                     the team's ceiling (a cycle starts at once)

Exit codes: 0 ok; 1 not found (job, pool, local stack); 2 bad input (a wrong file or option,
a request the stack refuses); 3 AWS error (one line on stderr, never a traceback); 4 `--wait` timed
out; 5 `--wait` saw the job end failed or cancelled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from . import argtypes
from .inputs import InputFileError, load

EXIT_OK, EXIT_NOT_FOUND, EXIT_BAD_INPUT, EXIT_AWS, EXIT_TIMED_OUT, EXIT_JOB_FAILED = 0, 1, 2, 3, 4, 5
EXIT_LEFT_IN_QUEUE = 6  # `redrive` left dead letters in the queue (refused, or AWS said no)


class UsageError(Exception):
    """The command line itself is wrong: an unknown option, a missing or bad value (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that refuses as the rest of the CLI does: one line, exit code 2 (`main`),
    instead of printing the usage and leaving the process."""

    def error(self, message: str):
        command = self.prog.partition(" ")[2]  # "sim" of "preemptor sim"; `_fail` names the program
        raise UsageError(f"{command + ': ' if command else ''}{message} (see --help)")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except UsageError as e:
        return _fail(e, EXIT_BAD_INPUT)
    from . import ops
    from .local.state import DeployFailed, LocalStackError, NoLocalStack

    try:
        return _dispatch(args)
    except (InputFileError, ops.BadInput, DeployFailed) as e:  # DeployFailed: the emulated stack's configuration check
        return _fail(e, EXIT_BAD_INPUT)
    except (ops.NotFound, NoLocalStack) as e:
        return _fail(e, EXIT_NOT_FOUND if isinstance(e, ops.NotFound) or args.command == "local" else EXIT_AWS)
    except ops.TimedOut as e:
        return _fail(e, EXIT_TIMED_OUT)
    except LocalStackError as e:
        return _fail(e, EXIT_AWS)
    except (ClientError, BotoCoreError) as e:
        return _fail(f"AWS error: {_aws_error(e)}", EXIT_AWS)
    except Exception as e:
        # An adapter's translation of an AWS error (`adapters.errors.translate`) keeps the
        # ClientError as its cause; anything else is a bug and keeps its traceback.
        if isinstance(e.__cause__, (ClientError, BotoCoreError)):
            return _fail(f"AWS error: {_aws_error(e.__cause__)}", EXIT_AWS)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="preemptor", description="Priority scheduler with checkpoint-aware preemption")
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

    explain = sub.add_parser("explain", help="why a job waits, runs, or was preempted (a stack's state, or a snapshot)")
    explain.add_argument("job")
    source = explain.add_mutually_exclusive_group()
    source.add_argument("--snapshot", type=Path, help="snapshot JSON (the `plan` format)")
    _add_target_options(explain, source)
    explain.add_argument("--policy", type=Path, help="policy JSON (default: the documented defaults, or the stack's)")
    explain.add_argument("--history", type=Path, help="with --snapshot: the job's decision log as a JSON list of entries")

    submit = sub.add_parser("submit", help="submit a job request to a stack (its submission bus)")
    submit.add_argument("--file", type=Path, required=True, help="job request JSON (examples/jobs/)")
    submit.add_argument("--bus", help="put it on this bus by name, unchecked (default: the stack's SubmissionBusName output)")
    _add_target_options(submit)
    _add_wait_options(submit, "until the job runs or ends")

    cancel = sub.add_parser("cancel", help="cancel a job (a Job Cancelled event from its team)")
    cancel.add_argument("job")
    _add_team_bus_options(cancel)
    _add_target_options(cancel)
    _add_wait_options(cancel, "until the job has ended")

    queue = sub.add_parser("queue", help="pending and running jobs per pool: rank, priority, team, GPUs, wait, state")
    _add_target_options(queue)

    status = sub.add_parser("status", help="where one job stands")
    status.add_argument("job")
    _add_target_options(status)

    history = sub.add_parser("history", help="the decision log: one job's, or every job's")
    history.add_argument("job", nargs="?")
    history.add_argument("--limit", type=argtypes.positive_int, help="only the newest N entries")
    _add_target_options(history)

    pools = sub.add_parser("pools", help="capacity, used, borrowed, per team")
    _add_target_options(pools)

    drain = sub.add_parser("drain", help="a pool admits nothing new and preempts nothing (running jobs go on)")
    drain.add_argument("pool")
    drain.add_argument("--note", type=argtypes.note, default="", help="why (shown by queue, pools and explain)")
    _add_target_options(drain)

    undrain = sub.add_parser("undrain", help="a drained pool schedules again (a cycle starts at once)")
    undrain.add_argument("pool")
    _add_target_options(undrain)

    raised = sub.add_parser(
        "quota-raised", help="the account's quota a launch of the pool met was raised: plan the pool at its size again (a cycle starts at once)"
    )
    raised.add_argument("pool")
    _add_target_options(raised)

    priority = sub.add_parser(
        "priority", help="give a job another priority (within its team's ceiling; a cycle of its pool starts at once)"
    )
    priority.add_argument("job")
    priority.add_argument("priority", help="an integer 0..1000 or one of the stack's tier names")
    priority.add_argument("--note", type=argtypes.note, default="", help="why (in the decision log and the team's notice)")
    _add_target_options(priority)

    lower = sub.add_parser("lower", help="lower a job's priority as its team (a Job Priority Lowered event; never raises)")
    lower.add_argument("job")
    lower.add_argument("priority", help="an integer 0..1000 or one of the stack's tier names, below the job's")
    lower.add_argument("--note", type=argtypes.note, default="", help="why (in the decision log and the team's notice)")
    _add_team_bus_options(lower)
    _add_target_options(lower)

    redrive = sub.add_parser("redrive", help="hand the events of the dead-letter queue back to their functions")
    redrive.add_argument("--dry-run", action="store_true", help="only list what would be redriven; the queue is left as it is")
    redrive.add_argument("--limit", type=argtypes.positive_int, help="at most N messages")
    redrive.add_argument(
        "--discard-refused", action="store_true", help="delete the messages it will not hand back (listed first, with why)"
    )
    _add_target_options(redrive)

    local = sub.add_parser("local", help="the local stack: emulated AWS on 127.0.0.1 that the CLI and AWS SDKs talk to")
    local_sub = local.add_subparsers(dest="local_command", required=True)
    up = local_sub.add_parser("up", help="serve the local stack until `local down` or Ctrl-C")
    from .local.state import DEFAULT_PORT

    up.add_argument("--port", type=argtypes.port, default=DEFAULT_PORT, help=f"TCP port on 127.0.0.1 (default {DEFAULT_PORT}; 0: any free one)")
    up.add_argument("--speed", type=argtypes.positive, default=60.0, help="simulated seconds per real second (default 60)")
    up.add_argument("--scenario", type=Path, help="scenario YAML whose pools and policy the stack runs (its jobs are not submitted)")
    up.add_argument("--max-lifetime", type=argtypes.positive, default=8 * 3600, metavar="SECONDS", help="stop after this long (default 8 h)")
    up.add_argument("--max-jobs", type=argtypes.positive_int, default=500, help="route at most this many submissions (default 500)")
    for name in ("down", "status"):
        cmd = local_sub.add_parser(name, help={"down": "stop the local stack", "status": "where the local stack is"}[name])
        cmd.add_argument("--json", action="store_true", help="print the answer as JSON")
    for cmd in local_sub.choices.values():
        cmd.add_argument("--state-file", type=Path, help="the local stack's state file (default: $PREEMPTOR_LOCAL_STATE, "
                         "$XDG_RUNTIME_DIR/preemptor/local.json, or .preemptor/local.json)")

    sim = sub.add_parser("sim", help="replay a job trace through our policy or a competitor's (docs/simulator.md)")
    from .sim.command import add_arguments as add_sim_arguments

    add_sim_arguments(sim)
    return parser


def _fail(message: object, code: int) -> int:
    print(f"preemptor: {' '.join(str(message).split())}", file=sys.stderr)
    return code


def _aws_error(e: Exception) -> str:
    if isinstance(e, ClientError):
        error = e.response.get("Error", {})
        return f"{e.operation_name}: {error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")
    return str(e)


def _dispatch(args) -> int:
    commands = {
        "demo": _demo,
        "replay-events": _replay,
        "plan": _plan,
        "explain": _explain,
        "submit": _submit,
        "sim": _sim,
        "cancel": _cancel,
        "queue": _queue,
        "status": _status,
        "history": _history_command,
        "pools": _pools,
        "drain": _drain,
        "undrain": _drain,
        "quota-raised": _quota_raised,
        "priority": _priority,
        "lower": _lower,
        "redrive": _redrive,
        "local": _local,
    }
    return commands[args.command](args)


# -- options shared by the operator commands ---------------------------------------------------
def _add_target_options(parser: argparse.ArgumentParser, group=None) -> None:
    where = group if group is not None else parser.add_mutually_exclusive_group()
    where.add_argument("--stack", help="a deployed stack's name (default: $PREEMPTOR_STACK)")
    where.add_argument("--local", action="store_true", help="the local stack (`preemptor local up`)")
    parser.add_argument("--profile", help="AWS profile (default: the usual settings)")
    parser.add_argument("--region", help="AWS region (default: the usual settings)")
    parser.add_argument("--state-file", type=Path, help="with --local: the local stack's state file")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")


def _add_team_bus_options(parser: argparse.ArgumentParser) -> None:
    """A team's own way to send its event: with only the bus's name and its team, which is
    all a principal holding the stack's TeamSubmitPolicy may use (no stack or table read)."""
    parser.add_argument("--bus", help="put the team's event on this bus by name, unchecked: the intake judges it (needs --team)")
    parser.add_argument("--team", type=_team_name, help="with --bus: the job's team, the event's source preemptor.<team>")


def _team_name(text: str) -> str:
    from preemptor.core.policy import validate_team_name

    try:
        return validate_team_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_wait_options(parser: argparse.ArgumentParser, until: str) -> None:
    parser.add_argument("--wait", action="store_true", help=f"poll and print state changes {until}")
    parser.add_argument("--timeout", type=argtypes.positive, default=600.0, help="with --wait: give up after this many seconds (default 600)")


def _target(args):
    from . import ops
    from .local.state import LocalState, default_state_path

    if args.local:
        return ops.Target.local_stack(LocalState.read(args.state_file or default_state_path()))
    stack = args.stack or os.environ.get("PREEMPTOR_STACK")
    if not stack:
        raise ops.BadInput("which stack? give --stack NAME (or set PREEMPTOR_STACK), or --local")
    return ops.Target.deployed(stack, profile=args.profile, region=args.region)


def _print(args, data, render) -> None:
    from .tables import Painter, use_colour

    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(render(data, Painter(use_colour(sys.stdout))))


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
    """Explain from a snapshot file (offline), or from a stack's live state."""
    if not args.snapshot:
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
    from . import ops

    target = _target(args)
    if args.policy:  # what-if: the stack's state under another policy
        target.parameters = {**target.parameters, "PolicyConfig": _policy_text(args.policy)}
    answer = ops.explain(target, args.job)
    print(json.dumps(answer, indent=2, default=str) if args.json else answer["text"])
    return EXIT_OK


def _submit(args) -> int:
    from preemptor.core.requests import JobRequest
    from . import ops

    request = load(args.file, "job request", JobRequest.model_validate)
    if args.bus and not (args.stack or args.local):
        return _submit_to_bus(request, args.bus, args)
    target = _target(args)
    if args.bus:
        target.outputs = {**target.outputs, "SubmissionBusName": args.bus}
    result = ops.submit(target, request)
    _say(args, f"submitted {result['job']} to {target.name}: event {result['event_id']}")
    if args.wait:
        result["status"] = ops.wait_for(target, result["job"], ops.RUNS_OR_ENDED, args.timeout, _progress(args))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return _wait_outcome(args, result)


def _submit_to_bus(request, bus: str, args) -> int:
    """A bus named by hand (no stack read, no checks against its configuration)."""
    event_id = _put_team_event(bus, request.team, "Job Submitted", request.model_dump_json(exclude_none=True), args)
    if event_id is None:
        return 1
    print(f"submitted {request.name}: event {event_id}")
    return 0


def _put_team_event(bus: str, team: str, detail_type: str, detail_json: str, args=None) -> str | None:
    """Put `team`'s event on a bus named by hand; its event id, or None (the refused entry
    printed on stderr)."""
    import boto3

    entry = {
        # The team is who sends: the bus lets a principal put only its own team's source.
        "Source": f"preemptor.{team}",
        "DetailType": detail_type,
        "Detail": detail_json,
        "EventBusName": bus,
    }
    session = boto3.session.Session(profile_name=getattr(args, "profile", None), region_name=getattr(args, "region", None))
    out = session.client("events").put_events(Entries=[entry])
    if out.get("FailedEntryCount"):
        print(json.dumps(out["Entries"], indent=2), file=sys.stderr)
        return None
    return out["Entries"][0]["EventId"]


def _to_team_bus(args, detail_type: str, detail: dict) -> int | None:
    """`--bus` without `--stack`/`--local`: the team's event, unchecked (the intake judges it,
    and the job's decision log and the team's notices tell what came of it). None when the
    command goes to a stack instead."""
    from . import ops

    if args.team and not args.bus:
        raise ops.BadInput("--team goes with --bus: with a stack, the job's team is read from the job")
    if not args.bus:
        return None
    if args.stack or args.local:
        raise ops.BadInput("--bus goes without --stack and --local: with a stack, the event goes on its own bus")
    if not args.team:
        raise ops.BadInput("--bus needs --team: the job's team, the event's source")
    if getattr(args, "wait", False):
        raise ops.BadInput("--wait follows the job in the stack's table: not with --bus")
    event_id = _put_team_event(args.bus, args.team, detail_type, json.dumps(detail), args)
    if event_id is None:
        return EXIT_AWS
    result = {"job": args.job, "team": args.team, "bus": args.bus, "event_id": event_id}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.job}: {detail_type} sent as team {args.team} on {args.bus}: event {event_id} (the intake judges it)")
    return EXIT_OK


def _cancel(args) -> int:
    from . import ops

    sent = _to_team_bus(args, "Job Cancelled", {"name": args.job})
    if sent is not None:
        return sent
    target = _target(args)
    result = ops.cancel(target, args.job)
    _say(args, f"{result['job']}: {result['note']} (was {result['state']})")
    if args.wait and result["event_id"]:
        result["status"] = ops.wait_for(target, args.job, ops.ENDED, args.timeout, _progress(args))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return EXIT_OK


def _say(args, line: str) -> None:
    """A progress line: on stdout, or on stderr when stdout carries the JSON answer."""
    print(line, file=sys.stderr if args.json else sys.stdout, flush=True)


def _progress(args):
    from .tables import clock_time, duration

    def on_change(view: dict) -> None:
        why = f" ({view['waiting_reason']})" if view.get("waiting_reason") else ""
        if view["state"] == "PENDING":
            why += f", waiting {duration(view['wait_s'])}"
        if view.get("outcome_reason") and view["state"] in ("FAILED", "CANCELLED", "COMPLETED"):
            why = f" ({view['outcome_reason']})"
        _say(args, f"{clock_time(view.get('started_at') or view['submitted_at'])[11:]}  {view['job']}: {view['state']}{why}")

    return on_change


def _wait_outcome(args, result: dict) -> int:
    state = (result.get("status") or {}).get("state")
    return EXIT_JOB_FAILED if args.wait and state in ("FAILED", "CANCELLED") else EXIT_OK


def _queue(args) -> int:
    from . import ops
    from .tables import render_queue

    _print(args, ops.queue(_target(args)), render_queue)
    return EXIT_OK


def _status(args) -> int:
    from . import ops
    from .tables import render_status

    _print(args, ops.status(_target(args), args.job), render_status)
    return EXIT_OK


def _history_command(args) -> int:
    from . import ops
    from .tables import render_history

    entries = ops.history(_target(args), args.job, args.limit)
    _print(args, entries, lambda data, painter: render_history(data, painter, one_job=args.job is not None))
    return EXIT_OK


def _pools(args) -> int:
    from . import ops
    from .tables import render_pools

    _print(args, ops.pools(_target(args)), render_pools)
    return EXIT_OK


def _drain(args) -> int:
    from . import ops

    drained = args.command == "drain"
    result = ops.set_drained(_target(args), args.pool, drained, getattr(args, "note", ""))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif drained and result.get("call_off_error"):
        print(
            f"pool {args.pool} drained: it admits nothing new and preempts nothing; running jobs go on; calling off the stops"
            f" its victims wait for was refused ({result['call_off_error']}): the pool's next cycle calls them off{_cycle_told(result)}"
        )
    elif drained:
        print(f"pool {args.pool} drained: it admits nothing new and preempts nothing; running jobs go on{_spared(result)}")
    else:
        print(f"pool {args.pool} undrained: scheduling again{_cycle_told(result)}")
    return EXIT_OK


def _cycle_told(result: dict) -> str:
    """What became of the cycle an operator's change started (`ops._start_cycle`)."""
    if result.get("cycle_error"):
        return f"; no cycle started ({result['cycle_error']}): the pool's next event or reconcile plans it"
    return " (a cycle started)" if result["schedule_execution"] else ""


def _quota_raised(args) -> int:
    from . import ops

    result = ops.quota_raised(_target(args), args.pool)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        then = _cycle_told(result)
        print(f"pool {args.pool} planned at its size again: the quota '{result['quota']}' (it left {result['was_gpus']} GPUs) is taken as raised{then}")
    return EXIT_OK


def _priority(args) -> int:
    from . import ops

    result = ops.set_priority(_target(args), args.job, args.priority, args.note)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif not result["changed"]:
        spared = _spared(result)
        print(f"{args.job}: priority is {result['to']} already ({result['state']}): nothing changed{spared}")
    else:
        then = _cycle_told(result)
        going_on = (
            "; its preemption is called off, it runs on" if result.get("preemption_called_off")
            else "; the stop already sent goes on" if result["state"] == "PREEMPTING" else _spared(result)
        )
        print(f"{args.job}: priority {result['from']} -> {result['to']} ({result['state']}){going_on}{then}")
    return EXIT_OK


def _spared(result: dict) -> str:
    """What a lowering called off: the preemptions its new priority no longer permits."""
    spared = result.get("victims_spared") or []
    return f"; no longer stops {', '.join(spared)} (no stop was sent)" if spared else ""


def _lower(args) -> int:
    from . import ops

    detail = {"name": args.job, "priority": int(args.priority) if args.priority.strip().isdigit() else args.priority}
    sent = _to_team_bus(args, "Job Priority Lowered", detail | ({"note": args.note} if args.note else {}))
    if sent is not None:
        return sent
    result = ops.lower(_target(args), args.job, args.priority, args.note)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif result["event_id"] is None:
        print(f"{args.job}: priority is {result['to']} already ({result['state']}): nothing sent")
    else:
        print(f"{args.job}: lowering {result['from']} -> {result['to']} sent as team event {result['event_id']} ({result['state']})")
    return EXIT_OK


def _redrive(args) -> int:
    from . import redrive

    target = _target(args)
    result = redrive.redrive(
        target, dry_run=args.dry_run, limit=args.limit, wait_s=0 if target.local else 1, discard_refused=args.discard_refused
    )
    _print(args, result, redrive.render)
    left = result["failed"] or any(not r["discarded"] for r in result["refused"])
    return EXIT_LEFT_IN_QUEUE if left else EXIT_OK


def _local(args) -> int:
    from .local import state as local_state

    path = args.state_file or local_state.default_state_path()
    if args.local_command == "up":
        from .local import server
        from .local.scenario import Scenario

        options = server.Options(
            port=args.port,
            speed=args.speed,
            max_lifetime_s=args.max_lifetime,
            max_jobs=args.max_jobs,
            state_path=path,
            scenario=load(args.scenario, "scenario", Scenario.model_validate) if args.scenario else server.LOCAL_SCENARIO,
        )
        try:
            server.serve(options, sys.stdout, sys.stderr)
        except OSError as e:
            raise local_state.LocalStackError(f"cannot serve on 127.0.0.1:{args.port}: {e.strerror or e}") from e
        return EXIT_OK
    if args.local_command == "down":
        stopped = local_state.stop(path)
        data = {"stopped": True, "pid": stopped.pid, "endpoint_url": stopped.endpoint_url}
        print(json.dumps(data, indent=2) if args.json else f"stopped the local stack (pid {stopped.pid}, {stopped.endpoint_url})")
        return EXIT_OK
    running = local_state.LocalState.read(path)
    data = {**running.to_dict(), "now": running.now(), "state_file": str(path)}
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        from .tables import clock_time

        print(
            f"local stack {running.stack} on {running.endpoint_url} (pid {running.pid}), {running.speed:g}x real time\n"
            f"  simulated time  {clock_time(running.now())}\n"
            f"  stops by itself {clock_time(running.stops_at)}\n"
            f"  state file      {path}\n"
            f"  e.g.  aws --endpoint-url {running.endpoint_url} --region {running.region} dynamodb scan "
            f"--table-name {running.outputs.get('JobsTableName')} (any credentials)"
        )
    return EXIT_OK


def _object(document):
    if not isinstance(document, dict):
        raise ValueError(f"the document must be an object, not {type(document).__name__}")
    return document


def _history(document) -> list[dict]:
    from .history_file import load_history

    if not isinstance(document, list) or not all(isinstance(e, dict) for e in document):
        raise ValueError("the decision log must be a list of entries (objects)")
    return load_history(document)


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
