"""botocore: one data loader for every session the local runtime makes.

Each boto3 session builds its own loader, which reads and parses the service models (JSON,
megabytes for SageMaker) again; the emulated stack makes two sessions (its own, and the
functions' `wiring.deps()`) every time it starts, ~0.2 s of model parsing each. While the
patches are installed, sessions share one loader per data path, as the clients of one
session already share theirs; the models are the same files, read once.
"""

from __future__ import annotations

import functools

import botocore.session

from ._core import replace

_ORIGINAL_CREATE_LOADER = botocore.session.create_loader


@functools.lru_cache(maxsize=4)
def _shared_loader(search_path_string: str | None = None):
    return _ORIGINAL_CREATE_LOADER(search_path_string)


def patch() -> None:
    replace(botocore.session, "create_loader", _shared_loader)
