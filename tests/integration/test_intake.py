"""Intake on the emulated stack, fed with the real event samples in events/."""

from __future__ import annotations

import calendar
import copy
import json
import time

from emulation import G5, P5, batch_queues, emulation, team_training_job
from eventfiles import all_event_files, load_raw

import pytest

from aws_faults import THROTTLING, answer_lost, aws_says_no, error_response, is_job_insert
from preemptor.adapters.store import JobsStore
from preemptor.config import JobDefinition, PoolConfig
from preemptor.core.errors import EventInProgress, Throttled
from preemptor.core.jobs import JobRecord
from preemptor.core.model import JobState
from preemptor.handlers import intake
from preemptor_tools.local.stack import LambdaContext

CONTEXT = LambdaContext(function_name="intake")
ADOPTABLE_SAGEMAKER = "sagemaker/constructed__sagemaker-training-job-state-change__inprogress-tagged.json"
ADOPTABLE_BATCH = "batch/constructed__batch-job-state-change__running-tagged.json"
G5 = PoolConfig(name="g5", service="batch", gpus=32)


def _dies_after_the_insert(env, event: dict) -> None:
    """A handling of `event` that inserts its adopted run, then fails on the run's checkpoint
    alias (throttled through every retry): the event goes back for a redelivery."""
    throttled = error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400)
    alias = lambda params: throttled if params.get("Item", {}).get("pk", {}).get("S", "").startswith("CKPT") else None  # noqa: E731
    with aws_says_no(env.store.client, "PutItem", alias), pytest.raises(Throttled):
        intake.handler(event, CONTEXT)


def _sample(relpath: str, **changes) -> dict:
    """A sample from events/ with top-level changes (e.g. source=...)."""
    event = json.loads(load_raw(relpath))
    event.update(changes)
    return event


def _cancel(job: str, team: str) -> dict:
    event = _sample("preemptor/job-cancelled.json", source=f"preemptor.{team}", id=f"cancel-{job}-{team}")
    event["detail"]["name"] = job
    return event


def test_rejections_are_counted_by_the_metric_alone(monkeypatch):
    # Given the intake's metrics recorded as they are added
    added: list[tuple[str, float]] = []
    monkeypatch.setattr(intake.metrics, "add_metric", lambda name, unit, value: added.append((name, value)))
    with emulation() as env:
        # When the malformed samples arrive
        for path in all_event_files():
            if path.parent.name == "malformed":
                intake.handler(path.read_text(), CONTEXT)
        # Then each is counted once by the RejectedEvents metric, and no counter item is
        # written to the jobs table (a hot key under exactly that storm)
        assert sum(v for n, v in added if n == "RejectedEvents") == 7
        assert env.store.client.get_item(TableName=env.store.table, Key={"pk": {"S": "STATS"}, "sk": {"S": "STATS"}}).get("Item") is None


def test_unmanaged_training_job_is_ignored():
    with emulation() as env:
        event = json.loads(load_raw("sagemaker/amazon-sagemaker-developer-g__sagemaker-training-job-state-change__8a0a8aaf.json"))
        result = env.put(event).results[0]
        assert result["outcome"] == "ignored" and "not managed" in result["reason"]


def test_tagged_job_started_outside_is_adopted_once_and_is_no_victim_without_the_managed_tag():
    with emulation() as env:
        event = _sample(ADOPTABLE_SAGEMAKER)
        # When its InProgress event arrives (twice: EventBridge delivers at least once)
        first = env.put(event).results[0]
        second = env.put(event).results[0]
        # Then it is adopted once and counted against the pool, in full (3 x 8 GPUs)
        assert first["outcome"] == "accepted" and first["reason"] == "adopted"
        assert second["outcome"] == "duplicate"
        job = env.job(first["job"])
        assert job.adopted and job.status is JobState.RUNNING and job.priority == 500
        assert job.gpus == 24 and env.store.pool("p5")["used_gpus"] == 24
        # And, without preemptor:managed=true (IAM lets the controller stop only such runs),
        # it may hold capacity but never be chosen as a victim
        assert job.stoppable is False and job.as_running().stoppable is False


def test_an_adopted_run_tagged_managed_may_be_a_victim():
    with emulation() as env:
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["Tags"]["preemptor:managed"] = "true"
        result = env.put(event).results[0]
        assert result["reason"] == "adopted" and env.job(result["job"]).stoppable is True


@pytest.mark.parametrize(
    "service, tag, value, priority, gpus",
    [
        pytest.param("batch", "preemptor:gpus", "eight", 50, 8, id="gpus-eight-is-not-raised"),
        pytest.param("batch", "preemptor:gpus", "-512", 50, 8, id="negative-gpus-never-lower-usage"),
        pytest.param("batch", "preemptor:gpus", "0", 50, 8, id="zero-gpus"),
        pytest.param("batch", "preemptor:checkpoint", "/tmp/x", 50, 8, id="checkpoint-not-s3"),
        pytest.param("sagemaker", "preemptor:priority", "urgent", 50, 24, id="unknown-tier-at-the-lowest"),
        pytest.param("sagemaker", "preemptor:gpus", "eight", 500, 24, id="training-job-counted-by-its-instances-whatever-its-gpus-tag"),
    ],
)
def test_an_unusable_adoption_tag_is_read_as_absent_and_the_run_counted(monkeypatch, service, tag, value, priority, gpus):
    # Given the intake's metrics recorded as they are added
    added: list[str] = []
    monkeypatch.setattr(intake.metrics, "add_metric", lambda name, unit, value: added.append(name))
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    with emulation(**({"pools": [G5]} if service == "batch" else {})) as env:
        # Given a run started outside the controller with one unusable preemptor tag (before:
        # "eight" raised ValueError into retries and the DLQ; "-512" set used_gpus to -512
        # and the next cycle admitted three 64-GPU jobs into a 64-GPU pool; then each was
        # refused, its GPUs in use and never counted)
        event = _sample(ADOPTABLE_BATCH if service == "batch" else ADOPTABLE_SAGEMAKER)
        event["detail"]["tags" if service == "batch" else "Tags"][tag] = value
        # When its event reaches the intake
        result = intake.handler(event, CONTEXT)
        # Then it is adopted and counted (a Batch job stating no GPUs: one instance's), that
        # tag read as absent (an unknown priority: the lowest tier), and the refusal said
        # on its line and counted
        assert (result["outcome"], result["reason"], result["refused"]) == ("accepted", "adopted", "bad-tag")
        job = env.job(result["job"])
        assert (job.priority, job.gpus) == (priority, gpus) and env.store.pool(job.pool)["used_gpus"] == gpus
        assert job.checkpoint_s3_uri == "" or tag != "preemptor:checkpoint"
        [line] = [e for e in env.store.history(job.name) if e["kind"] == "adopted"]
        assert f"tag {tag}: " in line["detail"] and "(bad-tag: read as absent)" in line["detail"]
        assert "RejectedEvents" not in added and ("RefusedClaims", {"Reason": "bad-tag"}) in emitted


@pytest.mark.parametrize(
    "tags, said",
    [
        ({"preemptor:team": "Research Team"}, "counted as (unattributed) at the lowest tier"),
        ({"preemptor:priority": "critical"}, "its priority tag claims 1000 (above-team-ceiling"),
    ],
    ids=["team-names-no-team", "priority-above-its-ceiling"],
)
def test_an_adopted_runs_line_says_why_it_is_not_stoppable_with_its_other_claims(tags, said):
    with emulation(pools=[G5], policy={"teams": {"research": {"max_priority": "high"}}}) as env:
        # Given a team's Batch run without the managed tag, whose team or priority tag claims
        # what the platform does not grant
        event = _sample(ADOPTABLE_BATCH)
        event["detail"]["tags"].pop("preemptor:managed", None)
        event["detail"]["tags"].update(tags)
        result = env.put(event).results[0]
        # Then its line says both: why it is not stoppable (before: lost under the refused claim)
        [line] = [e for e in env.store.history(result["job"]) if e["kind"] == "adopted"]
        assert "not stoppable (no preemptor:managed=true tag)" in line["detail"] and said in line["detail"]
        assert env.job(result["job"]).stoppable is False


@pytest.mark.parametrize(
    "service, change, counted, said, refused",
    [
        # Only its tag says so: bounded by what the pool holds, the claim refused
        pytest.param("batch", {"tag": "64"}, 32,
                     "its preemptor:gpus tag claims 64 GPUs, more than pool 'g5' holds (bad-tag): counted as the pool's 32", "bad-tag",
                     id="batch-tag"),
        # The service says so: counted in full, the pool over-full while it runs
        pytest.param("batch", {"required": "48"}, 48,
                     "it holds 48 GPUs, more than pool 'g5' is configured with (32): the pool is over-full while it runs", None,
                     id="batch-container-requirement"),
        pytest.param("sagemaker", {"instances": 10}, 80,
                     "it holds 80 GPUs, more than pool 'p5' is configured with (64): the pool is over-full while it runs", None,
                     id="training-job-instances"),
    ],
)
@pytest.mark.parametrize("first_handling_died", [False, True], ids=["", "redelivered-after-a-handling-died"])
def test_a_run_holding_more_gpus_than_its_pool_is_configured_with_is_counted(monkeypatch, service, change, counted, said, refused, first_handling_died):
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    with emulation(pools=[G5] if service == "batch" else [P5]) as env:
        # Given a team's run holding, or claiming, more GPUs than its pool is configured with
        event = _sample(ADOPTABLE_BATCH if service == "batch" else ADOPTABLE_SAGEMAKER)
        if "tag" in change:
            event["detail"]["tags"]["preemptor:gpus"] = change["tag"]
        if "required" in change:
            event["detail"]["container"]["resourceRequirements"].append({"type": "GPU", "value": change["required"]})
        if "instances" in change:
            event["detail"]["ResourceConfig"]["InstanceCount"] = change["instances"]
        if service == "batch":  # a checkpoint location, whose alias the first handling dies on
            event["detail"]["tags"]["preemptor:checkpoint"] = "s3://team-bucket/research/event-test"
        if first_handling_died:  # its first handling inserted the run, then failed on its checkpoint alias
            _dies_after_the_insert(env, event)
            emitted.clear()
        # When its event reaches the intake
        result = intake.handler(event, CONTEXT)
        # Then it is adopted and counted (before: refused, bad-tag, and its GPUs not counted)
        assert (result["outcome"], result["reason"], result.get("refused")) == ("accepted", "adopted", refused)
        job = env.job(result["job"])
        assert job.gpus == counted and env.store.pool(job.pool)["used_gpus"] == counted
        [line] = [e for e in env.store.history(job.name) if e["kind"] == "adopted"]
        assert said in line["detail"]
        assert [d["Reason"] for n, d in emitted if n == "RefusedClaims"] == ([refused] if refused else [])


