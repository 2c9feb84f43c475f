"""The example training loop as a real process: SIGTERM, relaunch, the controller's request.

`examples/training/train.py` trains a deterministic stand-in model, so a run that was
stopped and resumed must end with exactly the numbers of a run that never stopped. Waits
are bounded; nothing asserts on how long anything took.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "training" / "train.py"
WAIT_S = 60.0  # upper bound of every wait: a stuck process fails the test, it never hangs


class Training:
    """One run of train.py, its stdout read line by line as it comes."""

    def __init__(self, checkpoint_dir: Path, *args: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTOR_", "AWS_BATCH_", "TRAINING_JOB_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "functions" / "training"), env.get("PYTHONPATH", "")])
        self.process = subprocess.Popen(
            [sys.executable, str(TRAIN), "--checkpoint-dir", str(checkpoint_dir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_errors, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def _pump_errors(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.errors.append(line.rstrip("\n"))

    def wait_for_line(self, pattern: str) -> re.Match[str]:
        deadline = time.monotonic() + WAIT_S
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if match := regex.fullmatch(line):
                return match
        pytest.fail(f"no line matching {pattern!r}; output so far: {self.lines[-5:]}; stderr: {self._stderr()}")

    def finish(self) -> int:
        try:
            code = self.process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail("train.py did not exit")
        while (line := self._queue.get(timeout=WAIT_S)) is not None:
            self.lines.append(line)
        return code

    def _stderr(self) -> str:
        return "\n".join(self.errors[-20:])


def manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def wait_for_manifest(directory: Path, condition) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            current = manifest(directory)
        except (FileNotFoundError, ValueError):
            current = None
        if current is not None and condition(current):
            return current
        time.sleep(0.05)
    pytest.fail(f"manifest in {directory} never satisfied the condition")


def uninterrupted_result(tmp_path: Path, steps: int) -> str:
    run = Training(tmp_path / "uninterrupted", "--steps", str(steps), "--step-seconds", "0")
    assert run.finish() == 0
    return run.lines[-1]


def test_sigterm_then_relaunch_loses_nothing_beyond_the_step_in_progress(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Given a training process that has made progress (no periodic checkpoint: the one it
    # writes is the SIGTERM one; a signal landing in a periodic save is a unit test's case)
    first = Training(ckpt, "--steps", "100000", "--step-seconds", "0.01", "--every-s", "600")
    seen = int(first.wait_for_line(r"step (2\d) done")[1])
    assert not (ckpt / "manifest.json").exists()

    # When the service stops it (SIGTERM, as StopTrainingJob and TerminateJob do)
    first.process.send_signal(signal.SIGTERM)
    code = first.finish()

    # Then it exits 0 after a checkpoint of the step that was in progress
    assert code == 0, first._stderr()
    done = [int(m[1]) for line in first.lines if (m := re.fullmatch(r"step (\d+) done", line))]
    saved = manifest(ckpt)
    assert saved["reason"] == "sigterm"
    assert saved["step"] == done[-1] + 1 >= seen + 1
    assert first.lines[-1] == f"stopped: checkpoint at step {saved['step']}"
    assert all((ckpt / f["path"]).stat().st_size == f["bytes"] for f in saved["files"])

    # And a second run resumes there and ends exactly where a run that never stopped ends
    total = saved["step"] + 25
    second = Training(ckpt, "--steps", str(total), "--step-seconds", "0")
    assert second.wait_for_line(r"resumed at step (\d+)")[1] == str(saved["step"])
    assert second.finish() == 0
    first_step_of_second = next(int(m[1]) for line in second.lines if (m := re.fullmatch(r"step (\d+) done", line)))
    assert first_step_of_second == saved["step"]
    assert second.lines[-1] == uninterrupted_result(tmp_path, total)


def test_the_running_process_answers_the_controllers_request_and_the_relaunch_does_not(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Given a training process with no periodic checkpoints (a 10-minute period)
    first = Training(ckpt, "--steps", "100000", "--step-seconds", "0.01", "--every-s", "600")
    first.wait_for_line(r"step 3 done")
    assert not (ckpt / "manifest.json").exists()

    # When the controller's request marker appears in its checkpoint directory
    requested_at = time.time()
    marker = ckpt / "_preemptor" / "checkpoint-request.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"requested_at": requested_at, "reason": "preemption: for production"}))

    # Then a checkpoint answering it appears while the process keeps training
    answered = wait_for_manifest(ckpt, lambda m: m["reason"] == "requested")
    assert answered["requested_at"] == requested_at
    assert first.process.poll() is None
    first.process.send_signal(signal.SIGTERM)
    assert first.finish() == 0

    # And the relaunch, finding the same marker, does not answer it again
    stopped_at = manifest(ckpt)["step"]
    second = Training(ckpt, "--steps", str(stopped_at + 10), "--step-seconds", "0", "--every-s", "600")
    assert second.finish() == 0
    assert manifest(ckpt)["step"] == stopped_at
    assert f"resumed at step {stopped_at}" in second.lines


def test_the_project_environment_has_the_helper_installed():
    # Given the project's interpreter, started outside the checkout with no PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # When it imports the helper, Then it finds the package `make` installed
    found = subprocess.run(
        [sys.executable, "-c", "import preemptor_training, pathlib; print(pathlib.Path(preemptor_training.__file__).parent)"],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == ROOT / "functions" / "training" / "preemptor_training"
