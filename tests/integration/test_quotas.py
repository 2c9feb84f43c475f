"""The account's quotas read from Service Quotas (`adapters/quotas.py`), and reconcile's
reading of the quota a launch met below its pool (`reconcile._reread_quota`), on the emulated
stack: the fleet enforces the quota at CreateTrainingJob, Service Quotas lists it."""

from __future__ import annotations

import pytest
from aws_faults import aws_says_no, error_response
from emulation import P5, emulation

from preemptor.adapters.quotas import AccountQuotas
from preemptor.core.model import JobState
from preemptor.core.errors import AccessDenied, Throttled
from preemptor.service.actions import QUOTA_MEMORY_S
from preemptor.service.reconcile import QUOTA_RENEW_WITHIN_S
from preemptor_tools import ops
from preemptor_tools.tables import Painter, render_pools

P5_QUOTA = "ml.p5.48xlarge for training job usage"
THROTTLED = error_response("TooManyRequestsException", "Rate exceeded", 400)
DENIED = error_response("AccessDeniedException", "User is not authorized to perform: servicequotas:ListServiceQuotas", 400)


def _reconcile(env) -> dict:
    result = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
    env.stack.drain()
    return result


def _quota_repairs(result: dict) -> list[dict]:
    return [r for r in result["repairs"] if r["repair"].startswith("quota-")]


def _quota_errors(result: dict) -> list[dict]:
    return [e for e in result["errors"] if e.get("part") == "quota"]


def test_a_quota_is_read_by_its_name_through_every_page_service_quotas_lists():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6, "ml.p4d.24xlarge": 3}) as env:
        client = env.stack.client("service-quotas")
        pages = []
        client.meta.events.register("after-call.service-quotas.ListServiceQuotas", lambda parsed, **_: pages.append(len(parsed.get("Quotas", []))))

        def quotas() -> AccountQuotas:  # a reader with no code found yet: it lists
            return AccountQuotas(lambda: client)

        # The listing is longer than a page (the quotas of SageMaker's other types and usages)
        assert quotas().applied("sagemaker", P5_QUOTA) == 6.0
        assert quotas().applied("sagemaker", "ml.p4d.24xlarge for spot training job usage") == 3.0
        assert len(pages) >= 2 and max(pages) == 100
        # A quota it does not list: nothing known (never its default)
        assert quotas().applied("sagemaker", "ml.p5e.48xlarge for training job usage") is None
        # One listed with the reason its value could not be read: nothing known either
        unreadable = {
            "Quotas": [{"ServiceCode": "sagemaker", "QuotaCode": "L-1", "QuotaName": P5_QUOTA, "Value": 0.0,
                        "ErrorReason": {"ErrorCode": "DEPENDENCY_THROTTLING_ERROR", "ErrorMessage": "throttled"}}],
            "ResponseMetadata": {"HTTPStatusCode": 200},
        }
        with aws_says_no(client, "ListServiceQuotas", unreadable):
            assert quotas().applied("sagemaker", P5_QUOTA) is None
        # And one whose value is no count of instances
        del unreadable["Quotas"][0]["ErrorReason"]
        unreadable["Quotas"][0]["Value"] = -3.0
        with aws_says_no(client, "ListServiceQuotas", unreadable):
            assert quotas().applied("sagemaker", P5_QUOTA) is None
        # Refusals in the domain's terms
        with aws_says_no(client, "ListServiceQuotas", THROTTLED), pytest.raises(Throttled):
            quotas().applied("sagemaker", P5_QUOTA)
        with aws_says_no(client, "ListServiceQuotas", DENIED), pytest.raises(AccessDenied):
            quotas().applied("sagemaker", P5_QUOTA)


def _read_once(env) -> tuple[object, list[str], AccountQuotas]:
    """The stack's Service Quotas client, the operations it is asked (in order), and quotas
    read through it once (6 instances of ml.p5.48xlarge), its code kept."""
    client = env.stack.client("service-quotas")
    calls: list[str] = []
    client.meta.events.register("after-call.service-quotas.*", lambda model, **_: calls.append(model.name))
    quotas = AccountQuotas(lambda: client)
    assert quotas.applied("sagemaker", P5_QUOTA) == 6.0
    return client, calls, quotas


