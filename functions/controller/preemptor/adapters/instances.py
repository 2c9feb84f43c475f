"""Which EC2 instance a Batch job runs on: Batch reports the ECS container instance, ECS knows
its EC2 instance. Spot warnings name the EC2 instance, so this is how they reach the job."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError

from .errors import translate


def cluster_of(container_instance_arn: str) -> str | None:
    """`arn:aws:ecs:<region>:<account>:container-instance/<cluster>/<id>` -> `<cluster>`
    (None for the old ARN format without the cluster name)."""
    resource = container_instance_arn.split(":", 5)[-1]
    parts = resource.split("/")
    return parts[1] if len(parts) == 3 else None


class InstanceResolver:
    def __init__(self, ecs_client: Any):
        self.ecs = ecs_client

    def ec2_instance(self, container_instance_arn: str) -> str | None:
        cluster = cluster_of(container_instance_arn)
        if cluster is None:
            return None
        try:
            out = self.ecs.describe_container_instances(cluster=cluster, containerInstances=[container_instance_arn])
        except ClientError as e:
            raise translate(e, "DescribeContainerInstances") from e
        found = out.get("containerInstances", [])
        return found[0].get("ec2InstanceId") if found else None
