"""Where the training runs, and what the controller told it through the environment.

| variable | meaning | default |
|---|---|---|
| `PREEMPTOR_CHECKPOINT_S3_URI` | the job's checkpoint location (set by the controller on Batch jobs) | none |
| `PREEMPTOR_STOP_GRACE_S` | seconds between SIGTERM and SIGKILL | 120 on SageMaker, 30 elsewhere |
| `PREEMPTOR_REQUEST_POLL_S` | seconds between two reads of the request marker in S3 | 30 |

SageMaker's StopTrainingJob allows about 120 s after SIGTERM; Batch's TerminateJob the
container's stop timeout, 30 s by default.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Mapping

log = logging.getLogger("preemptor_training")

ENV_S3_URI = "PREEMPTOR_CHECKPOINT_S3_URI"
ENV_GRACE = "PREEMPTOR_STOP_GRACE_S"
ENV_POLL = "PREEMPTOR_REQUEST_POLL_S"
SAGEMAKER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
# Present in every SageMaker training container (the hosts of the job).
SAGEMAKER_RESOURCE_CONFIG = Path("/opt/ml/input/config/resourceconfig.json")


class Platform(str, Enum):
    SAGEMAKER = "sagemaker"
    BATCH = "batch"
    OTHER = "other"


GRACE_S = {Platform.SAGEMAKER: 120.0, Platform.BATCH: 30.0, Platform.OTHER: 30.0}
POLL_S = 30.0


def detect_platform(environ: Mapping[str, str], sagemaker_marker: Path = SAGEMAKER_RESOURCE_CONFIG) -> Platform:
    """SageMaker when its resource config is mounted (or `TRAINING_JOB_NAME` is set), Batch
    when `AWS_BATCH_JOB_ID` is set, else other."""
    if environ.get("TRAINING_JOB_NAME") or sagemaker_marker.exists():
        return Platform.SAGEMAKER
    if environ.get("AWS_BATCH_JOB_ID"):
        return Platform.BATCH
    return Platform.OTHER


@dataclass(frozen=True, slots=True)
class Settings:
    platform: Platform
    grace_s: float
    poll_s: float
    s3_uri: str | None
    upload: bool  # mirror checkpoints to s3_uri ourselves (SageMaker syncs its own directory)


def settings_from(environ: Mapping[str, str], platform: Platform) -> Settings:
    """Settings from the environment; a value that is not a positive number is logged and
    the default used (a typo in a variable must not stop a training job)."""
    s3_uri = environ.get(ENV_S3_URI, "").strip() or None
    return Settings(
        platform=platform,
        grace_s=_positive(environ, ENV_GRACE, GRACE_S[platform]),
        poll_s=_positive(environ, ENV_POLL, POLL_S),
        s3_uri=s3_uri,
        upload=s3_uri is not None and platform is not Platform.SAGEMAKER,
    )


def _positive(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        log.warning("%s=%r is not a positive number; using %s", name, raw, default, extra={"reason": "bad-env"})
        return default
    return value


def process_started_at() -> float | None:
    """When this process started (epoch seconds, to about a second), None if unknown.

    Linux gives the start in clock ticks after boot (`/proc/self/stat`, field 22) and the
    boot time (`/proc/stat`, `btime`).
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
