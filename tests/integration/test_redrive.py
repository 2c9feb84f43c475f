"""`preemptor redrive` on the emulated stack: what Lambda dead-lettered after its three attempts
goes back to its function and is handled; what the queue holds that is not the stack's own
stays there, with the reason; what AWS refuses during the redrive is kept for the next one."""

from __future__ import annotations

import json

import pytest
from emulation import START, emulation
from eventfiles import load_raw
from iam_policy import StackPolicies

from aws_faults import aws_says_no, error_response, is_job_insert
from preemptor.core.model import JobState
from preemptor_tools import ops, redrive
from preemptor_tools.local import server
from preemptor_tools.local.hostile import HostileWorld
from preemptor_tools.tables import Painter

OPERATOR = "RedriveOperatorPolicy"  # the template's managed policy for the people who redrive
THROTTLED = error_response("ThrottlingException", "Rate of requests exceeds the allowed throughput.", 400)


def _submission() -> dict:
    return json.loads(load_raw("preemptor/job-submitted-sagemaker.json"))


def _target(env) -> ops.Target:
    stack = env.stack
    return ops.Target(stack.stack_name, server.stack_outputs(stack), dict(stack.parameters), stack.session)


def _queue(env) -> str:
    return server.stack_outputs(env.stack)["EventsDeadLetterQueueUrl"]


def _messages(env) -> list[dict]:
    """Every message of the dead-letter queue, left in it (a receive that hides nothing)."""
    out = env.stack.client("sqs").receive_message(
        QueueUrl=_queue(env), MaxNumberOfMessages=10, VisibilityTimeout=0, MessageAttributeNames=["All"]
    )
    return out.get("Messages", [])


def _redrive(env, target: ops.Target | None = None, **options) -> dict:
    """Redrive as the operator holding the template's policy, then let the workflows run."""
    with env.stack.calls.acting_as(OPERATOR):
        result = redrive.redrive(target or _target(env), wait_s=0, **options)
    env.stack.drain()
    return result


def _dead_lettered_submission(env) -> dict:
    """A submission whose three attempts all fail (its job's insert is throttled the while):
    Lambda sends its invocation record to the queue."""
    event = _submission()
    with aws_says_no(env.store.client, "TransactWriteItems", lambda p: THROTTLED if is_job_insert(p) else None):
        assert env.put(event).results[0]["outcome"] == "retrying"
        env.advance(180, step=60)
    return event


def _hostile(clock):
    return HostileWorld(clock, START)  # no chaos of its own: Lambda's retries and dead letters


def test_a_submission_dead_lettered_after_lambdas_attempts_is_redriven_and_runs():
    with emulation(hostile=_hostile) as env:
        # Given a submission Lambda gave up on after its three attempts
        event = _dead_lettered_submission(env)
        assert env.store.get("llm-pretrain-7b") is None
        [message] = _messages(env)
        record = json.loads(message["Body"])
        # (its record as Lambda writes one: the event, the function, the last error)
        assert record["requestPayload"] == event
        assert record["requestContext"]["condition"] == "RetriesExhausted"
        assert record["requestContext"]["approximateInvokeCount"] == 3
        assert record["requestContext"]["functionArn"].endswith(f":function:{env.stack.resources['IntakeFunction']}:$LATEST")
        assert record["responseContext"]["functionError"] == "Unhandled"
        # When the operator redrives the queue
        result = _redrive(env)
        # Then the submission is handled: the job exists and runs, the queue is empty
        [done] = result["redriven"]
        assert done["event_id"] == event["id"] and done["writer"] == "lambda" and "Throttl" in done["error"]
        assert result["refused"] == [] and result["failed"] == []
        env.advance(300)
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING
        assert _messages(env) == []
        # And the operator's calls are what the template's policy for operators grants
        policies = StackPolicies.of(env.stack, managed=(OPERATOR,))
        mine = [c for c in env.stack.calls.calls if c.principal == OPERATOR]
        assert {r.action for c in mine for r in c.requests} == {"sqs:ReceiveMessage", "sqs:DeleteMessage", "lambda:InvokeFunction"}
        assert policies.denials(mine) == []
        # And a second redrive finds nothing
        assert _redrive(env)["redriven"] == []


