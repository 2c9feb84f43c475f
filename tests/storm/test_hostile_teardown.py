"""A hostile stack cleans up after itself: the next world alone decides what fails.

Not in test_hostile_world.py: that module keeps one stack alive for all its tests, and two
emulated stacks must never be alive at once in one process (they share moto's backends).
"""

from __future__ import annotations

from emulation import START, emulation

from preemptor_tools.local.hostile import HostileWorld
from preemptor_tools.local.scenario import Chaos

ALWAYS = 0.999


def test_a_stopped_stack_leaves_no_hostile_hook_behind() -> None:
    # Given a hostile stack started and stopped (as one test, or one demo, after another)
    import botocore.handlers

    before = list(botocore.handlers.BUILTIN_HANDLERS)
    with emulation(hostile=lambda clock: HostileWorld(clock, START, chaos=Chaos(throttle_rate=ALWAYS))) as emulated:
        world = emulated.stack.hostile
        assert len(botocore.handlers.BUILTIN_HANDLERS) > len(before)

    # Then botocore's handlers are as they were, so the next world alone decides what fails
    assert botocore.handlers.BUILTIN_HANDLERS == before
    assert not any(getattr(spec[1], "__self__", None) is world for spec in botocore.handlers.BUILTIN_HANDLERS)


def test_state_machine_calls_are_recorded_though_a_task_client_was_made_before_the_stack() -> None:
    # Given a Step Functions task client made before any stack (a test that ran workflows on
    # moto alone): its session was made without the stack's call recorder
    from preemptor_tools.local.moto_patches import stepfunctions

    stepfunctions._task_client("us-east-1", "lambda")
    # When a stack then runs a scheduling cycle
    with emulation() as env:
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=1, duration=600)
        env.advance(120)
        by = {(c.principal, c.api_action) for c in env.stack.calls.calls}
    # Then its state machine's calls are recorded as its own (the stack makes its task
    # clients' session after its recorder: an earlier one left them unrecorded, and IAM unproved)
    assert ("ScheduleStateMachine", "lambda:Invoke") in by
