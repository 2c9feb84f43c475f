"""Domain exceptions. Adapters translate AWS errors into these; workflows Catch them by name."""


class PreemptorError(Exception):
    """Base of every error the controller raises on purpose."""


class ConflictError(PreemptorError):
    """A conditional write lost a race: the item was not in the state the caller expected."""


class CapacityExhausted(ConflictError):
    """Reserving capacity would oversubscribe the pool."""


class JobNotFound(PreemptorError):
    """No such job in the jobs table."""


class ServiceJobNotFound(PreemptorError):
    """SageMaker or Batch does not know the run."""


class ServiceRejected(PreemptorError):
    """SageMaker or Batch refused a request (validation, quota, capacity)."""


class Throttled(PreemptorError):
    """AWS throttled the call; retry with backoff."""


class CheckpointNotReady(PreemptorError):
    """The victim has no fresh checkpoint yet."""
