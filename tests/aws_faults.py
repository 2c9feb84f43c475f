"""Make the emulated AWS say no: a botocore `before-call` hook that answers one operation
with a real error shape (code, message, HTTP status, extra response members) instead of
sending it to moto.

botocore turns a response returned by a `before-call` handler into the call's result, and
raises `ClientError` for an error response exactly as it does for one from the wire.
"""

from __future__ import annotations

import json
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from botocore.awsrequest import AWSResponse


def error_response(code: str, message: str = "", status: int = 400, **extra: Any) -> dict:
    """An error response as AWS sends it, request id included."""
    return {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"RequestId": str(uuid.uuid4()), "HTTPStatusCode": status, "RetryAttempts": 0},
        **extra,
    }


THROTTLING = {
    "dynamodb": error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400),
    "sagemaker": error_response("ThrottlingException", "Rate exceeded", 400),
    "batch": error_response("TooManyRequestsException", "Too Many Requests", 429),
    "s3": error_response("SlowDown", "Please reduce your request rate.", 503),
}


def transaction_conflict(items: int) -> dict:
    """TransactWriteItems cancelled because a concurrent transaction touched an item."""
    reasons = [{"Code": "None"} for _ in range(items)]
    reasons[0] = {"Code": "TransactionConflict", "Message": "Transaction is ongoing for the item"}
    return error_response(
        "TransactionCanceledException",
        f"Transaction cancelled, please refer cancellation reasons for specific reasons [{', '.join(r['Code'] for r in reasons)}]",
        400,
        CancellationReasons=reasons,
    )


SAGEMAKER_NOT_FOUND = error_response("ValidationException", "Requested resource not found.", 400)


def is_lease_taking(params: dict) -> bool:
    """Whether an UpdateItem call takes a pool's scheduling lease (`JobsStore.acquire_lease`)."""
    return "lease_owner = :o" in params.get("UpdateExpression", "")


def is_job_insert(params: dict) -> bool:
    """Whether a TransactWriteItems call inserts a submitted job (with its `submitted` line):
    the predicate for faults on the intake's insert."""
    first = (params.get("TransactItems") or [{}])[0]
    return first.get("Put", {}).get("Item", {}).get("sk", {}).get("S") == "JOB"


def _call_params(request: dict) -> dict:
    """The call's parameters: the decoded body of a JSON-protocol request (DynamoDB,
    SageMaker, Batch), else the request's URL and query (S3)."""
    body = request.get("body")
    if isinstance(body, (bytes, str)) and body[:1] in (b"{", "{"):
        return json.loads(body)
    return {"url": request.get("url", ""), "query": request.get("query_string", {})}


@contextmanager
def aws_says_no(
    client: Any,
    operation: str,
    response: dict | Callable[[dict], dict | None],
    times: int | None = None,
) -> Iterator[list[dict]]:
    """Answer `operation` (e.g. "TransactWriteItems") of `client` with `response`.

    `response` may be a function of the call's parameters returning an error response, or
    None to let that call through. `times` limits how many calls are refused. Yields the
    parameters of each refused call.
    """
    refused: list[dict] = []
    service = client.meta.service_model.service_id.hyphenize()
    event = f"before-call.{service}.{operation}"

    def handler(params: dict, **_: Any):
        if times is not None and len(refused) >= times:
            return None
        body = response(_call_params(params)) if callable(response) else response
        if body is None:
            return None
        refused.append(params)
        status = body["ResponseMetadata"]["HTTPStatusCode"]
        return AWSResponse("https://emulated", status, {}, None), body

    client.meta.events.register(event, handler, unique_id=f"aws-says-no-{id(handler)}")
    try:
        yield refused
    finally:
        client.meta.events.unregister(event, unique_id=f"aws-says-no-{id(handler)}")


