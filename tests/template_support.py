"""template.yaml as data, for tests: the template stays the single source of truth.

`load_template()` reads the SAM template with cfn-lint's CloudFormation-aware YAML loader
(short-form tags such as `!Ref` become their `{"Ref": ...}` long forms) and returns plain
dicts and lists. `table_key_schema()` gives the jobs table's keys and index in the shape
`create_table` takes, so moto tables are built from the template:

    client.create_table(TableName="jobs", BillingMode="PAY_PER_REQUEST", **table_key_schema())

`sam_transform()` expands the SAM resources into plain CloudFormation, offline.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_PATH = REPO_ROOT / "template.yaml"
JOBS_TABLE = "JobsTable"

# Values for parameters that have no default, used when the template is transformed.
TEST_PARAMETERS = {"CheckpointBucketName": "preemptor-test-checkpoints"}
# A syntactically valid stand-in for code that `sam package` would upload.
_FAKE_S3 = "s3://preemptor-test-artifacts"


@cache
def _load() -> dict:
    from cfnlint.decode.cfn_yaml import load

    # The JSON round trip turns cfn-lint's position-carrying nodes into plain Python types.
    return json.loads(json.dumps(load(str(TEMPLATE_PATH))))


def load_template() -> dict:
    """The parsed template.yaml (a fresh copy: callers may change it)."""
    return copy.deepcopy(_load())


def resources_of_type(template: dict, resource_type: str) -> dict[str, dict]:
    """Logical id -> resource, for every resource of `resource_type`."""
    return {rid: res for rid, res in template.get("Resources", {}).items() if res.get("Type") == resource_type}


def table_key_schema() -> dict:
    """KeySchema, AttributeDefinitions and GlobalSecondaryIndexes of the jobs table."""
    props = _load()["Resources"][JOBS_TABLE]["Properties"]
    return copy.deepcopy(
        {
            "KeySchema": props["KeySchema"],
            "AttributeDefinitions": props["AttributeDefinitions"],
            "GlobalSecondaryIndexes": props["GlobalSecondaryIndexes"],
        }
    )


def state_machine_definition_path(resource: dict) -> Path:
    """Local path of a state machine's ASL file (`DefinitionUri` is relative to the template)."""
    return TEMPLATE_PATH.parent / resource["Properties"]["DefinitionUri"]


def sam_transform(parameter_values: dict[str, Any] | None = None, region: str = "us-east-1") -> dict:
    """template.yaml expanded by aws-sam-translator into plain CloudFormation, offline.

    As `sam validate` does, local `CodeUri`s become S3 URIs. ASL files that exist are
    inlined as `Definition` (so that linters see the workflow); missing ones become S3 URIs.
    """
    import boto3
    from samtranslator.parser.parser import Parser
    from samtranslator.translator.translator import Translator

    template = load_template()
    functions = resources_of_type(template, "AWS::Serverless::Function").values()
    globals_function = template.get("Globals", {}).get("Function", {})
    for props in [globals_function, *(f["Properties"] for f in functions)]:
        if isinstance(props.get("CodeUri"), str) and not props["CodeUri"].startswith("s3://"):
            props["CodeUri"] = f"{_FAKE_S3}/{props['CodeUri'].strip('/')}.zip"
    for machine in resources_of_type(template, "AWS::Serverless::StateMachine").values():
        props = machine["Properties"]
        uri = props.get("DefinitionUri")
        if isinstance(uri, str) and not uri.startswith("s3://"):
            path = state_machine_definition_path(machine)
            del props["DefinitionUri"]
            if path.is_file():
                props["Definition"] = json.loads(path.read_text(encoding="utf-8"))
            else:
                props["DefinitionUri"] = f"{_FAKE_S3}/{uri}"

    translator = Translator(None, Parser(), boto_session=boto3.session.Session(region_name=region))
    return translator.translate(
        template,
        parameter_values={**TEST_PARAMETERS, **(parameter_values or {})},
        # Only names of AWS managed policies in `Policies` need the IAM lookup; we use none.
        get_managed_policy_map=lambda: {},
    )
