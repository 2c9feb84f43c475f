"""Job traces in the generic format `job_id,submit_s,duration_s,gpus,team,priority`.

One row per job: `submit_s` is seconds since the trace's origin, `duration_s` the job's
total run time (its work, without queueing or restarts), `gpus` how many it holds while it
runs. `../shared/data/traces/philly/philly-jobs.csv` (82,247 jobs from Microsoft's Philly
cluster, Jeon et al., USENIX ATC'19, CC BY 4.0) is the reference trace.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("job_id", "submit_s", "duration_s", "gpus", "team", "priority")
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S


class TraceError(ValueError):
    """The trace file is not in the generic format (with the line that is wrong)."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    job_id: str
    submit_s: float
    duration_s: float
    gpus: int
    team: str
    priority: int


MAX_TRACE_S = 100 * 365 * 86400.0  # a century: beyond any cluster's trace


def load_trace(path: Path | str, *, start_s: float | None = None, end_s: float | None = None) -> list[TraceJob]:
    """Read a trace, keeping the jobs submitted in [start_s, end_s), sorted by (submit_s, job_id).

    Raises TraceError naming the line for a missing column, a non-number, a negative
    time, a job of zero GPUs or a duplicated job id.
    """
    path = Path(path)
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    # UTF-8, with or without the byte-order mark some spreadsheets write (it would glue
    # itself to the first column's name).
    with path.open(newline="", encoding="utf-8-sig") as f:
        try:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(COLUMNS)}")
            for line, row in enumerate(reader, start=2):
                job = _parse_row(row, path, line)
                if job.job_id in seen:
                    raise TraceError(f"{path}:{line}: duplicate job_id {job.job_id!r}")
                seen.add(job.job_id)
                if start_s is not None and job.submit_s < start_s:
                    continue
                if end_s is not None and job.submit_s >= end_s:
                    continue
                jobs.append(job)
        except UnicodeDecodeError as e:
            raise TraceError(f"{path}: not UTF-8 text (byte {e.start} of a read: {e.reason})") from None
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return jobs


def _parse_row(row: dict, path: Path, line: int) -> TraceJob:
    if None in row:  # DictReader's key for the fields beyond the header's
        raise TraceError(f"{path}:{line}: {len(row) - 1 + len(row[None])} fields, the header has {len(row) - 1}: a comma inside a field must be quoted")

    def field(column: str, kind: type):
        text = row[column]
        if text is None:  # the row ends before this column
            raise TraceError(f"{path}:{line}: {column} is missing (the row has fewer columns than the header)")
        try:
            return kind(text)
        except ValueError:
            raise TraceError(f"{path}:{line}: {column} must be {'a whole number' if kind is int else 'a number'}, got {text.strip()!r}") from None

    job = TraceJob(
        job_id=field("job_id", str).strip(),
        submit_s=field("submit_s", float),
        duration_s=field("duration_s", float),
        gpus=field("gpus", int),
        team=field("team", str).strip(),
        priority=field("priority", int),
    )
    if not job.job_id:
        raise TraceError(f"{path}:{line}: empty job_id")
    for column in ("submit_s", "duration_s"):
        value = getattr(job, column)
        # A NaN or infinite time would never let the replay end; nor would one of 1e19 s,
        # whose every step is lost in the float's rounding.
        if not math.isfinite(value) or not 0 <= value <= MAX_TRACE_S:
            raise TraceError(f"{path}:{line}: {column} must be finite seconds in 0..{MAX_TRACE_S:.0f}, got {row[column].strip()!r}")
    if job.gpus <= 0:
        raise TraceError(f"{path}:{line}: job {job.job_id} asks for {job.gpus} GPUs")
    return job