def test_a_quota_once_found_in_the_listing_is_read_by_its_code_in_one_call():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        client, calls, quotas = _read_once(env)
        assert calls and set(calls) == {"ListServiceQuotas"}
        # The next reads ask for it by the code the listing gave (one call, not a page each
        # of SageMaker's quotas), and see a raise as the listing would
        calls.clear()
        env.fleet.set_instance_quota("ml.p5.48xlarge", 8)
        assert quotas.applied("sagemaker", P5_QUOTA) == 8.0
        assert calls == ["GetServiceQuota"]
        # Read by code with the reason its value could not be read: nothing known
        listing = client.get_paginator("list_service_quotas").paginate(ServiceCode="sagemaker")
        [code] = [q["QuotaCode"] for page in listing for q in page["Quotas"] if q["QuotaName"] == P5_QUOTA]
        unreadable = {
            "Quota": {"ServiceCode": "sagemaker", "QuotaCode": code, "QuotaName": P5_QUOTA, "Value": 0.0,
                      "ErrorReason": {"ErrorCode": "SERVICE_QUOTA_NOT_AVAILABLE_ERROR", "ErrorMessage": "not available"}},
            "ResponseMetadata": {"HTTPStatusCode": 200},
        }
        with aws_says_no(client, "GetServiceQuota", unreadable):
            assert quotas.applied("sagemaker", P5_QUOTA) is None
        # Refusals in the domain's terms, the code kept for the next read
        with aws_says_no(client, "GetServiceQuota", THROTTLED), pytest.raises(Throttled):
            quotas.applied("sagemaker", P5_QUOTA)
        calls.clear()
        assert quotas.applied("sagemaker", P5_QUOTA) == 8.0 and calls == ["GetServiceQuota"]
        # A code the service no longer knows, or that names another quota now: listed again
        # by name, and the code it gives kept
        gone = error_response("NoSuchResourceException", "The request failed because the specified service quota does not exist.", 400)
        other = {"Quota": {**unreadable["Quota"], "QuotaName": "ml.p5.48xlarge for endpoint usage", "Value": 2.0}, "ResponseMetadata": {"HTTPStatusCode": 200}}
        del other["Quota"]["ErrorReason"]
        for answer in (gone, other):
            calls.clear()
            with aws_says_no(client, "GetServiceQuota", answer, times=1):
                assert quotas.applied("sagemaker", P5_QUOTA) == 8.0
            assert calls[0] == "GetServiceQuota" and "ListServiceQuotas" in calls[1:]
            calls.clear()
            assert quotas.applied("sagemaker", P5_QUOTA) == 8.0 and calls == ["GetServiceQuota"]


def test_a_role_that_may_not_read_a_quota_by_its_code_reads_it_by_the_listing():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        client, calls, quotas = _read_once(env)
        denied = error_response("AccessDeniedException", "User is not authorized to perform: servicequotas:GetServiceQuota", 400)
        with aws_says_no(client, "GetServiceQuota", denied):
            # Given a role without servicequotas:GetServiceQuota (made before the grant)
            env.fleet.set_instance_quota("ml.p5.48xlarge", 8)
            calls.clear()
            # Then the read goes on by the listing, and the next ones ask it alone
            assert quotas.applied("sagemaker", P5_QUOTA) == 8.0
            assert calls[0] == "GetServiceQuota" and set(calls[1:]) == {"ListServiceQuotas"}
            calls.clear()
            assert quotas.applied("sagemaker", P5_QUOTA) == 8.0 and set(calls) == {"ListServiceQuotas"}
        # And a listing refused too is the read's refusal
        with aws_says_no(client, "ListServiceQuotas", DENIED), pytest.raises(AccessDenied):
            quotas.applied("sagemaker", P5_QUOTA)


