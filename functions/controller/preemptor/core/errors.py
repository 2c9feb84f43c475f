"""Domain exceptions. Adapters translate AWS errors into these (`adapters/errors.py`, one
place); workflows Retry and Catch them by class name (Step Functions sees a Lambda
function's exception under its class name, not its base classes: `RETRYABLE_ERRORS` lists
the names every Task's Retry must carry)."""

from __future__ import annotations


class PreemptorError(Exception):
    """Base of every error the controller raises on purpose."""


# -- retryable: the same call may succeed later (backoff with jitter) ---------------------
class Retryable(PreemptorError):
    """Transient: retrying the same call later may succeed."""


class Throttled(Retryable):
    """AWS throttled the call."""


class ServiceUnavailable(Retryable):
    """AWS answered with a server-side fault (HTTP 5xx: InternalServerError, ServiceUnavailable...)."""


class TransactionConflict(Retryable):
    """DynamoDB cancelled a transaction because a concurrent one touched the same items.

    Nothing was written; it is never "already done" and is retried.
    """


class EventInProgress(Retryable):
    """Another handling of the same event holds its claim and may still finish it (or may
    have died): this delivery fails, so Lambda's retry comes back after the claim ends,
    instead of the event being dropped as a duplicate of one that never completed."""


# -- conflicts: the stored state is not what the caller expected --------------------------
class ConflictError(PreemptorError):
    """A conditional write lost a race: the item was not in the state the caller expected.
    The caller re-reads and judges; it is not retried blindly.

    `reasons`: per-item cancellation reasons when a transaction was cancelled (in order).
    """

    def __init__(self, message: str = "", reasons: tuple[str, ...] = ()):
        super().__init__(message)
        self.reasons = tuple(reasons)


class CapacityExhausted(ConflictError):
    """Reserving capacity would oversubscribe the pool."""


class LeaseLost(ConflictError):
    """The scheduling cycle no longer holds its pool's lease (its workflow gave the cycle up
    and released it, or it expired and another cycle took it): it may admit and mark nothing."""


class PoolDrained(LeaseLost):
    """The pool was drained after the scheduling cycle read it: the cycle may admit and mark
    nothing more (`preemptor drain`)."""


# -- not found ----------------------------------------------------------------------------
class JobNotFound(PreemptorError):
    """No such job in the jobs table."""


class ServiceJobNotFound(PreemptorError):
    """SageMaker or Batch does not know the run."""


# -- terminal: retrying the same request cannot succeed -----------------------------------
class ServiceRejected(PreemptorError):
    """SageMaker, Batch or S3 refused a request for good (validation, quota, access denied).

    `code` is the AWS error code (a stable string, used as the reason).
    """

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class AccessDenied(ServiceRejected):
    """IAM denied the call (e.g. a stop of a run the controller may not stop)."""


class RunNameTaken(ServiceRejected):
    """The run's name is in use by a run that is not this job's incarnation (SageMaker
    training job names are unique per account and region, for good)."""


class CheckpointLocationUnavailable(PreemptorError):
    """A job's checkpoint location cannot be read or written (no such bucket, access
    denied, an invalid URI). Per job: the caller records it and carries on with others."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class InvalidStepInput(PreemptorError):
    """A workflow step's input does not match its schema (a bug in the state machine, or a
    hand-started execution): never retried."""


RETRYABLE_ERRORS: tuple[str, ...] = (Throttled.__name__, ServiceUnavailable.__name__, TransactionConflict.__name__)
"""Error names a workflow Task retries with backoff and jitter (besides the Lambda service's own)."""
