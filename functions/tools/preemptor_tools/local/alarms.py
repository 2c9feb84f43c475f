"""CloudWatch's part of the wait alarm, in the local runtime.

moto keeps alarms but evaluates none, least of all a Metrics Insights query. Here the wait
alarm (template.yaml `WaitAlarm`) is evaluated every period as CloudWatch would evaluate
its query: the oldest wait of the pending jobs of the watched tiers (what the functions
report as `OldestPendingWaitSeconds`), in minutes, against the threshold. When its state
changes, a `CloudWatch Alarm State Change` event of the real shape (the AWS sample in
events/other/, with this alarm's name, state and reason) is put on the default bus, where
the stack's rule routes an ALARM to the intake, which escalates (service/escalation.py).
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import uuid
from collections.abc import Callable

from preemptor.core.model import JobState

from ..paths import REPO_ROOT
from .stack import EmulatedStack, RoutedEvent

SAMPLE = REPO_ROOT / "events/other/amazon-cloudwatch-user-guide__cloudwatch-alarm-state-change__06df3b84.json"
PERIOD_S = 300  # the alarm's Period


class WaitAlarm:
    def __init__(self, stack: EmulatedStack, period_s: float = PERIOD_S):
        self.stack = stack
        self.period_s = period_s
        self.name = f"{stack.stack_name}-job-waiting-too-long"
        self.tiers = {t.strip() for t in stack.parameters["WaitAlarmTiers"].split(",") if t.strip()}
        self.threshold_min = float(stack.parameters["HighPriorityWaitAlarmMinutes"])
        self.state = "OK"
        self.next_at = stack.clock.now() + period_s
        self.transitions: list[tuple[float, str]] = []  # (when, new state)

    def tick(self, on_event: Callable[[RoutedEvent], None] | None = None) -> int:
        """Evaluate every period that has ended; returns the state changes sent."""
        sent = 0
        while self.stack.clock.now() >= self.next_at:
            at, self.next_at = self.next_at, self.next_at + self.period_s
            minutes = self._oldest_wait_s(at) / 60
            state = "ALARM" if minutes > self.threshold_min else "OK"
            if state == self.state:
                continue
            routed = self.stack.put_event(self._event(at, state, minutes))
            self.stack.drain()
            self.state = state
            self.transitions.append((at, state))
            sent += 1
            if on_event is not None:
                on_event(routed)
        return sent

    def _oldest_wait_s(self, at: float) -> float:
        policy = self.stack.deps().settings.policy
        waits = [
            at - job.submitted_at
            for job in self.stack.jobs()
            if job.status is JobState.PENDING and policy.tier_of(job.priority) in self.tiers
        ]
        return max(waits, default=0.0)

    def _event(self, at: float, state: str, minutes: float) -> dict:
        event = copy.deepcopy(json.loads(SAMPLE.read_text(encoding="utf-8")))
        when = dt.datetime.fromtimestamp(at, dt.timezone.utc)
        stamp = when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "+0000"
        comparison = "greater" if state == "ALARM" else "not greater"
        previous = {"value": self.state, "reason": f"was {self.state}", "timestamp": stamp}
        event.update(
            id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"preemptor-local/{self.name}/{at}")),
            time=when.strftime("%Y-%m-%dT%H:%M:%SZ"),
            region=self.stack.region,
            resources=[f"arn:aws:cloudwatch:{self.stack.region}:123456789012:alarm:{self.name}"],
        )
        event["detail"].update(
            alarmName=self.name,
            configuration={"description": "The oldest pending job of a watched tier has waited too long.", "metrics": []},
            previousState=previous,
            state={
                "value": state,
                "reason": f"Threshold Crossed: 1 out of the last 1 datapoints [{minutes:.1f}] was {comparison} than the threshold ({self.threshold_min:g}).",
                "timestamp": stamp,
            },
        )
        return event