def _noted(env, gpus: int = 48, left_s: float = QUOTA_MEMORY_S, quota: str = P5_QUOTA) -> float:
    """The pool noted at `gpus` by a launch over `quota`, its memory ending in `left_s`."""
    until = env.clock.now() + left_s
    env.store.ensure_pool("p5", P5.capacity_gpus)
    env.store.note_quota("p5", gpus, until, quota)
    return until


def test_a_quota_still_below_the_pool_is_noted_again_before_its_memory_ends_and_only_then():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        until = _noted(env)
        # Far from the end of its memory: read, nothing written
        result = _reconcile(env)
        assert _quota_repairs(result) == [] and _quota_errors(result) == []
        assert env.store.noted_quota("p5")["until"] == until
        # Within the renewal window: noted again for another memory, at the same value
        env.advance(QUOTA_MEMORY_S - QUOTA_RENEW_WITHIN_S + 60)
        now = env.clock.now()
        result = _reconcile(env)
        assert _quota_repairs(result) == [] and _quota_errors(result) == []
        assert env.store.noted_quota("p5") == {"gpus": 48, "until": now + QUOTA_MEMORY_S, "quota": P5_QUOTA}
        assert env.store.quota_capacity_gpus(env.store.pool("p5"), 64, until + 1) == 48


def test_a_quota_raised_to_cover_the_pool_is_forgotten_and_the_pool_planned():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        _noted(env)
        env.fleet.set_instance_quota("ml.p5.48xlarge", 8)
        result = _reconcile(env)
        assert _quota_repairs(result) == [{"pool": "p5", "quota": P5_QUOTA, "was_gpus": 48, "repair": "quota-raised", "gpus": 64, "instances": 8}]
        assert env.store.noted_quota("p5") is None
        assert env.store.quota_capacity_gpus(env.store.pool("p5"), 64, env.clock.now()) == 64
        # And the pool is planned (capacity grew), though nothing waits in it
        schedules = [e for e in env.stack.executions("ScheduleStateMachine") if e["name"].startswith("reconcile-p5")]
        assert schedules


def test_a_quota_changed_but_still_below_the_pool_is_noted_at_its_new_value():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        _noted(env)
        env.fleet.set_instance_quota("ml.p5.48xlarge", 5)
        result = _reconcile(env)
        assert [r["repair"] for r in _quota_repairs(result)] == ["quota-changed"]
        assert env.store.noted_quota("p5")["gpus"] == 40


def test_a_quota_not_of_the_pools_offering_any_more_is_forgotten():
    # Given a quota noted for another instance type (the pool's type was changed since)
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        _noted(env, quota="ml.p4d.24xlarge for training job usage")
        result = _reconcile(env)
        assert [(r["repair"], r["why"]) for r in _quota_repairs(result)] == [("quota-forgotten", "not the quota of the pool's offering")]
        assert env.store.noted_quota("p5") is None


