"""A run's token: what tells the controller's run of a job's incarnation from a copy of its
name and tags, which anyone who may create runs can make."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from preemptor.adapters.runners import bears_run_token, controller_tags, is_own_run, may_be_own_run
from preemptor.core.jobs import JobRecord, new_run_secret

_NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)


def _job(name: str = "train", secret: str | None = "ab" * 32, incarnation: int = 1) -> JobRecord:
    return JobRecord(
        name=name, team="vision", priority=100, pool="p5", service="sagemaker", gpus=8, request={},
        checkpoint_s3_uri=f"s3://b/vision/{name}", submitted_at=0.0, incarnation=incarnation, run_secret=secret,
    )


@given(name=_NAMES, incarnation=st.integers(1, 1000), other=st.integers(1, 1000))
def test_a_runs_token_is_its_incarnations_alone(name: str, incarnation: int, other: int):
    job = _job(name, incarnation=max(incarnation, other))
    token = job.run_token_of(incarnation)
    # Then it is 128 bits in hex, the same each time it is derived
    assert token is not None and len(token) == 32 and int(token, 16) >= 0 and token == job.run_token_of(incarnation)
    # And it vouches for that incarnation only
    tags = {"preemptor:run-token": token}
    assert bears_run_token(tags, job, incarnation)
    assert bears_run_token(tags, job, other) is (other == incarnation)


def test_a_token_depends_on_the_secret_and_the_job():
    job = _job()
    assert job.run_token_of(1) != _job(secret="cd" * 32).run_token_of(1)
    assert job.run_token_of(1) != _job(name="train-2").run_token_of(1)
    # And every job draws a secret of its own
    assert len({new_run_secret() for _ in range(100)}) == 100 and len(new_run_secret()) == 64


def test_the_controllers_tags_carry_the_token_and_a_copy_without_it_is_not_the_run():
    job = _job(incarnation=3)
    tags = controller_tags(job, "preemptor")
    assert tags["preemptor:run-token"] == job.run_token_of(3)
    assert is_own_run(tags, job, "preemptor") and may_be_own_run(tags, job, "train-r3")
    # (a tag may hold any letters: one that is no hex is a mismatch, never an error)
    forgeries = ({}, {"preemptor:run-token": ""}, {"preemptor:run-token": job.run_token_of(2)}, {"preemptor:run-token": "0" * 32},
                 {"preemptor:run-token": "é" * 32})
    for forged in forgeries:
        copy = {**tags, **forged} if forged else {k: v for k, v in tags.items() if k != "preemptor:run-token"}
        assert not is_own_run(copy, job, "preemptor") and not may_be_own_run(copy, job, "train-r3")


def test_a_job_stored_before_tokens_is_known_by_name_and_tags_as_before():
    job = _job(secret=None, incarnation=2)
    tags = controller_tags(job, "preemptor")
    assert job.run_token_of(2) is None and "preemptor:run-token" not in tags
    assert is_own_run(tags, job, "preemptor") and may_be_own_run(tags, job, "train-r2")
