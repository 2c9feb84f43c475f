"""template.yaml: the contract other code relies on, least privilege, and lint, offline.

Static checks read the template as written; IAM, EventBridge and lint checks read it as
CloudFormation after the SAM transform (aws-sam-translator, no network).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # so that `tests.*` helpers import without a conftest
    sys.path.insert(0, str(_REPO))

from tests.eventfiles import all_event_files, relative_name  # noqa: E402
from tests.template_support import (  # noqa: E402
    TEMPLATE_PATH,
    load_template,
    resources_of_type,
    sam_transform,
    state_machine_definition_path,
    table_key_schema,
)

FUNCTIONS = {
    "IntakeFunction": "preemptor.handlers.intake.handler",
    "PlanFunction": "preemptor.handlers.schedule.plan",
    "FinishCycleFunction": "preemptor.handlers.schedule.finish",
    "CheckpointFunction": "preemptor.handlers.checkpoint.handler",
    "JobControlFunction": "preemptor.handlers.control.handler",
    "ReconcileFunction": "preemptor.handlers.reconcile.handler",
}

STATE_MACHINES = {
    "ScheduleStateMachine": (
        "statemachines/schedule.asl.json",
        {"PlanFunctionArn", "FinishCycleFunctionArn", "JobControlFunctionArn", "PreemptStateMachineArn", "AlertsTopicArn"},
    ),
    "PreemptStateMachine": (
        "statemachines/preempt.asl.json",
        {"CheckpointFunctionArn", "JobControlFunctionArn", "ScheduleStateMachineArn", "AlertsTopicArn"},
    ),
    "JobEndedStateMachine": (
        "statemachines/job_ended.asl.json",
        {"JobControlFunctionArn", "ScheduleStateMachineArn", "AlertsTopicArn"},
    ),
    "SpotInterruptionStateMachine": (
        "statemachines/spot_interruption.asl.json",
        {"CheckpointFunctionArn", "JobControlFunctionArn", "ScheduleStateMachineArn", "AlertsTopicArn"},
    ),
}

INTAKE_RULES = {
    "SageMakerTrainingJobStateChange": {
        "source": ["aws.sagemaker"],
        "detail-type": ["SageMaker Training Job State Change"],
    },
    "BatchJobStateChange": {"source": ["aws.batch"], "detail-type": ["Batch Job State Change"]},
    "SpotInterruptionWarning": {"source": ["aws.ec2"], "detail-type": ["EC2 Spot Instance Interruption Warning"]},
    "RebalanceRecommendation": {"source": ["aws.ec2"], "detail-type": ["EC2 Instance Rebalance Recommendation"]},
    "ScheduledInstanceChange": {
        "source": ["aws.health"],
        "detail-type": ["AWS Health Event"],
        "detail": {"service": ["EC2"], "eventTypeCategory": ["scheduledChange"]},
    },
    "PreemptorJobEvents": {"source": [{"prefix": "preemptor."}], "detail-type": ["Job Submitted", "Job Cancelled", "Job Priority Lowered"]},
    "CheckpointObjectCreated": {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {"bucket": {"name": [{"Ref": "CheckpointBucketName"}]}},
    },
    "BatchServiceJobEvents": {
        "source": ["aws.batch"],
        "detail-type": ["Batch Service Job State Change", "Batch Service Job Preemption Started", "Batch Service Job Preemption Completed"],
    },
    "WaitAlarmStateChange": {
        "source": ["aws.cloudwatch"],
        "detail-type": ["CloudWatch Alarm State Change"],
        "detail": {"alarmName": [{"Fn::Sub": "${AWS::StackName}-job-waiting-too-long"}], "state": {"value": ["ALARM"]}},
    },
}

ALARMS = {
    "WaitAlarm",
    "PreemptionThrashAlarm",
    "IdleWhileWaitingAlarm",
    "PreemptionWithoutFreshCheckpointAlarm",
    "WorkflowFailuresAlarm",
    "DeadLetterAlarm",
    "RejectedEventsAlarm",
    "RefusedClaimsAlarm",
}

# Runs tagged managed, and none of another stack's (a run without the controller tag is a
# team's, or one launched before controllers named themselves).
MANAGED_TAG_CONDITION = {
    "StringEquals": {"aws:ResourceTag/preemptor:managed": "true"},
    "StringEqualsIfExists": {"aws:ResourceTag/preemptor:controller": {"Ref": "AWS::StackName"}},
}
LAUNCH_TAG_CONDITION = {
    "StringEquals": {"aws:RequestTag/preemptor:managed": "true", "aws:RequestTag/preemptor:controller": {"Ref": "AWS::StackName"}}
}

# Actions without resource-level permissions: the only ones an IAM role may grant on "*".
ACTIONS_WITHOUT_RESOURCES = {
    "sagemaker:ListTrainingJobs",
    "batch:DescribeJobs",
    "batch:ListJobs",
    "batch:DescribeJobQueues",
    "servicequotas:ListServiceQuotas",
    "logs:CreateLogDelivery",
    "logs:GetLogDelivery",
    "logs:UpdateLogDelivery",
    "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries",
    "logs:PutResourcePolicy",
    "logs:DescribeResourcePolicies",
    "logs:DescribeLogGroups",
}

SUBSTITUTION = re.compile(r"\$\{([A-Za-z0-9_]+)\}")


@pytest.fixture(scope="module")
def template() -> dict:
    return load_template()


@pytest.fixture(scope="module")
def cfn() -> dict:
    """The template after the SAM transform."""
    return sam_transform()


def _statements(node):
    """Every IAM statement anywhere under `node` (including both branches of Fn::If)."""
    if isinstance(node, dict):
        if "Effect" in node and ("Action" in node or "NotAction" in node):
            yield node
        for value in node.values():
            yield from _statements(value)
    elif isinstance(node, list):
        for value in node:
            yield from _statements(value)


def _actions(statement: dict) -> list[str]:
    actions = statement.get("Action", [])
    return [actions] if isinstance(actions, str) else list(actions)


def _resources(statement: dict) -> list:
    resources = statement.get("Resource", [])
    return resources if isinstance(resources, list) else [resources]


def _role_statements(cfn: dict):
    for role in resources_of_type(cfn, "AWS::IAM::Role").values():
        yield from _statements(role["Properties"].get("Policies", []))


# ---------------------------------------------------------------- the contract


def test_template_is_a_sam_template(template):
    assert template["AWSTemplateFormatVersion"] == "2010-09-09"
    assert template["Transform"] == "AWS::Serverless-2016-10-31"


@pytest.mark.parametrize(
    "logical_id, resource_type",
    [
        ("JobsTable", "AWS::DynamoDB::Table"),
        ("AlertsTopic", "AWS::SNS::Topic"),
        ("EventsDeadLetterQueue", "AWS::SQS::Queue"),
        *((f, "AWS::Serverless::Function") for f in FUNCTIONS),
        *((m, "AWS::Serverless::StateMachine") for m in STATE_MACHINES),
        *((a, "AWS::CloudWatch::Alarm") for a in sorted(ALARMS)),
    ],
)
def test_contract_resource_exists(template, logical_id, resource_type):
    assert template["Resources"][logical_id]["Type"] == resource_type


def test_parameters_and_defaults(template):
    params = template["Parameters"]
    assert params["Mode"]["Default"] == "enforce"
    assert set(params["Mode"]["AllowedValues"]) == {"enforce", "shadow"}
    assert [p["name"] for p in json.loads(params["PoolsConfig"]["Default"])] == ["p5"]
    assert json.loads(params["PolicyConfig"]["Default"]) == {}
    assert params["AlertEmail"]["Default"] == ""
    assert params["HighPriorityWaitAlarmMinutes"]["Type"] == "Number"
    assert params["HighPriorityWaitAlarmMinutes"]["Default"] == 10
    assert params["ManagedRoleArnForTraining"]["Default"] == ""
    assert "CheckpointBucketName" in params
    assert params["LogLevel"]["Default"] == "INFO"


def test_outputs(template):
    assert {
        "JobsTableName",
        "AlertsTopicArn",
        "ScheduleStateMachineArn",
        "JobEndedStateMachineArn",
        "SpotInterruptionStateMachineArn",
        "EventsDeadLetterQueueUrl",
    } <= set(template["Outputs"])


def test_global_function_settings(template):
    g = template["Globals"]["Function"]
    assert (g["Runtime"], g["CodeUri"], g["MemorySize"], g["Timeout"], g["Tracing"]) == (
        "python3.11",
        "functions/controller/",
        512,
        60,
        "Active",
    )
    env = g["Environment"]["Variables"]
    assert env["POWERTOOLS_SERVICE_NAME"] == "preemptor"
    assert env["POWERTOOLS_METRICS_NAMESPACE"] == "Preemptor"
    assert env["JOBS_TABLE"] == {"Ref": "JobsTable"}
    assert env["ALERTS_TOPIC_ARN"] == {"Ref": "AlertsTopic"}
    assert {"LOG_LEVEL", "MODE", "POOLS_CONFIG", "POLICY_CONFIG"} <= set(env)


@pytest.mark.parametrize(
    "function, variables",
    [
        ("IntakeFunction", {"SCHEDULE_STATE_MACHINE_ARN", "JOB_ENDED_STATE_MACHINE_ARN", "SPOT_STATE_MACHINE_ARN"}),
        ("ReconcileFunction", {"SCHEDULE_STATE_MACHINE_ARN"}),
    ],
)
def test_functions_that_start_workflows_know_their_arns(template, function, variables):
    env = template["Resources"][function]["Properties"]["Environment"]["Variables"]
    assert variables <= set(env)


# ---------------------------------------------------------------- functions


@pytest.mark.parametrize("function, handler", sorted(FUNCTIONS.items()))
def test_handler_points_into_the_shared_package(template, function, handler):
    # Given the function's handler string
    props = template["Resources"][function]["Properties"]
    assert props["Handler"] == handler
    module_name, attr = re.fullmatch(r"(preemptor\.handlers\.\w+)\.(\w+)", handler).groups()
    code_uri = props.get("CodeUri", template["Globals"]["Function"]["CodeUri"])
    module_file = TEMPLATE_PATH.parent / code_uri / (module_name.replace(".", "/") + ".py")
    if not module_file.is_file():
        return  # the handler module is not written yet; the handler string is still checked above
    # When the module is imported, Then it is the file under CodeUri and exposes the entry point
    module = importlib.import_module(module_name)
    assert Path(module.__file__).resolve() == module_file.resolve()
    assert callable(getattr(module, attr))


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_every_function_has_a_30_day_log_group(template, function):
    group = template["Resources"][f"{function}LogGroup"]
    assert group["Type"] == "AWS::Logs::LogGroup"
    assert group["Properties"]["LogGroupName"] == {"Fn::Sub": f"/aws/lambda/${{{function}}}"}
    assert group["Properties"]["RetentionInDays"] == 30


def test_no_powertools_layer(template):
    for function in resources_of_type(template, "AWS::Serverless::Function").values():
        assert "Layers" not in function["Properties"]
    assert "Layers" not in template["Globals"]["Function"]


# ---------------------------------------------------------------- state machines


@pytest.mark.parametrize("machine", sorted(STATE_MACHINES))
def test_state_machine_asl_file_exists(template, machine):
    resource = template["Resources"][machine]
    assert resource["Properties"]["DefinitionUri"] == STATE_MACHINES[machine][0]
    assert state_machine_definition_path(resource).is_file()


@pytest.mark.parametrize("machine", sorted(STATE_MACHINES))
def test_substitutions_match_the_asl_placeholders(template, machine):
    # Given the machine's substitutions and its ASL text
    resource = template["Resources"][machine]
    provided = set(resource["Properties"]["DefinitionSubstitutions"])
    text = state_machine_definition_path(resource).read_text(encoding="utf-8")
    json.loads(text)  # the file is JSON
    used = set(SUBSTITUTION.findall(text))
    # Then every placeholder is provided, and every substitution is used
    assert used - provided == set(), "placeholders the template does not provide"
    assert provided - used == set(), "substitutions the ASL does not use"
    assert provided == STATE_MACHINES[machine][1]


@pytest.mark.parametrize("machine", sorted(STATE_MACHINES))
def test_state_machine_is_standard_named_logged_and_traced(template, machine):
    props = template["Resources"][machine]["Properties"]
    assert props["Type"] == "STANDARD"
    assert "Fn::Sub" in props["Name"] and props["Name"]["Fn::Sub"].startswith("${AWS::StackName}-")
    assert props["Logging"]["Level"] == "ERROR"
    log_group = props["Logging"]["Destinations"][0]["CloudWatchLogsLogGroup"]["LogGroupArn"]["Fn::GetAtt"][0]
    assert template["Resources"][log_group]["Type"] == "AWS::Logs::LogGroup"
    assert props["Tracing"] == {"Enabled": True}
    assert "Definition" not in props, "ASL lives in statemachines/, never inline"


@pytest.mark.parametrize("machine", sorted(STATE_MACHINES))
def test_state_machine_may_invoke_exactly_the_functions_it_is_given(template, machine):
    props = template["Resources"][machine]["Properties"]
    given = {
        v["Fn::GetAtt"][0]
        for v in props["DefinitionSubstitutions"].values()
        if isinstance(v, dict) and "Fn::GetAtt" in v and v["Fn::GetAtt"][0] in FUNCTIONS
    }
    invokable = {p["LambdaInvokePolicy"]["FunctionName"]["Ref"] for p in props["Policies"] if "LambdaInvokePolicy" in p}
    assert invokable == given
    asl = state_machine_definition_path(template["Resources"][machine]).read_text(encoding="utf-8")
    may_publish = any("SNSPublishMessagePolicy" in p for p in props["Policies"])
    assert may_publish == ("arn:aws:states:::sns:publish" in asl)
    # The machines it may start are exactly those its ASL starts: through a substitution
    # (`<Machine>Arn`) or itself (`$$.StateMachine.Id`, a busy pool continuing).
    started = {k.removesuffix("Arn") for k in props["DefinitionSubstitutions"] if k.endswith("StateMachineArn")}
    if "$$.StateMachine.Id" in asl:
        started.add(machine)
    if "arn:aws:states:::states:startExecution" not in asl:
        started = set()
    may_start = {p["StepFunctionsExecutionPolicy"]["StateMachineName"]["Fn::GetAtt"][0] for p in props["Policies"] if "StepFunctionsExecutionPolicy" in p}
    statements = [st for p in props["Policies"] for st in p.get("Statement", [])]
    for st in statements:
        if st.get("Action") == "states:StartExecution":
            suffix = st["Resource"]["Fn::Sub"].rsplit("${AWS::StackName}", 1)[1]
            may_start |= {m for m in STATE_MACHINES if template["Resources"][m]["Properties"]["Name"]["Fn::Sub"].endswith(suffix)}
    assert may_start == started


# ---------------------------------------------------------------- data


def test_jobs_table_is_durable_encrypted_on_demand_with_the_index(template):
    table = template["Resources"]["JobsTable"]
    props = table["Properties"]
    assert table["DeletionPolicy"] == table["UpdateReplacePolicy"] == "Retain"
    assert props["BillingMode"] == "PAY_PER_REQUEST"
    assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
    assert props["SSESpecification"]["SSEEnabled"] is True
    assert props["TimeToLiveSpecification"] == {"AttributeName": "expires_at", "Enabled": True}
    schema = table_key_schema()
    assert schema["KeySchema"] == [
        {"AttributeName": "pk", "KeyType": "HASH"},
        {"AttributeName": "sk", "KeyType": "RANGE"},
    ]
    (index,) = schema["GlobalSecondaryIndexes"]
    assert index["IndexName"] == "ByPoolStatus"
    assert index["KeySchema"] == [
        {"AttributeName": "gsi1pk", "KeyType": "HASH"},
        {"AttributeName": "gsi1sk", "KeyType": "RANGE"},
    ]
    assert index["Projection"] == {"ProjectionType": "ALL"}
    assert {a["AttributeName"]: a["AttributeType"] for a in schema["AttributeDefinitions"]} == {
        "pk": "S",
        "sk": "S",
        "gsi1pk": "S",
        "gsi1sk": "S",
    }


def test_table_key_schema_creates_a_moto_table(monkeypatch):
    from moto import mock_aws
    import boto3

    for var, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(var, value)
    with mock_aws():
        # Given a table built from the template's schema
        client = boto3.client("dynamodb")
        client.create_table(TableName="jobs", BillingMode="PAY_PER_REQUEST", **table_key_schema())
        # When a pending job is written
        client.put_item(
            TableName="jobs",
            Item={"pk": {"S": "JOB#a"}, "sk": {"S": "JOB"}, "gsi1pk": {"S": "p5#PENDING"}, "gsi1sk": {"S": "0001"}},
        )
        # Then it is found through the pool/status index
        out = client.query(
            TableName="jobs",
            IndexName="ByPoolStatus",
            KeyConditionExpression="gsi1pk = :p",
            ExpressionAttributeValues={":p": {"S": "p5#PENDING"}},
        )
        assert [i["pk"]["S"] for i in out["Items"]] == ["JOB#a"]


# ---------------------------------------------------------------- least privilege


def test_no_wildcard_actions_anywhere(template, cfn):
    for doc in (template, cfn):
        statements = list(_statements(doc))
        assert statements
        for statement in statements:
            assert "NotAction" not in statement
            for action in _actions(statement):
                assert action != "*" and not action.endswith(":*"), statement


def test_roles_use_resource_star_only_for_actions_without_resource_level_permissions(cfn):
    for statement in _role_statements(cfn):
        if statement["Effect"] == "Allow" and "*" in _resources(statement):
            assert set(_actions(statement)) <= ACTIONS_WITHOUT_RESOURCES, statement


@pytest.mark.parametrize("action", ["sagemaker:StopTrainingJob", "batch:TerminateJob"])
def test_stop_and_terminate_only_controller_managed_jobs(cfn, action):
    granting = [s for s in _statements(cfn) if s["Effect"] == "Allow" and action in _actions(s)]
    assert granting, f"nothing grants {action}"
    for statement in granting:
        assert statement.get("Condition") == MANAGED_TAG_CONDITION, statement
        assert _actions(statement) == [action], "the tag condition must not be shared with other actions"


@pytest.mark.parametrize("action", ["sagemaker:CreateTrainingJob", "batch:SubmitJob"])
def test_launches_must_carry_the_managed_tag(cfn, action):
    # A job the controller launches without the tag is a job it could not stop later.
    granting = [s for s in _statements(cfn) if s["Effect"] == "Allow" and action in _actions(s)]
    assert granting
    for statement in granting:
        # The managed tag is required (further conditions may narrow the launch, never widen it)
        assert statement.get("Condition", {}).get("StringEquals", {}).items() >= LAUNCH_TAG_CONDITION["StringEquals"].items(), statement


def test_pass_role_only_the_training_roles_only_to_sagemaker(template):
    # The stack's training role and the teams' own (exact ARNs, no pattern), each statement
    # present only when its parameter is set
    statements = [s for s in _statements(template) if "iam:PassRole" in _actions(s)]
    assert [s["Resource"] for s in statements] == [{"Ref": "ManagedRoleArnForTraining"}, {"Ref": "TeamTrainingRoleArns"}]
    for statement in statements:
        assert statement["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
    policy = template["Resources"]["JobControlFunction"]["Properties"]["Policies"][0]
    conditional = [s for s in policy["Statement"] if "Fn::If" in s]
    assert [c["Fn::If"][0] for c in conditional] == ["HasTrainingRole", "HasTeamTrainingRoles"]
    assert [c["Fn::If"][1] for c in conditional] == statements
    assert all(c["Fn::If"][2] == {"Ref": "AWS::NoValue"} for c in conditional)
    assert template["Conditions"]["HasTeamTrainingRoles"] == {
        "Fn::Not": [{"Fn::Equals": [{"Fn::Join": ["", {"Ref": "TeamTrainingRoleArns"}]}, ""]}]
    }


TEAM_TRAINING = "TeamTrainingAccessPolicy"


def test_checkpoint_access_is_limited_to_the_checkpoint_bucket(cfn):
    # The controller's roles: markers are all they write
    roles = {k: v for k, v in cfn["Resources"].items() if k != TEAM_TRAINING}
    s3 = [s for s in _statements(roles) if any(a.startswith("s3:") for a in _actions(s))]
    assert s3
    for statement in s3:
        for resource in _resources(statement):
            assert "${CheckpointBucketName}" in resource["Fn::Sub"], statement
    writes = [s for s in s3 if "s3:PutObject" in _actions(s)]
    for statement in writes:
        assert all("/_preemptor/" in r["Fn::Sub"] for r in _resources(statement)), "only checkpoint requests"


def test_a_teams_training_role_is_granted_its_own_teams_prefixes_only(cfn):
    # The policy for the teams' roles: every object it grants is under the team's prefix
    # (checkpoints) or the team's output prefix, named by the role's tag; its listing too
    statements = list(_statements(cfn["Resources"][TEAM_TRAINING]))
    team = "${!aws:PrincipalTag/preemptor-team}"
    bucket = "arn:${AWS::Partition}:s3:::${CheckpointBucketName}"
    objects = [r["Fn::Sub"] for s in statements if s["Action"] != "s3:ListBucket" for r in _resources(s)]
    assert objects == [f"{bucket}/{team}/*", f"{bucket}/_output/{team}/*"]
    [listing] = [s for s in statements if s["Action"] == "s3:ListBucket"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": "${aws:PrincipalTag/preemptor-team}/*"}}
    assert all(s["Effect"] == "Allow" and not any("*" in a for a in _actions(s)) for s in statements)
    assert cfn["Outputs"]["TeamTrainingAccessPolicyArn"]["Value"] == {"Ref": TEAM_TRAINING}


def test_dynamodb_access_is_item_level_on_the_jobs_table(cfn):
    for statement in _statements(cfn):
        for action in (a for a in _actions(statement) if a.startswith("dynamodb:")):
            assert action in {
                "dynamodb:GetItem",
                "dynamodb:BatchGetItem",
                "dynamodb:Query",
                "dynamodb:PutItem",
                "dynamodb:UpdateItem",
                "dynamodb:DeleteItem",
                "dynamodb:BatchWriteItem",
                "dynamodb:ConditionCheckItem",
            }
            assert all("JobsTable" in json.dumps(r) for r in _resources(statement))


# ---------------------------------------------------------------- events and dead letters


def test_intake_rules_match_the_documented_events(template):
    events = template["Resources"]["IntakeFunction"]["Properties"]["Events"]
    assert {name: e["Properties"]["Pattern"] for name, e in events.items()} == INTAKE_RULES
    assert {e["Type"] for e in events.values()} == {"EventBridgeRule"}


def test_reconcile_runs_every_five_minutes(template):
    (event,) = template["Resources"]["ReconcileFunction"]["Properties"]["Events"].values()
    assert event["Type"] == "Schedule"
    assert event["Properties"]["Schedule"] == "rate(5 minutes)"


def test_every_rule_target_has_a_dead_letter_queue_and_retry_policy(cfn):
    rules = resources_of_type(cfn, "AWS::Events::Rule")
    assert len(rules) == len(INTAKE_RULES) + 1
    for rule_id, rule in rules.items():
        for target in rule["Properties"]["Targets"]:
            assert target["DeadLetterConfig"]["Arn"] == {"Fn::GetAtt": ["EventsDeadLetterQueue", "Arn"]}, rule_id
            assert "RetryPolicy" in target, rule_id


def test_dead_letter_queue_accepts_exactly_our_rules(cfn):
    (policy,) = resources_of_type(cfn, "AWS::SQS::QueuePolicy").values()
    statement, no_one_else = policy["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Principal"] == {"Service": "events.amazonaws.com"}
    # (and denies every other sender but the two functions' roles: tests/unit/test_iam.py)
    roles = no_one_else["Condition"]["ArnNotEqualsIfExists"]["aws:PrincipalArn"]
    assert no_one_else["Effect"] == "Deny" and {r["Fn::GetAtt"][0] for r in roles} == {"IntakeFunctionRole", "ReconcileFunctionRole"}
    assert all(cfn["Resources"][r["Fn::GetAtt"][0]]["Type"] == "AWS::IAM::Role" for r in roles)  # made by the SAM transform
    with_destination = {
        logical for logical, fn in resources_of_type(cfn, "AWS::Lambda::EventInvokeConfig").items()
        if fn["Properties"]["DestinationConfig"]["OnFailure"]["Destination"] == {"Fn::GetAtt": ["EventsDeadLetterQueue", "Arn"]}
    }
    assert len(with_destination) == 2  # the intake's and reconcile's: the only senders besides EventBridge
    assert _actions(statement) == ["sqs:SendMessage"]
    sources = statement["Condition"]["ArnEquals"]["aws:SourceArn"]
    assert {s["Fn::GetAtt"][0] for s in sources} == set(resources_of_type(cfn, "AWS::Events::Rule"))
    assert cfn["Resources"]["EventsDeadLetterQueue"]["Properties"]["SqsManagedSseEnabled"] is True


@pytest.mark.parametrize("function", ["IntakeFunction", "ReconcileFunction"])
def test_failed_async_invocations_go_to_the_dead_letter_queue(cfn, function):
    config = cfn["Resources"][f"{function}EventInvokeConfig"]["Properties"]
    assert config["DestinationConfig"]["OnFailure"]["Destination"] == {"Fn::GetAtt": ["EventsDeadLetterQueue", "Arn"]}


_SUBSCRIBED = {dt: rule for rule, p in INTAKE_RULES.items() for dt in p["detail-type"]}


def _resolved_rules(template, stack: str = "preemptor") -> dict:
    """The intake's rules with the stack name resolved (EventBridge sees the value)."""
    events = template["Resources"]["IntakeFunction"]["Properties"]["Events"]
    text = json.dumps(events).replace('{"Fn::Sub": "${AWS::StackName}-job-waiting-too-long"}', f'"{stack}-job-waiting-too-long"')
    return json.loads(text)


