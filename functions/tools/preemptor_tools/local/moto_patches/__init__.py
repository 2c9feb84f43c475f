"""The patches of moto the local runtime needs, pinned to one moto release, split by service.

moto runs the product's workflows, Lambda handlers, S3, SageMaker and Batch in-process, but
lacks a few behaviours the controller depends on. Each module fills the gaps of one service,
and each patch says which gap it fills:

- `lambda_`: run our handler in-process instead of moto's canned Docker-free answer.
- `send`: the handler through which every attempt botocore sends reaches moto answers only
  the emulated AWS running now (a handler invoked by an earlier one is refused), and lets a
  hostile world answer attempts in moto's place.
- `stepfunctions`: Wait states and Retry intervals in simulated time; parameter and response
  casing of the service integrations the ASL uses (`states:startExecution`, `sns:publish`);
  each definition's program and each JSONPath built once, not in every execution (a cost).
- `sagemaker`: training jobs that live (InProgress until the fleet ends them) and
  StopTrainingJob, which moto lacks.
- `batch`: jobs that stay SUBMITTED for the fleet instead of finishing at submission, and
  `Job.terminate` handed to the fleet.
- `s3`: `LastModified` from the simulated clock.
- `dynamodb`: each item operation atomic (moto applies a conditional write without a lock,
  and runs each Step Functions execution in its own thread: concurrent cycles lost updates);
  a transaction's `ClientRequestToken` honoured for 10 minutes, as DynamoDB does (moto
  ignores it: a resend after a lost answer was cancelled by its own first writes); the item
  operations' answers written without moto's per-member lookups, a transaction
  backed up by the items it names rather than by copies of whole tables, and each update
  expression parsed, each condition lexed, once per string (costs, not gaps).
- `servicequotas`: ListServiceQuotas for SageMaker (moto lists VPC's defaults only), its
  applied values the simulated fleet's quotas, paged as the service pages them.
- `events`: every event PutEvents accepted handed to listeners (the local stack routes what
  arrives over HTTP to the intake; moto cannot invoke Lambda targets).
- `sdk` (botocore, not moto): the sessions share one loader of the service models, the
  clients of a service one set of methods, one view of its model and one tree of its
  endpoint rules, and the emitters one event-alias cache and one answer per handler to
  "does it take keyword arguments"; requests
  of services signed with plain SigV4 carry the signature's scope, not its hash (moto checks
  none); a client's User-Agent is built once per set of features, and moto's list of a
  response class's actions once per class. Costs, not gaps.

Features no state machine of the product uses (`.sync` polling, task tokens, task timeouts,
Timestamp waits, `aws-sdk:*` error names) are not patched: on the emulated stack they behave
as moto makes them.

`install(clock, lambda_invoker)` patches them in; `uninstall()` restores moto. Both are
idempotent. Use them inside `mock_aws(config=MOTO_CONFIG)`: the config selects moto's
Docker-free Lambda and Batch backends and turns on ASL execution.

What the caller must create in moto:
- Lambda: a function per handler (`create_function` with any zip and a `Handler` string);
  invoking it calls `lambda_invoker(function_name, event)` instead of running the zip (an
  asynchronous invocation, `async_invoker`, and answers 202 whatever the handler does).
- Batch: a compute environment, a job queue and a job definition. Array jobs are not simulated.
- SageMaker: nothing (training jobs need only the usual CreateTrainingJob request).
"""

from __future__ import annotations

from typing import Any

import moto

PINNED_MOTO_VERSION = "5.2.5"
if moto.__version__ != PINNED_MOTO_VERSION:
    raise RuntimeError(
        f"preemptor_tools.local.moto_patches is written against moto {PINNED_MOTO_VERSION} internals, "
        f"found moto {moto.__version__}. Install moto=={PINNED_MOTO_VERSION} "
        "(see requirements-dev.txt) or re-check every hook in this package before bumping the pin."
    )

from preemptor_tools.local.clock import SimClock  # noqa: E402

from . import batch, dynamodb, events, lambda_, s3, sagemaker, sdk, send, servicequotas, stepfunctions  # noqa: E402
from ._core import _STATE, LambdaInvoker, quiet_moto_logging, restore_all  # noqa: E402
from .batch import get_batch_job, on_batch_job_submitted, on_batch_job_terminate_requested, set_batch_job_status  # noqa: E402
from .events import on_events_put  # noqa: E402
from .lambda_ import LambdaRuntimeExited  # noqa: E402
from .send import StaleInvocation, around_send  # noqa: E402
from .sagemaker import (  # noqa: E402
    check_training_job_create,
    get_training_job,
    on_training_job_created,
    on_training_job_stop_requested,
    set_training_job_status,
)
from .servicequotas import quotas_listed  # noqa: E402
from .stepfunctions import on_lambda_task_returned  # noqa: E402

# The mock_aws config the patches are written for.
MOTO_CONFIG: dict[str, Any] = {
    "stepfunctions": {"execute_state_machine": True},
    "lambda": {"use_docker": False},
    "batch": {"use_docker": False},
}

__all__ = [
    "MOTO_CONFIG",
    "PINNED_MOTO_VERSION",
    "LambdaInvoker",
    "LambdaRuntimeExited",
    "StaleInvocation",
    "around_send",
    "check_training_job_create",
    "install",
    "uninstall",
    "get_batch_job",
    "get_training_job",
    "on_batch_job_submitted",
    "on_batch_job_terminate_requested",
    "on_events_put",
    "on_lambda_task_returned",
    "on_training_job_created",
    "on_training_job_stop_requested",
    "quotas_listed",
    "set_batch_job_status",
    "set_training_job_status",
]


def install(clock: SimClock, lambda_invoker: LambdaInvoker, async_invoker: LambdaInvoker | None = None) -> None:
    """Patch moto for the local runtime. Calling it again only swaps the clock and invokers
    (`async_invoker`: what runs an `InvocationType=Event` invocation; without one, such an
    invocation is an error)."""
    with _STATE.lock:
        _STATE.clock = clock
        _STATE.lambda_invoker = lambda_invoker
        _STATE.async_invoker = async_invoker
        if _STATE.installed:
            return
        lambda_.patch()
        stepfunctions.patch()
        sagemaker.patch()
        batch.patch()
        s3.patch()
        dynamodb.patch()
        events.patch()
        servicequotas.patch()
        sdk.patch()
        send.patch()
        quiet_moto_logging()


def uninstall() -> None:
    """Restore moto as it was before `install` and forget listeners, clock and invoker."""
    with _STATE.lock:
        restore_all()
        stepfunctions.forget_task_clients()