@pytest.mark.parametrize(
    "refusal, error", [(THROTTLED, "Throttled"), (DENIED, "AccessDenied"), (None, "QuotaNotListed")], ids=["throttled", "denied", "not-listed"]
)
def test_a_quota_that_cannot_be_read_is_kept_until_an_operator_says_it_was_raised(refusal, error):
    with emulation(instance_quotas={} if refusal is None else {"ml.p5.48xlarge": 6}) as env:
        until = _noted(env)
        client = env.stack.deps().quotas.client
        with aws_says_no(client, "ListServiceQuotas", refusal or (lambda params: None)):
            # While its memory lasts: an error of the pass, the pool still planned at the quota
            result = _reconcile(env)
            assert [e["error"] for e in _quota_errors(result)] == [error]
            assert env.store.noted_quota("p5")["until"] == until
            # Past its memory, still unread: kept at what was last known, noted again before
            # it ended (before: forgotten, and a job larger than the quota then stopped the
            # pool's work once an hour for a launch the quota refused)
            for _ in range(4):
                env.advance(QUOTA_MEMORY_S - QUOTA_RENEW_WITHIN_S + 60)
                now = env.clock.now()
                result = _reconcile(env)
                assert [e["error"] for e in _quota_errors(result)] == [error] and _quota_repairs(result) == []
                assert env.store.noted_quota("p5") == {"gpus": 48, "until": now + QUOTA_MEMORY_S, "quota": P5_QUOTA}
        # When an operator says it was raised (Service Quotas cannot show it)
        said = ops.quota_raised(env.operator(), "p5")
        env.stack.drain()
        # Then the pool is planned at its size again, and a cycle of it started
        assert (said["quota"], said["was_gpus"]) == (P5_QUOTA, 48) and said["schedule_execution"]
        assert env.store.noted_quota("p5") is None
        assert env.store.quota_capacity_gpus(env.store.pool("p5"), 64, env.clock.now()) == 64
        # And a pool without a noted quota is not read at all
        calls = len(env.stack.calls.calls)
        _reconcile(env)
        assert not [c for c in env.stack.calls.calls[calls:] if c.api_action.startswith("service-quotas:")]


def test_a_run_larger_than_a_quota_service_quotas_does_not_list_stops_the_pool_once_not_once_an_hour():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        # Given Service Quotas listing no applied value of the pool's quota (its docs allow it)
        client = env.stack.deps().quotas.client
        unlisted = {"Quotas": [], "ResponseMetadata": {"HTTPStatusCode": 200}}
        with aws_says_no(client, "ListServiceQuotas", unlisted):
            # And research's low sweep on 6 instances, then production's critical run on all 8
            env.submit(name="sweep", team="research", priority="low", pool="p5", instances=6, duration=40000, checkpoint_every=600)
            env.advance(600)
            env.submit(name="pretrain", team="production", priority="critical", pool="p5", instances=8, duration=1200)
            # When four hours pass, reconcile reading nothing every 5 minutes
            for _ in range(4 * 12):
                env.advance(300, step=60)
                _reconcile(env)
        # Then the sweep was stopped once, before anyone knew the quota (the launch told it),
        # and never again: the quota, unread, was kept (before: forgotten after its hour, and
        # the sweep stopped once an hour for a launch the quota refused)
        stops = [e for e in env.store.history("sweep") if e["kind"] == "stop-requested"]
        assert len(stops) == 1, [e["kind"] for e in env.store.history("sweep")]
        assert env.job("sweep").status is JobState.RUNNING and env.job("pretrain").status is JobState.PENDING
        assert env.store.noted_quota("p5")["gpus"] == 48
        # And once the operator says the quota was raised (and it was), the run launches
        env.fleet.set_instance_quota("ml.p5.48xlarge", 8)
        ops.quota_raised(env.operator(), "p5")
        env.stack.drain()
        env.advance(600)
        assert env.job("pretrain").status is JobState.RUNNING


def test_the_operators_word_on_a_quota_stands_though_aws_refuses_the_cycle_it_starts(monkeypatch):
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        _noted(env)

        def refused(self, workflow, name, payload):
            raise AccessDenied(f"StartExecution {workflow}: not authorized")

        monkeypatch.setattr(ops.WorkflowStarter, "start", refused)
        result = ops.quota_raised(env.operator(), "p5")
        # The quota is forgotten; the refusal is said, not raised (asked again, the command
        # would find nothing noted)
        assert (result["schedule_execution"], result["cycle_error"]) == (None, "AccessDenied: StartExecution schedule: not authorized")
        assert env.store.noted_quota("p5") is None