def test_an_adopted_batch_job_counts_the_gpus_its_tag_states():
    with emulation(pools=[G5]) as env:
        result = env.put(_sample(ADOPTABLE_BATCH)).results[0]
        assert result["reason"] == "adopted"
        assert env.job("event-test").gpus == 8 and env.store.pool("g5")["used_gpus"] == 8


def test_a_teams_runs_of_one_name_are_each_adopted_and_counted_under_names_of_their_own():
    from preemptor.service.intake import adoption_names

    with emulation(pools=[G5]) as env:
        # Given a job of the controller's named "event-test", and three Batch runs a team
        # submitted under that name (Batch's names are not unique), 8 GPUs each
        batch_queues(env)
        env.submit(name="event-test", team="a", priority=200, pool="g5", gpus=8, duration=30000)
        assert env.job("event-test").status is JobState.RUNNING
        runs = []
        for n in range(3):
            event = _sample(ADOPTABLE_BATCH, id=f"run-{n}")
            event["detail"]["jobId"] = f"4c7599ae-0a82-49aa-ba5a-4727fcce14a{n}"
            runs.append(event)
        # When their RUNNING events arrive (the first twice: at least once)
        results = [env.put(e).results[0] for e in (*runs, runs[0])]
        # Then each is adopted under a name of its own, and counted (before: each refused as a
        # duplicate of the job's name, 24 GPUs in use the controller never counted)
        names = [adoption_names("event-test", "batch", r["detail"]["jobId"])[1] for r in runs]
        assert [(r["reason"], r["job"]) for r in results[:3]] == [("adopted", n) for n in names]
        assert results[3]["outcome"] == "duplicate"
        assert len(set(names)) == 3 and all(len(n) <= 56 for n in names)
        assert env.store.pool("g5")["used_gpus"] == 8 + 24
        assert {env.job(n).run_id for n in names} == {r["detail"]["jobId"] for r in runs}
        assert env.job("event-test").status is JobState.RUNNING and not env.job("event-test").adopted


@pytest.mark.parametrize(
    "service, run_name",
    [
        pytest.param("batch", "llama_finetune_v2", id="batch-underscores"),
        pytest.param("batch", "x" * 128, id="batch-128-characters"),
        pytest.param("sagemaker", "a" * 63, id="sagemaker-63-characters"),
    ],
)
def test_a_run_whose_name_cannot_name_a_job_is_adopted_and_counted_under_one_of_its_own(service, run_name):
    from preemptor.service.intake import adoption_names

    with emulation(**({"pools": [G5]} if service == "batch" else {})) as env:
        # Given a team's run named as its service allows, but no job may be
        if service == "batch":
            event = _sample(ADOPTABLE_BATCH)
            event["detail"]["jobName"], run_id, pool, gpus = run_name, event["detail"]["jobId"], "g5", 8
        else:
            event = _sample(ADOPTABLE_SAGEMAKER)
            event["detail"]["TrainingJobName"] = run_id = run_name
            pool, gpus = "p5", 24
        # When its event arrives
        result = env.put(event).results[0]
        # Then it is adopted and counted (before: refused, "bad-tag: run name", its GPUs in
        # use and never counted), under a name of its own, its run's name kept
        [name] = adoption_names(run_name, service, run_id)
        assert (result["outcome"], result["reason"], result["job"]) == ("accepted", "adopted", name)
        job = env.job(name)
        assert (job.run_id, job.run_name, job.gpus) == (run_id, run_name, gpus)
        assert env.store.pool(pool)["used_gpus"] == gpus
        assert len(name) <= 56 and name.startswith(run_name.replace("_", "-")[:20])
        [line] = [e for e in env.store.history(name) if e["kind"] == "adopted"]
        assert f"{service} run {run_name} (its name is another job's, or names none)" in line["detail"]


def test_an_adopted_training_job_checkpointing_to_a_bucket_root_is_counted_without_a_checkpoint():
    with emulation() as env:
        # Given a training job tagged for adoption whose CheckpointConfig is a bucket's root
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["CheckpointConfig"] = {"S3Uri": "s3://team-bucket"}
        # When its event arrives, Then it is adopted and counted, with no checkpoint the
        # controller would have to confirm under a whole bucket (and no crash after the write)
        result = env.put(event).results[0]
        assert result["reason"] == "adopted"
        job = env.job(result["job"])
        assert job.checkpoint_s3_uri == "" and env.store.pool("p5")["used_gpus"] == job.gpus
        [adopted] = [e for e in env.store.history(job.name) if e["kind"] == "adopted"]
        assert "no usable checkpoint location" in adopted["detail"]


def test_an_adopted_run_claiming_another_jobs_checkpoint_location_is_counted_but_not_credited_with_it():
    with emulation(pools=[P5, G5]) as env:
        # Given the research team's submitted job, checkpointing to its own location
        env.put(_sample("preemptor/job-submitted-sagemaker.json"))
        owned = env.job("llm-pretrain-7b").checkpoint_s3_uri
        # When a Batch run tagged for adoption claims that same location as its own
        event = _sample(ADOPTABLE_BATCH)
        event["detail"]["tags"]["preemptor:checkpoint"] = owned
        assert env.put(event).results[0]["reason"] == "adopted"
        # Then its GPUs count, but the location stays the job's: its checkpoint writes are
        # credited to the job, and the adopted run has no checkpoint of its own to be trusted
        adopted = env.job("event-test")
        assert adopted.checkpoint_s3_uri == "" and env.store.pool("g5")["used_gpus"] == 8
        assert "not trusted as its own" in [e for e in env.store.history("event-test") if e["kind"] == "adopted"][0]["detail"]
        bucket, key = owned.removeprefix("s3://").split("/", 1)
        assert env.store.find_checkpoint_owner(bucket, f"{key.rstrip('/')}/step-000000000001/manifest.json") == "llm-pretrain-7b"


def _blind_first_location_read(monkeypatch) -> None:
    """The next check of who holds a checkpoint location reads before a concurrent writer's
    alias lands: it sees no one."""
    real = JobsStore.checkpoint_location_user
    blind = [True]

    def read(self, uri, job):
        if blind.pop() if blind else False:
            return None
        return real(self, uri, job)

    monkeypatch.setattr(JobsStore, "checkpoint_location_user", read)


def test_a_submission_taking_its_location_just_before_an_adopted_run_claims_it_keeps_it(monkeypatch):
    with emulation() as env:
        env.put(_sample("preemptor/job-submitted-sagemaker.json"))
        location = env.job("llm-pretrain-7b").checkpoint_s3_uri
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["CheckpointConfig"]["S3Uri"] = location
        # When a run naming that location is adopted, and its look at the location misses the
        # submission's alias (written, as far as it can tell, after it looked)
        _blind_first_location_read(monkeypatch)
        assert env.put(event).results[0]["reason"] == "adopted"
        # Then its claim is refused by what is stored: the location stays the job's
        run = env.job(event["detail"]["TrainingJobName"])
        assert run.checkpoint_s3_uri == "" and env.store.pool("p5")["used_gpus"] >= run.gpus
        assert env.store.checkpoint_location_user(location, "someone-else") == "llm-pretrain-7b"
        assert "checkpoint-location-lost" in env.kinds(run.name)


@pytest.mark.parametrize(
    "prefix, trusted",
    [
        pytest.param("research/kmeans-1", True, id="a-job-shaped-location-is-its-own"),
        pytest.param("research", False, id="the-teams-root-lists-every-jobs-checkpoints"),
        pytest.param("research/llm-pretrain-7b/step-000000000001", False, id="inside-a-jobs-location"),
        pytest.param("_output/llm-pretrain-7b", False, id="the-controllers-training-output"),
        pytest.param(None, True, id="another-bucket-is-the-runs-business"),
    ],
)
def test_an_adopted_runs_location_in_the_checkpoint_bucket_is_trusted_only_where_it_lists_no_other_jobs_work(prefix, trusted):
    with emulation() as env:
        bucket = env.stack.parameters["CheckpointBucketName"]
        location = f"s3://{bucket}/{prefix}" if prefix else "s3://team-scratch/research/sweeps"
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["CheckpointConfig"]["S3Uri"] = location
        assert env.put(event).results[0]["reason"] == "adopted"
        run = env.job(event["detail"]["TrainingJobName"])
        # Counted either way; credited with a location only where it is the run's alone
        assert env.store.pool("p5")["used_gpus"] == run.gpus
        assert run.checkpoint_s3_uri == (location if trusted else "")
        [adopted] = [e for e in env.store.history(run.name) if e["kind"] == "adopted"]
        assert ("not trusted as its own" in adopted["detail"]) is not trusted


def _adopted_run_on_the_submissions_location(env) -> tuple[str, str]:
    """An adopted run whose own CheckpointConfig names the location the sample submission
    (job-submitted-sagemaker.json, not yet sent) will be given; returns (run, location)."""
    event = _sample(ADOPTABLE_SAGEMAKER)
    location = f"s3://{env.stack.parameters['CheckpointBucketName']}/research/llm-pretrain-7b"
    event["detail"]["CheckpointConfig"]["S3Uri"] = location
    assert env.put(event).results[0]["reason"] == "adopted"
    return event["detail"]["TrainingJobName"], location


def test_a_submission_takes_its_checkpoint_location_back_from_an_adopted_run_that_claimed_it_first():
    with emulation() as env:
        # Given an adopted run whose own CheckpointConfig names the location a job not yet
        # submitted will be given, and which has been credited with a checkpoint there
        run, location = _adopted_run_on_the_submissions_location(env)
        squatter = env.job(run)
        assert squatter.checkpoint_s3_uri == location
        env.store.transition(squatter, squatter.with_changes(last_checkpoint_at=env.clock.now()), [squatter.status])
        # When that job is submitted
        env.put(_sample("preemptor/job-submitted-sagemaker.json"))
        # Then the location is the submission's: its checkpoints are credited to it alone, and
        # the run keeps its GPUs counted with no checkpoint the controller would trust
        assert env.job("llm-pretrain-7b").checkpoint_s3_uri == location
        squatter = env.job(run)
        assert squatter.checkpoint_s3_uri == "" and squatter.last_checkpoint_at is None
        assert squatter.status is JobState.RUNNING and env.store.pool("p5")["used_gpus"] >= squatter.gpus
        bucket, key = location.removeprefix("s3://").split("/", 1)
        assert env.store.find_checkpoint_owner(bucket, f"{key}/step-000000000001/manifest.json") == "llm-pretrain-7b"
        assert "checkpoint-location-lost" in env.kinds(run)
        assert "checkpoint-location-taken" in env.kinds("llm-pretrain-7b")


