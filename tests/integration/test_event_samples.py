"""Every event sample in events/ through the intake handler of one emulated stack."""

from __future__ import annotations

import json

import pytest
from emulation import emulation
from eventfiles import all_event_files, relative_name

from preemptor.handlers import intake
from preemptor_tools.local.stack import LambdaContext

CONTEXT = LambdaContext(function_name="intake")


@pytest.fixture(scope="module")
def env():
    with emulation() as e:
        yield e


@pytest.mark.parametrize("path", all_event_files(), ids=relative_name)
def test_every_sample_gets_an_answer_and_never_an_exception(env, path):
    # Given any sample AWS published (malformed ones included), delivered raw to the intake
    raw = path.read_text()
    # When the handler runs
    result = intake.handler(raw if path.parent.name == "malformed" else json.loads(raw), CONTEXT)
    env.stack.drain()
    # Then it answers with an outcome and a reason instead of raising into a retry storm
    assert result["outcome"] in {"accepted", "ignored", "rejected", "duplicate"}
    assert result["reason"]
    if path.parent.name == "malformed":
        assert result["outcome"] == "rejected" and result["reason"].startswith("invalid-json")


