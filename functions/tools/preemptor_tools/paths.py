"""Where the checkout's files are: the tools run from a source checkout, never from a Lambda."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = REPO_ROOT / "template.yaml"
STATEMACHINES = REPO_ROOT / "statemachines"
