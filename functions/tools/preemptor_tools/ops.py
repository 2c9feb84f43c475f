"""What an operator asks of a Preemptor stack, deployed or local: the queue, a job's status,
the decision log, the pools; and what an operator does: submit, cancel, drain, undrain, and
give a job another priority.

A `Target` is one stack: its outputs and parameters (CloudFormation `DescribeStacks` for a
deployed stack, the state file for `preemptor local up`), a boto3 session (the usual
profile and region settings, or the local endpoint with fake credentials) and its clock
(wall time, or the local stack's simulated time). Every read goes through the same adapter
the functions use (`JobsStore`), every answer is a JSON-ready dict; `tables.py` renders them.

Submissions and cancels go where a team's go: the stack's submission bus, as
`preemptor.<team>` events; the intake handles them as any other. Draining writes the flag on
the pool's item in the jobs table, which every scheduling cycle of the pool reads first
(`service.scheduling.plan_cycle`); undraining starts a cycle at once. A job's priority is
the platform's call: the operator sets it on the job's record (`set_priority`), within its
team's ceiling, and a cycle of its pool starts at once.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from botocore.exceptions import BotoCoreError

from preemptor.adapters.alerts import Alerts
from preemptor.adapters.store import JobsStore, LogLine
from preemptor.adapters.workflows import WorkflowStarter, execution_name
from preemptor.config import Settings, first_problem
from preemptor.core.errors import ConflictError, PreemptorError, TransactionConflict
from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState, Notice
from preemptor.core.requests import JobRequest, RequestRefused, admit_request, resolve_priority
from preemptor.service.actions import announce, drained_preemptions, outranked_preemptions, priority_changed, releasable
from .local.state import FAKE_CREDENTIALS, LocalState

# Where `submit --wait` stops waiting: the job runs, or has ended.
RUNS_OR_ENDED = frozenset({JobState.RUNNING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
ENDED = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


class NotFound(Exception):
    """The job or pool named does not exist (exit 1)."""


class BadInput(Exception):
    """The stack would refuse what was asked (exit 2)."""


class TimedOut(Exception):
    """`--wait` gave up (exit 4)."""


@dataclass
class Target:
    """One Preemptor stack and how to reach it."""

    name: str
    outputs: dict[str, str]
    parameters: dict[str, str]
    session: Any  # boto3.session.Session
    endpoint_url: str | None = None
    clock: Callable[[], float] = time.time
    local: bool = False
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def deployed(cls, stack: str, *, profile: str | None = None, region: str | None = None) -> "Target":
        """A deployed stack, read with CloudFormation (the usual AWS profile and region settings)."""
        import boto3

        session = boto3.session.Session(profile_name=profile, region_name=region)
        described = session.client("cloudformation").describe_stacks(StackName=stack)["Stacks"][0]
        outputs = {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}
        parameters = {p["ParameterKey"]: p.get("ParameterValue", "") for p in described.get("Parameters", [])}
        return cls(stack, outputs, parameters, session)

    @classmethod
    def local_stack(cls, state: LocalState) -> "Target":
        """The stack `preemptor local up` serves: its endpoint, fake credentials, its clock."""
        import boto3

        session = boto3.session.Session(region_name=state.region, **FAKE_CREDENTIALS)
        return cls(state.stack, state.outputs, state.parameters, session, state.endpoint_url, state.now, local=True)

    def client(self, service: str) -> Any:
        if service not in self._clients:
            config = None
            if self.local:
                from botocore.config import Config

                # A local stack that went away is an answer at once, not after minutes of retries.
                config = Config(connect_timeout=2, retries={"mode": "standard", "max_attempts": 2})
            self._clients[service] = self.session.client(service, endpoint_url=self.endpoint_url, config=config)
        return self._clients[service]

    def now(self) -> float:
        return self.clock()

    @cached_property
    def settings(self) -> Settings:
        """The functions' settings, from the stack's parameters and outputs."""
        p, o = self.parameters, self.outputs
        env = {
            "JOBS_TABLE": o["JobsTableName"],
            "MODE": p.get("Mode") or "enforce",
            "POOLS_CONFIG": p.get("PoolsConfig") or "[]",
            "POLICY_CONFIG": p.get("PolicyConfig") or "{}",
            "CHECKPOINT_BUCKET": p.get("CheckpointBucketName", ""),
            "TRAINING_ROLE_ARN": p.get("ManagedRoleArnForTraining", ""),
            "MAX_TRAINING_RUNTIME_S": p.get("MaxTrainingRuntimeSeconds", ""),
            "SCHEDULE_STATE_MACHINE_ARN": o.get("ScheduleStateMachineArn", ""),
        }
        if p.get("WaitAlarmTiers"):  # the watched tiers must be the policy's: the stack's own, not the default
            env["WAIT_ALARM_TIERS"] = p["WaitAlarmTiers"]
        try:
            return Settings.from_env(env)
        except ValueError as e:  # pydantic's ValidationError too: a what-if --policy the stack's parameters do not fit
            raise BadInput(f"stack {self.name}: the functions could not run this configuration: {first_problem(e)}") from None

    @cached_property
    def store(self) -> JobsStore:
        return JobsStore(self.settings.jobs_table, self.client("dynamodb"))


# -- reads ------------------------------------------------------------------------------------
def job_view(record: JobRecord, now: float, waits: dict[str, dict] | None = None) -> dict:
    """One job as `queue` and `status` show it."""
    waited_from = record.pending_since or record.submitted_at
    if record.status is JobState.PENDING:
        wait = now - waited_from
    elif record.started_at is not None:
        wait = max(0.0, record.started_at - waited_from)
    else:
        wait = None
    why = (waits or {}).get(record.name) or {}
    return {
        "job": record.name,
        "team": record.team,
        "priority": record.priority,
        "pool": record.pool,
        "service": record.service,
        "gpus": record.gpus,
        "state": record.status.value,
        "wait_s": None if wait is None else round(wait, 3),
        "running_s": None
        if record.started_at is None or not record.status.holds_capacity
        else round(now - record.started_at, 3),
        "checkpoint_age_s": None if record.last_checkpoint_at is None else round(now - record.last_checkpoint_at, 3),
        "incarnation": record.incarnation,
        "run": record.run_name or record.run_id,
        "preemptions": record.preemptions,
        "lost_gpu_seconds": round(record.lost_gpu_seconds, 3),
        "preempted_by": record.preempted_by if record.status is JobState.PREEMPTING else None,
        "cancel_requested": record.cancel_requested,
        "outcome_reason": record.outcome_reason,
        "waiting_reason": why.get("reason") if record.status is JobState.PENDING else None,
        "waiting_detail": why.get("detail") if record.status is JobState.PENDING else None,
        "submitted_at": record.submitted_at,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
    }


def _pool_item(target: Target, pool: str) -> dict:
    item = target.store.pool(pool) or {}
    waits = item.get("last_waits")
    item["last_waits"] = {w["job"]: w for w in json.loads(waits)} if waits else {}
    return item


def _drain_view(item: dict) -> dict:
    return {
        "drained": bool(item.get("drained")),
        "drained_at": item.get("drained_at"),
        "drained_note": item.get("drained_note") or None,
    }


def queue(target: Target) -> dict:
    """Pending (in rank order: the pending index's order) and running jobs of every pool."""
    now = target.now()
    pools = []
    for cfg in target.settings.pools:
        item = _pool_item(target, cfg.name)
        waits = item["last_waits"]
        pending = target.store.pending(cfg.name, target.settings.pending_window)
        active = sorted(target.store.active(cfg.name), key=lambda r: (r.started_at or r.submitted_at, r.name))
        jobs = [{"rank": i, **job_view(r, now, waits)} for i, r in enumerate(pending, 1)]
        jobs += [{"rank": None, **job_view(r, now)} for r in active]
        pools.append(
            {
                "pool": cfg.name,
                "capacity_gpus": cfg.capacity_gpus,
                "used_gpus": int(item.get("used_gpus", 0)),
                **_drain_view(item),
                "jobs": jobs,
            }
        )
    return {"stack": target.name, "now": now, "pools": pools}


def status(target: Target, job: str) -> dict:
    """Where one job stands, with its newest decision."""
    record = target.store.get(job)
    if record is None:
        raise NotFound(f"{job}: no such job")
    now = target.now()
    item = _pool_item(target, record.pool)
    view = job_view(record, now, item["last_waits"])
    history = target.store.history(job)
    view["last_decision"] = _entry(history[-1]) if history else None
    view["pool_drained"] = bool(item.get("drained"))
    view["now"] = now
    return view


def _entry(e: dict) -> dict:
    return {k: e.get(k) for k in ("at", "job", "kind", "reason", "detail")} | {"extra": e.get("extra") or {}}


def history(target: Target, job: str | None = None, limit: int | None = None) -> list[dict]:
    """The decision log: one job's (NotFound if the job has none and does not exist), or
    every job's (a scan of the table), oldest first; `limit` keeps the newest entries."""
    if job is not None:
        entries = target.store.history(job)
        if not entries and target.store.get(job) is None:
            raise NotFound(f"{job}: no such job")
    else:
        entries = target.store.all_history()
    entries = [_entry(e) for e in entries]
    return entries[-limit:] if limit else entries


def pools(target: Target) -> dict:
    """Every pool: capacity (configured, and planned: what the account's quota leaves it,
    once a launch met a quota below it), used (the pool's own count), free (of the planned),
    the jobs holding it per team, and what each team runs above its nominal quota (borrowed)."""
    now = target.now()
    policy = target.settings.policy
    out = []
    for cfg in target.settings.pools:
        item = _pool_item(target, cfg.name)
        active = target.store.active(cfg.name)
        pending = target.store.pending(cfg.name, target.settings.pending_window)
        quotas = policy.for_pool(cfg.name).quotas
        teams: dict[str, dict] = {}
        for r in active + pending:
            team = teams.setdefault(
                r.team, {"team": r.team, "used_gpus": 0, "running": 0, "pending": 0, "pending_gpus": 0}
            )
            if r.status is JobState.PENDING:
                team["pending"] += 1
                team["pending_gpus"] += r.gpus
            else:
                team["running"] += 1
                team["used_gpus"] += r.gpus
        for q in quotas:
            teams.setdefault(q.team, {"team": q.team, "used_gpus": 0, "running": 0, "pending": 0, "pending_gpus": 0})
        for name, team in teams.items():
            if quotas:
                nominal = sum(q.nominal_gpus for q in quotas if q.team == name)
                team["nominal_gpus"] = nominal
                team["borrowed_gpus"] = max(0, team["used_gpus"] - nominal)
            else:
                team["nominal_gpus"] = None  # no quotas: the pool is shared by priority alone
                team["borrowed_gpus"] = None
        used = int(item.get("used_gpus", 0))
        # What the account's quota leaves the pool, as its plans count it (a launch met it).
        planned = JobsStore.quota_capacity_gpus(item, cfg.capacity_gpus, now)
        cap = item.get("quota_cap") or {}
        out.append(
            {
                "pool": cfg.name,
                "service": cfg.service,
                "capacity_gpus": cfg.capacity_gpus,
                "planned_gpus": planned,
                "quota": {"name": cap["quota"], "until": float(cap["until"])} if planned < cfg.capacity_gpus else None,
                "used_gpus": used,
                "free_gpus": max(0, planned - used),
                "borrowed_gpus": sum(t["borrowed_gpus"] for t in teams.values()) if quotas else None,
                "running": sum(1 for r in active),
                "pending": len(pending),
                **_drain_view(item),
                "last_plan_at": item.get("last_plan_at"),
                "teams": sorted(teams.values(), key=lambda t: t["team"]),
            }
        )
    return {"stack": target.name, "now": now, "pools": out}


def explain(target: Target, job: str) -> dict:
    """`explain` on the stack's live state (`service.scheduling.explain`), saying so when
    the job's pool is drained: the planner's verdict is then not what happens."""
    from preemptor.service.scheduling import explain as explain_live

    answer = explain_live(store=target.store, settings=target.settings, job=job, now=target.now())
    if answer["status"] == "unknown":
        raise NotFound(answer["text"])
    pool = answer.get("pool") or getattr(target.store.get(job), "pool", None)
    item = _pool_item(target, pool) if pool else {}
    answer["pool_drained"] = bool(item.get("drained"))
    if answer["pool_drained"]:
        note = f" ({item['drained_note']})" if item.get("drained_note") else ""
        line = (
            f"  pool {pool} is drained{note}: nothing is admitted or preempted there until `preemptor undrain {pool}`;"
            " the decision below is what a cycle of the undrained pool would do"
        )
        lines = answer["text"].splitlines()
        answer["text"] = "\n".join(lines[:1] + [line] + lines[1:])
    return answer


# -- actions ----------------------------------------------------------------------------------
def preflight(target: Target, request: JobRequest) -> JobRequest:
    """Refuse now (BadInput) what the stack's intake would refuse: an unknown team or pool,
    a priority above the team's ceiling, a request the pool does not allow. Tier names
    resolve against the stack's tiers. Returns the request as the stack reads it."""
    settings = target.settings
    policy = settings.policy
    try:
        request = JobRequest.model_validate(request.model_dump(), context={"tiers": policy.tiers})
    except ValueError as e:
        raise BadInput(str(e)) from e
    if not policy.team_listed(request.team):
        raise BadInput(f"unknown-team: team {request.team!r} is not configured in stack {target.name}")
    if request.priority > policy.max_priority(request.team):
        raise BadInput(
            f"above-team-ceiling: priority {request.priority} is above team {request.team!r}'s "
            f"ceiling {policy.max_priority(request.team)}"
        )
    pool = settings.pool(request.pool)
    if pool is None:
        known = ", ".join(p.name for p in settings.pools) or "none"
        raise BadInput(f"unknown-pool: pool {request.pool!r} is not configured in stack {target.name} (pools: {known})")
    existing = target.store.get(request.name)
    if existing is not None:
        # The intake would call it a duplicate and change nothing; the CLI would have said
        # "submitted" (and `--wait` followed the other job).
        raise BadInput(
            f"duplicate: job {request.name!r} already exists in stack {target.name} ({existing.status.value}, team "
            f"{existing.team}): job names are unique for good; submit it under another name"
        )
    try:
        admit_request(
            request,
            pool,
            checkpoint_bucket=settings.checkpoint_bucket,
            default_role_arn=settings.training_role_arn,
            max_runtime_s=settings.max_training_runtime_s,
            team_role_arn=policy.training_role(request.team),
        )
    except RequestRefused as e:
        raise BadInput(str(e)) from e
    return request


def put_event(target: Target, team: str, detail_type: str, detail_json: str) -> str:
    """Put a `preemptor.<team>` event on the stack's submission bus; returns its event id."""
    entry = {
        # The team is who sends: the bus lets a principal put only its own team's source.
        "Source": f"preemptor.{team}",
        "DetailType": detail_type,
        "Detail": detail_json,
        "EventBusName": target.outputs["SubmissionBusName"],
    }
    out = target.client("events").put_events(Entries=[entry])
    result = out["Entries"][0]
    if out.get("FailedEntryCount") or "EventId" not in result:
        raise BadInput(f"EventBridge refused the event: {result.get('ErrorCode')}: {result.get('ErrorMessage')}")
    return result["EventId"]


def submit(target: Target, request: JobRequest) -> dict:
    request = preflight(target, request)
    event_id = put_event(target, request.team, "Job Submitted", request.model_dump_json(exclude_none=True))
    return {"job": request.name, "event_id": event_id, "stack": target.name}


def cancel(target: Target, job: str) -> dict:
    """Ask the controller to cancel `job` (as its team: a "Job Cancelled" event)."""
    record = target.store.get(job)
    if record is None:
        raise NotFound(f"{job}: no such job")
    if record.status.is_terminal:
        return {"job": job, "state": record.status.value, "event_id": None, "note": "already ended: nothing to cancel"}
    event_id = put_event(target, record.team, "Job Cancelled", json.dumps({"name": job}))
    return {"job": job, "state": record.status.value, "event_id": event_id, "note": "cancel requested"}


def lower(target: Target, job: str, priority: str, note: str = "") -> dict:
    """Lower `job`'s priority as its team (a "Job Priority Lowered" event): a team may lower
    its own jobs, never raise them (`preemptor priority` is the operator's). Checked here
    first, so a mistake is said at once rather than found in the intake's log; the intake
    checks again, on the job as it is then, and writes the change (`priority-changed`,
    reason `team`), and a cycle of the pool plans it."""
    record, value = _job_and_priority(target, job, priority)
    if record.status.is_terminal:
        raise BadInput(f"{job}: already ended ({record.status.value}): it has no priority to change")
    result = {"job": job, "from": record.priority, "to": value, "state": record.status.value, "note": note or None}
    if value == record.priority:
        return result | {"event_id": None}
    if value > record.priority:
        raise BadInput(
            f"not-a-lowering: {job} has priority {record.priority}; its team may only lower it, and {value} is higher "
            "(raising is the operator's: preemptor priority)"
        )
    detail = {"name": job, "priority": value} | ({"note": note} if note else {})
    return result | {"event_id": put_event(target, record.team, "Job Priority Lowered", json.dumps(detail))}


def wait_for(
    target: Target,
    job: str,
    until: frozenset[JobState],
    timeout_s: float,
    on_change: Callable[[dict], None],
    poll_s: float | None = None,
) -> dict:
    """Poll the job's status until it reaches one of `until`, telling `on_change` every
    state it is seen in; TimedOut after `timeout_s` real seconds. A job that never appears
    was refused by the intake (BadInput)."""
    poll_s = poll_s if poll_s is not None else 0.2 if target.local else 1.0
    deadline = time.monotonic() + timeout_s
    seen: tuple | None = None
    appear_by = time.monotonic() + min(timeout_s, 30.0)
    while True:
        record = target.store.get(job)
        if record is None:
            if time.monotonic() >= appear_by:
                raise BadInput(f"{job}: the stack has no such job: its intake refused the submission (see its logs)")
        else:
            view = job_view(record, target.now())
            key = (view["state"], view["incarnation"])
            if key != seen:
                seen = key
                on_change(view)
            if record.status in until:
                return view
        if time.monotonic() >= deadline:
            raise TimedOut(f"{job}: still {seen[0] if seen else 'not seen'} after {timeout_s:g} s")
        time.sleep(poll_s)


def set_drained(target: Target, pool: str, drained: bool, note: str = "") -> dict:
    """Drain (admit nothing new, preempt nothing) or undrain a pool; undraining starts a
    scheduling cycle of the pool at once rather than at the next event or reconcile.
    Draining calls off the preemptions whose victims were sent no stop yet
    (`victims_spared`, `actions.drained_preemptions`); a cycle planning the pool as the
    drain lands marks and admits nothing after it (its writes are conditional on the pool
    not drained: `PoolDrained`). Call-offs AWS refused are told in `call_off_error` (the pool
    stays drained) and a cycle of the pool starts, which calls them off as a drained pool's
    cycles do. A cycle AWS refused to start is told in `cycle_error` (the pool stays as said;
    its next event or reconcile's cycle, within five minutes, plans it)."""
    _known_pool(target, pool)
    now = target.now()
    target.store.set_drained(pool, drained, now, note)
    # Drained, it preempts nothing: the stops its victims wait for are called off too.
    spared, call_off_error = [], None
    if drained:
        try:
            spared = drained_preemptions(store=target.store, pool=pool, now=now, alerts=_alerts(target))
        except (PreemptorError, BotoCoreError) as e:
            call_off_error = f"{type(e).__name__}: {e}"
    execution, cycle_error = (None, None)
    if not drained or call_off_error:
        execution, cycle_error = _start_cycle(target, "drain" if drained else "undrain", pool)
    return {
        "pool": pool, "drained": drained, "at": now, "note": note or None, "schedule_execution": execution,
        "cycle_error": cycle_error, "victims_spared": spared, "call_off_error": call_off_error,
    }


def quota_raised(target: Target, pool: str) -> dict:
    """The operator had the account's quota raised that a launch of `pool` met (the pool
    planned below its size, `pools` says so and the `quota-below-pool` alarm is on): the pool
    is planned at its size again, and a cycle starts at once. Reconcile forgets the quota by
    itself once Service Quotas lists it raised; where Service Quotas cannot show it (not
    listed, or its read refused), the quota is kept at what was last known until this is
    said. Said wrongly, the next launch over the quota notes it again. A cycle AWS refused
    to start is told in `cycle_error` (the quota stays forgotten)."""
    _known_pool(target, pool)
    noted = target.store.noted_quota(pool)
    if noted is None:
        raise BadInput(f"{pool}: no quota noted for it: it is planned at its size")
    if not target.store.forget_quota(pool, noted):
        raise BadInput(f"{pool}: a launch noted its quota again meanwhile: read `preemptor pools` and say it once more if it was raised")
    execution, cycle_error = _start_cycle(target, "quota-raised", pool)
    return {
        "pool": pool, "quota": noted["quota"], "was_gpus": noted["gpus"], "at": target.now(),
        "schedule_execution": execution, "cycle_error": cycle_error,
    }


def _known_pool(target: Target, pool: str) -> None:
    """Refuse a pool the stack does not have, naming those it has."""
    if target.settings.pool(pool) is None:
        known = ", ".join(p.name for p in target.settings.pools) or "none"
        raise NotFound(f"{pool}: no such pool (pools: {known})")


def _start_cycle(target: Target, why: str, pool: str) -> tuple[str | None, str | None]:
    """Start a scheduling cycle of `pool` for an operator's change already written: (its
    execution, or None; why AWS refused to start it, or None). A refusal is said, not raised:
    asked again, the change would change nothing and start nothing; the pool's next event,
    or reconcile's cycle, plans it."""
    if not target.settings.workflow_arns.get("schedule"):
        return None, None
    starter = WorkflowStarter(target.client("stepfunctions"), target.settings.workflow_arns)
    try:
        return starter.start("schedule", execution_name(why, pool, uuid.uuid4().hex[:12]), {"pool": pool}), None
    except (PreemptorError, BotoCoreError) as e:
        return None, f"{type(e).__name__}: {e}"


def set_priority(target: Target, job: str, priority: str, note: str = "") -> dict:
    """Give `job` another priority: an integer or one of the stack's tier names, at most its
    team's ceiling (the stack's policy: raising the ceiling is a change of the policy, not of
    one job). Pending, the job is ranked at it; running, it is judged at it as a victim, and
    judges its own victims at it when it is relaunched. Raised while its preemption waits for
    a checkpoint, the preemption is called off, the job is protected for one checkpoint wait
    (`_release`), and the new cycle judges again; a stop already sent goes on. Lowered while
    it waits for its victims, the preemptions its new priority no longer permits are called
    off where no stop was sent (`victims_spared`, `actions.outranked_preemptions`).

    Written with its decision-log line (`priority-changed`, with the note) and the team's
    notice (published at once, else by reconcile), conditional on the job as read:
    if the controller changed it meanwhile, it is read again and judged again. A cycle of the
    job's pool starts at once, as the change may admit or preempt; one AWS refused to start
    is told in `cycle_error` (the change stands, and the pool's next event or reconcile's
    cycle, every five minutes, plans it)."""
    record, value = _job_and_priority(target, job, priority)
    policy = target.settings.policy
    ceiling = policy.max_priority(record.team)
    if value > ceiling:
        raise BadInput(
            f"above-team-ceiling: priority {value} is above the ceiling of team {record.team!r}, {ceiling} "
            f"(its max_priority in the policy of stack {target.name})"
        )
    for _ in range(5):
        if record.status.is_terminal:
            raise BadInput(f"{job}: already ended ({record.status.value}): it has no priority to change")
        was = record.priority
        result = {"job": job, "from": was, "to": value, "state": record.status.value, "note": note or None}
        if was == value:
            # Asked again after a call that died between its change and the call-off of the
            # preemptions it no longer permits: the call-off is done now.
            spared = outranked_preemptions(
                store=target.store, policy=policy, preemptor=record, why="set by the operator", now=target.now(), alerts=_alerts(target)
            )
            return result | {
                "changed": False, "at": None, "schedule_execution": None, "preemption_called_off": False, "victims_spared": spared,
            }
        now = target.now()
        release = releasable(record) and value > was
        if release:
            going_on = f"; its preemption for {record.preempted_by} is called off (no stop was sent): the pool is planned again"
        else:
            going_on = "; the stop already sent goes on" if record.status is JobState.PREEMPTING else ""
        line, notice = priority_changed(
            record, value, policy.tier_of(value), now, "operator", "set by the operator", note, also=going_on, preemption_called_off=release
        )
        try:
            if release:
                _release(target, record, value, now, line, notice)
                spared = []
            else:
                changed = target.store.set_priority(record, value, line, notice)
                spared = outranked_preemptions(
                    store=target.store, policy=policy, preemptor=changed, why="set by the operator", now=now, alerts=_alerts(target)
                )
            result |= {"preemption_called_off": release, "victims_spared": spared}
            break
        except (ConflictError, TransactionConflict):
            # The controller changed the job meanwhile (a cycle admitted it, a run ended...).
            record = target.store.get(job)
            if record is None:
                raise NotFound(f"{job}: no such job") from None
    else:
        raise BadInput(f"{job}: it kept changing while its priority was set; nothing was changed: ask again")
    _tell_team(target, notice)
    execution, cycle_error = _start_cycle(target, "priority", record.pool)
    return result | {"changed": True, "at": now, "schedule_execution": execution, "cycle_error": cycle_error}


def _job_and_priority(target: Target, job: str, priority: str) -> tuple[JobRecord, int]:
    """The job (NotFound) and the priority asked for it, an integer or one of the stack's
    tier names (BadInput `bad-priority`)."""
    record = target.store.get(job)
    if record is None:
        raise NotFound(f"{job}: no such job")
    try:
        return record, resolve_priority(priority, target.settings.policy.tiers)
    except ValueError as e:
        raise BadInput(f"bad-priority: {e}") from None


def _tell_team(target: Target, notice: Notice) -> None:
    """Publish the team's notice of the operator's change now, on the stack's alerts topic
    (`ControlOperatorPolicy` grants it), and mark it sent. Refused (an operator without the
    grant, SNS throttling), or a stack without the topic's output, it stays in the table and
    reconcile publishes it within its next runs."""
    alerts = _alerts(target)
    if alerts is not None:
        announce(target.store, alerts, notice)


def _alerts(target: Target) -> Alerts | None:
    """The stack's alerts topic, to publish the operator's notices on at once (None: a stack
    without the topic's output; reconcile publishes them)."""
    topic = target.outputs.get("AlertsTopicArn")
    return Alerts(target.client("sns"), topic) if topic else None


def _release(target: Target, record: JobRecord, priority: int, now: float, line: LogLine, notice: Notice) -> None:
    """Raise a victim that waits for its checkpoint and call its preemption off, in one
    transaction conditional on the job as read: a stop claimed meanwhile (its workflow's stop
    step) moves the version, so this write is refused and the caller reads the job again.
    Its workflow's stop step then finds it running and sends nothing (`actions.stop`).

    It is protected for one checkpoint wait, as a victim spared after a checkpoint timeout
    is: no other preemption chooses it while the called-off one's workflow still waits (its
    wait began before this release), so that workflow's stop step can only find it released."""
    until = now + target.settings.policy.for_pool(record.pool).checkpoint_wait_max_s
    why = f"its priority was raised to {priority} by the operator"
    lines = (
        line,
        LogLine(record.name, now, "preemption-cancelled", "priority-raised", f"{why}; left running, protected for {until - now:.0f} s"),
        LogLine(
            record.preempted_by, now, "victim-spared", "priority-raised",
            f"{record.name} was not stopped ({why}); the pool is planned again", {"victim": record.name},
        ),
    )
    new = record.left_running(priority=priority, spared_until=until)
    target.store.transition(record, new, (JobState.PREEMPTING,), log=lines, notice=notice, called_off=True)
