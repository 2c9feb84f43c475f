"""Lambda: moto's Docker-free backend returns a canned payload; run our handler in-process.

Gap filled: `LambdaSimpleBackend.invoke` never runs the function's code. The patch calls the
`lambda_invoker` given to `install` (the emulated stack runs the handler named by the
function's `Handler`). A handler's exception becomes the function's error response, as the
Python runtime returns it, so Step Functions names the error after its class and Retry/Catch
on it work as on AWS. An asynchronous invocation (`InvocationType: Event`) is Lambda's to
retry and dead-letter, never the caller's: it goes to the `async_invoker` and is answered
202 with an empty body, whatever the handler does.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from moto.awslambda_simple.models import LambdaSimpleBackend

from ._core import _STATE, replace
from .send import invoked_under

LOG = logging.getLogger(__name__)

# How Step Functions names a Lambda failure the function's code did not report itself (the
# runtime died: out of memory, killed, timed out): "Unhandled errors in Lambda are reported
# as Lambda.Unknown" (Step Functions developer guide, "Handle Lambda service exceptions").
LAMBDA_UNKNOWN = "Lambda.Unknown"


class LambdaRuntimeExited(Exception):
    """Raised by a `lambda_invoker` whose function's runtime died (the emulator's crashes)."""

    error_type = LAMBDA_UNKNOWN


def patch() -> None:
    replace(LambdaSimpleBackend, "invoke", _invoke)


def _invoke(
    self: LambdaSimpleBackend,
    function_name: str,
    qualifier: str | None,
    body: Any,
    headers: Any,
    response_headers: Any,
) -> bytes:
    function = self.get_function(function_name, qualifier)  # unknown function -> 404 as on AWS
    event = json.loads(body) if body else {}
    invoker = _STATE.lambda_invoker
    if invoker is None:
        raise RuntimeError("moto_patches.install() has not been called: no lambda_invoker")
    if headers.get("X-Amz-Invocation-Type") == "Event":
        if _STATE.async_invoker is None:
            raise RuntimeError("moto_patches.install() was given no async_invoker: an asynchronous Invoke has no one to run it")
        _STATE.async_invoker(function.function_name, event)
        return b""
    try:
        with invoked_under(_STATE.clock):
            result = invoker(function.function_name, event)
    except Exception as error:  # noqa: BLE001 - a handler error is the function's response
        LOG.info("Lambda %s raised %s: %s", function.function_name, type(error).__name__, error)
        response_headers["x-amz-function-error"] = "Unhandled"
        error_type = getattr(error, "error_type", type(error).__name__)
        return json.dumps({"errorMessage": str(error), "errorType": error_type, "stackTrace": []}).encode()
    return json.dumps(result).encode()