def test_a_dead_letter_whose_event_was_handled_after_all_changes_nothing():
    with emulation(hostile=_hostile) as env:
        # Given a submission handled once, and a dead letter of the same event (its handling
        # died after its work: Lambda recorded a failure it had in fact done)
        event = _submission()
        env.put(event)
        env.advance(300)
        before = env.job("llm-pretrain-7b")
        assert before.status is JobState.RUNNING
        intake = env.stack.functions[env.stack.resources["IntakeFunction"]]
        env.stack.client("sqs").send_message(QueueUrl=_queue(env), MessageBody=json.dumps({
            "version": "1.0",
            "requestContext": {"functionArn": f"{intake.arn}:$LATEST", "condition": "RetriesExhausted", "approximateInvokeCount": 3},
            "requestPayload": event,
            "responsePayload": {"errorMessage": "Task timed out after 30.00 seconds"},
        }))
        # When it is redriven
        [done] = _redrive(env)["redriven"]
        # Then the intake knows the event: the job is not submitted again, not relaunched
        assert done["event_id"] == event["id"]
        after = env.job("llm-pretrain-7b")
        assert (after.status, after.incarnation, after.run_id) == (before.status, before.incarnation, before.run_id)
        assert env.kinds("llm-pretrain-7b").count("submitted") == 1
        assert _messages(env) == []


def test_an_event_eventbridge_could_not_deliver_is_redriven_to_its_target():
    with emulation(hostile=_hostile) as env:
        # Given an event EventBridge dead-lettered (the invoke throttled): the event itself,
        # its rule and target in the message's attributes
        event = _submission()
        intake = env.stack.functions[env.stack.resources["IntakeFunction"]]
        attributes = {
            "RULE_ARN": f"arn:aws:events:us-east-1:123456789012:rule/{env.stack.stack_name}-submissions",
            "TARGET_ARN": intake.arn,
            "ERROR_CODE": "SDK_CLIENT_ERROR",
            "ERROR_MESSAGE": "Rate Exceeded. (Service: Lambda, Status Code: 429)",
            "RETRY_ATTEMPTS": "8",
        }
        env.stack.client("sqs").send_message(
            QueueUrl=_queue(env),
            MessageBody=json.dumps(event),
            MessageAttributes={k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()},
        )
        # When it is redriven
        [done] = _redrive(env)["redriven"]
        # Then it reached the intake as it would have: the job is accepted
        assert (done["writer"], done["attempts"]) == ("eventbridge", 8) and "429" in done["error"]
        env.advance(300)
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING


def _forged_submission(team: str) -> dict:
    event = _submission()
    return {**event, "id": f"forged-{team}", "source": f"preemptor.{team}"}


@pytest.mark.parametrize(
    "body, attributes, why",
    [
        ("not json {", {}, "its body is not JSON"),
        (json.dumps(_submission()), {}, "neither a Lambda invocation record nor an EventBridge dead letter"),
        (
            json.dumps({"requestContext": {"functionArn": "arn:aws:lambda:us-east-1:123456789012:function:someone-elses"},
                        "requestPayload": _forged_submission("production")}),
            {},
            "names function arn:aws:lambda:us-east-1:123456789012:function:someone-elses, not one of this stack's",
        ),
        (
            json.dumps({"requestContext": {"functionArn": "not-an-arn"}, "requestPayload": _submission()}),
            {},
            "names no function ARN",
        ),
        (json.dumps({"requestContext": {"functionArn": "INTAKE"}, "requestPayload": ["a", "list"]}), {}, "carries no EventBridge event"),
        (json.dumps({"detail": {}}), {"TARGET_ARN": "INTAKE"}, "carries no EventBridge event"),
    ],
    ids=["not-json", "a-bare-event", "another-function", "no-arn", "no-event", "eventbridge-without-id"],
)
def test_what_redrive_will_not_hand_back_stays_in_the_queue_with_its_reason(body, attributes, why):
    with emulation(hostile=_hostile) as env:
        intake = env.stack.functions[env.stack.resources["IntakeFunction"]].arn
        body = body.replace('"INTAKE"', json.dumps(intake))
        # Given a message in the queue that is not a dead letter of the stack's functions
        env.stack.client("sqs").send_message(
            QueueUrl=_queue(env),
            MessageBody=body,
            MessageAttributes={k: {"DataType": "String", "StringValue": intake if v == "INTAKE" else v} for k, v in attributes.items()},
        )
        # When the operator redrives the queue
        result = _redrive(env)
        # Then it is refused, named with its reason, and left in the queue, visible again
        [refused] = result["refused"]
        assert refused["why"].startswith(why), refused["why"]
        assert result["redriven"] == [] and result["failed"] == []
        assert len(_messages(env)) == 1
        # And nothing reached the intake
        assert env.store.get("llm-pretrain-7b") is None
        # (showing it again is a call the operators' policy grants)
        mine = [c for c in env.stack.calls.calls if c.principal == OPERATOR]
        assert "sqs:ChangeMessageVisibility" in {r.action for c in mine for r in c.requests}
        assert StackPolicies.of(env.stack, managed=(OPERATOR,)).denials(mine) == []


