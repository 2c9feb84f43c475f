"""The training helper (preemptor_training): the training side of the checkpoint protocol.

Each test names the failure it rules out: a manifest naming files that are not there, a
torn checkpoint resumed from, a request answered late or twice, a stop that loses the step
it finished, old checkpoints piling up, and the S3 half (the controller's marker, the
mirror a Batch job resumes from) on moto's S3.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from preemptor_training import Checkpointer, LocalStore, Manifest, Reason, ReservedName, RestoreFailed, Stopped
from preemptor_training.manifest import MANIFEST, REQUEST_FILE, write_atomic

START = 1_000_000.0  # the run's start on the fake clock


class Clock:
    def __init__(self, now: float = START):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Model:
    """The training state: the steps it has trained on. A checkpoint must carry it whole."""

    def __init__(self) -> None:
        self.trained: list[int] = []
        self.saves: list[int] = []
        self.during_save = None  # called inside save, with the directory, to look around

    def train(self, step: int) -> None:
        self.trained.append(step)

    def save(self, directory: Path, step: int) -> None:
        if self.during_save:
            self.during_save(directory)
        (directory / "weights.json").write_text(json.dumps({"step": step, "trained": self.trained}))
        (directory / "optimizer").mkdir(exist_ok=True)
        (directory / "optimizer" / "state.bin").write_bytes(bytes(step % 251 for _ in range(64)))
        self.saves.append(step)

    def load(self, directory: Path) -> None:
        self.trained = json.loads((directory / "weights.json").read_text())["trained"]


def checkpointer(root: Path, model: Model, clock: Clock, **kwargs) -> Checkpointer:
    kwargs.setdefault("environ", {})
    kwargs.setdefault("run_started_at", START)
    return Checkpointer(root, save=model.save, load=model.load, clock=clock, **kwargs)


def write_request(root: Path, requested_at: float, reason: str = "preemption") -> None:
    marker = root / REQUEST_FILE
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"requested_at": requested_at, "reason": reason}))
    # A marker rewritten within the file system's timestamp granularity must still be seen.
    os.utime(marker, ns=(int(requested_at * 1e9), int(requested_at * 1e9)))


def root_manifest(root: Path) -> Manifest:
    return Manifest.decode((root / MANIFEST).read_bytes())


def checkpoint_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def run_steps(ckpt: Checkpointer, model: Model, clock: Clock, steps: range, step_s: float = 1.0) -> None:
    for step in steps:
        clock.advance(step_s)
        model.train(step)
        ckpt.step_done(step)


# -- manifests: written last, atomically ------------------------------------------------------
def test_a_reader_never_sees_a_manifest_naming_files_not_yet_written(tmp_path):
    # Given a run with one complete checkpoint at step 3
    model, clock = Model(), Clock()
    seen: list[tuple[str, bool, bool]] = []

    def look(directory: Path) -> None:
        # (inside the next save, before its files exist)
        current = root_manifest(tmp_path)
        files_present = all((tmp_path / f.path).exists() for f in current.files)
        seen.append((current.path, files_present, (directory / MANIFEST).exists()))

    with checkpointer(tmp_path, model, clock, keep=5) as ckpt:
        ckpt.resume()
        run_steps(ckpt, model, clock, range(0, 3))
        ckpt.checkpoint(Reason.PERIODIC)
        # When the next checkpoint is being saved
        model.during_save = look
        run_steps(ckpt, model, clock, range(3, 5))
        ckpt.checkpoint(Reason.PERIODIC)

    # Then, while its files were being written, the location's manifest still named the
    # previous checkpoint, all of whose files were there, and the new one had no manifest
    assert seen == [("step-000000000003", True, False)]
    # And afterwards the manifest names the new checkpoint, every file with its size
    after = root_manifest(tmp_path)
    assert (after.step, after.reason) == (5, Reason.PERIODIC)
    assert {f.path for f in after.files} == {"step-000000000005/weights.json", "step-000000000005/optimizer/state.bin"}
    assert all((tmp_path / f.path).stat().st_size == f.bytes for f in after.files)


def test_a_manifest_write_cut_short_before_the_rename_leaves_the_old_manifest_whole(tmp_path, monkeypatch):
    # Given a location whose manifest names a complete checkpoint
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock) as ckpt:
        ckpt.resume()
        run_steps(ckpt, model, clock, range(0, 2))
        ckpt.checkpoint(Reason.PERIODIC)
        before = (tmp_path / MANIFEST).read_bytes()

        # When the process dies between writing the new manifest and renaming it into place
        def killed(src, dst):
            raise KeyboardInterrupt("killed before the rename")

        monkeypatch.setattr(os, "replace", killed)
        run_steps(ckpt, model, clock, range(2, 4))
        with pytest.raises(KeyboardInterrupt):
            ckpt.checkpoint(Reason.PERIODIC)
        monkeypatch.undo()

    # Then the location's manifest is byte for byte the old one, and the cut-short checkpoint
    # (its own manifest never renamed into place) is not resumed from
    assert (tmp_path / MANIFEST).read_bytes() == before
    resumed = Model()
    with checkpointer(tmp_path, resumed, Clock(START + 100)) as again:
        assert again.resume() == 2
    assert resumed.trained == [0, 1]


def test_concurrent_readers_only_ever_read_whole_manifests(tmp_path):
    # Given a reader polling the location's manifest as fast as it can
    stop, bad = threading.Event(), []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            try:
                body = (tmp_path / MANIFEST).read_bytes()
            except FileNotFoundError:
                continue
            reads += 1
            try:
                Manifest.decode(body)
            except ValueError as e:
                bad.append(str(e))

    thread = threading.Thread(target=reader)
    thread.start()
    # When a run writes 60 checkpoints
    model, clock = Model(), Clock()
    try:
        with checkpointer(tmp_path, model, clock, every_s=1.0) as ckpt:
            ckpt.resume()
            run_steps(ckpt, model, clock, range(60))
    finally:
        stop.set()
        thread.join(timeout=30)
    # Then every manifest it read parsed whole
    assert reads > 0
    assert bad == []


# -- resume: the newest complete checkpoint ---------------------------------------------------
def make_checkpoints(root: Path, steps: list[int]) -> None:
    model, clock = Model(), Clock()
    with checkpointer(root, model, clock, keep=len(steps) + 1) as ckpt:
        ckpt.resume()
        done = 0
        for target in steps:
            run_steps(ckpt, model, clock, range(done, target))
            done = target
            ckpt.checkpoint(Reason.PERIODIC)


def tear_missing_manifest(directory: Path) -> None:
    (directory / MANIFEST).unlink()


def tear_truncated_file(directory: Path) -> None:
    weights = directory / "weights.json"
    weights.write_bytes(weights.read_bytes()[:5])


def tear_missing_file(directory: Path) -> None:
    (directory / "optimizer" / "state.bin").unlink()


def tear_garbled_manifest(directory: Path) -> None:
    (directory / MANIFEST).write_text('{"format": 1, "step": ')


@pytest.mark.parametrize(
    "tear",
    [tear_missing_manifest, tear_truncated_file, tear_missing_file, tear_garbled_manifest],
    ids=["no-manifest", "file-truncated", "file-missing", "manifest-garbled"],
)
def test_a_torn_newest_checkpoint_is_ignored_and_the_newest_complete_one_resumed(tmp_path, tear):
    # Given complete checkpoints at steps 4 and 8, and a newer one at step 12 that was torn
    make_checkpoints(tmp_path, [4, 8, 12])
    tear(tmp_path / "step-000000000012")

    # When a new run resumes
    model = Model()
    with checkpointer(tmp_path, model, Clock(START + 1000)) as ckpt:
        start = ckpt.resume()

    # Then it resumes from step 8 with the state of step 8, and the torn checkpoint is gone
    assert start == 8
    assert model.trained == list(range(8))
    assert ckpt.last is not None and ckpt.last.path == "step-000000000008"
    assert checkpoint_dirs(tmp_path) == ["step-000000000004", "step-000000000008"]


def test_a_directory_without_checkpoints_starts_at_step_zero_without_loading(tmp_path):
    # Given an empty location
    model = Model()
    model.load = lambda directory: pytest.fail("nothing to load")
    # When a run resumes, Then it starts at step 0
    with Checkpointer(tmp_path, save=model.save, load=model.load, environ={}) as ckpt:
        assert ckpt.resume() == 0
        assert ckpt.last is None


def test_a_checkpoint_before_any_step_ends_rewrites_the_manifest_not_the_checkpoint(tmp_path):
    # Given a run resumed at step 4
    make_checkpoints(tmp_path, [4])
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-000000000004").rglob("*") if p.is_file() and p.name != MANIFEST}
    model, clock = Model(), Clock(START + 100)
    with checkpointer(tmp_path, model, clock) as ckpt:
        assert ckpt.resume() == 4
        clock.advance(2)
        # When a checkpoint is asked for before step 4 ends
        manifest = ckpt.checkpoint(Reason.REQUESTED)
    # Then the complete checkpoint is not saved over in place (a kill then would tear it):
    # its manifest is rewritten (a new time, the new reason), its files untouched
    assert model.saves == []
    assert (manifest.step, manifest.reason, manifest.time) == (4, Reason.REQUESTED, START + 102)
    assert root_manifest(tmp_path) == manifest == LocalStore(tmp_path).newest()
    after = {p.name: p.read_bytes() for p in (tmp_path / "step-000000000004").rglob("*") if p.is_file() and p.name != MANIFEST}
    assert after == before


def test_a_save_callback_writing_the_reserved_manifest_name_is_refused(tmp_path):
    # Given a save callback that writes its own manifest.json at the top of the checkpoint
    model, clock = Model(), Clock()

    def save(directory: Path, step: int) -> None:
        (directory / MANIFEST).write_text("{}")

    # When it checkpoints, Then the helper refuses instead of overwriting it or being fooled
    with Checkpointer(tmp_path, save=save, load=model.load, environ={}, clock=clock) as ckpt:
        ckpt.resume()
        ckpt.step = 1
        with pytest.raises(ReservedName):
            ckpt.checkpoint(Reason.PERIODIC)


# -- the controller's request -----------------------------------------------------------------
def test_a_request_is_answered_at_the_next_step_boundary_and_only_once(tmp_path):
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock) as ckpt:
        ckpt.resume()
        run_steps(ckpt, model, clock, range(0, 5))
        assert model.saves == []  # no period, no request: no checkpoint

        # Given the controller writes a request while step 5 runs
        clock.advance(0.5)
        write_request(tmp_path, clock.now, "preemption: for prod")
        clock.advance(0.5)
        model.train(5)
        assert model.saves == []  # nothing happens inside the step
        # When step 5 ends
        ckpt.step_done(5)

        # Then a checkpoint of the state after step 5 answers it
        manifest = root_manifest(tmp_path)
        assert (manifest.step, manifest.reason, manifest.requested_at) == (6, Reason.REQUESTED, START + 5.5)
        assert manifest.time >= manifest.requested_at
        assert json.loads((tmp_path / manifest.path / "weights.json").read_text())["trained"] == list(range(6))
        # And the same marker, still there, is not answered again
        run_steps(ckpt, model, clock, range(6, 10))
        assert model.saves == [6]
        # But a newer request is
        write_request(tmp_path, clock.now + 0.1, "spot interruption")
        run_steps(ckpt, model, clock, range(10, 11))
        assert model.saves == [6, 11]
        assert root_manifest(tmp_path).requested_at == pytest.approx(clock.now - 1.0 + 0.1)
    assert ckpt.stats["request-answered"] == 2


def test_a_request_from_before_the_run_is_not_answered(tmp_path):
    # Given a marker left by an earlier run of the job (written before this run started)
    write_request(tmp_path, START - 60)
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock) as ckpt:
        ckpt.resume()
        # When the run goes through step boundaries
        run_steps(ckpt, model, clock, range(0, 3))
    # Then it writes no checkpoint for it, and says why
    assert model.saves == []
    assert ckpt.stats["request-before-run"] == 1


def test_a_request_older_than_the_resumed_checkpoint_is_not_answered_again(tmp_path):
    # Given a previous run answered a request with the checkpoint at step 4
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock) as ckpt:
        ckpt.resume()
        run_steps(ckpt, model, clock, range(0, 3))
        write_request(tmp_path, clock.now + 0.5)
        run_steps(ckpt, model, clock, range(3, 4))
    assert model.saves == [4]
    # When a relaunch that started before the marker's time (clocks, a quick restart) resumes
    again, later = Model(), Clock(clock.now + 10)
    with checkpointer(tmp_path, again, later, run_started_at=START) as ckpt2:
        assert ckpt2.resume() == 4
        run_steps(ckpt2, again, later, range(4, 8))
    # Then the marker still in the directory is recognised as answered
    assert again.saves == []
    assert ckpt2.stats["request-already-answered"] == 1


@pytest.mark.parametrize(
    "body",
    ['{"reason": "no time"}', "not json", '["requested_at", 5]', '{"requested_at": "soon"}', '{"requested_at": true}'],
    ids=["no-requested-at", "not-json", "not-an-object", "time-not-a-number", "time-a-boolean"],
)
def test_a_malformed_request_is_ignored_counted_and_training_goes_on(tmp_path, body):
    model, clock = Model(), Clock()
    marker = tmp_path / REQUEST_FILE
    marker.parent.mkdir(parents=True)
    marker.write_text(body)
    with checkpointer(tmp_path, model, clock) as ckpt:
        ckpt.resume()
        run_steps(ckpt, model, clock, range(0, 3))
    assert model.saves == []
    assert model.trained == [0, 1, 2]
    assert ckpt.stats["request-malformed"] == 1  # read once: the marker did not change


# -- periodic checkpoints and pruning ---------------------------------------------------------
def test_periodic_checkpoints_come_at_the_first_boundary_after_the_period(tmp_path):
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock, every_s=10.0) as ckpt:
        ckpt.resume()
        # Given steps of 3 s and a 10 s period, When 12 steps run
        run_steps(ckpt, model, clock, range(12), step_s=3.0)
    # Then a checkpoint follows every 4th step (12 s >= 10 s), never sooner
    assert model.saves == [4, 8, 12]
    assert root_manifest(tmp_path).reason is Reason.PERIODIC


def test_only_the_newest_k_checkpoints_are_kept(tmp_path):
    # Given keep=2 and a torn checkpoint left by an earlier run at step 1
    (tmp_path / "step-000000000001").mkdir(parents=True)
    (tmp_path / "step-000000000001" / "weights.json").write_text("{")
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock, every_s=1.0, keep=2) as ckpt:
        ckpt.resume()
        # When five checkpoints are written
        run_steps(ckpt, model, clock, range(5))
    # Then only the two newest remain, and the manifest names the newest
    assert model.saves == [1, 2, 3, 4, 5]
    assert checkpoint_dirs(tmp_path) == ["step-000000000004", "step-000000000005"]
    assert root_manifest(tmp_path).path == "step-000000000005"
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


# -- SIGTERM ----------------------------------------------------------------------------------
def test_sigterm_during_a_step_saves_at_its_end_and_exits_zero(tmp_path):
    model, clock = Model(), Clock()
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stopped:
        with checkpointer(tmp_path, model, clock, grace_s=120) as ckpt:
            ckpt.resume()
            run_steps(ckpt, model, clock, range(0, 3))
            # Given SIGTERM arrives in the middle of step 3
            clock.advance(0.5)
            os.kill(os.getpid(), signal.SIGTERM)
            assert ckpt.stopping and model.saves == []  # only a flag inside the handler
            clock.advance(0.5)
            model.train(3)
            # When step 3 ends
            ckpt.step_done(3)
    # Then the finished step is in the checkpoint, the exit code is 0, and the handler is restored
    assert stopped.value.code == 0
    assert stopped.value.manifest.step == 4
    assert (root_manifest(tmp_path).step, root_manifest(tmp_path).reason) == (4, Reason.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_sigterm_during_a_periodic_save_stops_without_saving_twice(tmp_path):
    model, clock = Model(), Clock()
    model.during_save = lambda directory: os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Stopped):
        with checkpointer(tmp_path, model, clock, every_s=2.0) as ckpt:
            ckpt.resume()
            # Given SIGTERM arrives while the periodic checkpoint after step 1 is being saved
            run_steps(ckpt, model, clock, range(0, 5))
    # Then that checkpoint is current: the run stops after it, without a second save
    assert model.saves == [2]
    assert model.trained == [0, 1]
    assert root_manifest(tmp_path).step == 2


def test_sigterm_with_a_request_pending_answers_the_request_too(tmp_path):
    model, clock = Model(), Clock()
    with pytest.raises(Stopped):
        with checkpointer(tmp_path, model, clock) as ckpt:
            ckpt.resume()
            run_steps(ckpt, model, clock, range(0, 2))
            write_request(tmp_path, clock.now + 0.1)
            os.kill(os.getpid(), signal.SIGTERM)
            run_steps(ckpt, model, clock, range(2, 3))
    manifest = root_manifest(tmp_path)
    assert (manifest.step, manifest.reason, manifest.requested_at) == (3, Reason.SIGTERM, START + 2.1)


def test_distributed_ranks_stop_together_when_one_rank_got_sigterm(tmp_path):
    # Given a non-writer rank that has seen nothing, and a group where another rank got SIGTERM
    model, clock = Model(), Clock()
    agreed: list[int] = []

    def agree(action: int) -> int:
        agreed.append(action)
        return 3 if len(agreed) == 2 else action

    with pytest.raises(Stopped):
        with checkpointer(tmp_path, model, clock, writer=False, agree=agree) as ckpt:
            ckpt.resume()
            run_steps(ckpt, model, clock, range(0, 5))
    # Then it saves its part at the agreed boundary and stops there, writing no manifest
    assert agreed == [0, 0]
    assert model.saves == [2]
    assert not (tmp_path / MANIFEST).exists()


def test_a_step_that_outlives_the_grace_is_reported_before_the_kill(tmp_path, caplog):
    # Given a grace of 50 ms (real time: the watcher sleeps on the process's clock)
    caplog.set_level(logging.ERROR, logger="preemptor_training")
    model = Model()
    with pytest.raises(Stopped):
        with Checkpointer(tmp_path, save=model.save, load=model.load, environ={}, grace_s=0.05) as ckpt:
            ckpt.resume()
            ckpt.step_done(0)
            ckpt.checkpoint(Reason.PERIODIC)
            # When SIGTERM arrives and the step in progress goes on past the grace
            os.kill(os.getpid(), signal.SIGTERM)
            reported = threading.Event()
            for _ in range(200):  # bounded: at most 10 s
                if ckpt.stats["grace-exceeded"]:
                    reported.set()
                    break
                threading.Event().wait(0.05)
            # Then the log says so, naming the step the next run resumes at
            assert reported.is_set()
            ckpt.step_done(1)
    assert [r.reason for r in caplog.records if r.levelno == logging.ERROR] == ["grace-exceeded"]
    assert "resumes at step 1" in caplog.records[0].getMessage()


def test_a_save_slower_than_the_grace_is_flagged_at_the_first_periodic_checkpoint(tmp_path):
    # Given a save that takes longer than the stop grace (20 ms against 1 ms)
    model, clock = Model(), Clock()
    slow = model.save

    def save(directory: Path, step: int) -> None:
        threading.Event().wait(0.02)
        slow(directory, step)

    with Checkpointer(tmp_path, save=save, load=model.load, environ={}, clock=clock, every_s=1.0, grace_s=0.001) as ckpt:
        ckpt.resume()
        # When the first periodic checkpoint is taken, long before any stop
        run_steps(ckpt, model, clock, range(1))
    # Then the mismatch is reported then, with the measured save time in the manifest
    assert ckpt.stats["save-exceeds-grace"] == 1
    assert root_manifest(tmp_path).save_s >= 0.02


@pytest.mark.parametrize(
    "uri",
    ["s3://bucket-only", "s3://bucket-only/", "https://bucket/prefix", "s3://Bad_Bucket/prefix", "bucket/prefix"],
    ids=["bare-bucket", "bare-bucket-slash", "not-s3", "invalid-bucket-name", "no-scheme"],
)
def test_a_checkpoint_location_must_be_an_s3_prefix(tmp_path, uri):
    model = Model()
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        Checkpointer(tmp_path, save=model.save, load=model.load, environ={}, s3_uri=uri)


# -- configuration from the environment -------------------------------------------------------
@pytest.mark.parametrize(
    ("environ", "grace"),
    [
        ({"AWS_BATCH_JOB_ID": "j-1"}, 30.0),
        ({"TRAINING_JOB_NAME": "experiment-r2"}, 120.0),
        ({"TRAINING_JOB_NAME": "experiment-r2", "PREEMPTOR_STOP_GRACE_S": "90"}, 90.0),
        ({"AWS_BATCH_JOB_ID": "j-1", "PREEMPTOR_STOP_GRACE_S": "soon"}, 30.0),
    ],
    ids=["batch-default", "sagemaker-default", "set-by-the-controller", "unreadable-value-falls-back"],
)
def test_the_stop_grace_follows_the_service_unless_the_controller_sets_it(tmp_path, environ, grace):
    model = Model()
    ckpt = Checkpointer(tmp_path, save=model.save, load=model.load, environ=environ)
    assert ckpt.grace_s == grace


def test_a_batch_job_mirrors_to_its_location_and_sagemaker_leaves_it_to_sagemaker(tmp_path):
    model = Model()
    batch = Checkpointer(tmp_path, save=model.save, load=model.load, environ={"AWS_BATCH_JOB_ID": "j", "PREEMPTOR_CHECKPOINT_S3_URI": "s3://ckpt-bucket/jobs/a"})
    sagemaker = Checkpointer(tmp_path, save=model.save, load=model.load, environ={"TRAINING_JOB_NAME": "a", "PREEMPTOR_CHECKPOINT_S3_URI": "s3://ckpt-bucket/jobs/a"})
    assert (batch.upload, str(batch.s3.location)) == (True, "s3://ckpt-bucket/jobs/a")
    assert (sagemaker.upload, str(sagemaker.s3.location)) == (False, "s3://ckpt-bucket/jobs/a")


# -- S3: the marker, the mirror ---------------------------------------------------------------
BUCKET = "preemptor-checkpoints"
URI = f"s3://{BUCKET}/checkpoints/experiment"


@pytest.fixture
def s3(monkeypatch):
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def keys(client, prefix: str = "checkpoints/experiment/") -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def test_the_controllers_request_in_s3_is_answered_with_a_checkpoint_it_accepts(tmp_path, s3):
    from preemptor.adapters.checkpoints import CheckpointStore

    controller = CheckpointStore(s3)
    model = Model()
    with Checkpointer(tmp_path, save=model.save, load=model.load, environ={"AWS_BATCH_JOB_ID": "j"}, s3_uri=URI, s3_client=s3, poll_s=0.001) as ckpt:
        ckpt.resume()
        for step in range(3):
            model.train(step)
            ckpt.step_done(step)
        assert keys(s3) == []
        # Given the controller asks for a checkpoint, the way it does (its own S3 adapter)
        import time

        requested_at = time.time()
        controller.request(URI, requested_at, "preemption: for production")
        # When the next step ends
        model.train(3)
        ckpt.step_done(3)
    # Then the checkpoint is in S3, manifest last-named, and the controller's own freshness
    # check sees a checkpoint at least as new as its request
    assert keys(s3) == [
        "checkpoints/experiment/_preemptor/checkpoint-request.json",
        "checkpoints/experiment/manifest.json",
        "checkpoints/experiment/step-000000000004/manifest.json",
        "checkpoints/experiment/step-000000000004/optimizer/state.bin",
        "checkpoints/experiment/step-000000000004/weights.json",
    ]
    newest = controller.newest(URI)
    assert newest is not None and int(newest) >= int(requested_at)
    uploaded = Manifest.decode(s3.get_object(Bucket=BUCKET, Key="checkpoints/experiment/manifest.json")["Body"].read())
    assert (uploaded.step, uploaded.reason, uploaded.requested_at) == (4, Reason.REQUESTED, requested_at)


def test_the_marker_in_s3_is_read_at_most_once_per_poll_interval(tmp_path, s3):
    reads: list[str] = []
    s3.meta.events.register("provide-client-params.s3.GetObject", lambda params, **kw: reads.append(params["Key"]))
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock, s3_uri=URI, s3_client=s3, poll_s=30.0) as ckpt:
        ckpt.resume()
        # Given 1 s steps, When 95 steps run
        run_steps(ckpt, model, clock, range(95))
    # Then S3 was asked at the first boundary and every 30 s after: 4 reads, not 95
    assert reads == ["checkpoints/experiment/_preemptor/checkpoint-request.json"] * 4


def test_an_unchanged_marker_in_s3_is_not_parsed_again_and_a_changed_one_is(tmp_path, s3):
    marker_key = "checkpoints/experiment/_preemptor/checkpoint-request.json"
    conditional: list[bool] = []
    s3.meta.events.register("provide-client-params.s3.GetObject", lambda params, **kw: conditional.append("IfNoneMatch" in params))
    # Given a marker in S3 the helper cannot use
    s3.put_object(Bucket=BUCKET, Key=marker_key, Body=b"{not json")
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock, s3_uri=URI, s3_client=s3, upload=False, poll_s=1.0) as ckpt:
        ckpt.resume()
        # When it is polled at three boundaries
        run_steps(ckpt, model, clock, range(3))
        # Then it is parsed (and reported) once: the later reads are conditional (304, no body)
        assert ckpt.stats["request-malformed"] == 1
        assert conditional == [False, True, True]
        # And when the controller replaces it with a request, the next boundary answers it
        s3.put_object(Bucket=BUCKET, Key=marker_key, Body=json.dumps({"requested_at": clock.now, "reason": "preemption"}).encode())
        run_steps(ckpt, model, clock, range(3, 4))
    assert model.saves == [4]
    assert root_manifest(tmp_path).requested_at == START + 3


def test_an_unreadable_marker_location_is_counted_and_training_goes_on(tmp_path, s3):
    model, clock = Model(), Clock()
    with checkpointer(tmp_path, model, clock, s3_uri="s3://no-such-bucket-here/x", s3_client=s3, upload=False, poll_s=1.0) as ckpt:
        ckpt.resume()
        run_steps(ckpt, model, clock, range(3))
    assert model.trained == [0, 1, 2]
    assert ckpt.stats["request-poll-failed:NoSuchBucket"] == 3


def test_a_batch_job_on_a_fresh_host_resumes_from_the_checkpoint_in_s3(tmp_path, s3):
    # Given a first run on one host that mirrored checkpoints to S3, keeping two
    first, clock = Model(), Clock()
    with checkpointer(tmp_path / "host-1", first, clock, s3_uri=URI, s3_client=s3, every_s=1.0, keep=2, poll_s=1e9) as ckpt:
        ckpt.resume()
        run_steps(ckpt, first, clock, range(6))
    # Then S3 holds the two newest only (pruned there too)
    assert {k.split("/")[2] for k in keys(s3) if "/step-" in k} == {"step-000000000005", "step-000000000006"}

    # And a torn copy of a later checkpoint (files without their manifest) is in S3
    s3.put_object(Bucket=BUCKET, Key="checkpoints/experiment/step-000000000009/weights.json", Body=b"{")
    # When the relaunch starts on a new host with an empty directory
    second = Model()
    with checkpointer(tmp_path / "host-2", second, Clock(clock.now + 60), s3_uri=URI, s3_client=s3, poll_s=1e9) as ckpt2:
        start = ckpt2.resume()
    # Then it resumes at step 6 with the state of step 6, and the torn copy is removed
    assert start == 6
    assert second.trained == list(range(6))
    assert LocalStore(tmp_path / "host-2").newest().step == 6
    assert not [k for k in keys(s3) if "step-000000000009" in k]


def test_a_failed_upload_is_counted_and_the_local_checkpoint_stays_usable(tmp_path, s3, caplog):
    model, clock = Model(), Clock()
    caplog.set_level(logging.ERROR, logger="preemptor_training")
    with checkpointer(tmp_path, model, clock, s3_uri=URI, s3_client=s3, upload=True, poll_s=1e9, every_s=1.0) as ckpt:
        ckpt.resume()
        # Given the location became unwritable after the run started (here: the bucket is gone)
        s3.delete_bucket(Bucket=BUCKET)
        # When a checkpoint is taken
        run_steps(ckpt, model, clock, range(1))
    # Then the error code reached the count and the log, and the checkpoint is complete here
    assert ckpt.stats["upload-failed:NoSuchBucket"] == 1
    assert any(getattr(r, "reason", "") == "upload-failed:NoSuchBucket" for r in caplog.records)
    assert LocalStore(tmp_path).newest().step == 1


def s3_steps(client) -> list[str]:
    """The checkpoint directories in S3 that hold their manifest."""
    return sorted(k.split("/")[2] for k in keys(client) if "/step-" in k and k.endswith("/" + MANIFEST))


def test_checkpoints_that_could_not_be_copied_never_prune_the_good_ones_from_s3(tmp_path, s3):
    from aws_faults import aws_says_no, error_response

    model, clock = Model(), Clock()
    with checkpointer(tmp_path / "host-1", model, clock, s3_uri=URI, s3_client=s3, every_s=1.0, keep=2, poll_s=1e9) as ckpt:
        ckpt.resume()
        # Given two checkpoints copied to S3
        run_steps(ckpt, model, clock, range(2))
        assert s3_steps(s3) == ["step-000000000001", "step-000000000002"]
        # When the next three cannot be copied (writes denied), while the local ones are pruned
        with aws_says_no(s3, "PutObject", error_response("AccessDenied", "Access Denied", 403)) as refused:
            run_steps(ckpt, model, clock, range(2, 5))
        assert refused and ckpt.stats["upload-failed:AccessDenied"] == 3
        assert checkpoint_dirs(tmp_path / "host-1") == ["step-000000000004", "step-000000000005"]
        # Then S3 still holds the two it had: a relaunch on a fresh host resumes at step 2
        assert s3_steps(s3) == ["step-000000000001", "step-000000000002"]
        fresh = Model()
        with checkpointer(tmp_path / "host-2", fresh, Clock(clock.now), s3_uri=URI, s3_client=s3, poll_s=1e9) as other:
            assert other.resume() == 2
        assert fresh.trained == [0, 1]
        # And once copies succeed again, S3 is pruned to the two newest it holds
        run_steps(ckpt, model, clock, range(5, 6))
        assert s3_steps(s3) == ["step-000000000002", "step-000000000006"]
        run_steps(ckpt, model, clock, range(6, 7))
    assert s3_steps(s3) == ["step-000000000006", "step-000000000007"]
    assert {k.split("/")[2] for k in keys(s3) if "/step-" in k} == {"step-000000000006", "step-000000000007"}


def test_a_torn_copy_in_s3_that_cannot_be_deleted_does_not_stop_the_resume(tmp_path, s3):
    from aws_faults import aws_says_no, error_response

    # Given a complete checkpoint at step 3 in S3 and a torn copy of step 5 beside it
    first, clock = Model(), Clock()
    with checkpointer(tmp_path / "host-1", first, clock, s3_uri=URI, s3_client=s3, every_s=3.0, poll_s=1e9) as ckpt:
        ckpt.resume()
        run_steps(ckpt, first, clock, range(3))
    s3.put_object(Bucket=BUCKET, Key="checkpoints/experiment/step-000000000005/weights.json", Body=b"{")
    # When a relaunch may read but not delete (a role without s3:DeleteObject)
    second = Model()
    with aws_says_no(s3, "DeleteObjects", error_response("AccessDenied", "Access Denied", 403)):
        with checkpointer(tmp_path / "host-2", second, Clock(clock.now + 60), s3_uri=URI, s3_client=s3, poll_s=1e9) as ckpt2:
            start = ckpt2.resume()
    # Then it resumes from the complete one, says the torn copy was left, and never reads it
    assert (start, second.trained) == (3, [0, 1, 2])
    assert ckpt2.stats["s3-torn-left:AccessDenied"] == 1
    assert "checkpoints/experiment/step-000000000005/weights.json" in keys(s3)


def test_a_throttled_restore_is_retried_with_backoff_before_the_run_gives_up(tmp_path, s3):
    from aws_faults import THROTTLING, aws_says_no

    # Given a first run's checkpoints in S3
    first, clock = Model(), Clock()
    with checkpointer(tmp_path / "host-1", first, clock, s3_uri=URI, s3_client=s3, every_s=1.0, poll_s=1e9) as ckpt:
        ckpt.resume()
        run_steps(ckpt, first, clock, range(3))
    # When the relaunch's first two listings are throttled (SlowDown)
    slept: list[float] = []
    second = Model()
    with aws_says_no(s3, "ListObjectsV2", THROTTLING["s3"], times=2) as refused:
        with checkpointer(tmp_path / "host-2", second, Clock(clock.now + 60), s3_uri=URI, s3_client=s3, poll_s=1e9, sleep=slept.append) as ckpt2:
            start = ckpt2.resume()
    # Then it waited and read again, and resumed where the first run stopped
    assert len(refused) == 2 and slept == [2.0, 4.0]
    assert ckpt2.stats["s3-restore-retried:SlowDown"] == 2
    assert (start, second.trained) == (3, [0, 1, 2])


def test_an_unreadable_mirror_at_start_refuses_to_train_from_scratch(tmp_path, s3):
    # Given a Batch job whose checkpoint location cannot be read when it starts
    model, clock = Model(), Clock()
    model.load = lambda directory: pytest.fail("nothing was restored")
    with checkpointer(tmp_path, model, clock, s3_uri="s3://no-such-bucket-here/x", s3_client=s3, upload=True) as ckpt:
        # When it resumes, Then it stops with the S3 error code instead of starting at step 0
        with pytest.raises(RestoreFailed) as failed:
            ckpt.resume()
    assert failed.value.code == "NoSuchBucket"
    assert ckpt.stats["s3-restore-failed:NoSuchBucket"] == 1
    assert model.saves == []


def test_write_atomic_replaces_the_whole_file(tmp_path):
    target = tmp_path / MANIFEST
    write_atomic(target, b"old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST]