def test_the_operators_word_on_a_quota_is_refused_where_there_is_nothing_to_say_it_of():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        # A pool planned at its size: nothing to forget
        with pytest.raises(ops.BadInput, match="no quota noted"):
            ops.quota_raised(env.operator(), "p5")
        # A pool the stack does not have
        with pytest.raises(ops.NotFound, match="no such pool"):
            ops.quota_raised(env.operator(), "p4")
        # A quota a launch noted again after the operator's read stands (the newer word)
        _noted(env)
        target = env.operator()
        read = target.store.noted_quota("p5")
        env.store.note_quota("p5", 40, read["until"] + 60, P5_QUOTA)
        target.store.noted_quota = lambda pool: read  # (the operator's read, before the launch's note)
        with pytest.raises(ops.BadInput, match="noted its quota again meanwhile"):
            ops.quota_raised(target, "p5")
        assert env.store.noted_quota("p5")["gpus"] == 40


def test_a_quota_noted_by_a_launch_while_reconcile_read_the_older_one_is_kept():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        older = _noted(env)
        env.fleet.set_instance_quota("ml.p5.48xlarge", 8)
        # Given a launch refused meanwhile noted the quota again (a newer word)
        newer = {"gpus": 56, "until": older + 100, "quota": P5_QUOTA}
        read = env.store.noted_quota("p5")
        env.store.note_quota("p5", newer["gpus"], newer["until"], P5_QUOTA)
        # When reconcile's forgetting of what it read lands: refused
        assert env.store.forget_quota("p5", read) is False
        assert env.store.noted_quota("p5") == newer


@pytest.mark.parametrize(
    "quota, left_s, error",
    [(6, QUOTA_RENEW_WITHIN_S - 60, None), (5, QUOTA_MEMORY_S, None), (None, QUOTA_RENEW_WITHIN_S - 60, "QuotaNotListed")],
    ids=["renewed", "changed", "kept-unread"],
)
def test_the_operators_word_on_a_quota_said_while_reconcile_reads_it_is_not_written_over(quota, left_s, error):
    with emulation(instance_quotas={} if quota is None else {"ml.p5.48xlarge": quota}) as env:
        _noted(env, left_s=left_s)
        said = []

        def operator_first(**_) -> None:
            # The operator's `quota-raised` lands after reconcile read the note, before its write
            if not said:
                with env.stack.calls.unattributed():
                    said.append(ops.quota_raised(env.operator(), "p5"))

        client = env.stack.deps().quotas.client
        client.meta.events.register("before-call.service-quotas", operator_first)
        try:
            # When reconcile would note the quota again (renewed, changed, or kept unread)
            result = _reconcile(env)
        finally:
            client.meta.events.unregister("before-call.service-quotas", operator_first)
        # Then the operator's word stands: the pool is planned at its size (before, the
        # renewal wrote the note back, and the pool stayed below its size another memory)
        assert said and said[0]["was_gpus"] == 48
        assert env.store.noted_quota("p5") is None
        assert env.store.quota_capacity_gpus(env.store.pool("p5"), 64, env.clock.now()) == 64
        assert _quota_repairs(result) == [] and [e["error"] for e in _quota_errors(result)] == ([error] if error else [])


def test_the_pools_view_counts_a_pool_at_what_the_quota_leaves_it_and_says_why():
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        # Given a job holding 8 GPUs of a pool whose quota, learned from a refusal, leaves it 48
        env.submit(name="first", team="a", priority=200, pool="p5", instances=1, duration=3600)
        _noted(env)
        [pool] = ops.pools(env.operator())["pools"]
        # Then the operators see it planned at 48, and only what that leaves free
        assert (pool["capacity_gpus"], pool["planned_gpus"], pool["used_gpus"], pool["free_gpus"]) == (64, 48, 8, 40)
        assert pool["quota"]["name"] == P5_QUOTA
        text = render_pools(ops.pools(env.operator()), Painter(False))
        assert f"p5 planned at 48 of its 64 GPUs: the account's quota '{P5_QUOTA}' leaves it no more" in text
        # And once the quota is raised and read, at its size again
        env.fleet.set_instance_quota("ml.p5.48xlarge", 8)
        _reconcile(env)
        [pool] = ops.pools(env.operator())["pools"]
        assert (pool["planned_gpus"], pool["free_gpus"], pool["quota"]) == (64, 56, None)
