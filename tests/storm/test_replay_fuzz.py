"""`preemptor replay-events` over every real AWS sample plus generated and mutated events:
an outcome line for each, exit 0, nothing raised.

The mutations are what a hostile or broken sender produces: fields deleted, values of the
wrong type, huge strings, control characters, unknown detail-types, JSON that is not an
object, JSON cut short. They come from a seeded generator, so a failure replays exactly.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

from preemptor_tools.cli import main
from preemptor_tools.local.replay import expand

ROOT = Path(__file__).resolve().parents[2]
# CI has a read-only copy of shared/ beside the repository.
SAMPLES = ROOT.parent / "shared" / "data" / "events"
REPO_EVENTS = ROOT / "events"
OUTCOMES = {"accepted", "ignored", "rejected", "duplicate"}
CONTROL = "".join(chr(c) for c in range(0, 32)) + "\x7f\u2028\ufeff"


def _paths(value, prefix=()):
    """Every (path, value) in a JSON value, objects and lists alike."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _set(event, path, value=None, delete=False):
    target = event
    for step in path[:-1]:
        target = target[step]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value


def mutate(event: dict, rng: random.Random) -> dict | list | str | int | None:
    """One hostile variant of a well-formed event."""
    event = copy.deepcopy(event)
    paths = [p for p, _ in _paths(event) if p]
    kind = rng.choice(["delete", "wrong-type", "huge", "control", "detail-type", "not-an-object"])
    path = rng.choice(paths) if paths else None
    if kind == "delete" and path:
        _set(event, path, delete=True)
    elif kind == "wrong-type" and path:
        _set(event, path, rng.choice([None, 0, -1, 1e308, True, [], {}, "", ["x"], {"x": 1}]))
    elif kind == "huge" and path:
        _set(event, path, "x" * rng.choice([1_000, 100_000]))
    elif kind == "control" and path:
        _set(event, path, "".join(rng.choice(CONTROL + "ab") for _ in range(40)))
    elif kind == "detail-type":
        event["detail-type"] = rng.choice(["Job Exploded", "", "SageMaker Training Job State Change\x00", "x" * 5000])
    else:
        return rng.choice([[event], 42, "event", None])
    return event


def generated_events(tmp_path: Path, samples: list[Path], count: int, seed: int) -> list[Path]:
    rng = random.Random(seed)
    valid = []
    for path in samples:
        try:
            event = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(event, dict) and "detail" in event:
            valid.append(event)
    out = tmp_path / "mutated"
    out.mkdir()
    files = []
    for n in range(count):
        variant = mutate(rng.choice(valid), rng)
        text = json.dumps(variant)
        if n % 10 == 0:
            text = text[: rng.randrange(1, max(2, len(text)))]  # JSON cut short
        path = out / f"mutated-{n:03d}.json"
        path.write_text(text)
        files.append(path)
    return files


def test_replay_events_answers_every_real_and_mutated_event(tmp_path: Path, capsys) -> None:
    # Given every real AWS sample, the repository's samples, and 150 mutations of them
    assert SAMPLES.is_dir(), f"the shared event samples are missing at {SAMPLES}"
    samples = expand([SAMPLES, REPO_EVENTS])
    mutated = generated_events(tmp_path, samples, count=150, seed=8)
    files = samples + mutated

    # When they are replayed through the intake of the emulated stack
    code = main(["replay-events", str(SAMPLES), str(REPO_EVENTS), str(tmp_path / "mutated")])

    # Then the command succeeds with one known outcome per file, and nothing raised
    lines = capsys.readouterr().out.splitlines()
    verdicts = [line for line in lines if line.split(": ", 1)[0].endswith(".json")]
    assert code == 0
    assert len(verdicts) == len(files)
    outcomes = [line.split(": ", 2)[1] for line in verdicts]
    errors = [line for line in verdicts if line.split(": ", 2)[1] not in OUTCOMES]
    assert errors == []
    assert outcomes.count("rejected") > 0 and outcomes.count("ignored") > 0
