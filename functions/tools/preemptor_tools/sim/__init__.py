"""The simulator: replays a job trace through our planner or a competitor's policy.

`trace` reads traces, `baselines` holds the policies (ours is the core planner itself),
`engine` is the discrete-event loop and its model, `metrics` summarises a replay and
`report` writes the bench's tables and plots. See docs/simulator.md.
"""

from .baselines import POLICY_NAMES, SimPolicy, StopModel, policy_by_name, preemptor_policy
from .engine import SimConfig, SimResult, SimulationError, simulate
from .metrics import summarize
from .trace import TraceError, TraceJob, load_trace

__all__ = [
    "POLICY_NAMES",
    "SimConfig",
    "SimPolicy",
    "SimResult",
    "SimulationError",
    "StopModel",
    "TraceError",
    "TraceJob",
    "load_trace",
    "policy_by_name",
    "preemptor_policy",
    "simulate",
    "summarize",
]
