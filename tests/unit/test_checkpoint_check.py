"""The checkpoint freshness rule of the preemption workflow (service/actions.check_checkpoint)."""

from __future__ import annotations

import pytest

from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState
from preemptor.core.policy import Policy
from preemptor.service.actions import check_checkpoint

NOW = 100_000.0


class FakeStore:
    def __init__(self, record: JobRecord):
        self.record, self.logged, self.noted = record, [], []

    def require(self, name):
        return self.record

    def note_checkpoint(self, name, at):
        self.noted.append(at)

    def log(self, job, at, kind, reason, detail="", **extra):
        self.logged.append(kind)


class FakeCheckpoints:
    def __init__(self, newest):
        self._newest = newest

    def newest(self, uri):
        return self._newest


def _record(started_at: float) -> JobRecord:
    return JobRecord(
        name="victim", team="t", priority=50, pool="p5", service="sagemaker", gpus=8, request={},
        checkpoint_s3_uri="s3://b/victim", submitted_at=0.0, status=JobState.PREEMPTING, started_at=started_at,
    )


@pytest.mark.parametrize(
    "newest, started_at, newer_than, fresh",
    [
        pytest.param(NOW - 300, NOW - 3600, None, True, id="recent-checkpoint"),
        pytest.param(NOW - 1800, NOW - 3600, None, False, id="old-checkpoint"),
        pytest.param(NOW - 7200, NOW - 120, None, True, id="relaunched-from-old-checkpoint-has-little-at-risk"),
        pytest.param(None, NOW - 120, None, False, id="no-checkpoint-yet-asks-for-one"),
        pytest.param(NOW - 10, NOW - 3600, NOW - 60, True, id="spot-newer-than-warning"),
        pytest.param(NOW - 300, NOW - 3600, NOW - 60, False, id="spot-older-than-warning"),
    ],
)
def test_freshness(newest, started_at, newer_than, fresh):
    # Given a victim with its newest checkpoint and run start (default limit: 900 s)
    store = FakeStore(_record(started_at))
    # When the workflow checks it
    result = check_checkpoint(
        store=store, checkpoints=FakeCheckpoints(newest), policy=Policy(), job="victim", now=NOW, newer_than=newer_than
    )
    # Then it is fresh exactly when a stop would lose no more than the limit allows
    assert result["fresh"] is fresh
    assert ("checkpoint-confirmed" in store.logged) is fresh
