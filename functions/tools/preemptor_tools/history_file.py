"""The decision-log file read by `preemptor explain JOB --snapshot FILE --history FILE`.

A JSON list of the entries the controller writes for a job (`preemptor history JOB --json`
prints them): `at` (seconds, any origin), `kind` (`preemption-started`, `requeued`, ...),
`reason`, `detail`, and `extra` with the figures `explain` reads. Other keys are kept. What
`explain` formats is checked here, so a wrong file is refused in one line naming the entry
and the field, not a traceback from the middle of a sentence.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Extra(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    preemptor: str | None = None
    rule: str | None = None
    checkpoint_age_s: float | None = Field(default=None, ge=0)
    lost_gpu_seconds: float | None = Field(default=None, ge=0)
    fresh_checkpoint: bool | None = None


class _Entry(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    at: float | None = None
    kind: str
    reason: str | None = None  # `preemptor history --json` gives null for a missing one
    detail: str | None = None
    extra: _Extra = Field(default_factory=_Extra)


_LOG = TypeAdapter(list[_Entry])


def load_history(document: Any) -> list[dict]:
    """Validate a decision log; returns its entries as the store gives them: only the keys
    the file has (`explain` tells a figure the log lacks from one it gives as null).
    Raises pydantic.ValidationError."""
    return [entry.model_dump(exclude_unset=True) for entry in _LOG.validate_python(document)]


__all__ = ["load_history"]