def test_the_redelivery_of_a_submission_whose_handling_died_after_its_alias_takes_the_location_back():
    throttled = error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400)
    with emulation() as env:
        # Given an adopted run that claimed the location a job not yet submitted will be given
        run, location = _adopted_run_on_the_submissions_location(env)
        # And a handling of that job's submission that wrote the location's alias, then
        # failed reading the run it replaced
        submission = _sample("preemptor/job-submitted-sagemaker.json")
        squatter_read = lambda params: throttled if params.get("Key", {}).get("pk", {}).get("S") == f"JOB#{run}" else None  # noqa: E731
        with aws_says_no(env.store.client, "GetItem", squatter_read) as refused:
            with pytest.raises(Throttled):
                env.put(submission)
        assert refused and env.job(run).checkpoint_s3_uri == location
        # When Lambda redelivers the submission
        assert env.put(submission).results[0]["outcome"] == "accepted"
        # Then the run is stripped of the location all the same, as if nothing had failed
        squatter = env.job(run)
        assert squatter.checkpoint_s3_uri == "" and squatter.last_checkpoint_at is None
        assert env.kinds(run).count("checkpoint-location-lost") == 1
        assert env.kinds("llm-pretrain-7b").count("checkpoint-location-taken") == 1
        # And a third delivery is known as handled and changes nothing
        assert env.put(submission).results[0]["reason"].endswith("already handled")
        assert env.kinds(run).count("checkpoint-location-lost") == 1


@pytest.mark.parametrize(
    "tag, required, counted",
    [
        pytest.param("1", "8", 8, id="a-tag-understating-the-requirement-is-not-believed"),
        pytest.param(None, "4", 4, id="no-tag-the-requirement-counts"),
        pytest.param("6", None, 6, id="no-requirement-the-tag-counts"),
        pytest.param("2", "eight", 2, id="a-malformed-requirement-is-not-counted"),
    ],
)
def test_an_adopted_batch_job_counts_the_gpus_batch_says_it_requires(tag, required, counted):
    event = _sample(ADOPTABLE_BATCH)
    event["detail"]["tags"].pop("preemptor:gpus", None)
    if tag is not None:
        event["detail"]["tags"]["preemptor:gpus"] = tag
    if required is not None:
        event["detail"]["container"]["resourceRequirements"].append({"type": "GPU", "value": required})
    with emulation(pools=[G5]) as env:
        assert env.put(event).results[0]["reason"] == "adopted"
        # Then the pool counts what the container holds, whatever the tag says
        assert env.job("event-test").gpus == counted and env.store.pool("g5")["used_gpus"] == counted


@pytest.mark.parametrize("policy", [{}, {"teams": {"research": {}}}], ids=["teams-unlisted", "teams-listed"])
@pytest.mark.parametrize("team", ["Research Team\n", "r" * 300])
def test_a_run_whose_team_tag_names_no_team_is_counted_as_no_ones_at_the_lowest_tier(monkeypatch, policy, team):
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    with emulation(policy=policy) as env:
        # Given a run on the pool's instances (3 x 8 GPUs) whose team tag is malformed, and
        # whose priority tag claims high
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["Tags"]["preemptor:team"] = team
        # When its InProgress event reaches the intake
        result = intake.handler(event, CONTEXT)
        # Then it is adopted and counted (before: refused bad-tag, its GPUs in use and not
        # counted), as no team's, at the lowest tier: no team's grant, quota or share is its
        assert (result["outcome"], result["reason"], result["refused"]) == ("accepted", "adopted", "bad-tag")
        job = env.job(result["job"])
        assert (job.team, job.priority, job.gpus) == ("(unattributed)", 50, 24) and env.store.pool("p5")["used_gpus"] == 24
        [line] = [e for e in env.store.history(job.name) if e["kind"] == "adopted"]
        assert "counted as (unattributed) at the lowest tier, not its priority tag's 500" in line["detail"]
        assert "tag preemptor:team: team must be" in line["detail"] and len(line["detail"]) < 1000
        assert ("RefusedClaims", {"Reason": "bad-tag"}) in emitted


def test_an_adoption_and_its_line_are_written_together_whatever_befalls_the_handling_after():
    with emulation() as env:
        # Given a team's run whose adoption dies after the insert (its checkpoint location's
        # alias throttled through every retry), and whose event is then dead-lettered
        event = _sample(ADOPTABLE_SAGEMAKER)
        _dies_after_the_insert(env, event)
        # Then the run is counted and its decision log says so (before: the line was written
        # after the insert, and lost with the handling: knobs seeds batch 0, 34 and 36)
        name = event["detail"]["TrainingJobName"]
        assert env.job(name).adopted and env.store.pool("p5")["used_gpus"] == 24
        assert env.kinds(name) == ["adopted"]
        # And a redelivery completes the adoption without a second line
        assert env.put(event).results[0]["reason"] == "adopted"
        assert env.kinds(name) == ["adopted"]


@pytest.mark.parametrize(
    "tags, policy, granted, refused",
    [
        pytest.param({"preemptor:priority": "critical"}, {"teams": {"research": {"max_priority": "low"}}}, 50,
                     "above-team-ceiling", id="priority-above-team-ceiling-counted-at-the-ceiling"),
        pytest.param({"preemptor:priority": "critical"}, {"teams": {"production": {}}}, 50,
                     "unknown-team", id="unlisted-team-counted-at-the-lowest-tier"),
    ],
)
@pytest.mark.parametrize("first_handling_died", [False, True], ids=["", "redelivered-after-a-handling-died"])
def test_a_run_claiming_more_than_its_team_is_granted_is_counted_at_the_grant(monkeypatch, tags, policy, granted, refused, first_handling_died):
    # Given the intake's per-reason metrics recorded as they are emitted
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    with emulation(policy=policy) as env:
        # Given a run its team launched on the pool's instance type (3 x 8 GPUs), whose tags
        # claim a priority the policy does not grant its team (before: refused, and its GPUs
        # were not counted: the controller filled the pool around it, 96 GPUs in a 64-GPU pool)
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["Tags"].update(tags)
        if first_handling_died:  # its first handling inserted the run, then failed on its checkpoint alias
            _dies_after_the_insert(env, event)
        # When its InProgress event reaches the intake
        result = intake.handler(event, CONTEXT)
        # Then it is adopted and its GPUs counted, at the priority the platform grants
        assert (result["outcome"], result["reason"], result["refused"]) == ("accepted", "adopted", refused)
        job = env.job(result["job"])
        assert job.priority == granted and env.store.pool("p5")["used_gpus"] == 24
        # And the refused claim is said on its line and counted by its reason
        line = env.store.history(job.name)[-1]
        assert line["kind"] == "adopted" and f"at priority {granted}" in line["detail"]
        assert f"its priority tag claims 1000 ({refused}: " in line["detail"]
        assert ("RefusedClaims", {"Reason": refused}) in emitted


def test_a_run_of_an_instance_type_no_pool_has_is_not_adopted_into_the_pool_its_tag_names():
    with emulation() as env:
        # Given a run its team launched on an instance type of no pool, tagged for pool p5
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["ResourceConfig"]["InstanceType"] = "ml.g5.48xlarge"
        # Then it is refused: it holds none of p5's GPUs
        result = env.put(event).results[0]
        assert result["outcome"] == "rejected" and result["reason"].startswith("unknown-pool: sagemaker run ")
        assert result["reason"].endswith(" runs on ml.g5.48xlarge, which no sagemaker pool has")
        assert (env.store.pool("p5") or {}).get("used_gpus", 0) == 0


def _pool_tag(tags: dict, pool: str | None) -> None:
    """The run's `preemptor:pool` tag set to `pool`, or removed (None)."""
    tags.pop("preemptor:pool", None)
    if pool is not None:
        tags["preemptor:pool"] = pool


P4 = PoolConfig(name="p4", service="sagemaker", instance_type="ml.p4d.24xlarge", instances=4, gpus_per_instance=8,
                fallback_instance_types=("ml.p4de.24xlarge",))
P5_SPOT = PoolConfig(name="p5-spot", service="sagemaker", instance_type="ml.p5.48xlarge", instances=4, gpus_per_instance=8, capacity_type="spot")


