"""The stack's configuration, checked as it is deployed: the custom resource `ConfigCheck`.

CloudFormation creates or updates `ConfigCheck` (template.yaml) with the parameters every
function reads (`PolicyConfig`, `PoolsConfig`, `WaitAlarmTiers`, `ManagedRoleArnForTraining`)
and those the roles are granted by (`TrainingInstanceTypes`, `TeamTrainingRoleArns`) before it updates the
functions, which depend on it. A configuration the functions could not run fails the deploy
with the parameter and the field named, and CloudFormation rolls the stack back:

    ConfigCheck: CREATE_FAILED: PolicyConfig: field aging.rate_per_hour: Input should be a finite number

Without it each function would fail every invocation with that configuration, and every
event given to it would end in the dead-letter queue. What is checked is what the functions
read (`Settings.from_env`): a knob misspelt or out of range, a number NaN or infinite
(JSON's 1e999 reads as an infinity), a pool without its size, two pools of one name, a
watched tier the policy does not have; and a SageMaker pool the controller's role could
never launch on (an instance type outside `TrainingInstanceTypes`, a role other than the
ones it may pass: a pool's must be `ManagedRoleArnForTraining`, a team's one of
`TeamTrainingRoleArns`).

The check is given the version of its own code (`CodeVersion`, published per code change),
so a code update re-checks the configuration it deploys with. A rollback is not checked:
when an update fails later in the stack, CloudFormation gives the check the properties it
passed before, while its code is still the new one (the function rolls back after it); a
stricter new check refusing them would leave the stack in UPDATE_ROLLBACK_FAILED. An update
is a rollback when it goes back to a lower code version than the one it leaves (versions
only grow), or to properties without one.

The answer goes to the request's pre-signed `ResponseURL` (the custom resource protocol);
a Delete always succeeds, so that a stack stays removable whatever it was deployed with.
The function makes no AWS call.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any, Mapping

from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import TypeAdapter

from ..config import Settings, first_problem
from ..core.policy import Policy
from ..core.pools import PoolConfig
from .observability import logger

# The resource's properties: the parameters the functions read (with the environment
# variables they read them from), and TrainingInstanceTypes, which only the roles are
# granted by (template.yaml, JobControlFunction's CreateTrainingJob condition; its PassRole
# is of ManagedRoleArnForTraining and TeamTrainingRoleArns): a pool and a team must fit them.
ENVIRONMENT = {
    "PolicyConfig": "POLICY_CONFIG",
    "PoolsConfig": "POOLS_CONFIG",
    "WaitAlarmTiers": "WAIT_ALARM_TIERS",
    "ManagedRoleArnForTraining": "TRAINING_ROLE_ARN",
}
PARAMETERS = (*ENVIRONMENT, "TrainingInstanceTypes", "TeamTrainingRoleArns")
CODE_VERSION = "CodeVersion"  # the check's own published version (an ARN ending in :<n>), not a parameter
MAX_REASON = 1000  # CloudFormation shows the reason in the stack's events; keep it one line
_POOLS = TypeAdapter(list[PoolConfig])


def problem(properties: Mapping[str, Any]) -> str | None:
    """What the functions could not run in these parameters, in one line; None when they
    can. `properties` holds the parameters by name (`PARAMETERS`); a missing one is its
    template default."""
    policy_text = str(properties.get("PolicyConfig") or "{}")
    pools_text = str(properties.get("PoolsConfig") or "[]")
    for name, text, kind in (("PolicyConfig", policy_text, dict), ("PoolsConfig", pools_text, list)):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as e:
            return f"{name} is not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        if not isinstance(document, kind):
            return f"{name} must be a JSON {'object' if kind is dict else 'list of pools'}, got {type(document).__name__}"
        try:
            Policy(**document) if kind is dict else _POOLS.validate_python(document)
        except ValueError as e:  # pydantic's ValidationError is one
            return f"{name}: {first_problem(e)}"
    env = {"JOBS_TABLE": "config-check", "POLICY_CONFIG": policy_text, "POOLS_CONFIG": pools_text}
    for name in ("WaitAlarmTiers", "ManagedRoleArnForTraining"):
        if properties.get(name) is not None:
            env[ENVIRONMENT[name]] = str(properties[name])
    try:
        settings = Settings.from_env(env)
    except ValueError as e:  # pydantic's ValidationError is one
        return f"stack parameters: {first_problem(e)}"
    return _outside_grants(settings, properties)


def _outside_grants(settings: Settings, properties: Mapping[str, Any]) -> str | None:
    """A SageMaker pool the controller's role could never launch on: an instance type
    (its own or a fallback) outside `TrainingInstanceTypes` (the CreateTrainingJob
    condition), or a role of its own other than `ManagedRoleArnForTraining` (the only one
    it may pass for a pool); a team's training role outside `TeamTrainingRoleArns` (the
    others it may pass). Every launch there would be AccessDenied."""
    sagemaker = [p for p in settings.pools if p.service == "sagemaker"]
    if properties.get("TrainingInstanceTypes") is not None:
        allowed = {t.strip() for t in str(properties["TrainingInstanceTypes"]).split(",") if t.strip()}
        for pool in sagemaker:
            outside = [t for t in pool.instance_types if t not in allowed]
            if outside:
                return (
                    f"PoolsConfig: pool {pool.name!r} launches on {', '.join(outside)}, not in TrainingInstanceTypes "
                    f"({', '.join(sorted(allowed)) or 'empty'}): the controller may not create training jobs there"
                )
    if properties.get("ManagedRoleArnForTraining") is not None:
        role = str(properties["ManagedRoleArnForTraining"])
        for pool in sagemaker:
            if pool.role_arn and pool.role_arn != role:
                return (
                    f"PoolsConfig: pool {pool.name!r} passes role {pool.role_arn}, but the controller may pass only "
                    f"ManagedRoleArnForTraining ({role or 'empty'})"
                )
    if properties.get("TeamTrainingRoleArns") is not None:
        passable = {r.strip() for r in str(properties["TeamTrainingRoleArns"]).split(",") if r.strip()}
        for team in sorted(settings.policy.teams or {}):
            role = settings.policy.training_role(team)
            if role is not None and role == settings.training_role_arn:
                return (
                    f"PolicyConfig: teams.{team}.training_role_arn is ManagedRoleArnForTraining, the role every team "
                    "without one of its own shares: a team's own role must be its own"
                )
            if role is not None and role not in passable:
                return (
                    f"PolicyConfig: teams.{team}.training_role_arn is {role}, not in TeamTrainingRoleArns "
                    f"({', '.join(sorted(passable)) or 'empty'}): the controller may not pass it"
                )
    return None


@logger.inject_lambda_context(clear_state=True)
def handler(event: dict, context: LambdaContext) -> None:
    """Answer CloudFormation's request: SUCCESS, or FAILED with `problem`'s line."""
    request, passed = event.get("RequestType"), "configuration valid"
    try:
        if request == "Delete":
            found, passed = None, "deleted"
        elif request == "Update" and rolls_back(event):
            found, passed = None, "rollback to a configuration an earlier version of the check passed: not checked again"
        else:
            found = problem(event.get("ResourceProperties") or {})
    except Exception as e:  # noqa: BLE001 - a check that breaks must still answer, or the deploy hangs for an hour
        logger.exception("the configuration check failed")
        found = f"the configuration check failed: {type(e).__name__}: {e}"
    status = "FAILED" if found else "SUCCESS"
    logger.info("configuration checked", extra={"request": request, "status": status, "problem": found, "answer": found or passed})
    respond(event, status, found or passed)


def rolls_back(event: Mapping[str, Any]) -> bool:
    """Whether an update goes back to properties an earlier version of the check passed: a
    code version lower than the one it leaves, or none (the module docstring)."""
    old = _version((event.get("OldResourceProperties") or {}).get(CODE_VERSION))
    if old is None:
        return False
    new = _version((event.get("ResourceProperties") or {}).get(CODE_VERSION))
    return new is None or new < old


def _version(arn: Any) -> int | None:
    """The version number of a published version's ARN (arn:aws:lambda:...:function:<name>:<n>)."""
    number = str(arn).rsplit(":", 1)[-1] if arn else ""
    return int(number) if number.isdigit() else None


