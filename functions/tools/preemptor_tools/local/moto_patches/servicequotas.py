"""Service Quotas: ListServiceQuotas and GetServiceQuota for SageMaker, which moto lacks (it
knows the default quotas of VPC only).

The applied values come from the listeners of `quotas_listed` (the simulated fleet: the
quotas it enforces at CreateTrainingJob), among the other quotas SageMaker lists (other
instance types and usages, their values fixed), so that a reader pages through a listing as
long as the service's (100 quotas a page at most, a NextToken between pages). Each quota
has the code, ARN and fields the service gives it; a code is derived from the quota's name,
so the same quota has the same code in every listing. GetServiceQuota gives a quota by that
code, or NoSuchResourceException for a code SageMaker has no applied value of.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from moto.core.exceptions import JsonRESTError
from moto.servicequotas.exceptions import NoSuchResource
from moto.servicequotas.responses import ServiceQuotasResponse

from ._core import listeners, replace, subscribe

# () -> {quota name: applied value} of SageMaker's quotas (instances).
QuotasListed = Callable[[], dict[str, float]]
_LISTED = "servicequotas_listed"
_PAGE_MAX = 100
# What else SageMaker lists: quotas of instance types and usages no pool of a story takes.
_OTHER_TYPES = [f"ml.{family}.{size}" for family in ("m5", "c5", "g5", "g6", "r5") for size in ("large", "xlarge", "2xlarge", "4xlarge", "12xlarge")]
_OTHER_USAGES = ("training job usage", "spot training job usage", "endpoint usage", "processing job usage", "transform job usage")


def patch() -> None:
    replace(ServiceQuotasResponse, "list_service_quotas", _list_service_quotas)
    replace(ServiceQuotasResponse, "get_service_quota", _get_service_quota)


def quotas_listed(source: QuotasListed) -> Callable[[], None]:
    """`source()` gives the applied values ListServiceQuotas lists for SageMaker; returns
    unsubscribe."""
    return subscribe(_LISTED, source)


def _code(name: str) -> str:
    return "L-" + hashlib.sha256(name.encode()).hexdigest()[:8].upper()


def _sagemaker_quotas(region: str, account: str) -> list[dict]:
    values = {f"{t} for {usage}": 2.0 for t in _OTHER_TYPES for usage in _OTHER_USAGES}
    for source in listeners(_LISTED):
        values.update(source())
    quotas = []
    for name, value in values.items():
        code = _code(name)
        quotas.append({
            "ServiceCode": "sagemaker",
            "ServiceName": "Amazon SageMaker",
            "QuotaArn": f"arn:aws:servicequotas:{region}:{account}:sagemaker/{code}",
            "QuotaCode": code,
            "QuotaName": name,
            "Value": float(value),
            "Unit": "None",
            "Adjustable": True,
            "GlobalQuota": False,
        })
    return sorted(quotas, key=lambda q: q["QuotaCode"])


def _list_service_quotas(self: ServiceQuotasResponse) -> str:
    params = json.loads(self.body or "{}")
    if params.get("ServiceCode") != "sagemaker":
        raise NoSuchResource()
    size = int(params.get("MaxResults") or _PAGE_MAX)
    if not 1 <= size <= _PAGE_MAX:
        raise JsonRESTError("ValidationException", f"1 validation error detected: Value '{size}' at 'maxResults' failed to satisfy constraint")
    token = params.get("NextToken")
    quotas = _sagemaker_quotas(self.region, self.current_account)
    start = 0
    if token is not None:
        if not token.startswith("page-") or not token[5:].isdigit() or int(token[5:]) > len(quotas):
            raise JsonRESTError("InvalidPaginationTokenException", "Invalid pagination token.")
        start = int(token[5:])
    page = quotas[start:start + size]
    out: dict = {"Quotas": page}
    if start + size < len(quotas):
        out["NextToken"] = f"page-{start + size}"
    return json.dumps(out)


def _get_service_quota(self: ServiceQuotasResponse) -> str:
    params = json.loads(self.body or "{}")
    if params.get("ServiceCode") != "sagemaker":
        quota = self.backend.get_service_quota(service_code=str(params.get("ServiceCode")), quota_code=str(params.get("QuotaCode")))
        return json.dumps({"Quota": quota})
    for quota in _sagemaker_quotas(self.region, self.current_account):
        if quota["QuotaCode"] == params.get("QuotaCode"):
            return json.dumps({"Quota": quota})
    raise NoSuchResource()
