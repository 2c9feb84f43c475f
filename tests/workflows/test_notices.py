"""Notices to the teams that own jobs: one SNS topic, message attributes `team`, `job` and
`kind`, and subscriptions that filter on them (executed on moto, whose SNS applies filter
policies as SNS does)."""

from __future__ import annotations

import pytest
from aws_faults import notice_publish_fails
from emulation import emulation
from notice_queues import received, subscribe

from preemptor.adapters.alerts import NOTICE_KINDS


def test_each_team_gets_the_notices_of_its_own_jobs_before_and_after_a_preemption():
    with emulation() as env:
        # Given the research team subscribed to its own notices, and the operators to all
        research = subscribe(env, "research-notices", {"team": ["research"]})
        production = subscribe(env, "production-notices", {"team": ["production"]})
        everything = subscribe(env, "operators", None)
        # When research's sweep holds the pool and production's critical job preempts it,
        # and the sweep is relaunched once production is done
        env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(600)
        env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1200)
        env.advance(1800)
        # Then research was told, in order: the preemption was planned (before the stop),
        # the sweep was preempted (with the work lost), and relaunched from its checkpoint
        notices = received(env, research)
        assert [n["attributes"]["kind"] for n in notices] == ["preemption-planned", "preempted", "relaunched"]
        assert all(n["attributes"] == {"team": "research", "job": "sweep", "kind": n["attributes"]["kind"]} for n in notices)
        planned, preempted, relaunched = (n["message"] for n in notices)
        assert (planned["job"], planned["preemptor"], planned["team"], planned["gpus"]) == ("sweep", "prod", "research", 64)
        assert preempted["by"] == "prod" and preempted["lost_gpu_seconds"] >= 0 and preempted["resumes_as"] == "sweep-r2"
        assert relaunched["run"] == "sweep-r2" and relaunched["resumes_from"].endswith("/research/sweep")
        # And production, whose job was never touched, got nothing; the operators got all
        assert received(env, production) == []
        assert {n["attributes"]["kind"] for n in received(env, everything)} == {"preemption-planned", "preempted", "relaunched"}
        assert set(NOTICE_KINDS) >= {"preemption-planned", "preempted", "relaunched"}


def _reconcile(env) -> None:
    env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
    env.stack.drain()


def _preempted_and_relaunched(env) -> None:
    """Research's sweep holds the pool, production's critical job preempts it, and the sweep
    is relaunched once production is done."""
    env.submit(name="sweep", team="research", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
    env.advance(600)
    env.submit(name="prod", team="production", priority="critical", pool="p5", instances=8, duration=1200)
    env.advance(1800)


@pytest.mark.parametrize("how", ["throttled", "no-answer"])
def test_a_notice_sns_refused_is_published_by_reconcile_once(how):
    with emulation() as env:
        research = subscribe(env, "research-notices", {"team": ["research"]})
        # Given SNS refusing (throttled, or no answer) every publish of a `preempted` notice
        with notice_publish_fails(env.stack.deps().alerts.client, "preempted", how) as refused:
            _preempted_and_relaunched(env)
        assert refused
        # Then the team was told of the plan and the relaunch, not yet of the preemption
        assert [n["attributes"]["kind"] for n in received(env, research)] == ["preemption-planned", "relaunched"]
        # When reconcile passes, once SNS takes it again
        _reconcile(env)
        # Then the preemption's notice comes, as its writer would have sent it
        [late] = received(env, research)
        assert late["attributes"] == {"team": "research", "job": "sweep", "kind": "preempted"}
        assert late["message"]["by"] == "prod" and late["message"]["resumes_as"] == "sweep-r2"
        # And only once: the next passes publish nothing more, and keep nothing
        _reconcile(env)
        assert received(env, research) == []
        assert env.store.notices("p5") == []


def test_a_notice_whose_writer_died_after_the_change_is_published_by_reconcile():
    with emulation() as env:
        research = subscribe(env, "research-notices", {"team": ["research"]})
        # Given the function that requeues the sweep dying as it publishes its notice, its
        # step retried and finding the requeue done
        with notice_publish_fails(env.stack.deps().alerts.client, "preempted", "died") as died:
            _preempted_and_relaunched(env)
        assert died
        assert [n["attributes"]["kind"] for n in received(env, research)] == ["preemption-planned", "relaunched"]
        assert env.job("sweep").incarnation == 2 and env.kinds("sweep").count("requeued") == 1
        # When reconcile passes, a minute on
        env.advance(60)
        _reconcile(env)
        # Then the team hears of the preemption all the same, once
        assert [n["attributes"]["kind"] for n in received(env, research)] == ["preempted"]
        _reconcile(env)
        assert received(env, research) == [] and env.store.notices("p5") == []


def test_the_notices_their_writers_published_are_forgotten_and_never_sent_again():
    with emulation() as env:
        research = subscribe(env, "research-notices", {"team": ["research"]})
        _preempted_and_relaunched(env)
        assert [n["attributes"]["kind"] for n in received(env, research)] == ["preemption-planned", "preempted", "relaunched"]
        # Given the notices kept until reconcile, each marked published
        kept = env.store.notices("p5")
        assert [(n.kind, sent) for n, sent in kept] == [("preempted", True), ("relaunched", True)]
        # When reconcile passes, Then it sends none again and forgets them
        _reconcile(env)
        assert received(env, research) == [] and env.store.notices("p5") == []