def respond(event: Mapping[str, Any], status: str, reason: str) -> None:
    """PUT the answer to the request's pre-signed URL (the custom resource protocol). A
    failure to answer raises: Lambda retries the asynchronous invocation."""
    url = str(event["ResponseURL"])
    if urllib.parse.urlsplit(url).scheme not in ("https", "http"):
        raise ValueError(f"ResponseURL must be an http(s) URL, got scheme {urllib.parse.urlsplit(url).scheme!r}")
    # Kept on an update (a new one would make CloudFormation delete the old); on a create,
    # the stack's name: arn:aws:cloudformation:<region>:<account>:stack/<name>/<id>.
    stack = str(event.get("StackId", "")).split("/")
    physical = event.get("PhysicalResourceId") or f"{stack[1] if len(stack) > 2 else 'stack'}-config-check"
    body = json.dumps(
        {
            "Status": status,
            "Reason": " ".join(reason.split())[:MAX_REASON],
            "PhysicalResourceId": physical,
            "StackId": event["StackId"],
            "RequestId": event["RequestId"],
            "LogicalResourceId": event["LogicalResourceId"],
            "Data": {},
        }
    ).encode()
    # The URL is CloudFormation's pre-signed S3 URL: signed for an empty content type.
    put = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": "", "Content-Length": str(len(body))})
    with urllib.request.urlopen(put, timeout=30) as answer:  # noqa: S310 - http(s) only, checked above
        answer.read()