def test_a_dry_run_lists_the_dead_letters_and_leaves_them():
    with emulation(hostile=_hostile) as env:
        event = _dead_lettered_submission(env)
        result = _redrive(env, dry_run=True)
        [listed] = result["listed"]
        assert listed["event_id"] == event["id"] and "redriven" not in result
        assert len(_messages(env)) == 1
        # (and says so as text: what it would hand back, to whom, and why it failed)
        first, line = redrive.render(result, Painter(False)).splitlines()
        assert first == f"would redrive 1 dead letter(s) of {_queue(env)}"
        assert line.startswith(f"  Job Submitted from {event['source']} (event {event['id']}) to {env.stack.resources['IntakeFunction']}: RetriesExhausted")
        assert env.store.get("llm-pretrain-7b") is None


@pytest.mark.parametrize(
    "operation, answer, kept_because",
    [
        ("Invoke", error_response("TooManyRequestsException", "Rate Exceeded.", 429, Reason="CallerRateLimitExceeded"), "not re-invoked: Invoke: TooManyRequestsException"),
        ("Invoke", error_response("AccessDeniedException", "not authorized to perform: lambda:InvokeFunction", 403), "not re-invoked: Invoke: AccessDeniedException"),
        ("DeleteMessage", error_response("AWS.SimpleQueueService.NonExistentQueue", "The specified queue does not exist.", 400), "re-invoked, but left in the queue"),
    ],
    ids=["invoke-throttled", "invoke-denied", "delete-refused"],
)
def test_a_dead_letter_aws_refuses_to_redrive_is_kept_for_the_next_redrive(operation, answer, kept_because):
    with emulation(hostile=_hostile) as env:
        # Given a dead-lettered submission, and AWS saying no to one call of the redrive
        _dead_lettered_submission(env)
        target = _target(env)
        client = target.client("lambda" if operation == "Invoke" else "sqs")
        with aws_says_no(client, operation, answer):
            result = _redrive(env, target)
        # Then the dead letter stays in the queue, visible again, with what AWS said
        [failed] = result["failed"]
        assert failed["why"].startswith(kept_because), failed["why"]
        assert len(_messages(env)) == 1
        # And the next redrive hands it back once: the submission runs, accepted once
        assert len(_redrive(env, target)["redriven"]) == 1
        env.advance(300)
        assert env.job("llm-pretrain-7b").status is JobState.RUNNING
        assert env.kinds("llm-pretrain-7b").count("submitted") == 1
        assert _messages(env) == []


def test_a_redriven_event_that_fails_again_returns_to_the_queue():
    with emulation(hostile=_hostile) as env:
        # Given a dead-lettered submission, and the cause still there
        event = _dead_lettered_submission(env)
        with aws_says_no(env.store.client, "TransactWriteItems", lambda p: THROTTLED if is_job_insert(p) else None):
            # When it is redriven: Lambda's three attempts fail again
            [done] = _redrive(env)["redriven"]
            env.advance(180, step=60)
        # Then it is dead-lettered again, not lost
        [message] = _messages(env)
        assert json.loads(message["Body"])["requestPayload"] == event
        assert done["event_id"] == event["id"]
