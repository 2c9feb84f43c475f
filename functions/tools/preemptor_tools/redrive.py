"""`preemptor redrive`: hand the events in a stack's dead-letter queue back to their functions.

Two writers put messages in `EventsDeadLetterQueue`, each in its own shape:
- Lambda, for an asynchronous invocation whose attempts all failed (the intake's events, the
  scheduled reconcile), sends an invocation record: the event is its `requestPayload`, the
  function `requestContext.functionArn`, the last error `responsePayload` (Lambda developer
  guide, "Capturing records of Lambda asynchronous invocations").
- EventBridge, for an event it could not deliver to a rule's target (Lambda throttled it, or
  the invoke was denied), sends the event itself, with the message attributes `RULE_ARN`,
  `TARGET_ARN`, `ERROR_CODE` and `ERROR_MESSAGE` (EventBridge user guide, "Using dead-letter
  queues to process undelivered events").

Each dead letter is re-invoked asynchronously (`InvocationType=Event`), so Lambda's retries and
its on-failure destination hold again: an event that still fails comes back to the queue, never
lost. Only once Lambda has queued it (202) is the message deleted. The intake claims each event
id before it handles it and drops one it has handled, so an event redriven twice, or handled
before its failure was recorded, changes nothing.

Trust: the intake takes a submission's team from its `source`, which only EventBridge's
`events:source` condition guards; a message in this queue has bypassed it. The queue's policy
lets no one but EventBridge (for the stack's rules) and the two functions' roles send to it
(template.yaml, `EventsDeadLetterQueuePolicy`), and a dead letter is redriven only to a function
the stack names in its `RedriveFunctionArns` output and only when it carries an EventBridge
event. Any other message is refused with its reason and left in the queue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from .ops import BadInput, Target

# How long a received dead letter stays hidden from other readers while it is redriven (a
# refused one is shown again at the end of the run).
VISIBILITY_S = 120
_BATCH = 10  # SQS's most messages per ReceiveMessage


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter that may be redriven."""

    message_id: str
    receipt: str
    function_arn: str  # unqualified
    event: dict
    error: str  # why its function or EventBridge gave up on it
    attempts: int | None  # how often Lambda ran it (EventBridge: delivery attempts)
    sent_at: float | None  # when it reached the queue (epoch seconds)
    writer: str  # "lambda" or "eventbridge"

    def view(self) -> dict:
        return {
            "message_id": self.message_id,
            "writer": self.writer,
            "function": self.function_arn,
            "event_id": self.event.get("id"),
            "detail_type": self.event.get("detail-type"),
            "source": self.event.get("source"),
            "error": self.error,
            "attempts": self.attempts,
            "sent_at": self.sent_at,
        }


def function_arn(arn: object) -> str | None:
    """`arn:aws:lambda:<region>:<account>:function:<name>` of a function ARN, with or
    without a version or alias qualifier; None when it is not one."""
    if not isinstance(arn, str):
        return None
    parts = arn.split(":")
    if len(parts) not in (7, 8) or parts[0] != "arn" or parts[2] != "lambda" or parts[5] != "function" or not parts[6]:
        return None
    return ":".join(parts[:7])


def read(message: dict, functions: frozenset[str]) -> DeadLetter | str:
    """A message of the dead-letter queue as a `DeadLetter`, or why it is not redriven."""
    body = message.get("Body", "")
    try:
        document = json.loads(body)
    except ValueError:
        return "its body is not JSON"
    attributes = {k: v.get("StringValue") for k, v in (message.get("MessageAttributes") or {}).items()}
    system = message.get("Attributes") or {}
    sent = system.get("SentTimestamp")
    sent_at = int(sent) / 1000.0 if isinstance(sent, str) and sent.isdigit() else None
    if isinstance(document, dict) and "requestContext" in document and "requestPayload" in document:
        context = document["requestContext"] if isinstance(document["requestContext"], dict) else {}
        response = document.get("responsePayload") if isinstance(document.get("responsePayload"), dict) else {}
        named, event, writer = context.get("functionArn"), document["requestPayload"], "lambda"
        error = " ".join(str(x) for x in (context.get("condition"), response.get("errorType"), response.get("errorMessage")) if x)
        attempts = context.get("approximateInvokeCount")
    elif "TARGET_ARN" in attributes:
        named, event, writer = attributes["TARGET_ARN"], document, "eventbridge"
        error = ": ".join(x for x in (attributes.get("ERROR_CODE"), attributes.get("ERROR_MESSAGE")) if x)
        attempts = attributes.get("RETRY_ATTEMPTS")
        attempts = int(attempts) if isinstance(attempts, str) and attempts.isdigit() else None
    else:
        return "neither a Lambda invocation record nor an EventBridge dead letter (no requestContext, no TARGET_ARN attribute)"
    arn = function_arn(named)
    if arn is None:
        return f"names no function ARN ({named!r})"
    if arn not in functions:
        return f"names function {arn}, not one of this stack's ({', '.join(sorted(functions))})"
    if not isinstance(event, dict) or not isinstance(event.get("id"), str) or not isinstance(event.get("detail-type"), str):
        return "carries no EventBridge event (an object with an id and a detail-type)"
    return DeadLetter(message["MessageId"], message["ReceiptHandle"], arn, event, error, attempts if isinstance(attempts, int) else None, sent_at, writer)


