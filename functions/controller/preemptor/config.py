"""Configuration read once at the edge (the handler) and passed down as typed models."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .core.policy import Policy
from .core.pools import JobDefinition, PoolConfig, fallback_onto_another_pool

__all__ = ["JobDefinition", "Mode", "PoolConfig", "Settings", "first_problem"]


class Mode(StrEnum):
    ENFORCE = "enforce"  # act on decisions
    SHADOW = "shadow"  # decide and log, change nothing


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    jobs_table: str
    # The controller's name (its stack's), on every run it launches: a second stack in the
    # account and region that lists it in its OtherControllers neither stops nor adopts
    # this one's runs (and IAM keeps every other stack's stops off them).
    controller: str = ""
    # The other Preemptor stacks of the account and region (OtherControllers): a run tagged
    # as one of theirs is left to it. A run claiming a controller not listed is a team's,
    # its claim not believed (a team's way to hide its run from every stack's count).
    other_controllers: frozenset[str] = frozenset()
    alerts_topic_arn: str = ""
    mode: Mode = Mode.ENFORCE
    pools: tuple[PoolConfig, ...]
    policy: Policy = Field(default_factory=Policy)
    workflow_arns: dict[str, str] = Field(default_factory=dict)
    pending_window: int = Field(default=200, gt=0)
    # Where every job's checkpoints live (s3://<bucket>/<team>/<job>), and the training
    # role a SageMaker pool without its own `role_arn` passes (the one iam:PassRole allows).
    checkpoint_bucket: str = ""
    training_role_arn: str | None = None
    # The longest run time the stack's role may give a training job (MaxTrainingRuntimeSeconds,
    # the sagemaker:MaxRuntimeInSeconds condition); None: no limit known here.
    max_training_runtime_s: int | None = Field(default=None, gt=0)
    # The wait alarm (template.yaml `WaitAlarm`): the tiers it watches, its threshold, and
    # its name, by which the controller knows its state changes (the escalation).
    wait_alarm_name: str = ""
    wait_alarm_tiers: tuple[str, ...] = ("critical", "high")
    wait_alarm_minutes: float = Field(default=10.0, gt=0)
    # A submission, or GPUs freed, is planned at the end of its settle window, with every
    # change within it (`adapters.workflows.settled_schedule`); 0: each at once.
    settle_s: float = Field(default=3.0, ge=0, le=60)

    @model_validator(mode="after")
    def _consistent(self) -> "Settings":
        names = [p.name for p in self.pools]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:  # the second would never be planned: `pool` finds the first
            raise ValueError(f"pools: one pool per name; repeated: {', '.join(repeated)}")
        shared = fallback_onto_another_pool(self.pools)
        if shared:
            raise ValueError(f"pools: {shared}")
        unknown = [t for t in self.wait_alarm_tiers if t not in self.policy.tiers]
        if unknown:  # a job of a misspelt tier is never escalated, and the alarm never fires for it
            # (the policy's tier names are lower case, and so are the alarm's metric dimensions)
            raise ValueError(f"wait_alarm_tiers: unknown tier(s) {', '.join(unknown)} (tiers: {', '.join(sorted(self.policy.tiers))})")
        return self

    def pool(self, name: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.name == name), None)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        """Read the function's environment (set by template.yaml)."""
        return cls(
            jobs_table=env["JOBS_TABLE"],
            controller=env.get("CONTROLLER_NAME", ""),
            other_controllers=frozenset(n.strip() for n in env.get("OTHER_CONTROLLERS", "").split(",") if n.strip()),
            alerts_topic_arn=env.get("ALERTS_TOPIC_ARN", ""),
            mode=env.get("MODE", "enforce"),
            pools=[PoolConfig(**p) for p in json.loads(env.get("POOLS_CONFIG") or "[]")],
            policy=Policy(**json.loads(env.get("POLICY_CONFIG") or "{}")),
            checkpoint_bucket=env.get("CHECKPOINT_BUCKET", ""),
            training_role_arn=env.get("TRAINING_ROLE_ARN") or None,
            max_training_runtime_s=int(float(env["MAX_TRAINING_RUNTIME_S"])) if env.get("MAX_TRAINING_RUNTIME_S") else None,
            wait_alarm_name=env.get("WAIT_ALARM_NAME", ""),
            wait_alarm_tiers=tuple(t.strip() for t in env.get("WAIT_ALARM_TIERS", "critical,high").split(",") if t.strip()),
            wait_alarm_minutes=float(env.get("WAIT_ALARM_MINUTES") or 10),
            settle_s=float(env.get("SETTLE_S") or 3),
            workflow_arns={
                key: env[var]
                for key, var in (
                    ("schedule", "SCHEDULE_STATE_MACHINE_ARN"),
                    ("job_ended", "JOB_ENDED_STATE_MACHINE_ARN"),
                    ("spot", "SPOT_STATE_MACHINE_ARN"),
                    ("preempt", "PREEMPT_STATE_MACHINE_ARN"),
                )
                if env.get(var)
            },
        )


def first_problem(error: ValueError, whole: str = "") -> str:
    """A refused configuration or file in one line: pydantic's first problem with the field
    it is in (`whole` names a problem of the whole document; none by default), and how many
    more there are; any other ValueError as it says."""
    if not isinstance(error, ValidationError):
        return str(error)
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or whole
    message = str(first["msg"]).removeprefix("Value error, ")
    more = error.error_count() - 1
    tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{'field ' + field + ': ' if field else ''}{message}{tail}"
