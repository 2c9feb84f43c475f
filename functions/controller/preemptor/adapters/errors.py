"""The one place where AWS errors (`botocore` `ClientError`) become the domain's errors.

Classes, by what the caller should do:
- retryable (`Throttled`, `ServiceUnavailable`, `TransactionConflict`): the same call may
  succeed later; botocore's `standard` retry mode already retried it a few times, the
  workflow's Retry (backoff with jitter) takes over;
- conflict (`ConflictError`): a condition failed; the caller re-reads and judges;
- not found (`ServiceJobNotFound`), already exists (`ResourceInUse`: the caller checks
  whose it is);
- terminal (`ServiceRejected`, `AccessDenied`): the same request will fail again.

Codes, not messages, decide. The one exception is SageMaker `DescribeTrainingJob` on a
missing job, which answers `ValidationException` with "Requested resource not found." and
no other code or status to tell it from a malformed request (aws/aws-sdk#165); there the
message is read, and only there.
"""

from __future__ import annotations

import re
from enum import StrEnum

from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError

from ..core.errors import (
    AccessDenied,
    ConflictError,
    PreemptorError,
    ServiceJobNotFound,
    ServiceRejected,
    ServiceUnavailable,
    Throttled,
    TransactionConflict,
)

# A call that got no answer once botocore's retries ran out: no connection, a connect or
# read timeout, a connection closed mid-answer. Not an AWS error (no code): the request may
# or may not have been applied. Retryable, as `ServiceUnavailable`.
NO_ANSWER: tuple[type[Exception], ...] = (BotoConnectionError, HTTPClientError)

THROTTLING_CODES: frozenset[str] = frozenset(
    {
        # Throttling codes of the services the controller calls (botocore's standard retry
        # mode retries the same set; a test keeps the two lists in step).
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",  # Batch, Lambda
        "ProvisionedThroughputExceededException",  # DynamoDB
        "RequestLimitExceeded",  # DynamoDB account limit, EC2
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",  # S3
        "PriorRequestNotComplete",
        "EC2ThrottledException",
        "TransactionInProgressException",  # DynamoDB: the same client token is still running
    }
)
SERVER_FAULT_CODES: frozenset[str] = frozenset(
    {
        "InternalServerError",  # DynamoDB
        "InternalFailure",  # any service (common error)
        "InternalError",  # S3
        "ServiceUnavailable",  # any service (common error), S3
        "ServiceUnavailableException",
        "InternalServerException",
        "ServerException",  # Batch
        "RequestTimeout",
        "RequestTimeoutException",
    }
)
ACCESS_DENIED_CODES: frozenset[str] = frozenset(
    {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnrecognizedClientException"}
)
NOT_FOUND_CODES: frozenset[str] = frozenset(
    {"ResourceNotFound", "ResourceNotFoundException", "NoSuchKey", "NoSuchBucket", "ExecutionDoesNotExist", "NotFound"}
)
ALREADY_EXISTS_CODES: frozenset[str] = frozenset({"ResourceInUse", "ExecutionAlreadyExists", "ResourceInUseException"})
CONDITION_FAILED = "ConditionalCheckFailedException"
TRANSACTION_CANCELED = "TransactionCanceledException"

# The exact message SageMaker gives for a missing training job (see the module docstring),
# and the wording of the emulated SageMaker the local stack and the tests run on.
_SAGEMAKER_NOT_FOUND = re.compile(r"^(Requested resource not found|Could not find training job)")


class ErrorKind(StrEnum):
    THROTTLED = "throttled"
    UNAVAILABLE = "unavailable"
    TRANSACTION_CONFLICT = "transaction-conflict"
    CONDITION_FAILED = "condition-failed"
    NOT_FOUND = "not-found"
    ALREADY_EXISTS = "already-exists"
    ACCESS_DENIED = "access-denied"
    REJECTED = "rejected"

    @property
    def retryable(self) -> bool:
        return self in (ErrorKind.THROTTLED, ErrorKind.UNAVAILABLE, ErrorKind.TRANSACTION_CONFLICT)


def code_of(error: ClientError) -> str:
    return error.response.get("Error", {}).get("Code", "") or ""


def message_of(error: ClientError) -> str:
    return error.response.get("Error", {}).get("Message", "") or ""


def status_of(error: ClientError) -> int:
    return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def cancellation_reasons(error: ClientError) -> tuple[str, ...]:
    """Per-item reason codes of a cancelled DynamoDB transaction, in request order."""
    return tuple((r or {}).get("Code", "None") for r in error.response.get("CancellationReasons", []) or [])


def classify(error: ClientError) -> ErrorKind:
    """What kind of failure `error` is (codes first, HTTP status as the fallback for 5xx)."""
    code = code_of(error)
    if code == TRANSACTION_CANCELED:
        reasons = set(cancellation_reasons(error))
        if "ConditionalCheckFailed" in reasons:
            return ErrorKind.CONDITION_FAILED  # judged by a re-read, whatever else happened
        if reasons & {"ThrottlingError", "ProvisionedThroughputExceeded"}:
            return ErrorKind.THROTTLED
        if "TransactionConflict" in reasons:
            return ErrorKind.TRANSACTION_CONFLICT
        return ErrorKind.REJECTED  # ValidationError, ItemCollectionSizeLimitExceeded
    if code == CONDITION_FAILED:
        return ErrorKind.CONDITION_FAILED
    if code in THROTTLING_CODES:
        return ErrorKind.THROTTLED
    if code in SERVER_FAULT_CODES or status_of(error) >= 500:
        return ErrorKind.UNAVAILABLE
    if code in ACCESS_DENIED_CODES:
        return ErrorKind.ACCESS_DENIED
    if code in NOT_FOUND_CODES:
        return ErrorKind.NOT_FOUND
    if code in ALREADY_EXISTS_CODES:
        return ErrorKind.ALREADY_EXISTS
    return ErrorKind.REJECTED


def is_sagemaker_not_found(error: ClientError) -> bool:
    """SageMaker's "no such training job": `ValidationException` + its message (see above)."""
    return code_of(error) == "ValidationException" and bool(_SAGEMAKER_NOT_FOUND.match(message_of(error)))


def translate(error: ClientError, what: str) -> PreemptorError:
    """The domain error for `error` raised by the call described by `what`.

    ALREADY_EXISTS is translated to `ServiceRejected` (code `ResourceInUse`...): callers
    that can tell their own resource from someone else's check before calling this.
    """
    kind = classify(error)
    code = code_of(error)
    detail = f"{what}: {code}"
    if kind is ErrorKind.THROTTLED:
        return Throttled(detail)
    if kind is ErrorKind.UNAVAILABLE:
        return ServiceUnavailable(detail)
    if kind is ErrorKind.TRANSACTION_CONFLICT:
        return TransactionConflict(f"{detail} {list(cancellation_reasons(error))}")
    if kind is ErrorKind.CONDITION_FAILED:
        return ConflictError(f"{what}: condition failed {list(cancellation_reasons(error))}".rstrip(" []"), cancellation_reasons(error))
    if kind is ErrorKind.NOT_FOUND:
        return ServiceJobNotFound(detail)
    if kind is ErrorKind.ACCESS_DENIED:
        return AccessDenied(f"{detail}: {message_of(error)}", code)
    return ServiceRejected(f"{detail}: {message_of(error)}", code)