def test_the_stacks_own_wait_alarm_reaches_the_intake_and_only_in_alarm():
    from moto.events.models import EventPattern

    template = load_template()
    rule = _resolved_rules(template)["WaitAlarmStateChange"]["Properties"]["Pattern"]
    pattern = EventPattern(json.dumps(rule), rule)
    sample = json.loads((_REPO / "events/other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__06df3b84.json").read_text())
    ours = {**sample, "detail": {**sample["detail"], "alarmName": "preemptor-job-waiting-too-long"}}
    back_to_ok = {**ours, "detail": {**ours["detail"], "state": {**ours["detail"]["state"], "value": "OK"}}}
    assert [pattern.matches_event(e) for e in (sample, ours, back_to_ok)] == [False, True, False]


@pytest.mark.parametrize("path", [p for p in all_event_files() if p.parent.name != "malformed"], ids=relative_name)
def test_sample_event_reaches_exactly_the_rule_for_its_type(template, path):
    from moto.events.models import EventPattern

    # Given a sample event from events/
    event = json.loads(path.read_text(encoding="utf-8"))
    events = _resolved_rules(template)
    # When it is matched against every intake rule
    matched = {
        name
        for name, e in events.items()
        if EventPattern(json.dumps(e["Properties"]["Pattern"]), e["Properties"]["Pattern"]).matches_event(event)
    }
    # Then it reaches the rule for its source and detail-type, or none if intake does not handle it
    rule = _SUBSCRIBED.get(event.get("detail-type"))
    wanted = INTAKE_RULES[rule]["source"][0] if rule else None
    source = str(event.get("source"))
    ours = source.startswith(wanted["prefix"]) if isinstance(wanted, dict) else source == wanted
    # (Health events: only EC2's scheduled changes concern a job)
    narrowed = rule != "ScheduledInstanceChange" or (
        (event.get("detail") or {}).get("service") == "EC2" and (event.get("detail") or {}).get("eventTypeCategory") == "scheduledChange"
    )
    # (Alarm state changes: only the stack's own wait alarm's; no sample is one of ours)
    narrowed = narrowed and rule != "WaitAlarmStateChange"
    expected = {rule} if rule and ours and narrowed else set()
    assert matched == expected


