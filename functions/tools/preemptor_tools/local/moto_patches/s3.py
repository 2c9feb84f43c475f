"""S3: object times from the simulated clock.

Gap filled: moto stamps objects (`LastModified`) with the wall clock; the checkpoint protocol
compares them with simulated time. The fleet pins the clock to a transition's own time while
it writes a checkpoint, so `LastModified` is the moment the checkpoint was written.
"""

from __future__ import annotations

from moto.s3 import models as s3_models

from ._core import replace, sim_utcnow


def patch() -> None:
    replace(s3_models, "utcnow", sim_utcnow)
