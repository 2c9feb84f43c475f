"""The trust boundary of a submission: `admit_request` builds the service call from the pool.

Pure: no AWS. What the emulated stack then launches is in tests/integration/test_intake.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from preemptor.adapters.runners import controller_tags
from preemptor.core.jobs import JobRecord, new_run_secret
from preemptor.core.pools import JobDefinition, PoolConfig
from preemptor.core.requests import (
    CONTROLLER_RUN_TAGS, SERVICE_MAX_TAGS, JobRequest, Refusal, RequestRefused, admit_request, spot_launch,
)

BUCKET = "preemptor-checkpoints"
ROLE = "arn:aws:iam::123456789012:role/p5-training"
P5 = PoolConfig(
    name="p5", service="sagemaker", instance_type="ml.p5.48xlarge", instances=8, gpus_per_instance=8,
    role_arn=ROLE, output_s3_uri="s3://ml-artifacts/p5/", subnets=("subnet-0a", "subnet-0b"),
    security_group_ids=("sg-0a",), network_isolation=True, kms_key_id="alias/p5",
)
P5_OPEN = PoolConfig(name="p5", service="sagemaker", instance_type="ml.p5.48xlarge", instances=8, gpus_per_instance=8)
G5 = PoolConfig(
    name="g5", service="batch", gpus=32, job_queue="arn:aws:batch:us-east-1:123456789012:job-queue/g5",
    job_definitions=("eval:3", JobDefinition(name="research-train:1", team="research")),
)


def sagemaker(**changes: Any) -> JobRequest:
    """A research team's SageMaker submission that states only its own part, with `changes`
    applied (`request.X` keys change the body; None deletes)."""
    detail: dict[str, Any] = {
        "name": "llm-7b", "team": "research", "priority": "high", "pool": "p5", "service": "sagemaker",
        "request": {
            "AlgorithmSpecification": {"TrainingImage": "img:1", "TrainingInputMode": "File"},
            "ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100},
            "StoppingCondition": {"MaxRuntimeInSeconds": 86400},
            "CheckpointConfig": {"LocalPath": "/opt/ml/checkpoints"},
            "Tags": [{"Key": "project", "Value": "foundation"}],
        },
    }
    return JobRequest.model_validate(_apply(detail, changes))


def batch(**changes: Any) -> JobRequest:
    detail: dict[str, Any] = {
        "name": "eval-1", "team": "platform", "priority": 200, "pool": "g5", "service": "batch", "gpus": 4,
        "request": {"jobDefinition": "eval:3", "containerOverrides": {"environment": [{"name": "A", "value": "1"}]}},
    }
    return JobRequest.model_validate(_apply(detail, changes))


def _apply(detail: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    detail = copy.deepcopy(detail)
    for key, value in changes.items():
        target, name = (detail["request"], key.removeprefix("request_")) if key.startswith("request_") else (detail, key)
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value
    return detail


def refused(req: JobRequest, pool: PoolConfig = P5, **kw: Any) -> RequestRefused:
    with pytest.raises(RequestRefused) as caught:
        admit_request(req, pool, checkpoint_bucket=BUCKET, **kw)
    return caught.value


# ------------------------------------------------------------------------- SageMaker


def test_sagemaker_call_is_built_from_the_pool_and_the_teams_prefix():
    # Given a request that states only the team's part
    req = sagemaker()
    # When it is admitted into a pool that sets role, output, network and encryption
    admitted = admit_request(req, P5, checkpoint_bucket=BUCKET)
    body = admitted.request
    # Then the call carries the pool's settings and the team's own checkpoint prefix
    assert body["RoleArn"] == ROLE
    assert body["OutputDataConfig"] == {"S3OutputPath": "s3://ml-artifacts/p5/research/", "KmsKeyId": "alias/p5"}
    assert body["VpcConfig"] == {"Subnets": ["subnet-0a", "subnet-0b"], "SecurityGroupIds": ["sg-0a"]}
    assert body["EnableNetworkIsolation"] is True and "EnableInterContainerTrafficEncryption" not in body
    assert body["ResourceConfig"]["VolumeKmsKeyId"] == "alias/p5"
    assert body["CheckpointConfig"] == {"LocalPath": "/opt/ml/checkpoints", "S3Uri": f"s3://{BUCKET}/research/llm-7b"}
    assert admitted.checkpoint_s3_uri == f"s3://{BUCKET}/research/llm-7b"
    # And the demand is counted from the instances: 2 x 8
    assert admitted.gpus == 16
    # And the request itself is left untouched
    assert "RoleArn" not in req.request


def test_a_pool_without_its_own_role_uses_the_stacks_training_role_and_default_output():
    admitted = admit_request(sagemaker(), P5_OPEN, checkpoint_bucket=BUCKET, default_role_arn="arn:aws:iam::1:role/t")
    assert admitted.request["RoleArn"] == "arn:aws:iam::1:role/t"
    assert admitted.request["OutputDataConfig"] == {"S3OutputPath": f"s3://{BUCKET}/_output/research/"}
    assert "VpcConfig" not in admitted.request and "EnableNetworkIsolation" not in admitted.request


def test_without_any_training_role_a_sagemaker_job_is_refused():
    error = refused(sagemaker(), P5_OPEN)
    assert (error.reason, error.field) == (Refusal.NOT_ALLOWED, "request.RoleArn")


def test_repeating_exactly_what_the_pool_sets_is_accepted():
    req = sagemaker(
        request_RoleArn=ROLE,
        request_OutputDataConfig={"S3OutputPath": "s3://ml-artifacts/p5/research", "KmsKeyId": "alias/p5"},
        request_VpcConfig={"Subnets": ["subnet-0b", "subnet-0a"], "SecurityGroupIds": ["sg-0a"]},
        request_EnableNetworkIsolation=True,
        request_EnableInterContainerTrafficEncryption=False,
        request_CheckpointConfig={"S3Uri": f"s3://{BUCKET}/research/llm-7b/"},
        checkpoint_s3_uri=f"s3://{BUCKET}/research/llm-7b",
    )
    assert admit_request(req, P5, checkpoint_bucket=BUCKET).gpus == 16


@pytest.mark.parametrize(
    "changes, field",
    [
        pytest.param({"request_RoleArn": "arn:aws:iam::123456789012:role/Admin"}, "request.RoleArn", id="another-role"),
        pytest.param({"request_OutputDataConfig": {"S3OutputPath": "s3://attacker/loot"}},
                     "request.OutputDataConfig.S3OutputPath", id="output-elsewhere"),
        pytest.param({"request_OutputDataConfig": {"S3OutputPath": "s3://ml-artifacts/p5/production"}},
                     "request.OutputDataConfig.S3OutputPath", id="another-teams-output"),
        pytest.param({"request_OutputDataConfig": {"KmsKeyId": "alias/mine"}}, "request.OutputDataConfig.KmsKeyId", id="another-kms-key"),
        pytest.param({"request_VpcConfig": {"Subnets": ["subnet-open"], "SecurityGroupIds": ["sg-0a"]}}, "request.VpcConfig", id="another-subnet"),
        pytest.param({"request_EnableNetworkIsolation": False}, "request.EnableNetworkIsolation", id="network-isolation-off"),
        pytest.param({"request_ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeKmsKeyId": "k"}},
                     "request.ResourceConfig.VolumeKmsKeyId", id="another-volume-key"),
        pytest.param({"request_CheckpointConfig": {"S3Uri": f"s3://{BUCKET}/production/finetune"}},
                     "request.CheckpointConfig.S3Uri", id="another-teams-checkpoints"),
        pytest.param({"checkpoint_s3_uri": f"s3://{BUCKET}/production/finetune"}, "checkpoint_s3_uri", id="checkpoint-field"),
        pytest.param({"request_Tags": [{"Key": "preemptor:managed", "Value": "true"}]}, "request.Tags.preemptor:managed", id="controller-tag"),
    ],
)
def test_a_request_that_sets_what_the_pool_sets_is_refused_naming_the_field(changes, field):
    # Given a request that sets a field the pool (or the controller) decides, otherwise
    # (before: the body went to SageMaker untouched: any role, output path, VPC, another
    # team's checkpoint prefix, whose files SageMaker would sync into the container)
    error = refused(sagemaker(**changes))
    # Then it is refused as set by the pool, naming the field
    assert (error.reason, error.field) == (Refusal.SET_BY_POOL, field)


def test_vpc_and_isolation_are_refused_in_a_pool_that_sets_none():
    assert refused(sagemaker(request_VpcConfig={"Subnets": ["s"], "SecurityGroupIds": ["g"]}), P5_OPEN,
                   default_role_arn=ROLE).field == "request.VpcConfig"
    assert refused(sagemaker(request_EnableNetworkIsolation=True), P5_OPEN, default_role_arn=ROLE).field == (
        "request.EnableNetworkIsolation"
    )


@pytest.mark.parametrize(
    "key",
    ["DebugHookConfig", "TensorBoardOutputConfig", "ProfilerConfig", "RemoteDebugConfig", "TrainingJobName"],
)
def test_fields_the_controller_does_not_pass_on_are_refused(key):
    # Given a request with a member that writes elsewhere or names the run (not ours to pass on)
    error = refused(sagemaker(**{f"request_{key}": {"S3OutputPath": "s3://elsewhere/x"}}))
    assert (error.reason, error.field) == (Refusal.NOT_ALLOWED, f"request.{key}")


def test_an_image_outside_the_pools_prefixes_is_refused():
    pool = P5.model_copy(update={"image_prefixes": ("123456789012.dkr.ecr.us-east-1.amazonaws.com/",)})
    error = refused(sagemaker(), pool)
    assert (error.reason, error.field) == (Refusal.NOT_ALLOWED, "request.AlgorithmSpecification.TrainingImage")


# ----------------------------------------------------------------- self-declared demand


@pytest.mark.parametrize(
    "changes, gpus",
    [
        pytest.param({}, 16, id="instance-count"),
        pytest.param({"instances": 2}, 16, id="instances-agreeing"),
        pytest.param({"gpus": 16}, 16, id="gpus-agreeing"),
        pytest.param({"request_ResourceConfig": {"VolumeSizeInGB": 50}, "instances": 3}, 24, id="instances-fill-the-config"),
        pytest.param({"request_ResourceConfig": {"VolumeSizeInGB": 50}, "gpus": 32}, 32, id="gpus-fill-the-config"),
        pytest.param({"request_ResourceConfig": {"InstanceGroups": [
            {"InstanceGroupName": "a", "InstanceType": "ml.p5.48xlarge", "InstanceCount": 2},
            {"InstanceGroupName": "b", "InstanceType": "ml.p5.48xlarge", "InstanceCount": 3}]}}, 40, id="groups-in-full"),
    ],
)
def test_sagemaker_demand_is_counted_from_the_instances(changes, gpus):
    admitted = admit_request(sagemaker(**changes), P5, checkpoint_bucket=BUCKET)
    assert admitted.gpus == gpus
    resources = admitted.request["ResourceConfig"]
    assert "InstanceGroups" in resources or resources["InstanceCount"] * 8 == gpus


@pytest.mark.parametrize(
    "changes, field",
    [
        pytest.param({"gpus": 1}, "gpus", id="gpus-1-with-instance-count-2"),
        pytest.param({"instances": 1, "request_ResourceConfig": {"InstanceGroups": [
            {"InstanceGroupName": "a", "InstanceType": "ml.p5.48xlarge", "InstanceCount": 32}]}},
            "instances", id="groups-of-32-declared-as-1"),
        pytest.param({"request_ResourceConfig": {"InstanceType": "ml.g5.48xlarge", "InstanceCount": 2}},
                     "request.ResourceConfig.InstanceType", id="another-pools-instance-type"),
        pytest.param({"request_ResourceConfig": {"InstanceGroups": [
            {"InstanceGroupName": "a", "InstanceType": "ml.p5.48xlarge", "InstanceCount": 1},
            {"InstanceGroupName": "cpu", "InstanceType": "ml.c5.18xlarge", "InstanceCount": 8}]}},
            "request.ResourceConfig.InstanceGroups[1].InstanceType", id="group-of-another-type"),
        pytest.param({"request_ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 0}},
                     "request.ResourceConfig.InstanceCount", id="zero-instances"),
        pytest.param({"request_ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": "2"}},
                     "request.ResourceConfig.InstanceCount", id="count-as-text"),
        pytest.param({"request_ResourceConfig": {"VolumeSizeInGB": 50}}, "request.ResourceConfig.InstanceCount", id="no-count"),
        pytest.param({"request_ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 9}}, "gpus", id="more-than-the-pool"),
        pytest.param({"service": "batch", "gpus": 8, "request_jobDefinition": "eval:3"}, "service", id="batch-job-in-a-sagemaker-pool"),
    ],
)
def test_misstated_demand_is_refused(changes, field):
    # Given a request whose declared demand disagrees with what it would run (before: gpus=1
    # with InstanceCount 2, 32 instances in groups declared as 1, another pool's instance
    # type, were all accepted and counted as declared)
    error = refused(sagemaker(**changes))
    # Then it is refused, naming the field
    assert (error.reason, error.field) == (Refusal.BAD_DEMAND, field)


# ------------------------------------------------------------------------------ Batch


def test_batch_call_is_built_from_the_pool():
    admitted = admit_request(batch(), G5, checkpoint_bucket=BUCKET)
    body = admitted.request
    assert body["jobQueue"] == G5.job_queue and body["jobDefinition"] == "eval:3"
    assert body["containerOverrides"]["resourceRequirements"] == [{"type": "GPU", "value": "4"}]
    assert {"name": "PREEMPTOR_CHECKPOINT_S3_URI", "value": f"s3://{BUCKET}/platform/eval-1"} in (
        body["containerOverrides"]["environment"]
    )
    assert (admitted.gpus, admitted.checkpoint_s3_uri) == (4, f"s3://{BUCKET}/platform/eval-1")


@pytest.mark.parametrize(
    "changes, reason, field",
    [
        pytest.param({"request_jobQueue": "arn:aws:batch:us-east-1:123456789012:job-queue/prod"}, Refusal.SET_BY_POOL,
                     "request.jobQueue", id="another-queue"),
        pytest.param({"request_jobDefinition": "production-secrets:7"}, Refusal.NOT_ALLOWED, "request.jobDefinition",
                     id="definition-not-allowed"),
        pytest.param({"request_jobDefinition": "research-train:1",
                      "request_containerOverrides": {"command": ["sh", "-c", "env"]}}, Refusal.NOT_ALLOWED,
                     "request.containerOverrides.command", id="command-on-another-teams-definition"),
        pytest.param({"request_jobDefinition": "research-train:1",
                      "request_containerOverrides": {"environment": [{"name": "DATA", "value": "s3://x/research/secret"}]}},
                     Refusal.NOT_ALLOWED, "request.containerOverrides.environment", id="environment-on-another-teams-definition"),
        pytest.param({"request_jobDefinition": "research-train:1", "request_containerOverrides": None, "request_parameters": {"config": "leak.yaml"}},
                     Refusal.NOT_ALLOWED, "request.parameters", id="parameters-on-another-teams-definition"),
        pytest.param({"request_containerOverrides": {"resourceRequirements": [{"type": "GPU", "value": "8"}]}},
                     Refusal.BAD_DEMAND, "request.containerOverrides.resourceRequirements", id="gpu-override-contradicts"),
        pytest.param({"request_arrayProperties": {"size": 100}}, Refusal.NOT_ALLOWED, "request.arrayProperties", id="array-job"),
        pytest.param({"request_nodeOverrides": {"numNodes": 16}}, Refusal.NOT_ALLOWED, "request.nodeOverrides", id="multi-node"),
        pytest.param({"request_schedulingPriorityOverride": 9999}, Refusal.NOT_ALLOWED,
                     "request.schedulingPriorityOverride", id="batch-priority"),
        pytest.param({"request_containerOverrides": {"environment": [
            {"name": "PREEMPTOR_CHECKPOINT_S3_URI", "value": f"s3://{BUCKET}/research/llm-7b"}]}},
                     Refusal.SET_BY_POOL, "request.containerOverrides.environment.PREEMPTOR_CHECKPOINT_S3_URI",
                     id="another-teams-checkpoints"),
        pytest.param({"request_tags": {"preemptor:managed": "true"}}, Refusal.SET_BY_POOL, "request.tags.preemptor:managed",
                     id="controller-tag"),
        pytest.param({"gpus": 64}, Refusal.BAD_DEMAND, "gpus", id="more-than-the-pool"),
        # Batch takes 50 tags a job, the controller's among them: every launch would fail
        pytest.param({"request_tags": {f"k{i}": "v" for i in range(43)}}, Refusal.NOT_ALLOWED, "request.tags", id="no-room-for-the-controllers-tags"),
    ],
)
def test_a_batch_request_beyond_the_pools_allow_list_is_refused(changes, reason, field):
    error = refused(batch(**changes), G5)
    assert (error.reason, error.field) == (reason, field)


def test_a_team_may_override_the_command_of_its_own_or_a_shared_definition():
    steering = {"command": ["python", "train.py"], "environment": [{"name": "LR", "value": "3e-4"}]}
    research = batch(team="research", request_jobDefinition="research-train:1", request_containerOverrides=steering,
                     request_parameters={"config": "big.yaml"})
    shared = batch(request_containerOverrides={"command": ["python", "eval.py"]}, request_parameters={"config": "eval.yaml"})
    assert admit_request(research, G5, checkpoint_bucket=BUCKET).request["containerOverrides"]["command"]
    assert admit_request(shared, G5, checkpoint_bucket=BUCKET).request["containerOverrides"]["command"]
    # and another team may run research's definition as it is, its resources sized
    as_is = batch(request_jobDefinition="research-train:1", request_containerOverrides={"memory": 65536})
    admitted = admit_request(as_is, G5, checkpoint_bucket=BUCKET).request["containerOverrides"]
    assert [e["name"] for e in admitted["environment"]] == ["PREEMPTOR_CHECKPOINT_S3_URI"]


def test_a_batch_pool_without_a_queue_refuses_submissions():
    error = refused(batch(), PoolConfig(name="g5", service="batch", gpus=32, job_definitions=("eval:3",)))
    assert (error.reason, error.field) == (Refusal.NOT_ALLOWED, "request.jobQueue")


# --------------------------------------------------------------------------- capacity type

P5_SPOT = P5_OPEN.model_copy(update={"capacity_type": "spot", "on_demand_fallback": True, "spot_wait_s": 600})


def test_a_spot_pool_launches_managed_spot_waiting_its_spot_wait_beyond_the_run_time():
    # Given a spot pool that waits 600 s for spot, and a job of at most 86,400 s
    body = admit_request(sagemaker(), P5_SPOT, checkpoint_bucket=BUCKET, default_role_arn=ROLE).request
    # Then the pool made it a managed-spot job: MaxWait = run time + spot wait
    assert body["EnableManagedSpotTraining"] is True
    assert body["StoppingCondition"] == {"MaxRuntimeInSeconds": 86_400, "MaxWaitTimeInSeconds": 87_000}


@pytest.mark.parametrize(
    ("pool", "changes", "field"),
    [
        pytest.param(P5_OPEN, {"request_EnableManagedSpotTraining": True}, "request.EnableManagedSpotTraining", id="spot-in-on-demand"),
        pytest.param(P5_SPOT, {"request_EnableManagedSpotTraining": False}, "request.EnableManagedSpotTraining", id="on-demand-in-spot"),
        pytest.param(
            P5_SPOT,
            {"request_StoppingCondition": {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 999_999}},
            "request.StoppingCondition.MaxWaitTimeInSeconds",
            id="own-spot-wait",
        ),
    ],
)
def test_spot_or_on_demand_is_the_pools_choice_not_the_submitters(pool, changes, field):
    # When a submitter picks the capacity type (or how long to wait for spot) itself
    with pytest.raises(RequestRefused) as refused:
        admit_request(sagemaker(**changes), pool, checkpoint_bucket=BUCKET, default_role_arn=ROLE)
    # Then it is refused, naming the field the pool sets
    assert (refused.value.reason, refused.value.field) == (Refusal.SET_BY_POOL, field)


def test_a_spot_pool_offers_every_type_on_spot_before_any_on_demand():
    pool = P5_SPOT.model_copy(update={"fallback_instance_types": ("ml.p5e.48xlarge",)})
    assert pool.offerings == ("ml.p5.48xlarge:spot", "ml.p5e.48xlarge:spot", "ml.p5.48xlarge", "ml.p5e.48xlarge")
    assert P5_SPOT.model_copy(update={"on_demand_fallback": False}).offerings == ("ml.p5.48xlarge:spot",)
    assert P5_OPEN.offerings == ("ml.p5.48xlarge",)


def test_a_fallback_launch_changes_the_capacity_type_of_the_admitted_request():
    body = admit_request(sagemaker(), P5_SPOT, checkpoint_bucket=BUCKET, default_role_arn=ROLE).request
    on_demand = spot_launch(body, spot=False)
    assert "EnableManagedSpotTraining" not in on_demand and on_demand["StoppingCondition"] == {"MaxRuntimeInSeconds": 86_400}
    assert spot_launch(on_demand, spot=True, spot_wait_s=600) == body


def test_on_demand_fallback_needs_a_spot_pool():
    with pytest.raises(ValueError, match="on_demand_fallback"):
        PoolConfig(name="p5", instance_type="ml.p5.48xlarge", instances=1, on_demand_fallback=True)


def test_a_request_leaves_room_for_the_controllers_tags_under_the_services_limit():
    # Given the most tags of its own a team's run may carry, and one more
    room = SERVICE_MAX_TAGS - CONTROLLER_RUN_TAGS
    fits = admit_request(sagemaker(request_Tags=[{"Key": f"k{i}", "Value": "v"} for i in range(room)]), P5, checkpoint_bucket=BUCKET)
    error = refused(sagemaker(request_Tags=[{"Key": f"k{i}", "Value": "v"} for i in range(room + 1)]))
    # Then the first is admitted, the second refused naming the field and the limit (before:
    # admitted, and every launch refused by SageMaker until the job failed)
    assert len(fits.request["Tags"]) == room
    assert (error.reason, error.field) == (Refusal.NOT_ALLOWED, "request.Tags") and f"at most {room}" in error.detail
    # And the controller's tags on a run are never more than it leaves room for
    record = JobRecord(
        name="x", team="vision", priority=1, pool="p5", service="sagemaker", gpus=8, request={}, checkpoint_s3_uri="s3://b/vision/x",
        submitted_at=0.0, run_secret=new_run_secret(),
    )
    assert len(controller_tags(record, "preemptor")) == CONTROLLER_RUN_TAGS