def test_submissions_are_read_from_the_stacks_own_bus_and_aws_events_from_the_default_bus(template):
    events = template["Resources"]["IntakeFunction"]["Properties"]["Events"]
    buses = {name: e["Properties"].get("EventBusName") for name, e in events.items()}
    # The submission rule listens on the stack's bus; AWS service events stay on the default bus
    assert buses.pop("PreemptorJobEvents") == {"Ref": "SubmissionBus"}
    assert set(buses.values()) == {None}
    assert template["Resources"]["SubmissionBus"]["Type"] == "AWS::Events::EventBus"


def test_a_teams_principals_may_put_events_on_the_bus_only_under_their_own_source(template):
    (statement,) = template["Resources"]["TeamSubmitPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert (statement["Effect"], statement["Action"]) == ("Allow", "events:PutEvents")
    assert statement["Resource"] == {"Fn::GetAtt": ["SubmissionBus", "Arn"]}
    # The principal's preemptor-team tag names its team: events:source must be that team's
    assert statement["Condition"]["StringEquals"]["events:source"] == "preemptor.${aws:PrincipalTag/preemptor-team}"
    outputs = template["Outputs"]
    assert outputs["TeamSubmitPolicyArn"]["Value"] == {"Ref": "TeamSubmitPolicy"}
    assert outputs["SubmissionBusName"]["Value"] == {"Ref": "SubmissionBus"}


# ---------------------------------------------------------------- alerts


def test_alerts_topic_is_encrypted_and_email_is_optional(template):
    topic = template["Resources"]["AlertsTopic"]["Properties"]
    assert "KmsMasterKeyId" in topic
    subscription = template["Resources"]["AlertsEmailSubscription"]
    assert subscription["Condition"] == "HasAlertEmail"
    assert template["Conditions"]["HasAlertEmail"] == {"Fn::Not": [{"Fn::Equals": [{"Ref": "AlertEmail"}, ""]}]}


def test_cloudwatch_may_use_the_alerts_key(template):
    # CloudWatch alarms cannot publish to a topic encrypted with the AWS managed SNS key.
    key = template["Resources"]["AlertsKey"]["Properties"]["KeyPolicy"]
    assert any(s.get("Principal") == {"Service": "cloudwatch.amazonaws.com"} for s in key["Statement"])


@pytest.mark.parametrize("alarm", sorted(ALARMS))
def test_alarm_notifies_the_alerts_topic_both_ways(template, alarm):
    props = template["Resources"][alarm]["Properties"]
    assert props["AlarmActions"] == props["OKActions"] == [{"Ref": "AlertsTopic"}]
    assert props["TreatMissingData"] == "notBreaching"


@pytest.mark.parametrize(
    "alarm, metric",
    [
        ("WaitAlarm", "OldestPendingWaitSeconds"),
        ("PreemptionThrashAlarm", "Preemptions"),
        ("IdleWhileWaitingAlarm", "IdleGpusWhileWaiting"),
        ("PreemptionWithoutFreshCheckpointAlarm", "StopsWithoutFreshCheckpoint"),
        ("RejectedEventsAlarm", "RejectedEvents"),
        ("RefusedClaimsAlarm", "RefusedClaims"),
    ],
)
def test_custom_metric_alarms_read_the_preemptor_namespace(template, alarm, metric):
    def text(expression) -> str:  # a plain query, or one built with Fn::Sub
        return expression["Fn::Sub"][0] if isinstance(expression, dict) else expression

    expressions = " ".join(text(m.get("Expression", "")) for m in template["Resources"][alarm]["Properties"]["Metrics"])
    assert f"({metric}) FROM Preemptor" in expressions


def test_the_wait_alarm_watches_the_configured_tiers_in_minutes(template):
    props = template["Resources"]["WaitAlarm"]["Properties"]
    assert props["Threshold"] == {"Ref": "HighPriorityWaitAlarmMinutes"}
    metrics = {m["Id"]: m for m in props["Metrics"]}
    # The query is built from the WaitAlarmTiers parameter, not from tier names in the code
    query, values = metrics["waitSeconds"]["Expression"]["Fn::Sub"]
    assert values == {"Tiers": {"Fn::Join": ["' OR Tier = '", {"Ref": "WaitAlarmTiers"}]}}
    tiers = template["Parameters"]["WaitAlarmTiers"]["Default"].split(",")
    assert query.replace("${Tiers}", "' OR Tier = '".join(tiers)) == (
        "SELECT MAX(OldestPendingWaitSeconds) FROM Preemptor WHERE Tier = 'critical' OR Tier = 'high'"
    )
    assert metrics["waitMinutes"]["Expression"] == "waitSeconds / 60"
    assert metrics["waitMinutes"]["ReturnData"] is True
    # And the functions know the alarm by the same name, tiers and threshold (the escalation)
    env = template["Globals"]["Function"]["Environment"]["Variables"]
    assert env["WAIT_ALARM_NAME"] == props["AlarmName"]
    assert env["WAIT_ALARM_TIERS"] == {"Fn::Join": [",", {"Ref": "WaitAlarmTiers"}]}
    assert env["WAIT_ALARM_MINUTES"] == {"Ref": "HighPriorityWaitAlarmMinutes"}
    rule = template["Resources"]["IntakeFunction"]["Properties"]["Events"]["WaitAlarmStateChange"]["Properties"]["Pattern"]
    assert rule["detail"]["alarmName"] == [props["AlarmName"]]


def test_workflow_failures_alarm_watches_every_state_machine(template):
    metrics = template["Resources"]["WorkflowFailuresAlarm"]["Properties"]["Metrics"]
    watched = {
        m["MetricStat"]["Metric"]["Dimensions"][0]["Value"]["Ref"]
        for m in metrics
        if "MetricStat" in m and m["MetricStat"]["Metric"]["MetricName"] == "ExecutionsFailed"
    }
    assert watched == set(STATE_MACHINES)


# ---------------------------------------------------------------- lint and config


def _lint_errors(text: str) -> list[str]:
    from cfnlint.api import lint

    return [repr(m) for m in lint(text, regions=["us-east-1"]) if m.rule.id.startswith("E")]


def test_cfn_lint_finds_no_errors_in_the_transformed_template(cfn):
    assert _lint_errors(json.dumps(cfn)) == []


def test_cfn_lint_finds_no_errors_in_the_sam_template():
    assert _lint_errors(TEMPLATE_PATH.read_text(encoding="utf-8")) == []


def test_transform_keeps_the_training_role_optional(cfn):
    # With no training role the PassRole statement disappears at deploy time (Fn::If on a condition).
    assert cfn["Conditions"]["HasTrainingRole"] == {
        "Fn::Not": [{"Fn::Equals": [{"Ref": "ManagedRoleArnForTraining"}, ""]}]
    }


def test_samconfig():
    config = tomllib.loads((TEMPLATE_PATH.parent / "samconfig.toml").read_text(encoding="utf-8"))
    assert config["version"] == 0.1
    default = config["default"]
    assert default["global"]["parameters"]["stack_name"] == "preemptor"
    assert default["build"]["parameters"]["cached"] is True
    assert default["build"]["parameters"]["parallel"] is True
    deploy = default["deploy"]["parameters"]
    assert (deploy["capabilities"], deploy["confirm_changeset"], deploy["resolve_s3"], deploy["region"]) == (
        "CAPABILITY_IAM",
        True,
        True,
        "us-east-1",
    )
    assert default["validate"]["parameters"]["lint"] is True
