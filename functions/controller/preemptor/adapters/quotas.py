"""The account's quotas as Service Quotas lists them.

A launch refused with SageMaker's `ResourceLimitExceeded` names the quota it met; the
controller then plans the pool at what that quota leaves it (`actions._learn_quota`), and
reconcile reads the quota again by that name to see it raised, or still short.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

from botocore.exceptions import ClientError

from ..core.errors import ServiceUnavailable
from .errors import NO_ANSWER, translate

_PAGE = 100  # the most ListServiceQuotas gives in a page


class AccountQuotas:
    """`make_client` makes the Service Quotas client at the first read (only reconcile reads
    quotas: the other functions never build it)."""

    def __init__(self, make_client: Callable[[], Any]):
        self._make_client = make_client

    @cached_property
    def client(self) -> Any:
        return self._make_client()

    def applied(self, service_code: str, name: str) -> float | None:
        """The applied value of `service_code`'s quota named `name`, or None when Service
        Quotas does not list one: it lists a quota only where the applied value is available,
        and a listed quota it could not read carries an `ErrorReason` instead (a value that is
        no count of instances, negative say, is taken as unread too). Never the
        default value (ListAWSDefaultServiceQuotas): it does not reflect an increase, and a
        pool planned at it could be planned at nothing."""
        try:
            for page in self.client.get_paginator("list_service_quotas").paginate(
                ServiceCode=service_code, PaginationConfig={"PageSize": _PAGE}
            ):
                for quota in page.get("Quotas", []):
                    if quota.get("QuotaName") == name:
                        value = quota.get("Value")
                        unreadable = quota.get("ErrorReason") or not isinstance(value, (int, float)) or not 0 <= value < float("inf")
                        return None if unreadable else float(value)
        except ClientError as e:
            raise translate(e, "ListServiceQuotas") from e
        except NO_ANSWER as e:
            raise ServiceUnavailable(f"ListServiceQuotas: no answer ({type(e).__name__})") from e
        return None
