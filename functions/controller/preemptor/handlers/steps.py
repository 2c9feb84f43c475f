"""Typed inputs of the workflow steps (the Lambda functions Step Functions invokes).

Each function's input is one model, or a union discriminated by `action`; Powertools'
parser validates the raw input against it before the handler runs. A malformed input (a
state machine sending a field the step does not know, a missing or ill-typed field) is
`InvalidStepInput`: a bug, never retried, named in the execution's history.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Callable, Literal, Union

from aws_lambda_powertools.utilities.parser import ValidationError, parse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter

from ..adapters.errors import NO_ANSWER
from ..core.errors import InvalidStepInput, ServiceUnavailable

Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Reason = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Incarnation = Annotated[int, Field(ge=1)]


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _JobStep(_Step):
    job: Name
    incarnation: Incarnation


# -- job control ---------------------------------------------------------------------------
class Launch(_JobStep):
    action: Literal["launch"]


class GiveUpLaunch(_JobStep):
    """The launch step gave up (`error`: the workflow's error name and cause)."""

    action: Literal["give-up-launch"]
    error: Reason


# The preemption a step acts for: the time its victim was marked (`preempting_since`), which
# the plan step hands on with the victim. A victim released and chosen again since is in
# another preemption: a step of the earlier one neither stops nor spares it. None: a
# workflow that names none (a spot interruption's, which is not called off).
Since = Annotated[float, Field(ge=0)]


class Stop(_JobStep):
    action: Literal["stop"]
    fresh: bool = True
    since: Since | None = None


class RunState(_JobStep):
    action: Literal["state"]


class Requeue(_JobStep):
    action: Literal["requeue"]
    fresh: bool = True
    phase: Literal["running", "stopped", "completed", "failed", "gone"] = "stopped"


class Interrupt(_JobStep):
    action: Literal["interrupt"]
    reason: Reason
    execution: Name | None = None  # the spot workflow's execution: a retried step knows its own mark


class Spare(_JobStep):
    action: Literal["spare"]
    # Why the preemption is given up: no fresh checkpoint in time (the policy says spare),
    # or the stop was refused (IAM: the controller may not stop this run).
    why: Literal["checkpoint-timeout", "stop-refused"] = "checkpoint-timeout"
    since: Since | None = None


class Finish(_JobStep):
    action: Literal["finish"]
    outcome: Literal["completed", "failed", "cancelled", "interrupted", "capacity-error"]
    reason: Reason


ControlStep = TypeAdapter(
    Annotated[Union[Launch, GiveUpLaunch, Stop, RunState, Requeue, Interrupt, Spare, Finish], Field(discriminator="action")]
)


# -- checkpoints ---------------------------------------------------------------------------
class CheckCheckpoint(_Step):
    action: Literal["check"]
    job: Name
    newer_than: float | None = None  # a spot interruption: only a checkpoint after it counts
    since: Since | None = None  # the preemption it checks for (`Stop.since`)


class RequestCheckpoint(_Step):
    action: Literal["request"]
    job: Name
    reason: Reason = "preemption"
    execution: Name | None = None  # the workflow's execution: a retried step answers with its first attempt's request


class NoteCheckpoint(_Step):
    """After a stop, before the requeue: note the newest checkpoint S3 holds (one written
    during the grace may not have reached the table through its S3 event yet)."""

    action: Literal["note"]
    job: Name


CheckpointStep = TypeAdapter(
    Annotated[Union[CheckCheckpoint, RequestCheckpoint, NoteCheckpoint], Field(discriminator="action")]
)


# -- scheduling ----------------------------------------------------------------------------
class PlanCycle(_Step):
    pool: Name
    owner: Name  # the schedule execution's name: the lease owner
    cycle: int = Field(default=0, ge=0)


class FinishCycle(_Step):
    pool: Name
    owner: Name
    cycle: int | None = Field(default=None, ge=0)  # the failed cycle: its admissions are released


def step_input(model: type[BaseModel] | TypeAdapter) -> Callable:
    """Parse the handler's event into `model` with Powertools' parser (after the Powertools
    decorators above it have seen the raw event), raising InvalidStepInput if it does not fit.

    A call that got no answer once botocore's own retries ran out (no connection, a read
    timeout, a connection closed mid-answer) fails the step as `ServiceUnavailable`, which
    every workflow retries: under its own name (`ReadTimeoutError`...) no Retry matched it,
    and one network blip failed the whole workflow. The step may have been applied (the
    answer was what got lost): each step is idempotent for that."""

    def decorate(handler: Callable) -> Callable:
        @functools.wraps(handler)
        def wrapper(event: Any, context: Any) -> Any:
            try:
                step = parse(event=event, model=model)
            except ValidationError as e:
                raise InvalidStepInput(f"{handler.__name__}: {_summary(e)}") from e
            try:
                return handler(step, context)
            except NO_ANSWER as e:
                raise ServiceUnavailable(f"{handler.__name__}: no answer: {type(e).__name__}: {e}") from e

        return wrapper

    return decorate


def _summary(error: ValidationError) -> str:
    """One line per problem: `location: message` (the input itself is not echoed)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in error.errors()[:10])
