"""Scheduling policy: a typed, validated, immutable configuration read once at the edge.

The operator's file (`POLICY_CONFIG`, `preemptor plan --policy FILE`) is one JSON object:
the tier names, the knobs that apply to every pool, and per-pool overrides under `pools`.

```json
{"tiers": {"critical": 1000, "high": 500, "medium": 200, "low": 50},
 "within_team": "LowerPriority", "across_teams": "LowerPriority",
 "aging": {"rate_per_hour": 10, "cap": "below-next-tier", "starving_after_s": 86400},
 "pools": {"p5": {"min_runtime_s": 1800, "budget": {"window_s": 3600, "max_preemptions": 4}}}}
```

A pool's override replaces the knob it names; for knobs that are objects (`aging`,
`fair_share`, `near_completion`, `budget`, `tier_max_sla_s`) it replaces only the keys it
gives. `docs/policy.md` is the reference of every knob.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

DEFAULT_TIERS: Mapping[str, int] = {"critical": 1000, "high": 500, "medium": 200, "low": 50}
MAX_PRIORITY = 1000
LOWEST_TIER = "lowest"  # in `spot_max_priority`: whatever the lowest configured tier is

# A team name becomes an EventBridge source (`preemptor.<team>`), an S3 prefix
# (`<bucket>/<team>/<job>`), a tag value and a principal tag: lower-case letters, digits
# and hyphens, at most 63 characters, so it is valid in all four.
TEAM_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
# Whom a run a team launched is counted against when its team tag names no team (malformed):
# not a team name, so no team's quota, grant or share is taken by it.
UNATTRIBUTED = "(unattributed)"


def validate_team_name(team: object) -> str:
    """Check that `team` is a well-formed team name (see `TEAM_NAME`).

    Raises:
        ValueError: naming what is wrong, with the value shortened.
    """
    if not isinstance(team, str) or not TEAM_NAME.fullmatch(team):
        shown = repr(team) if not isinstance(team, str) or len(team) <= 40 else repr(team[:37] + "...")
        raise ValueError(
            f"team must be 1..63 lower-case letters, digits or hyphens starting with a letter or digit, got {shown}"
        )
    return team


class PreemptionMode(StrEnum):
    """Who may preempt whom (the names of Kueue's `withinClusterQueue` policies)."""

    NEVER = "Never"
    LOWER_PRIORITY = "LowerPriority"
    LOWER_OR_NEWER_EQUAL_PRIORITY = "LowerOrNewerEqualPriority"


class ReclaimMode(StrEnum):
    """Whether a team within its nominal quota takes back capacity other teams borrowed
    (Kueue's `reclaimWithinCohort`)."""

    NEVER = "Never"
    LOWER_PRIORITY = "LowerPriority"  # only borrowed work of lower priority
    ANY = "Any"  # any borrowed work, whatever its priority


class CheckpointTimeoutAction(StrEnum):
    """What to do with a victim that did not write a fresh checkpoint in time."""

    STOP_ANYWAY = "stop-anyway"  # stop it and record the lost work
    SPARE = "spare"  # leave it running; the preemptor waits for the next cycle


class MaxPreemptionsAction(StrEnum):
    """What happens to a job that has been preempted `max_preemptions` times."""

    PROTECT = "protect"  # it can no longer be chosen as a victim
    FAIL = "fail"  # it is failed instead of relaunched (AWS Batch's retries-before-termination)


class AgingCap(StrEnum):
    BELOW_NEXT_TIER = "below-next-tier"  # aging never lifts a job into the next tier
    NONE = "none"  # aging goes up to the maximum priority


class _Knob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Aging(_Knob):
    """A waiting job's effective priority rises by `rate_per_hour` points per hour waited
    (off by default: the controller reads its pending window from an index sorted by
    claimed priority, so aging can only reorder the jobs inside the window; see
    docs/policy.md, "Aging and the pending window").

    The rise stops one point below the next tier (`cap`), so aging orders work within a
    tier and does not overturn the tiers. A job that has waited `starving_after_s` loses
    the cap and reserves capacity: jobs ranked below it may no longer take the GPUs it
    waits for, so low work cannot starve forever behind a stream of small or higher jobs.
    """

    rate_per_hour: float = Field(default=0.0, ge=0)
    cap: AgingCap = AgingCap.BELOW_NEXT_TIER
    starving_after_s: float | None = Field(default=None, gt=0)  # opt-in: see docs/policy.md


class FairShare(_Knob):
    """Among jobs of equal effective priority, the team with less decayed usage goes first."""

    enabled: bool = True
    half_life_s: float = Field(default=86_400.0, gt=0)  # 1 day: see docs/policy.md


class NearCompletion(_Knob):
    """No preemption of a job about to finish (by its estimated remaining time or its progress)."""

    remaining_s: float | None = Field(default=None, gt=0)  # protected while 0 <= remaining < this
    progress: float | None = Field(default=None, ge=0, le=1)  # protected while progress > this


class Budget(_Knob):
    """At most `max_preemptions` preemptions, or `max_gpu_hours` of lost work, per pool and window."""

    window_s: float = Field(default=3600.0, gt=0)
    max_preemptions: int | None = Field(default=None, ge=0)
    max_gpu_hours: float | None = Field(default=None, ge=0)


class CheckpointWait(_Knob):
    """When a victim that is not known to save on SIGTERM is worth waiting for.

    The workflow asks for a checkpoint and waits only when the work it saves, the victim's
    GPUs x its seconds at risk, outweighs what the wait costs: the preemptor's GPUs x
    `expected_wait_s` (the checkpoint's write time plus the workflow's poll), weighted by
    the preemptor's priority over the victim's (`priority_weighted`).
    """

    expected_wait_s: float = Field(default=200.0, ge=0)
    priority_weighted: bool = True


class CheckpointAhead(_Knob):
    """Checkpoints asked of likely victims before a preemption needs them.

    A pending job of higher priority that will soon stop running jobs names its likely
    victims: one that holds capacity without preempting yet (its preemption delay, the
    preemption budget), and, with `on_queue_pressure`, one that cannot fit even with every
    victim it may take until a little more capacity frees (queue pressure; a starving job
    that reserves capacity too). They are asked for a checkpoint now, so that when the
    preemption comes their checkpoint is fresh and they are stopped at once.

    A job the wait alarm will escalate (a tier it watches, `PendingJob.escalates_at`) that
    cannot fit now names, `before_escalation_s` ahead, the victims it will take once
    escalated: escalation lifts their minimum runtime, and an escalated job stops its
    victims without waiting for a checkpoint.

    Preemptions also come unannounced (a job submitted that stops others at once). With
    `forecast_window_s`, the pool's preemptions of that window forecast the GPUs the next
    `forecast_horizon_s` will take: the running jobs first in victim order, up to that
    many GPUs, are likely victims too.

    The budget: at most `max_jobs` per pool and plan; only victims with more than
    `min_at_risk_s` of work at risk; a job is asked ahead at most once per `min_interval_s`.
    """

    max_jobs: int = Field(default=8, ge=0)  # 0 turns it off
    min_at_risk_s: float = Field(default=300.0, ge=0)
    min_interval_s: float = Field(default=1800.0, ge=0)
    on_queue_pressure: bool = True
    forecast_window_s: float | None = Field(default=3600.0, gt=0)  # None: no forecast
    forecast_horizon_s: float = Field(default=900.0, gt=0)
    before_escalation_s: float | None = Field(default=300.0, gt=0)  # None: not ahead of escalation


# An IAM role's ARN: partition, 12-digit account, then the role's path and name (IAM allows
# letters, digits and +=,.@_- in names, and / between path parts).
ROLE_ARN = re.compile(r"arn:aws(?:-[a-z]+)*:iam::\d{12}:role/[\w+=,.@/-]{1,512}")


class TeamPolicy(_Knob):
    """What one team may ask for: its highest priority (an integer or a tier name); and the
    SageMaker execution role its training jobs run as (`training_role_arn`), the team's own,
    so that one team's jobs cannot read or write another team's checkpoints (None: the
    pool's role, else the stack's ManagedRoleArnForTraining, which every such team shares)."""

    max_priority: int | str = MAX_PRIORITY
    training_role_arn: str | None = None

    @field_validator("training_role_arn")
    @classmethod
    def _role_arn(cls, arn: str | None) -> str | None:
        if arn is not None and not ROLE_ARN.fullmatch(arn):
            raise ValueError(f"expected an IAM role ARN (arn:aws:iam::<account>:role/<name>), got {arn[:80]!r}")
        return arn


class Quota(_Knob):
    """A team's guaranteed GPUs in a pool, optionally for one tier of its work only.

    `borrowing_limit`: GPUs above nominal the team may borrow from idle quota (None: no limit).
    `lending_limit`: GPUs of its idle nominal quota others may borrow (None: all of it);
    the rest, `nominal_gpus - lending_limit`, is kept free for the team.
    """

    team: str = Field(min_length=1)
    tier: str | None = None
    nominal_gpus: int = Field(ge=0)
    borrowing_limit: int | None = Field(default=None, ge=0)
    lending_limit: int | None = Field(default=None, ge=0)

    @field_validator("tier")
    @classmethod
    def _lower(cls, tier: str | None) -> str | None:
        return None if tier is None else tier.lower()

    @model_validator(mode="after")
    def _lending_within_nominal(self) -> "Quota":
        if self.lending_limit is not None and self.lending_limit > self.nominal_gpus:
            raise ValueError(f"lending_limit {self.lending_limit} exceeds nominal_gpus {self.nominal_gpus}")
        return self

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.team, self.tier)

    @property
    def ceiling(self) -> float:
        """Most GPUs the quota's work may hold: nominal plus what it may borrow."""
        return float("inf") if self.borrowing_limit is None else self.nominal_gpus + self.borrowing_limit

    @property
    def kept(self) -> int:
        """GPUs of the nominal quota never lent to others."""
        return 0 if self.lending_limit is None else self.nominal_gpus - self.lending_limit


