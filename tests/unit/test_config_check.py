"""The configuration check as the stack deploys (`ConfigCheck`, a custom resource): what the
functions could not run fails the deploy, named, before any function runs with it."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from preemptor.handlers import config_check
from preemptor_tools.local.clock import SimClock
from preemptor_tools.local.stack import EmulatedStack, LambdaContext
from preemptor_tools.local.state import DeployFailed
from template_support import REPO_ROOT, load_template, resources_of_type

ROLE = "arn:aws:iam::123456789012:role/training"
DEFAULTS = {
    "PolicyConfig": "{}",
    "PoolsConfig": '[{"name": "p5", "instance_type": "ml.p5.48xlarge", "instances": 64}]',
    "WaitAlarmTiers": "critical,high",
    "ManagedRoleArnForTraining": ROLE,
    "TrainingInstanceTypes": "ml.p5.48xlarge,ml.p5e.48xlarge",
    "TeamTrainingRoleArns": "",
}
NLP_ROLE = "arn:aws:iam::123456789012:role/preemptor/nlp-training"
TEAM_ROLES = '{"teams": {"nlp": {"training_role_arn": "%s"}, "vision": {"training_role_arn": "%s"}}}'

FALLBACK = '[{"name": "p5", "instance_type": "ml.p5.48xlarge", "instances": 8, "fallback_instance_types": ["ml.p4d.24xlarge"]}]'


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"PolicyConfig": '{"aging": {"rate_per_hour": 1e999}}'}, "PolicyConfig: field aging.rate_per_hour: Input should be a finite number"),
        ({"PolicyConfig": '{"min_runtime_s": 600, "aging": {"rate": 10}}'}, "PolicyConfig: field aging.rate: Extra inputs are not permitted"),
        ({"PolicyConfig": '{"tiers": {"gold": 900}, "tier_max_sla_s": {"platinum": 60}}'}, "PolicyConfig: tier_max_sla_s: unknown tier 'platinum' (tiers: gold)"),
        ({"PolicyConfig": '{"aging": '}, "PolicyConfig is not valid JSON at line 1, column 11"),
        ({"PolicyConfig": "[]"}, "PolicyConfig must be a JSON object, got list"),
        ({"PoolsConfig": '[{"name": "p5", "service": "sagemaker"}]'}, "PoolsConfig: field 0: pool 'p5' needs 'instances' or 'gpus'"),
        ({"PoolsConfig": '{"name": "p5"}'}, "PoolsConfig must be a JSON list of pools, got dict"),
        ({"PoolsConfig": '[{"name": "p5", "gpus": 8}, {"name": "p5", "gpus": 16}]'}, "stack parameters: pools: one pool per name; repeated: p5"),
        # a fallback onto another pool's own type: its runs would take that pool's instances
        ({"PoolsConfig": FALLBACK[:-1] + ', {"name": "p4", "instance_type": "ml.p4d.24xlarge", "instances": 4}]'},
         "stack parameters: pools: pool 'p5' falls back to ml.p4d.24xlarge (on-demand), which is pool 'p4''s own"),
        ({"WaitAlarmTiers": "critical,urgent"}, "stack parameters: wait_alarm_tiers: unknown tier(s) urgent (tiers: critical, high, low, medium)"),
        # the alarm's metric and the planner's tier names are lower case: 'Critical' never matches
        ({"WaitAlarmTiers": "Critical"}, "wait_alarm_tiers: unknown tier(s) Critical"),
        ({"PolicyConfig": '{"tiers": {"gold": 900, "bronze": 10}}'}, "wait_alarm_tiers: unknown tier(s) critical, high (tiers: bronze, gold)"),
        # what IAM would deny at every launch: the pools must fit the role's grants
        ({"PoolsConfig": FALLBACK}, "PoolsConfig: pool 'p5' launches on ml.p4d.24xlarge, not in TrainingInstanceTypes (ml.p5.48xlarge, ml.p5e.48xlarge)"),
        ({"PoolsConfig": '[{"name": "g6", "instance_type": "ml.g6.48xlarge", "instances": 2}]', "TrainingInstanceTypes": "ml.p5.48xlarge"}, "pool 'g6' launches on ml.g6.48xlarge"),
        ({"PoolsConfig": '[{"name": "p5", "gpus": 8, "role_arn": "arn:aws:iam::123456789012:role/other"}]'}, "PoolsConfig: pool 'p5' passes role arn:aws:iam::123456789012:role/other, but the controller may pass only ManagedRoleArnForTraining (arn:aws:iam::123456789012:role/training)"),
        ({"PoolsConfig": '[{"name": "p5", "gpus": 8, "role_arn": "arn:aws:iam::123456789012:role/other"}]', "ManagedRoleArnForTraining": ""}, "may pass only ManagedRoleArnForTraining (empty)"),
        # a team's own training role: well formed, its own, and one the controller may pass
        ({"PolicyConfig": TEAM_ROLES % ("training", NLP_ROLE)}, "PolicyConfig: field teams.nlp.training_role_arn: expected an IAM role ARN (arn:aws:iam::<account>:role/<name>), got 'training'"),
        ({"PolicyConfig": TEAM_ROLES % (NLP_ROLE, NLP_ROLE), "TeamTrainingRoleArns": NLP_ROLE}, f"PolicyConfig: teams.vision.training_role_arn: {NLP_ROLE} is also the training role of team 'nlp'; each team needs a role of its own"),
        ({"PolicyConfig": TEAM_ROLES % (NLP_ROLE, ROLE + "-vision")}, f"PolicyConfig: teams.nlp.training_role_arn is {NLP_ROLE}, not in TeamTrainingRoleArns (empty): the controller may not pass it"),
        ({"PolicyConfig": TEAM_ROLES % (NLP_ROLE, ROLE + "-vision"), "TeamTrainingRoleArns": NLP_ROLE}, f"teams.vision.training_role_arn is {ROLE}-vision, not in TeamTrainingRoleArns ({NLP_ROLE})"),
        ({"PolicyConfig": TEAM_ROLES % (NLP_ROLE, ROLE), "TeamTrainingRoleArns": f"{NLP_ROLE},{ROLE}"}, "PolicyConfig: teams.vision.training_role_arn is ManagedRoleArnForTraining, the role every team without one of its own shares"),
    ],
    ids=[
        "infinite-knob", "misspelt-knob", "unknown-tier", "not-json", "policy-not-an-object", "pool-without-size",
        "pools-not-a-list", "two-pools-one-name", "fallback-onto-another-pools-type", "unknown-watched-tier", "watched-tier-capitalised", "tiers-renamed-alarm-not",
        "fallback-type-not-granted", "pool-type-not-granted", "pool-role-not-passable", "pool-role-without-stack-role",
        "team-role-not-an-arn", "team-role-shared", "team-role-not-passable", "second-team-role-not-passable",
        "team-role-is-the-stacks",
    ],
)
def test_a_configuration_the_functions_could_not_run_is_named(changes, expected):
    found = config_check.problem({**DEFAULTS, **changes})
    assert found is not None and expected in found, found


def test_the_template_defaults_and_the_example_policy_pass():
    template = load_template()
    defaults = {name: template["Parameters"][name]["Default"] for name in config_check.PARAMETERS}
    assert config_check.problem(defaults) is None
    assert config_check.problem({**defaults, "PolicyConfig": (REPO_ROOT / "examples" / "policy.json").read_text()}) is None
    assert config_check.problem({}) is None  # the functions' own defaults
    # a Batch pool has no instance types of its own, a SageMaker pool of the stack's role passes
    batch = '[{"name": "g5", "service": "batch", "gpus": 32}, {"name": "p5", "gpus": 8, "role_arn": "%s"}]' % ROLE
    assert config_check.problem({**DEFAULTS, "PoolsConfig": batch, "TrainingInstanceTypes": ""}) is None
    assert config_check.problem({**DEFAULTS, "PoolsConfig": FALLBACK, "TrainingInstanceTypes": "ml.p5.48xlarge,ml.p4d.24xlarge"}) is None
    # each team on a role of its own that the controller may pass
    vision = "arn:aws-us-gov:iam::123456789012:role/teams/vision_training.v2"
    roles = {"PolicyConfig": TEAM_ROLES % (NLP_ROLE, vision), "TeamTrainingRoleArns": f"{NLP_ROLE}, {vision}"}
    assert config_check.problem({**DEFAULTS, **roles}) is None


# -- the custom resource protocol: the answer is a PUT to the request's pre-signed URL ----------
class _CloudFormation:
    """A ResponseURL that records what is PUT to it."""

    def __init__(self):
        answers = self.answers = []

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):  # noqa: N802 - the http.server hook
                body = self.rfile.read(int(self.headers["Content-Length"]))
                answers.append((self.headers.get("Content-Type"), json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/response?X-Amz-Signature=x"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cloudformation():
    cfn = _CloudFormation()
    yield cfn
    cfn.close()


def _request(url: str, kind: str, properties: dict, **extra) -> dict:
    return {
        "RequestType": kind,
        "ResponseURL": url,
        "StackId": "arn:aws:cloudformation:us-east-1:123456789012:stack/preemptor/5b6f-11ee",
        "RequestId": "req-1",
        "ResourceType": "Custom::PreemptorConfigCheck",
        "LogicalResourceId": "ConfigCheck",
        "ResourceProperties": {"ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:check", **properties},
        **extra,
    }


CONTEXT = LambdaContext(function_name="config-check")


def test_a_bad_configuration_fails_the_create_and_a_good_one_passes_the_update(cloudformation):
    # When CloudFormation creates the check with an infinite aging rate
    config_check.handler(_request(cloudformation.url, "Create", {**DEFAULTS, "PolicyConfig": '{"aging": {"rate_per_hour": 1e999}}'}), CONTEXT)
    # Then it answers FAILED with the parameter and the field, for the request it was given
    content_type, answer = cloudformation.answers[-1]
    assert content_type == ""  # what the pre-signed URL is signed for
    assert answer["Status"] == "FAILED"
    assert answer["Reason"] == "PolicyConfig: field aging.rate_per_hour: Input should be a finite number"
    assert (answer["StackId"], answer["RequestId"], answer["LogicalResourceId"]) == ("arn:aws:cloudformation:us-east-1:123456789012:stack/preemptor/5b6f-11ee", "req-1", "ConfigCheck")
    assert answer["PhysicalResourceId"] == "preemptor-config-check"
    # When the stack is updated with a good one, Then SUCCESS, and the resource keeps its id
    config_check.handler(_request(cloudformation.url, "Update", DEFAULTS, PhysicalResourceId="preemptor-config-check"), CONTEXT)
    assert cloudformation.answers[-1][1]["Status"] == "SUCCESS"
    assert cloudformation.answers[-1][1]["PhysicalResourceId"] == "preemptor-config-check"


VERSION = "arn:aws:lambda:us-east-1:123456789012:function:check:{}"


def test_a_code_update_rechecks_an_unchanged_configuration_and_a_rollback_is_not_refused(cloudformation):
    # Given a stack deployed with a configuration the check of version 3 passed, which the
    # stricter check of version 4 refuses
    deployed = {**DEFAULTS, "PolicyConfig": '{"aging": {"rate_per_hour": 1e999}}', "CodeVersion": VERSION.format(3)}
    # When a code update publishes version 4, the configuration unchanged
    config_check.handler(
        _request(cloudformation.url, "Update", {**deployed, "CodeVersion": VERSION.format(4)}, PhysicalResourceId="preemptor-config-check",
                 OldResourceProperties=deployed),
        CONTEXT,
    )
    # Then the check runs again, and the update fails
    assert cloudformation.answers[-1][1]["Status"] == "FAILED"
    assert cloudformation.answers[-1][1]["Reason"].startswith("PolicyConfig: field aging.rate_per_hour")
    # When CloudFormation rolls back, giving the new code the properties of version 3
    config_check.handler(
        _request(cloudformation.url, "Update", deployed, PhysicalResourceId="preemptor-config-check",
                 OldResourceProperties={**deployed, "CodeVersion": VERSION.format(4)}),
        CONTEXT,
    )
    # Then it passes: refused, the stack would be left in UPDATE_ROLLBACK_FAILED
    answer = cloudformation.answers[-1][1]
    assert answer["Status"] == "SUCCESS" and answer["Reason"].startswith("rollback to a configuration an earlier version")
    # So does a rollback to a template from before the check had a code version
    pre = {k: v for k, v in deployed.items() if k != "CodeVersion"}
    config_check.handler(
        _request(cloudformation.url, "Update", pre, PhysicalResourceId="preemptor-config-check", OldResourceProperties={**pre, "CodeVersion": VERSION.format(4)}),
        CONTEXT,
    )
    assert cloudformation.answers[-1][1]["Status"] == "SUCCESS"
    # But an update to such a template, or with the same version and a new configuration, is checked
    for old in (pre, deployed):
        config_check.handler(
            _request(cloudformation.url, "Update", deployed, PhysicalResourceId="preemptor-config-check", OldResourceProperties={**old, "PolicyConfig": "{}"}),
            CONTEXT,
        )
        assert cloudformation.answers[-1][1]["Status"] == "FAILED"


def test_a_delete_always_succeeds_so_the_stack_stays_removable(cloudformation):
    config_check.handler(_request(cloudformation.url, "Delete", {"PolicyConfig": "not json"}, PhysicalResourceId="preemptor-config-check"), CONTEXT)
    assert cloudformation.answers[-1][1]["Status"] == "SUCCESS"


def test_a_check_that_breaks_still_answers_so_the_deploy_does_not_hang(cloudformation, monkeypatch):
    # Given a check that raises (a bug): unanswered, CloudFormation would wait an hour
    def broken(properties):
        raise KeyError("surprise")

    monkeypatch.setattr(config_check, "problem", broken)
    config_check.handler(_request(cloudformation.url, "Create", DEFAULTS), CONTEXT)
    answer = cloudformation.answers[-1][1]
    assert answer["Status"] == "FAILED" and answer["Reason"] == "the configuration check failed: KeyError: 'surprise'"


def test_an_answer_goes_only_to_an_http_url(cloudformation):
    with pytest.raises(ValueError, match="ResponseURL must be an http"):
        config_check.handler(_request("file:///etc/passwd", "Create", DEFAULTS), CONTEXT)
    assert cloudformation.answers == []


# -- the template: the functions are deployed after the check, the check after its log group ----
def test_every_function_waits_for_the_check_of_the_configuration_they_read():
    template = load_template()
    check = template["Resources"]["ConfigCheck"]
    assert check["Type"] == "Custom::PreemptorConfigCheck"
    assert check["Properties"]["ServiceToken"] == {"Fn::GetAtt": ["ConfigCheckFunction", "Arn"]}
    # the check is given each parameter the functions read, so a change of any re-runs it
    assert set(check["Properties"]) - {"ServiceToken", config_check.CODE_VERSION} == set(config_check.PARAMETERS)
    # and its own code version (published per code change): a code update re-runs it too
    assert check["Properties"][config_check.CODE_VERSION] == {"Ref": "ConfigCheckFunction.Version"}
    assert template["Resources"]["ConfigCheckFunction"]["Properties"]["AutoPublishAlias"]
    for name in config_check.PARAMETERS:
        assert {"Ref": name} in (check["Properties"][name], *check["Properties"][name].get("Fn::Join", [None, [None]])[1:])
    env = template["Globals"]["Function"]["Environment"]["Variables"]
    for name, variable in config_check.ENVIRONMENT.items():
        assert name in json.dumps(env[variable])
    # the instance types are the CreateTrainingJob condition's
    assert '"sagemaker:InstanceTypes": {"Ref": "TrainingInstanceTypes"}' in json.dumps(template["Resources"]["JobControlFunction"])
    assert check["DependsOn"] == "ConfigCheckFunctionLogGroup"
    functions = resources_of_type(template, "AWS::Serverless::Function")
    assert {name for name, f in functions.items() if f.get("DependsOn") != "ConfigCheck"} == {"ConfigCheckFunction"}
    # it makes no AWS call: no policy beyond the logs and traces SAM gives every function
    assert "Policies" not in functions["ConfigCheckFunction"]["Properties"]


# -- the emulated stack runs the same check -----------------------------------------------------
def test_the_emulated_stack_refuses_to_deploy_what_the_check_refuses_and_deploys_after():
    before = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("POWERTOOLS_TRACE_DISABLED")
    with pytest.raises(DeployFailed, match=r"^ConfigCheck: CREATE_FAILED: PolicyConfig: field aging.rate_per_hour: Input should be a finite number$"):
        with EmulatedStack(SimClock(0.0), parameters={"PolicyConfig": '{"aging": {"rate_per_hour": 1e999}}'}):
            pass
    # nothing of the failed deploy is left behind: the environment it set is restored, and the
    # next deploy starts emulated AWS again and creates the functions
    assert (os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("POWERTOOLS_TRACE_DISABLED")) == before
    with EmulatedStack(SimClock(0.0)) as stack:
        assert len(stack.functions) == len(resources_of_type(load_template(), "AWS::Serverless::Function"))
        assert stack.client("dynamodb").describe_table(TableName=stack.resources["JobsTable"])["Table"]["TableStatus"] == "ACTIVE"


# -- the operator's CLI reads the same settings from the stack's parameters ---------------------
def test_the_cli_reads_the_stacks_watched_tiers_and_refuses_a_what_if_policy_they_do_not_fit():
    from preemptor_tools import ops

    renamed = {"PolicyConfig": '{"tiers": {"gold": 900, "bronze": 10}}', "PoolsConfig": '[{"name": "p5", "gpus": 8}]', "WaitAlarmTiers": "gold"}
    # Given a stack whose policy renames the tiers and whose alarm watches one of them
    target = ops.Target("preemptor", {"JobsTableName": "jobs"}, renamed, session=None)
    # Then its settings are read with its own watched tiers (not the default critical,high)
    assert target.settings.wait_alarm_tiers == ("gold",)
    # And a what-if policy without that tier is refused in one line, not a traceback
    what_if = ops.Target("preemptor", {"JobsTableName": "jobs"}, {**renamed, "PolicyConfig": "{}"}, session=None)
    with pytest.raises(ops.BadInput, match=r"^stack preemptor: the functions could not run this configuration: wait_alarm_tiers: unknown tier\(s\) gold \(tiers: critical, high, low, medium\)$"):
        what_if.settings