@pytest.mark.parametrize(
    "instance_type, spot, tag, counted_in, refused",
    [
        # Before: refused (bad-demand: not pool p5's instance type), its 24 GPUs not counted
        pytest.param("ml.p4d.24xlarge", None, None, "p4", None, id="untagged-on-the-second-pools-type"),
        pytest.param("ml.p4d.24xlarge", None, "p5", "p4", "wrong-pool", id="tagged-p5-on-p4s-type"),
        pytest.param("ml.p4de.24xlarge", None, "p4", "p4", None, id="on-the-pools-fallback-type"),
        # Before: refused (unknown-pool), not counted
        pytest.param("ml.p5.48xlarge", None, "nowhere", "p5", "wrong-pool", id="tagged-with-no-pool"),
        # Before: counted where the tag said, whichever way it was bought
        pytest.param("ml.p5.48xlarge", True, "p5", "p5-spot", "wrong-pool", id="on-spot-tagged-for-the-on-demand-pool"),
        pytest.param("ml.p5.48xlarge", False, "p5-spot", "p5", "wrong-pool", id="on-demand-tagged-for-the-spot-pool"),
        pytest.param("ml.p5.48xlarge", True, None, "p5-spot", None, id="on-spot-untagged"),
        # EventBridge's event states no flag: a maximum wait, accepted only on spot, says it
        pytest.param("ml.p5.48xlarge", "max-wait", "p5", "p5-spot", "wrong-pool", id="on-spot-by-its-max-wait-tagged-p5"),
        # Neither, and SageMaker no longer knows the job: either way, the tag picks among its type
        pytest.param("ml.p5.48xlarge", None, "p5-spot", "p5-spot", None, id="either-way-the-tag-picks-among-its-type"),
    ],
)
def test_a_teams_training_job_is_counted_in_the_pool_whose_instances_it_runs_on_whatever_its_pool_tag_says(
    monkeypatch, instance_type, spot, tag, counted_in, refused
):
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    types = {"TrainingInstanceTypes": "ml.p5.48xlarge,ml.p4d.24xlarge,ml.p4de.24xlarge"}
    with emulation(pools=[P5, P4, P5_SPOT], parameters=types) as env:
        # Given a run its team launched (3 instances) on `instance_type`, tagged with `tag`
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["ResourceConfig"]["InstanceType"] = instance_type
        if spot == "max-wait":
            event["detail"]["StoppingCondition"] = {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
        elif spot is not None:
            event["detail"]["EnableManagedSpotTraining"] = spot
        _pool_tag(event["detail"]["Tags"], tag)
        # When its InProgress event reaches the intake
        result = intake.handler(event, CONTEXT)
        # Then it is adopted and its 24 GPUs counted in the pool it runs on, and nowhere else
        assert (result["outcome"], result["reason"], result.get("refused")) == ("accepted", "adopted", refused)
        job = env.job(result["job"])
        assert job.pool == counted_in and job.gpus == 24
        assert {p: (env.store.pool(p) or {}).get("used_gpus", 0) for p in ("p5", "p4", "p5-spot")} == {
            p: 24 if p == counted_in else 0 for p in ("p5", "p4", "p5-spot")
        }
        # And a pool tag it does not run on is said on its line and counted as refused
        [line] = [e for e in env.store.history(job.name) if e["kind"] == "adopted"]
        said = f"its pool tag names {tag!r}, and it runs on pool {counted_in!r}'s capacity (wrong-pool: not believed)"
        assert (said in line["detail"]) == (refused is not None)
        assert (("RefusedClaims", {"Reason": "wrong-pool"}) in emitted) == (refused is not None)


@pytest.mark.parametrize(
    "spot, tag, counted_in, refused",
    [
        # Before: counted where its tag said (either way was believed), the other pool
        # oversubscribed by its 24 GPUs
        pytest.param(False, "p5-spot", "p5", "wrong-pool", id="on-demand-tagged-for-the-spot-pool"),
        pytest.param(True, "p5", "p5-spot", "wrong-pool", id="on-spot-tagged-for-the-on-demand-pool"),
        pytest.param(True, None, "p5-spot", None, id="on-spot-untagged"),
    ],
)
def test_a_teams_training_job_whose_event_does_not_say_how_it_is_bought_is_counted_in_the_pool_bought_its_way(spot, tag, counted_in, refused):
    from iam_policy import StackPolicies

    with emulation(pools=[P5, P5_SPOT]) as env:
        # Given two pools of ml.p5.48xlarge, one on demand and one on spot, and a team's
        # training job on that type whose event, as EventBridge's, states neither
        # EnableManagedSpotTraining nor a maximum wait
        team_training_job(env, "research-run", instances=3, spot=spot)
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["TrainingJobName"] = "research-run"
        _pool_tag(event["detail"]["Tags"], tag)
        before = len(env.stack.calls.calls)
        result = env.put(event).results[0]
        # Then the intake asked SageMaker, and counted it in the pool that buys it its way
        assert (result["outcome"], result["reason"], result.get("refused")) == ("accepted", "adopted", refused)
        assert env.job(result["job"]).pool == counted_in
        used = {p: (env.store.pool(p) or {}).get("used_gpus", 0) for p in ("p5", "p5-spot")}
        assert used == {p: 24 if p == counted_in else 0 for p in ("p5", "p5-spot")}
        # And with the rights it has
        calls = env.stack.calls.calls[before:]
        assert "sagemaker:DescribeTrainingJob" in {r.action for c in calls for r in c.requests}
        assert StackPolicies.of(env.stack).denials(calls) == []


def test_a_training_job_whose_buying_cannot_be_read_is_counted_in_its_tagged_pool_of_its_type_and_said_so():
    with emulation(pools=[P5, P5_SPOT]) as env:
        team_training_job(env, "research-run", instances=3)
        event = _sample(ADOPTABLE_SAGEMAKER)
        event["detail"]["TrainingJobName"] = "research-run"
        _pool_tag(event["detail"]["Tags"], "p5-spot")
        denied = error_response("AccessDeniedException", "User is not authorized to perform: sagemaker:DescribeTrainingJob", 400)
        sagemaker = env.stack.deps().runners["sagemaker"].client
        # When SageMaker refuses the look-up for good, Then the job is counted all the same,
        # in its tagged pool among those of its type, and its line says why
        with aws_says_no(sagemaker, "DescribeTrainingJob", denied) as refused:
            result = env.put(event).results[0]
        assert refused and (result["outcome"], result["reason"]) == ("accepted", "adopted")
        assert env.job(result["job"]).pool == "p5-spot" and env.store.pool("p5-spot")["used_gpus"] == 24
        [line] = [e for e in env.store.history(result["job"]) if e["kind"] == "adopted"]
        assert "whether it runs on spot could not be read (AccessDeniedException)" in line["detail"]
        # And a throttled look-up fails the handling, for Lambda's retry to look again
        event["id"], event["detail"]["TrainingJobName"] = "another-event", "research-run-2"
        team_training_job(env, "research-run-2", instances=3)
        fn = env.stack.resources["IntakeFunction"]
        with aws_says_no(sagemaker, "DescribeTrainingJob", THROTTLING["sagemaker"]), pytest.raises(Throttled):
            env.stack.invoke_lambda(fn, event)
        assert env.store.get("research-run-2") is None
        assert env.job(env.stack.invoke_lambda(fn, event)["job"]).pool == "p5"


@pytest.mark.parametrize(
    "queue, tag, counted_in, refused",
    [
        # Before: counted where the tag said (g5), though Batch runs it in g6's queue
        pytest.param("g6-queue", "g5", "g6", "wrong-pool", id="in-g6s-queue-tagged-g5"),
        pytest.param("arn:aws:batch:us-east-1:123456789012:job-queue/g6-queue", None, "g6", None, id="untagged-in-g6s-queue-by-arn"),
        # A queue of no pool's may share a pool's compute environment: the tag is believed
        pytest.param("team-queue", "g6", "g6", None, id="in-a-queue-of-its-own-tagged-g6"),
        pytest.param("team-queue", "nowhere", "g5", "wrong-pool", id="in-a-queue-of-its-own-tagged-with-no-pool"),
    ],
)
def test_a_teams_batch_job_is_counted_in_the_pool_whose_queue_it_runs_in(monkeypatch, queue, tag, counted_in, refused):
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    with emulation(pools=[G5, G6]) as env:
        # Given a Batch job its team submitted to `queue` (8 GPUs), tagged with `tag`
        event = _sample(ADOPTABLE_BATCH)
        event["detail"]["jobQueue"] = queue
        _pool_tag(event["detail"]["tags"], tag)
        result = intake.handler(event, CONTEXT)
        # Then it is counted in the pool whose queue runs it (else its tag's, else the first)
        assert (result["outcome"], result["reason"], result.get("refused")) == ("accepted", "adopted", refused)
        assert env.job(result["job"]).pool == counted_in
        assert {p: (env.store.pool(p) or {}).get("used_gpus", 0) for p in ("g5", "g6")} == {p: 8 if p == counted_in else 0 for p in ("g5", "g6")}
        assert (("RefusedClaims", {"Reason": "wrong-pool"}) in emitted) == (refused is not None)


def _queues_on(env, **queues: tuple[str, ...]) -> None:
    """Batch job queues of the emulated account, each on the compute environments named."""
    batch, iam = env.stack.client("batch"), env.stack.client("iam")
    role = iam.create_role(RoleName="batch", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    arns = {}
    for name in sorted({ce for ces in queues.values() for ce in ces}):
        arns[name] = batch.create_compute_environment(computeEnvironmentName=name, type="UNMANAGED", state="ENABLED", serviceRole=role)["computeEnvironmentArn"]
    for queue, ces in queues.items():
        order = [{"order": i + 1, "computeEnvironment": arns[ce]} for i, ce in enumerate(ces)]
        batch.create_job_queue(jobQueueName=queue, state="ENABLED", priority=1, computeEnvironmentOrder=order)


# g5's queue and g6's run on their own fleets; research's queue shares g6's, eval's runs on
# instances of its own.
SHARED_QUEUES = {
    "g5-queue": ("g5-fleet",), "g6-queue": ("g6-fleet",), "research-queue": ("research-fleet", "g6-fleet"), "eval-queue": ("eval-fleet",),
}
G6 = PoolConfig(name="g6", service="batch", gpus=32, job_queue="g6-queue")


def _in_a_teams_queue(env, queue: str, tag: str | None) -> dict:
    """The RUNNING event of a Batch job (8 GPUs) its team submitted to `queue` (its ARN),
    tagged for pool `tag`, in an account with the queues of SHARED_QUEUES."""
    _queues_on(env, **SHARED_QUEUES)
    event = _sample(ADOPTABLE_BATCH)
    event["detail"]["jobQueue"] = f"arn:aws:batch:us-east-1:123456789012:job-queue/{queue}"
    _pool_tag(event["detail"]["tags"], tag)
    return event


@pytest.mark.parametrize(
    "queue, tag, counted_in, refused",
    [
        # Before: counted in g5 (its tag, else the first Batch pool), while g6's instances ran it
        pytest.param("research-queue", "g5", "g6", "wrong-pool", id="sharing-g6s-fleet-tagged-g5"),
        pytest.param("research-queue", None, "g6", None, id="sharing-g6s-fleet-untagged"),
        # Before: counted in g5, whose fleet it never ran on
        pytest.param("eval-queue", "g5", None, "unknown-pool", id="on-a-fleet-of-its-own"),
    ],
)
def test_a_teams_batch_job_in_a_queue_of_no_pools_is_counted_in_the_pool_whose_compute_environments_it_shares(queue, tag, counted_in, refused):
    from iam_policy import StackPolicies

    with emulation(pools=[G5, G6]) as env:
        # Given a Batch job its team submitted to a queue of its own (8 GPUs), tagged with `tag`
        event = _in_a_teams_queue(env, queue, tag)
        before = len(env.stack.calls.calls)
        result = env.put(event).results[0]
        # Then it is counted in the pool whose fleet its queue runs on, and in no other; on a
        # fleet of its own, nowhere (it holds none of the pools' GPUs), and the refusal says why
        used = {p: (env.store.pool(p) or {}).get("used_gpus", 0) for p in ("g5", "g6")}
        assert used == {p: 8 if p == counted_in else 0 for p in ("g5", "g6")}
        if counted_in is None:
            assert result["outcome"] == "rejected" and result["reason"].startswith("unknown-pool")
            assert "runs in job queue eval-queue, whose compute environments no batch pool's queues use" in result["reason"]
        else:
            assert (result["outcome"], result["reason"], result.get("refused")) == ("accepted", "adopted", refused)
            assert env.job(result["job"]).pool == counted_in
        # And the intake read the queues with the rights it has
        calls = env.stack.calls.calls[before:]
        assert "batch:DescribeJobQueues" in {r.action for c in calls for r in c.requests}
        assert StackPolicies.of(env.stack).denials(calls) == []


def test_a_teams_batch_job_whose_queues_compute_environments_cannot_be_read_is_counted_as_before_and_said_so():
    with emulation(pools=[G5, G6]) as env:
        event = _in_a_teams_queue(env, "research-queue", "g5")
        denied = error_response("AccessDeniedException", "User is not authorized to perform: batch:DescribeJobQueues", 403)
        # When Batch refuses the look-up for good (an SCP, a role edited by hand)
        with aws_says_no(env.stack.deps().runners["batch"].client, "DescribeJobQueues", denied) as refused:
            result = env.put(event).results[0]
        assert refused
        # Then the job is still counted (its GPUs are held), in its tagged pool, and its line says so
        assert (result["outcome"], result["reason"]) == ("accepted", "adopted")
        assert env.job(result["job"]).pool == "g5" and env.store.pool("g5")["used_gpus"] == 8
        [line] = [e for e in env.store.history(result["job"]) if e["kind"] == "adopted"]
        assert "the compute environments of job queue research-queue could not be read (AccessDeniedException)" in line["detail"]


def test_a_teams_batch_job_whose_queue_look_up_is_throttled_is_counted_where_it_runs_when_its_event_comes_again():
    with emulation(pools=[G5, G6]) as env:
        event = _in_a_teams_queue(env, "research-queue", None)
        fn = env.stack.resources["IntakeFunction"]
        # When the look-up is throttled through botocore's retries, the handling fails (Lambda
        # retries the event) and nothing is counted in a pool it may not run on
        with aws_says_no(env.stack.deps().runners["batch"].client, "DescribeJobQueues", THROTTLING["batch"]), pytest.raises(Throttled):
            env.stack.invoke_lambda(fn, event)
        assert {p: (env.store.pool(p) or {}).get("used_gpus", 0) for p in ("g5", "g6")} == {"g5": 0, "g6": 0}
        # Then the event's retry counts it in g6, whose fleet its queue shares
        result = env.stack.invoke_lambda(fn, event)
        assert (result["outcome"], result["reason"]) == ("accepted", "adopted")
        assert env.job(result["job"]).pool == "g6" and env.store.pool("g6")["used_gpus"] == 8


def test_a_heterogeneous_cluster_is_counted_in_full():
    with emulation() as env:
        # Given a run whose ResourceConfig has two instance groups of the pool's type
        event = _sample(ADOPTABLE_SAGEMAKER)
        resources = event["detail"]["ResourceConfig"]
        del resources["InstanceType"], resources["InstanceCount"]
        resources["InstanceGroups"] = [
            {"InstanceGroupName": "a", "InstanceType": "ml.p5.48xlarge", "InstanceCount": 1},
            {"InstanceGroupName": "b", "InstanceType": "ml.p5.48xlarge", "InstanceCount": 4},
        ]
        # Then all five instances are counted
        result = env.put(event).results[0]
        assert result["reason"] == "adopted" and env.job(result["job"]).gpus == 40


_RUN_SECRET = "9f" * 32


def _admitted(env, name: str, team: str = "research", incarnation: int = 1) -> JobRecord:
    """A job of the controller's at `incarnation`, admitted: its launch is under way."""
    record = JobRecord(
        name=name, team=team, priority=500, pool="p5", service="sagemaker", gpus=24, request={},
        checkpoint_s3_uri=f"s3://preemptor-checkpoints/{team}/{name}", submitted_at=0.0, incarnation=incarnation,
        run_secret=_RUN_SECRET,
    )
    assert env.store.put_new(record)
    record = env.store.require(name)
    return env.store.transition(
        record, record.with_changes(status=JobState.ADMITTED, admitted_at=1.0), [JobState.PENDING], usage_delta=24, pool_limit=64
    )


def _claiming_the_controllers_run(job: str, run: str, **tags) -> dict:
    """The start event of training job `run` (3 x 8 GPUs of pool p5, team research) whose
    tags claim the controller launched it for `job`."""
    event = _sample(ADOPTABLE_SAGEMAKER)
    event["detail"]["TrainingJobName"] = run
    event["detail"]["Tags"].update({"preemptor:managed": "true", "preemptor:job": job, "preemptor:incarnation": "1", **tags})
    return event


def test_a_run_the_controller_launched_is_never_adopted_even_before_its_alias_exists():
    with emulation() as env:
        # Given job x admitted, its launch under way, and its run's start event arriving
        # before the launch recorded the run's alias
        token = _admitted(env, "x").run_token_of(1)
        claim = {"preemptor:controller": "preemptor", "preemptor:run-token": token}
        result = env.put(_claiming_the_controllers_run("x", "x", **claim)).results[0]
        # Then it is not adopted as a second job: its launch records it
        assert result["outcome"] == "ignored" and result["reason"].startswith("own run:")
        assert [j.name for j in env.store.all_jobs()] == ["x"] and env.store.pool("p5")["used_gpus"] == 24


@pytest.mark.parametrize(
    "claimed_job, run, tags",
    [
        pytest.param("ghost", "ghost", {}, id="its-job-was-never-submitted"),
        pytest.param("x", "research-own", {}, id="not-the-name-the-controller-gives-the-job"),
        pytest.param("x", "x-r2", {"preemptor:incarnation": "2"}, id="an-incarnation-the-job-never-reached"),
        pytest.param("x", "x-r2", {"preemptor:incarnation": "2", "preemptor:team": "vision", "reached": 2}, id="another-team-than-the-jobs"),
        pytest.param("../x", "research-own", {}, id="a-job-tag-no-job-can-be-named"),
        # Its name and tags exactly as the controller's launch will make them, created first
        # (before: taken for the launch's own run, whatever it runs and holds)
        pytest.param("x", "x", {"preemptor:controller": "preemptor"}, id="a-copy-of-the-run-to-come-without-its-token"),
        pytest.param("x", "x", {"preemptor:run-token": "0" * 32}, id="a-copy-of-the-run-to-come-with-a-made-up-token"),
        # The token of the run before, read from its tags, on a copy of the next one's
        pytest.param("x", "x-r2", {"preemptor:incarnation": "2", "reached": 2, "token-of": 1}, id="a-copy-with-the-token-of-the-run-before"),
    ],
)
def test_a_teams_run_wearing_the_controllers_tags_is_adopted_and_counted_not_trusted(monkeypatch, claimed_job, run, tags):
    # Given the intake's per-reason metrics recorded as they are emitted
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    with emulation() as env:
        # Given the controller's job x admitted (research, incarnation 1 unless `reached`),
        # and a team's own training job whose tags claim the controller launched it (before:
        # "own run", ignored: its 24 GPUs never counted, the pool filled around it)
        tags = dict(tags)
        job = _admitted(env, "x", incarnation=tags.pop("reached", 1))
        if "token-of" in tags:
            tags["preemptor:run-token"] = job.run_token_of(tags.pop("token-of"))
        event = _claiming_the_controllers_run(claimed_job, run, **tags)
        # When its start event arrives
        result = intake.handler(event, CONTEXT)
        # Then it is adopted as the team's run, its GPUs counted, and the claim refused,
        # named in its line and counted
        assert result["outcome"] == "accepted" and result["reason"] == "adopted"
        adopted = env.job(result["job"])
        assert adopted.adopted and adopted.run_name == run and adopted.gpus == 24 and adopted.stoppable
        assert adopted.name == run or run == "x"  # a job's name is the job's: counted under one of its own
        assert env.store.pool("p5")["used_gpus"] == 48 and env.job("x").status is JobState.ADMITTED
        [line] = [e for e in env.store.history(adopted.name) if e["kind"] == "adopted"]
        assert f"its tags claim it is the controller's run of job {claimed_job!r} (controller-tags" in line["detail"]
        assert result["refused"] == "controller-tags" and ("RefusedClaims", {"Reason": "controller-tags"}) in emitted


def test_a_run_wearing_the_controllers_tags_with_nothing_to_adopt_it_by_is_refused():
    with emulation() as env:
        # Given a run claiming to be the controller's, without the team and priority tags
        # every run the controller launches carries
        event = _claiming_the_controllers_run("ghost", "ghost")
        for tag in ("preemptor:team", "preemptor:priority"):
            del event["detail"]["Tags"][tag]
        result = env.put(event).results[0]
        # Then it is refused with the reason (reconcile stops it: it is tagged managed)
        assert result["outcome"] == "rejected" and result["reason"].startswith("controller-tags:")
        assert env.store.all_jobs() == []


def test_another_controllers_run_is_left_to_it():
    with emulation(parameters={"OtherControllers": "preemptor-staging,preemptor-research"}) as env:
        # Given a second stack in the account (listed in OtherControllers), whose run names a
        # job of the same name
        _admitted(env, "x")
        event = _claiming_the_controllers_run("x", "x", **{"preemptor:controller": "preemptor-staging"})
        result = env.put(event).results[0]
        # Then this controller neither takes it for its own job's run nor adopts it
        assert result["outcome"] == "ignored" and result["reason"].startswith("another controller's run:")
        assert [j.name for j in env.store.all_jobs()] == ["x"] and env.store.pool("p5")["used_gpus"] == 24


def test_a_teams_run_claiming_a_stack_that_is_not_listed_is_counted_and_never_a_victim(monkeypatch):
    emitted: list[tuple[str, dict]] = []
    monkeypatch.setattr(intake, "emit", lambda name, value, **dims: emitted.append((name, dims)))
    with emulation(parameters={"OtherControllers": "preemptor-staging"}) as env:
        # Given a team's run (3 x 8 GPUs of p5) tagged as a run of a stack the operators did
        # not list: a way to hide it from every stack's count (before: ignored here, and
        # counted by no stack; the pool was oversubscribed around it)
        event = _claiming_the_controllers_run("x", "research-run", **{"preemptor:controller": "preemptor-shadow"})
        result = env.put(event).results[0]
        # Then it is adopted and counted, its claim refused and counted
        assert (result["outcome"], result["reason"], result["refused"]) == ("accepted", "adopted", "controller-tags")
        job = env.job(result["job"])
        assert job.adopted and env.store.pool("p5")["used_gpus"] == 24
        assert ("RefusedClaims", {"Reason": "controller-tags"}) in emitted
        # And it is never a victim: IAM keeps this stack off a run tagged with another's name
        assert job.stoppable is False
        [line] = [e for e in env.store.history(job.name) if e["kind"] == "adopted"]
        assert "its tags claim it is stack 'preemptor-shadow''s run (controller-tags" in line["detail"]
        assert "no preemptor:managed=true tag" not in line["detail"]


def test_a_submission_named_as_an_adopted_run_is_refused_with_the_reason_not_taken_for_a_duplicate():
    with emulation(pools=[G5]) as env:
        # Given a Batch job research submitted itself, adopted under its name ("event-test")
        assert env.put(_sample(ADOPTABLE_BATCH)).results[0]["reason"] == "adopted"
        # When a team submits a job of that name to the controller (Batch's names are not unique)
        batch_queues(env)
        result = env.submit(name="event-test", team="applied", priority=200, pool="g5", gpus=8, duration=600)
        # Then it is refused, saying why (before: "job event-test was already submitted", a
        # duplicate, though no such submission ever was), and the run stays as it was
        assert result["outcome"] == "rejected" and result["reason"].startswith(
            "name-taken: event-test is the name of a batch run team 'research' launched outside the controller (adopted)"
        )
        assert env.job("event-test").adopted and env.job("event-test").team == "research"


def test_submission_sample_is_accepted_and_launched_and_resubmission_is_a_duplicate():
    with emulation() as env:
        event = _sample("preemptor/job-submitted-sagemaker.json")
        assert env.put(event).results[0]["outcome"] == "accepted"
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING
        again = copy.deepcopy(event)
        again["id"] = "another-delivery-of-the-same-job"
        result = env.put(again).results[0]
        assert result["outcome"] == "duplicate"
        # Exactly one SageMaker training job exists for it
        jobs = env.stack.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]
        assert [j["TrainingJobName"] for j in jobs] == ["llm-pretrain-7b"]


def test_the_event_of_a_handler_killed_mid_way_is_handled_by_lambdas_retry():
    with emulation() as env:
        event = _sample("preemptor/job-submitted-sagemaker.json")
        # Given a handling of the submission killed at the function's timeout, after its claim
        env.store.claim_event(event["id"], env.clock.now(), owner="killed-at-timeout")
        # When Lambda retries the delivery a minute later, while that handling might still run
        env.clock.advance_to(env.clock.now() + 60)
        # Then the delivery fails, to be retried: it is not dropped as a duplicate
        with pytest.raises(EventInProgress):
            env.put(event)
        assert env.store.get("llm-pretrain-7b") is None
        # And Lambda's second retry, two minutes later, handles it
        env.clock.advance_to(env.clock.now() + 120)
        assert env.put(event).results[0]["outcome"] == "accepted"
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING


def test_a_failed_submission_whose_claim_could_not_be_given_back_is_handled_by_lambdas_retry():
    throttled = error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400)
    with emulation() as env:
        event = _sample("preemptor/job-submitted-sagemaker.json")
        client = env.store.client
        # Given DynamoDB throttles the job's record and then the claim's release
        job_put = lambda params: throttled if is_job_insert(params) else None  # noqa: E731
        with aws_says_no(client, "TransactWriteItems", job_put) as refused_puts, aws_says_no(client, "DeleteItem", throttled) as refused_deletes:
            with pytest.raises(Throttled):
                env.put(event)
        assert (len(refused_puts), len(refused_deletes)) == (1, 1)
        # When Lambda retries a minute later, Then the claim left behind defers it
        env.clock.advance_to(env.clock.now() + 60)
        with pytest.raises(EventInProgress):
            env.put(event)
        # And the second retry handles the submission: nothing was lost
        env.clock.advance_to(env.clock.now() + 120)
        assert env.put(event).results[0]["outcome"] == "accepted"
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING


