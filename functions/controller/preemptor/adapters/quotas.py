"""The account's quotas as Service Quotas lists them.

A launch refused with SageMaker's `ResourceLimitExceeded` names the quota it met; the
controller then plans the pool at what that quota leaves it (`actions._learn_quota`), and
reconcile reads the quota again by that name to see it raised, or still short.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError

from ..core.errors import ServiceUnavailable
from .errors import NO_ANSWER, translate

_PAGE = 100  # the most ListServiceQuotas gives in a page


class AccountQuotas:
    """`client`: a Service Quotas client, or what makes one at the first read (only reconcile
    reads quotas: the other functions never build it)."""

    def __init__(self, client: Any | Callable[[], Any]):
        self._client = client
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if callable(self._client) and not hasattr(self._client, "meta"):
                self._client = self._client()
            return self._client

    def applied(self, service_code: str, name: str) -> float | None:
        """The applied value of `service_code`'s quota named `name`, or None when Service
        Quotas does not list one: it lists a quota only where the applied value is available,
        and a listed quota it could not read carries an `ErrorReason` instead. Never the
        default value (ListAWSDefaultServiceQuotas): it does not reflect an increase, and a
        pool planned at it could be planned at nothing."""
        try:
            for page in self.client.get_paginator("list_service_quotas").paginate(
                ServiceCode=service_code, PaginationConfig={"PageSize": _PAGE}
            ):
                for quota in page.get("Quotas", []):
                    if quota.get("QuotaName") == name:
                        return None if quota.get("ErrorReason") or quota.get("Value") is None else float(quota["Value"])
        except ClientError as e:
            raise translate(e, "ListServiceQuotas") from e
        except NO_ANSWER as e:
            raise ServiceUnavailable(f"ListServiceQuotas: no answer ({type(e).__name__})") from e
        return None
