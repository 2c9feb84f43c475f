"""The one loader for the event samples in `events/`.

Tests read events through these helpers only, so the samples that `sam local invoke -e`
takes are exactly the ones the tests check.
"""

from __future__ import annotations

from pathlib import Path

EVENTS_DIR = Path(__file__).resolve().parent.parent / "events"


def event_path(name: str) -> Path:
    """Path of a sample given relative to `events/`, e.g. "ec2/foo.json"."""
    path = EVENTS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"no event sample {name!r} under {EVENTS_DIR}")
    return path


def load_raw(relpath: str) -> str:
    """The sample's exact text (malformed samples are not valid JSON, so no decoding)."""
    return event_path(relpath).read_text(encoding="utf-8")


def all_event_files() -> list[Path]:
    """Every `*.json` sample under `events/`, sorted."""
    return sorted(EVENTS_DIR.rglob("*.json"))


def relative_name(path: Path) -> str:
    """The name `event_path` takes for `path`, e.g. "ec2/foo.json"."""
    return path.relative_to(EVENTS_DIR).as_posix()