def test_a_submission_backdated_by_its_event_time_is_submitted_when_received():
    with emulation() as env:
        # Given a submission whose `time` (the submitter sets it in PutEvents) is 50 minutes old
        event = _sample("preemptor/job-submitted-sagemaker.json")
        event["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(env.clock.now() - 3000))
        received = env.clock.now()
        assert env.put(event).results[0]["outcome"] == "accepted"
        # Then it was submitted when the controller received it: no place in the queue, no
        # aging and no wait (for the alarm's escalation) bought with a date
        job = env.job("llm-pretrain-7b")
        assert job.submitted_at == received and job.waiting_since() == received


def test_a_submission_whose_insert_lost_its_answer_is_accepted_once():
    with emulation() as env:
        # Given the job's insert reaches DynamoDB and its answer is lost, so botocore resends
        # it and the resend finds the item it wrote itself
        with answer_lost(env.store.client, "TransactWriteItems", when=is_job_insert) as resent:
            result = env.put(_sample("preemptor/job-submitted-sagemaker.json")).results[0]
        assert resent == [1]
        # Then the submission is accepted, logged once and launched: not called a duplicate
        assert result["outcome"] == "accepted"
        assert env.kinds("llm-pretrain-7b").count("submitted") == 1
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING


def test_the_redelivery_of_a_submission_whose_handling_died_after_the_insert_completes_it():
    throttled = error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400)
    with emulation() as env:
        event = _sample("preemptor/job-submitted-sagemaker.json")
        # Given a handling that inserted the job, then failed on the checkpoint alias
        alias = lambda params: throttled if params.get("Key", {}).get("pk", {}).get("S", "").startswith("CKPT") else None  # noqa: E731
        with aws_says_no(env.store.client, "UpdateItem", alias) as refused:
            with pytest.raises(Throttled):
                env.put(event)
        assert refused and env.job("llm-pretrain-7b").status is JobState.PENDING
        # When Lambda redelivers the event
        result = env.put(event).results[0]
        # Then the submission is completed: accepted, its alias written, logged once, launched
        assert result["outcome"] == "accepted"
        assert env.kinds("llm-pretrain-7b").count("submitted") == 1
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING
        # And another event submitting the same name is the duplicate
        again = copy.deepcopy(event)
        again["id"] = "another-submission-of-the-name"
        assert env.put(again).results[0]["outcome"] == "duplicate"