@contextmanager
def answer_lost(
    client: Any, operation: str, times: int = 1, when: Callable[[dict], bool] | None = None
) -> Iterator[list[int]]:
    """The call of `operation` reaches AWS and is applied, but its answer is lost on the way
    back (a connection reset): botocore sends the same request again, and the second answer
    is the one the caller sees. `when`: only calls whose parameters it accepts. Yields the
    attempt numbers that were resent."""
    resent: list[int] = []
    service = client.meta.service_model.service_id.hyphenize()
    event = f"needs-retry.{service}.{operation}"
    unique = f"answer-lost-{id(resent)}"

    def handler(attempts: int, request_dict: dict | None = None, **_: Any) -> float | None:
        if len(resent) >= times or attempts > 1:
            return None
        if when is not None and not when(_call_params(request_dict or {})):
            return None
        resent.append(attempts)
        return 0.0  # retry at once: the applied call is sent again

    client.meta.events.register(event, handler, unique_id=unique)
    try:
        yield resent
    finally:
        client.meta.events.unregister(event, unique_id=unique)


@contextmanager
def answer_lost_after_applied(
    client: Any, operation: str, times: int = 1, when: Callable[[dict], bool] | None = None
) -> Iterator[list[int]]:
    """The call of `operation` reaches AWS and is applied, and then no answer comes back
    before the read timeout, after every retry the client makes: the caller sees botocore's
    `ReadTimeoutError`, not knowing the call was applied. `when`: only calls whose
    parameters it accepts. Yields the list of calls lost (its length)."""
    from botocore.exceptions import ReadTimeoutError

    lost: list[int] = []
    service = client.meta.service_model.service_id.hyphenize()
    unique = f"answer-lost-after-applied-{id(lost)}"

    def remember(params: dict, context: dict, **_: Any) -> None:
        context[unique] = _call_params(params)

    def handler(context: dict, **_: Any) -> None:
        if len(lost) < times and (when is None or when(context.get(unique, {}))):
            lost.append(1)
            raise ReadTimeoutError(endpoint_url=f"https://{service}.emulated")

    # (unique ids are the emitter's, not the event's: one per handler)
    client.meta.events.register_first(f"before-call.{service}.{operation}", remember, unique_id=f"{unique}-params")
    client.meta.events.register(f"after-call.{service}.{operation}", handler, unique_id=unique)
    try:
        yield lost
    finally:
        client.meta.events.unregister(f"before-call.{service}.{operation}", unique_id=f"{unique}-params")
        client.meta.events.unregister(f"after-call.{service}.{operation}", unique_id=unique)


@contextmanager
def notice_publish_fails(client: Any, kind: str, how: str) -> Iterator[list[dict]]:
    """Every SNS Publish (on the alerts' `client`) of a notice of `kind` fails: SNS throttles
    it (`throttled`), or no answer comes once botocore's retries ran out (`no-answer`), or
    the function dies as it publishes (`died`: the Lambda runtime is killed, and whoever
    invoked it retries). Yields the calls that failed."""
    from botocore.exceptions import ConnectTimeoutError

    from preemptor_tools.local.moto_patches import LambdaRuntimeExited

    failed: list[dict] = []
    unique = f"notice-publish-fails-{id(failed)}"

    def handler(params: dict, **_: Any) -> tuple[AWSResponse, dict] | None:
        body = params.get("body") or {}
        if not any(k.endswith(".StringValue") and v == kind for k, v in body.items()):
            return None
        failed.append(body)
        if how == "died":
            raise LambdaRuntimeExited("RequestId: emulated Error: Runtime exited with error: signal: killed")
        if how == "no-answer":
            raise ConnectTimeoutError(endpoint_url="https://sns.emulated")
        return AWSResponse("https://sns.emulated", 400, {}, None), error_response("Throttling", "Rate exceeded", 400)

    client.meta.events.register("before-call.sns.Publish", handler, unique_id=unique)
    try:
        yield failed
    finally:
        client.meta.events.unregister("before-call.sns.Publish", unique_id=unique)
