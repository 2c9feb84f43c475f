"""Against a deployed stack. Skipped unless these are set (and AWS credentials are usable):

  PREEMPTOR_E2E_STACK    the stack name given to `sam deploy`
  PREEMPTOR_E2E_REQUEST  a job request JSON (like events/preemptor/job-submitted-*.json's
                         detail) for a small job in one of the stack's pools

The test submits the job through EventBridge, waits until the controller has recorded it,
asks why it waits or runs, then cancels it and checks that the cancellation is recorded.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

STACK = os.environ.get("PREEMPTOR_E2E_STACK")
REQUEST = os.environ.get("PREEMPTOR_E2E_REQUEST")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not (STACK and REQUEST), reason="set PREEMPTOR_E2E_STACK and PREEMPTOR_E2E_REQUEST"),
]


def _outputs(cfn, stack: str) -> dict[str, str]:
    described = cfn.describe_stacks(StackName=stack)["Stacks"][0]
    return {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}


def _wait_for(predicate, timeout_s: float = 300, every_s: float = 5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("timed out waiting for the deployed controller")


def test_submit_record_and_cancel_on_a_deployed_stack():
    import boto3

    from preemptor.adapters.store import JobsStore

    outputs = _outputs(boto3.client("cloudformation"), STACK)
    store = JobsStore(outputs["JobsTableName"], boto3.client("dynamodb"))
    request = json.loads(Path(REQUEST).read_text())
    request["name"] = f"e2e-{uuid.uuid4().hex[:8]}"
    events = boto3.client("events")

    # When the job is submitted
    events.put_events(Entries=[{"Source": "preemptor", "DetailType": "Job Submitted", "Detail": json.dumps(request)}])
    # Then the controller records it with a decision
    record = _wait_for(lambda: store.get(request["name"]))
    assert record.team == request["team"]
    assert _wait_for(lambda: store.history(request["name"]))

    # When it is cancelled, then the controller records the cancellation
    events.put_events(
        Entries=[{"Source": "preemptor", "DetailType": "Job Cancelled", "Detail": json.dumps({"name": request["name"]})}]
    )
    kinds = _wait_for(
        lambda: {e["kind"] for e in store.history(request["name"])} & {"cancelled", "cancel-requested"}, timeout_s=600
    )
    assert kinds
