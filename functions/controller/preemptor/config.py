"""Configuration read once at the edge (the handler) and passed down as typed models."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .core.policy import Policy


class Mode(StrEnum):
    ENFORCE = "enforce"  # act on decisions
    SHADOW = "shadow"  # decide and log, change nothing


class PoolConfig(BaseModel):
    """A capacity pool: either instances x GPUs per instance, or a GPU count."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    service: Literal["sagemaker", "batch"] = "sagemaker"
    instance_type: str | None = None
    instances: int | None = Field(default=None, gt=0)
    gpus_per_instance: int = Field(default=8, gt=0)
    gpus: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _has_size(self) -> "PoolConfig":
        if self.gpus is None and self.instances is None:
            raise ValueError(f"pool {self.name!r} needs 'instances' or 'gpus'")
        return self

    @property
    def capacity_gpus(self) -> int:
        return self.gpus if self.gpus is not None else self.instances * self.gpus_per_instance


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True)

    jobs_table: str
    alerts_topic_arn: str = ""
    mode: Mode = Mode.ENFORCE
    pools: tuple[PoolConfig, ...]
    policy: Policy = Field(default_factory=Policy)
    workflow_arns: dict[str, str] = Field(default_factory=dict)
    pending_window: int = Field(default=200, gt=0)

    def pool(self, name: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.name == name), None)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        """Read the function's environment (set by template.yaml)."""
        return cls(
            jobs_table=env["JOBS_TABLE"],
            alerts_topic_arn=env.get("ALERTS_TOPIC_ARN", ""),
            mode=env.get("MODE", "enforce"),
            pools=[PoolConfig(**p) for p in json.loads(env.get("POOLS_CONFIG") or "[]")],
            policy=Policy(**json.loads(env.get("POLICY_CONFIG") or "{}")),
            workflow_arns={
                key: env[var]
                for key, var in (
                    ("schedule", "SCHEDULE_STATE_MACHINE_ARN"),
                    ("job_ended", "JOB_ENDED_STATE_MACHINE_ARN"),
                    ("spot", "SPOT_STATE_MACHINE_ARN"),
                )
                if env.get(var)
            },
        )