# Knobs that are objects: a pool override merges into them key by key.
_OBJECT_KNOBS = (
    "aging", "fair_share", "near_completion", "budget", "tier_max_sla_s", "tier_preemption_delay_s",
    "checkpoint_wait", "checkpoint_ahead",
)


class PoolPolicy(BaseModel):
    """The knobs of one pool. `Policy` holds the defaults; `Policy.for_pool` the effective set."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    # -- ranking -------------------------------------------------------------------------
    aging: Aging = Field(default_factory=Aging)
    fair_share: FairShare = Field(default_factory=FairShare)
    tier_max_sla_s: dict[str, float] = Field(default_factory=dict)
    spot_max_priority: int | str | None = "lowest"  # a priority, a tier name, "lowest" (tier), or null
    # -- quotas --------------------------------------------------------------------------
    quotas: tuple[Quota, ...] = ()
    reclaim_within_pool: ReclaimMode = ReclaimMode.ANY
    # -- who may preempt whom --------------------------------------------------------------
    within_team: PreemptionMode = PreemptionMode.LOWER_PRIORITY
    across_teams: PreemptionMode = PreemptionMode.LOWER_PRIORITY
    # -- protections -----------------------------------------------------------------------
    min_runtime_s: float = Field(default=0.0, ge=0)
    near_completion: NearCompletion = Field(default_factory=NearCompletion)
    max_preemptions: int | None = Field(default=None, ge=0)
    on_max_preemptions: MaxPreemptionsAction = MaxPreemptionsAction.PROTECT
    # -- rate limits -----------------------------------------------------------------------
    budget: Budget | None = None
    preemption_delay_s: float = Field(default=0.0, ge=0)
    # Per tier of the preemptor's claimed priority: replaces `preemption_delay_s` for it.
    tier_preemption_delay_s: dict[str, float] = Field(default_factory=dict)
    # -- checkpoint protocol (the workflows loop on these) --------------------------------
    checkpoint_max_age_s: float = Field(default=900.0, gt=0)
    checkpoint_poll_s: int = Field(default=30, gt=0)
    checkpoint_wait_max_s: int = Field(default=600, gt=0)
    on_checkpoint_timeout: CheckpointTimeoutAction = CheckpointTimeoutAction.STOP_ANYWAY
    checkpoint_wait: CheckpointWait = Field(default_factory=CheckpointWait)
    checkpoint_ahead: CheckpointAhead = Field(default_factory=CheckpointAhead)
    stop_poll_s: int = Field(default=30, gt=0)
    stop_wait_max_s: int = Field(default=900, gt=0)

    @field_validator("tier_max_sla_s")
    @classmethod
    def _positive_slas(cls, limits: dict[str, float]) -> dict[str, float]:
        for tier, seconds in limits.items():
            if seconds <= 0:
                raise ValueError(f"tier_max_sla_s[{tier!r}] must be positive, got {seconds}")
        return {tier.lower(): seconds for tier, seconds in limits.items()}

    @field_validator("tier_preemption_delay_s")
    @classmethod
    def _delays(cls, delays: dict[str, float]) -> dict[str, float]:
        for tier, seconds in delays.items():
            if seconds < 0:
                raise ValueError(f"tier_preemption_delay_s[{tier!r}] must be >= 0, got {seconds}")
        return {tier.lower(): seconds for tier, seconds in delays.items()}

    @field_validator("quotas")
    @classmethod
    def _one_quota_per_key(cls, quotas: tuple[Quota, ...]) -> tuple[Quota, ...]:
        keys = [q.key for q in quotas]
        repeated = sorted({f"{t}/{tier or '*'}" for t, tier in keys if keys.count((t, tier)) > 1})
        if repeated:
            raise ValueError(f"one quota per team and tier; repeated: {', '.join(repeated)}")
        return quotas

    def workflow_settings(self) -> dict:
        """The numbers the Step Functions workflows loop on (waits, bounds, timeout action)."""
        return {
            "checkpoint_poll_s": self.checkpoint_poll_s,
            "checkpoint_attempts": max(1, self.checkpoint_wait_max_s // self.checkpoint_poll_s),
            "on_checkpoint_timeout": self.on_checkpoint_timeout.value,
            "stop_poll_s": self.stop_poll_s,
            "stop_attempts": max(1, self.stop_wait_max_s // self.stop_poll_s),
        }


_POOL_KNOBS = tuple(PoolPolicy.model_fields)


def escalation_lead_s(knobs: PoolPolicy) -> float | None:
    """How long before the wait alarm escalates a waiting job its likely victims are asked
    for a checkpoint (`checkpoint_ahead.before_escalation_s`); None when that is off, or no
    checkpoint is asked ahead at all (`max_jobs` 0)."""
    ahead = knobs.checkpoint_ahead
    return ahead.before_escalation_s if ahead.max_jobs else None


def history_window_s(knobs: PoolPolicy) -> float | None:
    """How far back the planner reads a pool's past preemptions (`Snapshot.preemption_history`):
    the budget's window and the checkpoint forecast's, the longer; None when it reads none."""
    ahead = knobs.checkpoint_ahead
    windows = [knobs.budget.window_s] if knobs.budget is not None else []
    if ahead.max_jobs and ahead.forecast_window_s is not None:
        windows.append(ahead.forecast_window_s)
    return max(windows, default=None)


class Policy(PoolPolicy):
    """The knobs of one controller: tier names, defaults for every pool, per-pool overrides.

    Defaults are the documented defaults: LowerPriority within and across teams, no minimum
    runtime, no near-completion protection, no budget, no delay, no quotas.
    """

    tiers: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_TIERS))
    pools: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # The teams allowed to submit, with their priority ceilings. None: any well-formed team
    # may submit at any priority.
    teams: dict[str, TeamPolicy] | None = None

    _effective: dict[str, PoolPolicy] = PrivateAttr(default_factory=dict)
    _default: PoolPolicy | None = PrivateAttr(default=None)
    _ceilings: dict[str, int] = PrivateAttr(default_factory=dict)

    @field_validator("tiers")
    @classmethod
    def _tiers_in_range(cls, tiers: dict[str, int]) -> dict[str, int]:
        if not tiers:
            raise ValueError("at least one tier is needed")
        for name, value in tiers.items():
            if not 0 <= value <= MAX_PRIORITY:
                raise ValueError(f"tier {name!r} has priority {value}, outside 0..{MAX_PRIORITY}")
        return {name.lower(): value for name, value in tiers.items()}

    @model_validator(mode="after")
    def _resolve_pools(self) -> "Policy":
        default = PoolPolicy.model_validate({k: getattr(self, k) for k in _POOL_KNOBS})
        self._check_tier_names("", default)
        effective = {}
        base = default.model_dump(mode="json")
        for name, override in self.pools.items():
            unknown = sorted(set(override) - set(_POOL_KNOBS))
            if unknown:
                raise ValueError(f"pools.{name}: unknown knob(s) {', '.join(unknown)}")
            merged = dict(base)
            for key, value in override.items():
                if key in _OBJECT_KNOBS and isinstance(value, dict) and isinstance(merged.get(key), dict):
                    merged[key] = {**merged[key], **value}
                else:
                    merged[key] = value
            try:
                knobs = PoolPolicy.model_validate(merged)
            except ValidationError as e:
                raise ValueError(f"pools.{name}: {e}") from None
            self._check_tier_names(f"pools.{name}.", knobs)
            effective[name] = knobs
        self._default = default
        self._effective = effective
        self._ceilings = self._resolve_teams()
        return self

    def _resolve_teams(self) -> dict[str, int]:
        ceilings: dict[str, int] = {}
        role_of: dict[str, str] = {}
        for team, limits in (self.teams or {}).items():
            try:
                validate_team_name(team)
            except ValueError as e:
                raise ValueError(f"teams: {e}") from None
            ceilings[team] = self.priority_value(limits.max_priority, f"teams.{team}.max_priority")
            role = limits.training_role_arn
            if role is not None and role in role_of:
                # A role is scoped to one team's checkpoints by its preemptor-team tag; two
                # teams on one role could each read and write the other's.
                raise ValueError(
                    f"teams.{team}.training_role_arn: {role} is also the training role of team {role_of[role]!r}; "
                    "each team needs a role of its own"
                )
            if role is not None:
                role_of[role] = team
        return ceilings

    def training_role(self, team: str) -> str | None:
        """The execution role of `team`'s training jobs, if it has one of its own."""
        limits = (self.teams or {}).get(team)
        return limits.training_role_arn if limits is not None else None

    def team_listed(self, team: str) -> bool:
        """Whether `team` may submit at all (every team when no `teams` are configured)."""
        return self.teams is None or team in self._ceilings

    def max_priority(self, team: str) -> int:
        """The highest priority `team` may run at (MAX_PRIORITY when no `teams` are configured)."""
        if self.teams is None:
            return MAX_PRIORITY
        return self._ceilings.get(team, -1)

    def _check_tier_names(self, where: str, knobs: PoolPolicy) -> None:
        known = ", ".join(sorted(self.tiers))
        for tier in knobs.tier_max_sla_s:
            if tier not in self.tiers:
                raise ValueError(f"{where}tier_max_sla_s: unknown tier {tier!r} (tiers: {known})")
        for tier in knobs.tier_preemption_delay_s:
            if tier not in self.tiers:
                raise ValueError(f"{where}tier_preemption_delay_s: unknown tier {tier!r} (tiers: {known})")
        for quota in knobs.quotas:
            if quota.tier is not None and quota.tier not in self.tiers:
                raise ValueError(f"{where}quotas: unknown tier {quota.tier!r} for team {quota.team!r} (tiers: {known})")
        self.priority_value(knobs.spot_max_priority, f"{where}spot_max_priority")

    def for_pool(self, name: str) -> PoolPolicy:
        """The effective knobs of pool `name`: its overrides over the defaults."""
        return self._effective.get(name) or self._default  # type: ignore[return-value]

    def priority_value(self, value: int | str | None, what: str = "priority") -> int | None:
        """An integer priority or a tier name, as an integer (None stays None)."""
        if value is None or isinstance(value, bool):
            return None
        if value == LOWEST_TIER:
            return min(self.tiers.values())
        if isinstance(value, int):
            if not 0 <= value <= MAX_PRIORITY:
                raise ValueError(f"{what}: {value} is outside 0..{MAX_PRIORITY}")
            return value
        level = self.tiers.get(str(value).lower())
        if level is None:
            raise ValueError(f"{what}: unknown tier {value!r} (tiers: {', '.join(sorted(self.tiers))})")
        return level

    def tier_of(self, priority: int) -> str:
        """Name of the highest tier whose value is <= priority ('below-<lowest>' under all)."""
        best = None
        for name, value in sorted(self.tiers.items(), key=lambda kv: kv[1]):
            if value <= priority:
                best = name
        return best or f"below-{min(self.tiers, key=self.tiers.__getitem__)}"

    def workflow_settings(self, pool: str | None = None) -> dict:
        """The numbers the workflows loop on, for `pool` (the defaults when None)."""
        knobs = self._default if pool is None else self.for_pool(pool)
        return PoolPolicy.workflow_settings(knobs)  # type: ignore[arg-type]
