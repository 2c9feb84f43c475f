"""Alarms that act: the wait alarm's state change escalates the jobs it is about.

When the wait alarm (template.yaml `WaitAlarm`: the oldest pending job of a watched tier has
waited longer than its threshold) goes to ALARM, EventBridge delivers the state change to
the intake, and each pending job of a watched tier that has waited longer than the
threshold is escalated: marked on its record (`escalated_at`), in one transaction with its
decision-log line and its team's notice (`waiting-too-long`, published after it, or by
reconcile), and its pool planned again at once. The planner then lifts the soft
protections (minimum runtime, spare-on-timeout, preemption delay) of the victims it
chooses for that job (docs/policy.md). Quotas, priorities and non-preemptible jobs are not
soft: escalation never lets a job take what the policy forbids.
"""

from __future__ import annotations

from ..adapters.alerts import Alerts
from ..adapters.store import JobsStore, LogLine
from ..adapters.workflows import WorkflowStarter, execution_name
from ..config import Settings
from ..core.model import Notice
from .actions import announce


def escalate(
    *, store: JobsStore, settings: Settings, workflows: WorkflowStarter, alerts: Alerts | None, alarm: str, now: float
) -> dict:
    """Escalate every pending job of a watched tier waiting past the alarm's threshold;
    returns {"escalated": [job...], "pools": [pool...]}. Idempotent: a job is escalated once
    per wait, so a repeated alarm event changes nothing."""
    threshold_s = settings.wait_alarm_minutes * 60
    watched = set(settings.wait_alarm_tiers)
    escalated: list[str] = []
    pools: list[str] = []
    for pool in settings.pools:
        mine, replan = [], False
        for record in store.pending(pool.name, settings.pending_window):
            waited = now - record.waiting_since()  # the current wait: a requeue starts a new one
            if settings.policy.tier_of(record.priority) not in watched or waited <= threshold_s:
                continue
            subject = f"Preemptor: job {record.name} has waited {waited / 60:.0f} min"
            message = {"pool": pool.name, "waited_s": round(waited), "alarm": alarm, "action": "escalated"}
            notice = Notice(pool.name, now, "waiting-too-long", record.name, record.team, subject, message)
            line = LogLine(
                record.name, now, "escalated", "wait-alarm",
                f"{alarm}: waited {waited / 60:.0f} min (over {settings.wait_alarm_minutes:g}); "
                "the soft protections of its victims are lifted",
            )
            if not store.escalate(record.name, now, line, notice):
                # Escalated in this wait already (else no longer pending): an earlier delivery
                # whose schedule start failed is retried by EventBridge, so plan the pool again.
                replan = replan or (record.escalated_at is not None and record.escalated_at >= record.waiting_since())
                continue
            mine.append(record.name)
            announce(store, alerts, notice)
        escalated += mine
        if mine or replan:
            pools.append(pool.name)
            workflows.start("schedule", execution_name("escalation", pool.name, f"{int(now)}"), {"pool": pool.name})
    return {"escalated": escalated, "pools": pools}
