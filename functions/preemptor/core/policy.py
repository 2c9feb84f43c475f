"""Scheduling policy: a typed, validated, immutable configuration read once at the edge."""

from __future__ import annotations

from enum import StrEnum
from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_TIERS: Mapping[str, int] = {"critical": 1000, "high": 500, "medium": 200, "low": 50}
MAX_PRIORITY = 1000


class PreemptionMode(StrEnum):
    """Who may preempt whom (the names of Kueue's `withinClusterQueue` policies)."""

    NEVER = "Never"
    LOWER_PRIORITY = "LowerPriority"
    LOWER_OR_NEWER_EQUAL_PRIORITY = "LowerOrNewerEqualPriority"


class CheckpointTimeoutAction(StrEnum):
    """What to do with a victim that did not write a fresh checkpoint in time."""

    STOP_ANYWAY = "stop-anyway"  # stop it and record the lost work
    SPARE = "spare"  # leave it running; the preemptor waits for the next cycle


class Policy(BaseModel):
    """The knobs of one controller. Defaults are the documented defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tiers: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_TIERS))
    within_team: PreemptionMode = PreemptionMode.LOWER_PRIORITY
    across_teams: PreemptionMode = PreemptionMode.LOWER_PRIORITY
    checkpoint_max_age_s: float = Field(default=900.0, gt=0)
    checkpoint_poll_s: int = Field(default=30, gt=0)
    checkpoint_wait_max_s: int = Field(default=600, gt=0)
    on_checkpoint_timeout: CheckpointTimeoutAction = CheckpointTimeoutAction.STOP_ANYWAY
    stop_poll_s: int = Field(default=30, gt=0)
    stop_wait_max_s: int = Field(default=900, gt=0)

    @field_validator("tiers")
    @classmethod
    def _tiers_in_range(cls, tiers: dict[str, int]) -> dict[str, int]:
        for name, value in tiers.items():
            if not 0 <= value <= MAX_PRIORITY:
                raise ValueError(f"tier {name!r} has priority {value}, outside 0..{MAX_PRIORITY}")
        return {name.lower(): value for name, value in tiers.items()}

    def tier_of(self, priority: int) -> str:
        """Name of the highest tier whose value is <= priority ('below-<lowest>' under all)."""
        best = None
        for name, value in sorted(self.tiers.items(), key=lambda kv: kv[1]):
            if value <= priority:
                best = name
        return best or f"below-{min(self.tiers, key=self.tiers.__getitem__)}"

    def workflow_settings(self) -> dict:
        """The numbers the Step Functions workflows loop on (waits, bounds, timeout action)."""
        return {
            "checkpoint_poll_s": self.checkpoint_poll_s,
            "checkpoint_attempts": max(1, self.checkpoint_wait_max_s // self.checkpoint_poll_s),
            "on_checkpoint_timeout": self.on_checkpoint_timeout.value,
            "stop_poll_s": self.stop_poll_s,
            "stop_attempts": max(1, self.stop_wait_max_s // self.stop_poll_s),
        }
