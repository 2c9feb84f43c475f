"""The operator's commands, made as the principal holding the template's policy for operators
(`ControlOperatorPolicy`): every call they make is one it grants, and it grants nothing they
do not use. moto enforces no IAM; the calls are recorded and asked of the policy
(`tests/iam_policy.py`), its conditions included."""

from __future__ import annotations

import contextlib

import pytest

from botocore.exceptions import ClientError
from emulation import emulation, when_a_step_returns
from iam_policy import StackPolicies

from preemptor.core.model import JobState
from preemptor_tools import ops

OPERATOR = "ControlOperatorPolicy"


def test_the_operators_commands_need_only_what_the_operator_policy_grants():
    with emulation() as env:
        # Given research's low sweep preempted by production's medium job, its stop waiting
        # for a checkpoint (64 GPUs x 30 minutes at risk), and the operator looking at it all
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=14400, checkpoint_every=7200)
        env.advance(1800)
        target = env.operator()

        def operate() -> None:
            # (a launch met the account's quota of the pool's type, below the pool)
            env.store.note_quota("p5", 48, env.clock.now() + 3600, "ml.p5.48xlarge for training job usage")
            with env.stack.calls.acting_as(OPERATOR):
                ops.queue(target), ops.pools(target), ops.status(target, "sweep"), ops.history(target, "sweep")
                ops.explain(target, "eval")
                # When the operator raises the victim (its preemption is called off, and leaves the budget)
                result = ops.set_priority(target, "sweep", "medium", "results due today")
                assert result["preemption_called_off"]
                # and drains the pool, then undrains it
                ops.set_drained(target, "p5", True, "maintenance")
                ops.set_drained(target, "p5", False)
                # and says that quota was raised
                assert ops.quota_raised(target, "p5")["was_gpus"] == 48

        with when_a_step_returns(env, "preempt", "Ask for a checkpoint", operate) as done:
            env.submit(name="eval", team="production", priority="medium", pool="p5", instances=4, duration=1200)
        assert done and env.job("sweep").status is JobState.RUNNING
        # Then every call the operator made is one the operator policy grants
        policies = StackPolicies.of(env.stack, managed=(OPERATOR,))
        mine = [c for c in env.stack.calls.calls if c.principal == OPERATOR]
        assert policies.denials(mine) == []
        # And it grants nothing they do not use (but DescribeStacks, which `--stack` reads the
        # outputs with: the emulated stack hands them over)
        used = {r.action for c in mine for r in c.requests}
        assert used == {
            "dynamodb:GetItem", "dynamodb:Query", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem", "states:StartExecution",
            "sns:Publish", "kms:GenerateDataKey", "kms:Decrypt",
        }
        # And research was told of the change by the operator's command, not left for reconcile
        [(notice, sent)] = [(n, sent) for n, sent in env.store.notices("p5") if n.kind == "priority-changed"]
        assert notice.job == "sweep" and sent


def test_the_operator_policy_changes_jobs_and_pools_only():
    with emulation() as env:
        dynamodb, table = env.stack.client("dynamodb"), env.stack.resources["JobsTable"]
        policies = StackPolicies.of(env.stack, managed=(OPERATOR,))

        def allowed(call) -> bool:
            before = len(env.stack.calls.calls)
            with env.stack.calls.acting_as(OPERATOR), contextlib.suppress(ClientError):
                call()
            made = env.stack.calls.calls[before:]
            assert made, "the call was not recorded"
            return not policies.denials(made)

        def put(pk: str, sk: str):
            return lambda: dynamodb.put_item(TableName=table, Item={"pk": {"S": pk}, "sk": {"S": sk}})

        def delete(pk: str, sk: str):
            return lambda: dynamodb.delete_item(TableName=table, Key={"pk": {"S": pk}, "sk": {"S": sk}})

        # Then it may write a job's and a pool's items, and delete a pool's budget item
        assert allowed(put("JOB#train", "LOG#0")) and allowed(put("POOL#p5", "NOTICE#1"))
        assert allowed(delete("POOL#p5", "PREEMPT#00000000001.000#train"))
        # And never a run alias, an event's claim or the pools' registry, nor delete a job
        for pk, sk in (("RUN#sagemaker#train", "RUN"), ("EVENT#e-1", "EVENT"), ("POOLS", "POOLS")):
            assert not allowed(put(pk, sk)), pk
        assert not allowed(delete("JOB#train", "JOB"))
        # And it starts schedule cycles, and no other workflow
        sfn = env.stack.client("stepfunctions")
        for machine, expected in (("ScheduleStateMachine", True), ("PreemptStateMachine", False)):
            arn = env.stack.state_machines[machine]
            assert allowed(lambda: sfn.start_execution(stateMachineArn=arn, name="operator-test", input="{}")) is expected, machine


@pytest.mark.parametrize("act", ["lower the preemptor", "drain the pool"])
def test_the_operators_call_off_of_a_victims_stop_needs_only_what_the_operator_policy_grants(act):
    with emulation() as env:
        # Given research's medium sweep preempted by production's high job, its stop waiting
        # for a checkpoint
        env.submit(name="sweep", team="research", priority="medium", pool="p5", instances=8, duration=14400, checkpoint_every=7200)
        env.advance(1800)
        target = env.operator()
        answers = []

        def operate() -> None:
            # When the operator lowers the production job below the sweep, or drains the pool
            with env.stack.calls.acting_as(OPERATOR):
                if act == "lower the preemptor":
                    answers.append(ops.set_priority(target, "prod", "low"))
                else:
                    answers.append(ops.set_drained(target, "p5", True, "maintenance"))

        with when_a_step_returns(env, "preempt", "Ask for a checkpoint", operate) as done:
            env.submit(name="prod", team="production", priority="high", pool="p5", instances=8, duration=1200)
        assert done
        # Then the sweep's stop is called off (it runs on, out of the preemption budget)
        assert answers[0]["victims_spared"] == ["sweep"] and env.job("sweep").status is JobState.RUNNING
        assert env.store.preemptions_since("p5", 0) == []
        # And every call the operator made is one the operator policy grants
        mine = [c for c in env.stack.calls.calls if c.principal == OPERATOR]
        assert mine and StackPolicies.of(env.stack, managed=(OPERATOR,)).denials(mine) == []
