"""The account's quotas as Service Quotas lists them.

A launch refused with SageMaker's `ResourceLimitExceeded` names the quota it met; the
controller then plans the pool at what that quota leaves it (`actions._learn_quota`), and
reconcile reads the quota again by that name to see it raised, or still short.

The refusal gives a name, and only ListServiceQuotas finds a quota by name: SageMaker lists
hundreds (one for each instance type and each kind of use), a call for each hundred at each
read. The first read finds the quota's code there; the next read it with one
GetServiceQuota, while the container lives. A role that may not call GetServiceQuota (one made
before the grant, or trimmed by hand) reads by the listing alone, as before the code was kept.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

from botocore.exceptions import ClientError

from ..core.errors import AccessDenied, ServiceUnavailable
from .errors import NO_ANSWER, code_of, translate

_PAGE = 100  # the most ListServiceQuotas gives in a page


class AccountQuotas:
    """`make_client` makes the Service Quotas client at the first read (only reconcile reads
    quotas: the other functions never build it)."""

    def __init__(self, make_client: Callable[[], Any]):
        self._make_client = make_client
        self._codes: dict[tuple[str, str], str] = {}  # (service code, quota name) -> quota code
        self._by_code_denied = False  # GetServiceQuota refused as not allowed: the listing alone

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
            quota = self._by_code(service_code, name)
            if quota is None:
                quota = self._listed(service_code, name)
        except ClientError as e:
            raise translate(e, "ListServiceQuotas") from e
        except NO_ANSWER as e:
            raise ServiceUnavailable(f"Service Quotas: no answer ({type(e).__name__})") from e
        if quota is None:
            return None
        value = quota.get("Value")
        unreadable = quota.get("ErrorReason") or not isinstance(value, (int, float)) or not 0 <= value < float("inf")
        return None if unreadable else float(value)

    def _by_code(self, service_code: str, name: str) -> dict | None:
        """The quota by the code a listing gave it (GetServiceQuota); None when no listing
        gave one yet, or the service no longer gives that code this name (then forgotten)."""
        code = self._codes.get((service_code, name))
        if code is None or self._by_code_denied:
            return None
        try:
            quota = self.client.get_service_quota(ServiceCode=service_code, QuotaCode=code)["Quota"]
        except ClientError as e:
            error = translate(e, f"GetServiceQuota {service_code} {code}")
            if isinstance(error, AccessDenied):
                self._by_code_denied = True  # the role lacks the grant: the listing reads it
                return None
            if code_of(e) != "NoSuchResourceException":
                raise error from e
            quota = None  # no applied value to give now: the listing says whether it has one
        if quota is None or quota.get("QuotaName") != name:
            del self._codes[(service_code, name)]
            return None
        return quota

    def _listed(self, service_code: str, name: str) -> dict | None:
        """The quota named `name` in `service_code`'s listing, its code kept; None when not listed."""
        for page in self.client.get_paginator("list_service_quotas").paginate(ServiceCode=service_code, PaginationConfig={"PageSize": _PAGE}):
            for quota in page.get("Quotas", []):
                if quota.get("QuotaName") == name:
                    if quota.get("QuotaCode"):
                        self._codes[(service_code, name)] = quota["QuotaCode"]
                    return quota
        return None