def test_the_redelivery_of_an_adoption_whose_handling_died_after_the_insert_claims_its_location():
    throttled = error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400)
    with emulation() as env:
        event = _sample(ADOPTABLE_SAGEMAKER)
        run, location = event["detail"]["TrainingJobName"], event["detail"]["CheckpointConfig"]["S3Uri"]
        # Given a handling that inserted the adopted run, then failed on its location's alias
        alias = lambda params: throttled if params.get("Item", {}).get("pk", {}).get("S", "").startswith("CKPT") else None  # noqa: E731
        with aws_says_no(env.store.client, "PutItem", alias) as refused:
            with pytest.raises(Throttled):
                env.put(event)
        assert refused and env.job(run).checkpoint_s3_uri == location
        # When Lambda redelivers the event
        result = env.put(event).results[0]
        # Then the adoption is completed, not called a duplicate: its writes are credited to
        # it, it is logged once, and its GPUs are counted once
        assert result["outcome"] == "accepted" and result["reason"] == "adopted"
        bucket, key = location.removeprefix("s3://").split("/", 1)
        assert env.store.find_checkpoint_owner(bucket, f"{key}/step-000000000001/manifest.json") == run
        assert env.kinds(run).count("adopted") == 1
        assert env.store.pool("p5")["used_gpus"] == env.job(run).gpus
        # And another event of the same run is its progress, adopting nothing again
        again = copy.deepcopy(event)
        again["id"] = "another-event-of-the-run"
        assert env.put(again).results[0]["reason"].startswith("progress:")
        assert env.kinds(run).count("adopted") == 1


def test_in_a_hostile_world_a_failed_delivery_is_retried_by_lambda_minutes_later_and_handled():
    from emulation import START
    from preemptor_tools.local.hostile import HostileWorld

    throttled = error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400)
    with emulation(hostile=lambda clock: HostileWorld(clock, START)) as env:
        client = env.store.client
        event = _sample("preemptor/job-submitted-sagemaker.json")
        # Given a submission whose handling fails and whose claim cannot be given back
        job_put = lambda params: throttled if is_job_insert(params) else None  # noqa: E731
        with aws_says_no(client, "TransactWriteItems", job_put), aws_says_no(client, "DeleteItem", throttled):
            first = env.put(event).results[0]
        # Then Lambda retries it a minute later (the claim still held: retried again), and
        # two minutes after that it is handled: nothing dead-lettered, the job runs
        assert first["outcome"] == "retrying"
        env.advance(60, step=60)
        assert env.store.get("llm-pretrain-7b") is None
        env.advance(120, step=60)
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING
        assert env.stack.dead_letters == [] and env.stack.async_retries == []


def test_the_training_job_runs_with_what_the_pool_and_the_team_set():
    # Given a pool that sets the role, output location, network and encryption
    pool = PoolConfig(
        name="p5", service="sagemaker", instance_type="ml.p5.48xlarge", instances=8, gpus_per_instance=8,
        role_arn="arn:aws:iam::123456789012:role/p5-training", output_s3_uri="s3://ml-artifacts/p5",
        subnets=("subnet-0a",), security_group_ids=("sg-0a",), network_isolation=True, kms_key_id="alias/p5",
    )
    # (a pool's own role must be the stack's training role: the one its IAM may pass)
    with emulation(pools=[pool], parameters={"ManagedRoleArnForTraining": "arn:aws:iam::123456789012:role/p5-training"}) as env:
        # When the research team submits a job that states none of them
        assert env.put(_sample("preemptor/job-submitted-sagemaker.json")).results[0]["outcome"] == "accepted"
        # Then SageMaker runs it under the pool's settings and the team's checkpoint prefix
        job = env.stack.client("sagemaker").describe_training_job(TrainingJobName="llm-pretrain-7b")
        assert job["RoleArn"] == "arn:aws:iam::123456789012:role/p5-training"
        assert job["OutputDataConfig"] == {"S3OutputPath": "s3://ml-artifacts/p5/research/", "KmsKeyId": "alias/p5"}
        assert job["VpcConfig"] == {"Subnets": ["subnet-0a"], "SecurityGroupIds": ["sg-0a"]}
        assert job["EnableNetworkIsolation"] is True
        assert job["CheckpointConfig"]["S3Uri"] == "s3://preemptor-checkpoints/research/llm-pretrain-7b"
        assert env.job("llm-pretrain-7b").gpus == 16


def test_a_team_with_a_training_role_of_its_own_trains_under_it_and_no_other():
    """A team's own role (PolicyConfig teams.<team>.training_role_arn, listed in
    TeamTrainingRoleArns) is what its jobs run as: the role TeamTrainingAccessPolicy scopes
    to the team's own checkpoints (tests/unit/test_iam.py)."""
    from iam_policy import StackPolicies

    stack_role = "arn:aws:iam::123456789012:role/preemptor-training"
    research_role = "arn:aws:iam::123456789012:role/preemptor/research-training"
    policy = {"teams": {"research": {"training_role_arn": research_role}, "vision": {}}}
    parameters = {"ManagedRoleArnForTraining": stack_role, "TeamTrainingRoleArns": research_role}
    with emulation(policy=policy, parameters=parameters) as env:
        # Given the research team, with a role of its own, submitting a job that names none
        before = len(env.stack.calls.calls)
        assert env.put(_sample("preemptor/job-submitted-sagemaker.json")).results[0]["outcome"] == "accepted"
        # Then SageMaker runs it as the team's role, not the stack's shared one
        job = env.stack.client("sagemaker").describe_training_job(TrainingJobName="llm-pretrain-7b")
        assert job["RoleArn"] == research_role
        # And IAM lets the controller pass that role, and allows every call it made
        calls = env.stack.calls.calls[before:]
        assert [r.resource for c in calls for r in c.requests if r.action == "iam:PassRole"] == [research_role]
        assert StackPolicies.of(env.stack).denials(calls) == []
        # When the team asks for the stack's shared role instead (whose grants reach every
        # team's checkpoints)
        event = _sample("preemptor/job-submitted-sagemaker.json")
        event["id"], event["detail"]["name"] = "7c2e1d4f-3b5e-4f8c-a021-4d6e8f0b2c12", "llm-pretrain-shared-role"
        event["detail"]["request"]["RoleArn"] = stack_role
        result = env.put(event).results[0]
        # Then it is refused, naming the field, and nothing is launched
        assert result["outcome"] == "rejected" and result["reason"].startswith("set-by-pool: request.RoleArn"), result
        assert env.store.get("llm-pretrain-shared-role") is None