def stack_functions(target: Target) -> frozenset[str]:
    """The functions a dead letter of `target` may be redriven to (its `RedriveFunctionArns`)."""
    named = target.outputs.get("RedriveFunctionArns")
    if not named:
        raise BadInput(f"stack {target.name} has no RedriveFunctionArns output: update it to this version of template.yaml")
    arns = {function_arn(a.strip()) for a in named.split(",")}
    arns.discard(None)
    return frozenset(arns)


def redrive(
    target: Target, *, dry_run: bool = False, limit: int | None = None, wait_s: int = 1, discard_refused: bool = False
) -> dict:
    """Re-invoke the dead letters of `target`'s queue (at most `limit`), or only list them
    (`dry_run`); `wait_s`: each ReceiveMessage's long poll (a short poll may miss messages).
    `discard_refused`: delete the messages it refuses, once listed (left in the queue, they
    keep its alarm in ALARM, and a new dead letter would then notify no one).

    Returns `redriven` (or `listed`), `refused` (with why, and whether it was discarded) and
    `failed` (Lambda or SQS said no; the message stays). Every message not deleted is made
    visible again before returning."""
    queue = target.outputs.get("EventsDeadLetterQueueUrl")
    if not queue:
        raise BadInput(f"stack {target.name} has no EventsDeadLetterQueueUrl output")
    functions = stack_functions(target)
    sqs, lam = target.client("sqs"), target.client("lambda")
    done: list[dict] = []
    refused: list[dict] = []
    failed: list[dict] = []
    seen: set[str] = set()
    kept: list[str] = []  # receipts of the messages left in the queue, shown again at the end
    try:
        while limit is None or len(seen) < limit:
            want = _BATCH if limit is None else min(_BATCH, limit - len(seen))
            messages = sqs.receive_message(
                QueueUrl=queue,
                MaxNumberOfMessages=want,
                VisibilityTimeout=VISIBILITY_S,
                WaitTimeSeconds=wait_s,
                AttributeNames=["SentTimestamp"],
                MessageAttributeNames=["All"],
            ).get("Messages", [])
            fresh = [m for m in messages if m["MessageId"] not in seen]  # SQS delivers at least once
            if not fresh:
                break
            for message in fresh:
                seen.add(message["MessageId"])
                letter = read(message, functions)
                if isinstance(letter, str):
                    entry = {"message_id": message["MessageId"], "why": letter, "discarded": False}
                    refused.append(entry)
                    if discard_refused and not dry_run:
                        entry["discarded"], why_kept = _delete(sqs, queue, message["ReceiptHandle"])
                        if why_kept:
                            entry["why"] += f"; not discarded: {why_kept}"
                    if not entry["discarded"]:
                        kept.append(message["ReceiptHandle"])
                elif dry_run:
                    done.append(letter.view())
                    kept.append(letter.receipt)
                else:
                    outcome = _redrive_one(sqs, lam, queue, letter)
                    if outcome is None:
                        done.append(letter.view())
                    else:
                        failed.append({**letter.view(), "why": outcome})
                        kept.append(letter.receipt)
    finally:
        for receipt in kept:
            try:
                sqs.change_message_visibility(QueueUrl=queue, ReceiptHandle=receipt, VisibilityTimeout=0)
            except ClientError:
                pass  # it shows again when its visibility timeout ends
    return {
        "stack": target.name,
        "queue": queue,
        "dry_run": dry_run,
        "listed" if dry_run else "redriven": done,
        "refused": refused,
        "failed": failed,
    }


def _redrive_one(sqs: Any, lam: Any, queue: str, letter: DeadLetter) -> str | None:
    """Re-invoke one dead letter and delete it; None, or why it stays in the queue."""
    try:
        lam.invoke(FunctionName=letter.function_arn, InvocationType="Event", Payload=json.dumps(letter.event).encode())
    except ClientError as e:
        return f"not re-invoked: {_error(e)}"
    deleted, why_kept = _delete(sqs, queue, letter.receipt)
    # Re-invoked but not deleted: a later redrive invokes it again, which the intake drops by its event id.
    return None if deleted else f"re-invoked, but left in the queue: {why_kept}"


def _delete(sqs: Any, queue: str, receipt: str) -> tuple[bool, str]:
    try:
        sqs.delete_message(QueueUrl=queue, ReceiptHandle=receipt)
    except ClientError as e:
        return False, _error(e)
    return True, ""


def _error(e: ClientError) -> str:
    error = e.response.get("Error", {})
    return f"{e.operation_name}: {error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")


def render(result: dict, painter: Any) -> str:
    """`preemptor redrive` as text."""
    lines = []
    done = result["listed"] if result["dry_run"] else result["redriven"]
    verb = "would redrive" if result["dry_run"] else "redrove"
    lines.append(f"{verb} {len(done)} dead letter(s) of {result['queue']}")
    for d in done:
        lines.append(f"  {d['detail_type']} from {d['source']} (event {d['event_id']}) to {d['function'].rsplit(':', 1)[-1]}: {d['error'] or 'no error given'}")
    if result["failed"]:
        lines.append(painter.paint(f"left {len(result['failed'])} in the queue, AWS said no:", "31"))
        lines += [f"  event {f['event_id']}: {f['why']}" for f in result["failed"]]
    if result["refused"]:
        lines.append(painter.paint(f"refused {len(result['refused'])}:", "33"))
        lines += [
            f"  message {r['message_id']} ({'discarded' if r['discarded'] else 'left in the queue'}): {r['why']}"
            for r in result["refused"]
        ]
    return "\n".join(lines)