@pytest.mark.parametrize(
    "field, value, named",
    [
        pytest.param("RoleArn", "arn:aws:iam::123456789012:role/Admin", "request.RoleArn: set by the pool", id="role"),
        pytest.param("OutputDataConfig", {"S3OutputPath": "s3://attacker-bucket/loot"},
                     "request.OutputDataConfig.S3OutputPath: set by the pool", id="output-location"),
        pytest.param("VpcConfig", {"Subnets": ["subnet-evil"], "SecurityGroupIds": ["sg-open"]},
                     "request.VpcConfig: set by pool", id="network"),
        pytest.param("CheckpointConfig", {"S3Uri": "s3://preemptor-checkpoints/production/finetune"},
                     "request.CheckpointConfig.S3Uri: set by the controller", id="another-teams-checkpoints"),
    ],
)
def test_a_request_that_sets_what_the_pool_sets_is_rejected_with_the_field_named(field, value, named):
    with emulation() as env:
        # Given a submission whose request body sets a field the pool decides
        event = _sample("preemptor/job-submitted-sagemaker.json")
        event["detail"]["request"][field] = value
        # When it reaches the intake
        result = env.put(event).results[0]
        # Then it is rejected naming the field, and nothing is queued or launched
        assert result["outcome"] == "rejected" and result["reason"] == f"set-by-pool: {named}" or named in result["reason"]
        assert result["reason"].startswith("set-by-pool:")
        assert env.store.get("llm-pretrain-7b") is None


def test_a_submission_under_the_bare_preemptor_source_is_rejected():
    with emulation() as env:
        # Given the old shape: source "preemptor", which names no sender
        event = _sample("preemptor/job-submitted-sagemaker.json", source="preemptor")
        # When it is put on the submission bus (no rule listens for it: the rule's pattern is
        # a prefix "preemptor."), and handed to the intake directly
        assert not env.put(event).matched
        result = intake.handler(event, CONTEXT)
        # Then it is rejected, and no job exists
        assert result["outcome"] == "rejected" and result["reason"].startswith("bad-source:")
        assert env.store.get("llm-pretrain-7b") is None


def test_a_submission_on_the_default_bus_reaches_no_rule():
    with emulation() as env:
        # Given a well-formed submission put on the account's default bus instead of the stack's
        routed = env.stack.put_event(_sample("preemptor/job-submitted-sagemaker.json"), bus="default")
        # Then no rule of the stack sees it: submissions are read from the stack's own bus only
        assert not routed.matched and env.store.get("llm-pretrain-7b") is None


def test_a_detail_naming_another_team_than_its_source_is_rejected():
    with emulation() as env:
        # Given team "intern" (its source) submitting a job that claims to be research's
        event = _sample("preemptor/job-submitted-sagemaker.json", source="preemptor.intern")
        result = env.put(event).results[0]
        # Then the team is not taken from the detail: the submission is rejected
        assert result["outcome"] == "rejected" and result["reason"].startswith("team-mismatch:")
        assert env.store.get("llm-pretrain-7b") is None


@pytest.mark.parametrize(
    "teams, priority, outcome, reason",
    [
        pytest.param(None, 1000, "accepted", "job-submitted", id="no-teams-configured-every-tier-allowed"),
        pytest.param({"research": {"max_priority": "high"}}, "high", "accepted", "job-submitted", id="at-the-ceiling"),
        pytest.param({"research": {"max_priority": "high"}}, 1000, "rejected",
                     "above-team-ceiling: priority 1000 is above team 'research''s ceiling 500", id="above-the-ceiling"),
        pytest.param({"production": {}}, 50, "rejected", "unknown-team: team 'research' is not configured", id="unlisted-team"),
    ],
)
def test_team_ceilings(teams, priority, outcome, reason):
    with emulation(policy={"teams": teams} if teams else {}) as env:
        event = _sample("preemptor/job-submitted-sagemaker.json")
        event["detail"]["priority"] = priority
        result = env.put(event).results[0]
        assert (result["outcome"], result["reason"]) == (outcome, reason)


def test_submission_to_an_unknown_pool_is_rejected_with_a_reason():
    with emulation() as env:
        event = _sample("preemptor/job-submitted-sagemaker.json")
        event["detail"]["pool"] = "nowhere"
        result = env.put(event).results[0]
        assert result["outcome"] == "rejected" and result["reason"] == "unknown-pool: pool 'nowhere' is not configured"


def test_batch_job_runs_on_the_pools_queue_with_its_gpus_and_checkpoint_prefix():
    pool = PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue", job_definitions=("preemptor-eval:3",))
    with emulation(pools=[pool]) as env:
        result = env.put(_sample("preemptor/job-submitted-batch.json")).results[0]
        assert result["outcome"] == "accepted", result
        job = env.job("eval-sweep-42")
        overrides = job.request["containerOverrides"]
        assert job.request["jobQueue"] == "g5-queue" and job.gpus == 4
        assert {"name": "PREEMPTOR_CHECKPOINT_S3_URI", "value": "s3://preemptor-checkpoints/platform/eval-sweep-42"} in overrides["environment"]
        assert overrides["resourceRequirements"] == [{"type": "GPU", "value": "4"}]


def test_a_command_override_on_another_teams_job_definition_is_rejected():
    pool = PoolConfig(
        name="g5", service="batch", gpus=32, job_queue="g5-queue",
        job_definitions=(JobDefinition(name="research-train:1", team="research"),),
    )
    with emulation(pools=[pool]) as env:
        # Given the platform team submitting research's job definition with its own command
        event = _sample("preemptor/job-submitted-batch.json")
        event["detail"]["request"]["jobDefinition"] = "research-train:1"
        event["detail"]["request"]["containerOverrides"]["command"] = ["sh", "-c", "cat /secrets/*"]
        result = env.put(event).results[0]
        # Then it is rejected, naming the field
        assert result["outcome"] == "rejected"
        assert result["reason"].startswith("not-allowed: request.containerOverrides.command: job definition 'research-train:1' belongs to team 'research'")


def test_cancel_of_a_pending_job():
    with emulation() as env:
        env.submit(name="big", team="a", priority=500, pool="p5", instances=8, duration=3600)
        env.submit(name="waiting", team="a", priority=200, pool="p5", instances=8, duration=3600)
        assert env.put(_cancel("waiting", team="a")).results[0]["reason"] == "cancelled-pending"
        assert env.job("waiting").status is JobState.CANCELLED


def test_only_the_jobs_own_team_may_cancel_it():
    with emulation() as env:
        # Given team a's running job
        env.submit(name="running", team="a", priority=200, pool="p5", instances=8, duration=3600)
        env.advance(300)
        # When team b asks to cancel it
        result = env.put(_cancel("running", team="b")).results[0]
        # Then the cancel is refused with the reason, and the job keeps running
        assert result["outcome"] == "rejected"
        assert result["reason"] == "not-your-job: job running belongs to team 'a', not 'b'"
        env.advance(300)
        assert env.job("running").status is JobState.RUNNING and not env.job("running").cancel_requested


@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_cancel_of_a_running_job_stops_it_and_frees_its_gpus(service):
    with emulation(pools=[P5 if service == "sagemaker" else G5]) as env:
        if service == "batch":
            batch_queues(env)
        pool, size = ("p5", {"instances": 8}) if service == "sagemaker" else ("g5", {"gpus": 32})
        env.submit(name="running", team="a", priority=200, pool=pool, duration=3600, **size)
        env.advance(300)
        assert env.put(_cancel("running", team="a")).results[0]["reason"] == "stopping-for-cancel"
        env.advance(300)
        # Then the job ends CANCELLED, though Batch ends the terminated run FAILED
        job = env.job("running")
        assert job.status is JobState.CANCELLED and job.outcome_reason.startswith("cancelled")
        assert [e["kind"] for e in env.store.history("running")][-1] == "cancelled"
        assert (env.store.pool(pool) or {}).get("used_gpus", 0) == 0

def test_a_cancel_tells_its_stop_whatever_fails_after_it_is_sent():
    with emulation() as env:
        env.submit(name="running", team="a", priority=200, pool="p5", instances=8, duration=3600)
        env.advance(300)
        fn = env.stack.resources["IntakeFunction"]
        # When the team cancels the running job and a decision-log line written on its own
        # is refused (the function would die there), then the run ends before a second handling
        def log_line(params: dict) -> dict | None:
            return THROTTLING["dynamodb"] if params["Item"]["sk"]["S"].startswith("LOG#") else None

        with aws_says_no(env.store.client, "PutItem", log_line) as refused:
            assert env.stack.invoke_lambda(fn, _cancel("running", team="a"))["reason"] == "stopping-for-cancel"
        env.advance(300)
        # Then the stop was told with the cancel request, before it was sent: one line, and
        # the job ended cancelled; no line needed a write of its own
        assert refused == []
        kinds = env.kinds("running")
        assert kinds.count("cancel-requested") == 1 and kinds[-1] == "cancelled"
        assert env.job("running").status is JobState.CANCELLED
        # And a handling again of the same cancel changes nothing
        assert env.stack.invoke_lambda(fn, _cancel("running", team="a"))["outcome"] == "duplicate"
        assert env.kinds("running") == kinds


def test_a_cancel_whose_stop_was_throttled_stops_the_run_when_handled_again_and_tells_it_once():
    with emulation() as env:
        env.submit(name="running", team="a", priority=200, pool="p5", instances=8, duration=3600)
        env.advance(300)
        sagemaker, fn = env.stack.deps().runners["sagemaker"].client, env.stack.resources["IntakeFunction"]
        # When the first handling's stop is throttled (the function fails, the event is retried)
        with aws_says_no(sagemaker, "StopTrainingJob", THROTTLING["sagemaker"]), pytest.raises(Exception, match="Throttl"):
            env.stack.invoke_lambda(fn, _cancel("running", team="a"))
        assert env.job("running").status is JobState.RUNNING
        # Then the retried handling stops it, and the cancel is told once
        assert env.stack.invoke_lambda(fn, _cancel("running", team="a"))["reason"] == "stopping-for-cancel"
        env.advance(300)
        assert env.job("running").status is JobState.CANCELLED
        assert env.kinds("running").count("cancel-requested") == 1


def test_stale_events_of_an_old_incarnation_are_ignored():
    with emulation() as env:
        env.submit(name="low", team="a", priority=50, pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(600)
        env.submit(name="high", team="b", priority=1000, pool="p5", instances=8, duration=600)
        env.advance(300)
        # The Stopped event of the preempted first run arrived after the requeue
        assert env.job("low").incarnation == 2
        history = env.store.history("low")
        assert "requeued" in [e["kind"] for e in history]
        assert env.store.pool("p5")["used_gpus"] == 64


def test_checkpoint_writes_announced_by_s3_keep_the_last_checkpoint_time():
    with emulation() as env:
        # Given a job whose checkpoints live under s3://preemptor-checkpoints/research/llm-pretrain-7b
        env.put(_sample("preemptor/job-submitted-sagemaker.json"))
        created = json.loads(load_raw("s3/constructed__s3-object-created__checkpoint.json"))
        created["time"] = "2026-11-30T09:00:00Z"
        # When S3 announces a checkpoint written below that prefix
        result = env.put(created).results[0]
        # Then the job's last checkpoint time is that of the event
        assert result["outcome"] == "accepted" and result["job"] == "llm-pretrain-7b"
        assert env.job("llm-pretrain-7b").last_checkpoint_at == calendar.timegm((2026, 11, 30, 9, 0, 0))
        # And the controller's own markers and other jobs' objects are not checkpoints of it
        marker = copy.deepcopy(created)
        marker["id"] = "marker"
        marker["detail"]["object"]["key"] = "research/llm-pretrain-7b/_preemptor/checkpoint-request.json"
        assert env.put(marker).results[0]["outcome"] == "ignored"
        other = copy.deepcopy(created)
        other["id"] = "other"
        other["detail"]["object"]["key"] = "research/another-job/ckpt.pt"
        assert env.put(other).results[0]["outcome"] == "ignored"


def _helper_manifest(directory: str, files: dict[str, bytes]) -> bytes:
    """The training helper's manifest of `directory` naming `files` (relative key -> body)."""
    return json.dumps({
        "format": 1, "step": int(directory.removeprefix("step-")), "time": 0.0, "reason": "periodic", "path": directory,
        "requested_at": None, "save_s": 1.0, "files": [{"path": k, "bytes": len(v)} for k, v in files.items()],
    }).encode()


def test_a_file_of_a_helper_checkpoint_counts_only_when_its_manifest_is_announced_and_whole():
    with emulation() as env:
        env.put(_sample("preemptor/job-submitted-sagemaker.json"))
        before = env.job("llm-pretrain-7b").last_checkpoint_at
        s3, bucket, prefix = env.stack.client("s3"), env.stack.parameters["CheckpointBucketName"], "research/llm-pretrain-7b"
        created = json.loads(load_raw("s3/constructed__s3-object-created__checkpoint.json"))
        created["time"] = "2026-11-30T09:00:00Z"

        def announce(key: str, body: bytes, event_id: str) -> dict:
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)
            event = copy.deepcopy(created)
            event["id"], event["detail"]["object"]["key"] = event_id, f"{prefix}/{key}"
            return env.put(event).results[0]

        files = {"step-000000000420/weights.pt": b"w" * 10, "step-000000000420/optimizer/state.bin": b"o" * 20}
        # Given SageMaker's sync uploading a checkpoint in its own order: the manifest first
        written = announce("step-000000000420/manifest.json", _helper_manifest("step-000000000420", files), "manifest")
        # Then it is no checkpoint while the files it names are not all there
        assert written["outcome"] == "ignored" and "not all there" in written["reason"]
        # And a file of a checkpoint is never one by itself
        for n, (key, body) in enumerate(files.items()):
            result = announce(key, body, f"part-{n}")
            assert result["outcome"] == "ignored" and "manifest" in result["reason"]
        assert env.job("llm-pretrain-7b").last_checkpoint_at == before
        # And the location's manifest, announced once the checkpoint is whole, makes it one,
        # as of its manifest in S3 (the listing's time, not the event's)
        whole_at = env.clock.now()
        assert announce("manifest.json", _helper_manifest("step-000000000420", files), "root")["outcome"] == "accepted"
        assert env.job("llm-pretrain-7b").last_checkpoint_at == pytest.approx(whole_at, abs=1)


def _managed_spot_event(job: str, status: str, secondary: str, event_id: str, at: float | None = None) -> dict:
    """The real SageMaker state-change sample, as managed spot sends it for `job`'s run (at
    `at`, when given: the sample's own time is years ago)."""
    event = _sample(
        "sagemaker/amazon-sagemaker-developer-g__sagemaker-training-job-state-change__8a0a8aaf.json", id=event_id
    )
    if at is not None:
        event["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    event["detail"].update(TrainingJobName=job, TrainingJobStatus=status, SecondaryStatus=secondary)
    event["detail"]["TrainingJobArn"] = f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{job}"
    return event


def test_a_managed_spot_interruption_is_accounted_and_the_job_keeps_running():
    with emulation() as env:
        # Given a running job that checkpointed 5 minutes ago
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200, checkpoint_every=300)
        env.advance(600)
        # When SageMaker managed spot takes its instances away
        interrupted_at = env.clock.now()
        interrupted = env.put(_managed_spot_event("spotty", "InProgress", "Interrupted", "spot-1", interrupted_at)).results[0]
        # Then it is accounted in the job's log with the work it lost (since the checkpoint,
        # at most 300 s of 16 GPUs), which is the job's (explain and the report read it there);
        # the job stays RUNNING on its GPUs, held paused: a stop now would lose nothing
        assert interrupted["outcome"] == "accepted"
        [entry] = [e for e in env.store.history("spotty") if e["kind"] == "spot-interrupted"]
        lost = entry["extra"]["lost_gpu_seconds"]
        assert entry["reason"] == "managed-spot" and 0 < lost <= 16 * 300
        job = env.job("spotty")
        assert job.status is JobState.RUNNING and job.incarnation == 1 and job.lost_gpu_seconds == lost
        assert job.spot_paused and job.as_running().work_at_risk_s(interrupted_at + 3600) == 0
        assert env.store.pool("p5")["used_gpus"] == 16
        # When it restarts ten minutes later (the service does, from its checkpoint)
        env.advance(600)
        restarting = env.put(_managed_spot_event("spotty", "InProgress", "Restarting", "spot-2", interrupted_at + 600)).results[0]
        # Then only the work since the restart is at risk
        assert restarting["outcome"] == "accepted" and "spot-restarting" in env.kinds("spotty")
        job = env.job("spotty")
        assert not job.spot_paused and job.work_started_at == pytest.approx(interrupted_at + 600, abs=1)
        assert job.as_running().work_at_risk_s(interrupted_at + 900) == pytest.approx(300, abs=1)


def test_a_redelivered_managed_spot_interruption_is_counted_once():
    with emulation() as env:
        # Given a running job whose last checkpoint is 5 minutes old, interrupted by managed spot
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200, checkpoint_every=600)
        env.advance(900)
        now = env.clock.now()
        interrupted, restarting = (
            _managed_spot_event("spotty", "InProgress", s, f"spot-{s}", now + delay) for s, delay in (("Interrupted", 0), ("Restarting", 300))
        )
        assert env.put(interrupted).results[0]["outcome"] == "accepted"
        env.advance(300)
        env.put(restarting)
        lost = env.job("spotty").lost_gpu_seconds
        assert lost > 0
        # When EventBridge delivers both events again a minute later, the interruption last
        env.advance(60)
        again = [env.put(event).results[0] for event in (restarting, interrupted)]
        # Then neither is counted again: one line each, the same lost work, the run not
        # paused again by the older interruption
        assert [a["outcome"] for a in again] == ["duplicate", "duplicate"]
        assert not env.job("spotty").spot_paused
        assert env.kinds("spotty").count("spot-interrupted") == 1 and env.kinds("spotty").count("spot-restarting") == 1
        assert env.job("spotty").lost_gpu_seconds == lost


def test_a_managed_spot_interruption_delivered_after_its_restart_pauses_nothing():
    with emulation() as env:
        # Given a running job that managed spot interrupted and restarted, whose events
        # arrive out of order: the restart first
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200, checkpoint_every=600)
        env.advance(900)
        now = env.clock.now()
        env.put(_managed_spot_event("spotty", "InProgress", "Restarting", "spot-r", now))
        # When the interruption (60 s before it) arrives
        result = env.put(_managed_spot_event("spotty", "InProgress", "Interrupted", "spot-i", now - 60)).results[0]
        # Then its lost work is counted, and the run is not held paused: it runs again
        assert result["outcome"] == "accepted" and env.job("spotty").lost_gpu_seconds > 0
        assert not env.job("spotty").spot_paused


def test_a_managed_spot_restart_stamped_ahead_of_the_clock_is_taken_as_of_its_handling():
    with emulation() as env:
        # Given a running job whose last checkpoint is 5 minutes old
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200, checkpoint_every=600)
        env.advance(900)
        now = env.clock.now()
        # When a restart event arrives stamped an hour ahead of the clock
        env.put(_managed_spot_event("spotty", "InProgress", "Restarting", "spot-ahead", now + 3600))
        # Then the restart counts as of now: the run's work is at risk from then on, not an hour later
        job = env.job("spotty")
        assert job.work_started_at <= env.clock.now()
        assert job.as_running().work_at_risk_s(env.clock.now() + 600) >= 600


def test_a_managed_spot_interruption_stamped_before_its_runs_start_is_taken_as_of_that_start():
    with emulation() as env:
        # Given a relaunched job whose newest checkpoint is its earlier run's, 15 minutes
        # before this run started
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200)
        env.advance(300)
        job = env.job("spotty")
        env.store.transition(job, job.with_changes(last_checkpoint_at=job.started_at - 900), [JobState.RUNNING])
        # When an interruption of this run arrives stamped 10 minutes before the run started
        result = env.put(_managed_spot_event("spotty", "InProgress", "Interrupted", "spot-early", job.started_at - 600)).results[0]
        # Then it counts as of the run's start: none of the earlier run's work since its
        # checkpoint is counted as this run's loss
        job = env.job("spotty")
        assert result["outcome"] == "accepted" and job.lost_gpu_seconds == 0
        assert job.spot_paused and job.spot_interrupted_at == job.started_at


def test_a_managed_spot_job_that_waited_past_its_max_wait_is_relaunched_not_failed():
    with emulation() as env:
        # Given a running job
        env.submit(name="spotty", team="a", priority=200, pool="p5", instances=2, duration=7200)
        env.advance(300)
        # When managed spot gives up: no spot capacity within MaxWaitTimeInSeconds
        env.put(_managed_spot_event("spotty", "Failed", "MaxWaitTimeExceeded", "spot-3"))
        # Then the job waits for capacity and is launched again as a new run, not failed
        job = env.job("spotty")
        assert job.status in (JobState.PENDING, JobState.ADMITTED, JobState.RUNNING) and job.incarnation == 2
        assert "capacity-wait" in env.kinds("spotty")
