"""`explain` on live state: the emulated stack's jobs table, as an operator would ask."""

from __future__ import annotations

from emulation import emulation

from preemptor.service.scheduling import explain


def _explain(env, job: str) -> dict:
    d = env.stack.deps()
    return explain(store=d.store, settings=d.settings, job=job, now=env.clock.now())


def test_why_a_job_waits_behind_equal_priority_work():
    with emulation() as env:
        env.submit(name="first", team="a", priority="high", pool="p5", instances=8, duration=3600)
        env.submit(name="second", team="b", priority="high", pool="p5", instances=8, duration=3600)
        answer = _explain(env, "second")
        assert answer["status"] == "pending"
        # It names the blocker: no free capacity, and the running job is not lower priority
        assert "no-capacity-no-eligible-victims" in answer["text"]
        assert "first" in answer["text"] and "not-lower-priority" in answer["text"]


def test_who_preempted_a_job_under_which_rule_and_how_old_its_checkpoint_was():
    with emulation() as env:
        env.submit(name="low", team="a", priority="low", pool="p5", instances=8, duration=7200, checkpoint_every=300)
        env.advance(900)
        env.submit(name="crit", team="b", priority="critical", pool="p5", instances=8, duration=600)
        answer = _explain(env, "low")
        [episode] = answer["preemptions"]
        assert episode["preemptor"] == "crit"
        assert episode["rule"] == "lower-priority"
        assert episode["checkpoint_age_s"] is not None and episode["checkpoint_age_s"] <= 900
        assert "crit" in answer["text"] and "lower-priority" in answer["text"]


def test_unknown_job():
    with emulation() as env:
        assert _explain(env, "nobody")["status"] == "unknown"


def test_a_job_waiting_in_a_pool_the_accounts_quota_holds_below_its_configuration_is_told_so():
    # Given a pool of 8 x ml.p5.48xlarge whose account quota is 6, with a low sweep on 6
    with emulation(instance_quotas={"ml.p5.48xlarge": 6}) as env:
        env.submit(name="sweep", team="a", priority="low", pool="p5", instances=6, duration=7200, checkpoint_every=300)
        env.advance(300)
        # When an equal-priority job for 2 more is launched into the "free" 16 GPUs and meets the quota
        env.submit(name="eval", team="b", priority="low", pool="p5", instances=2, duration=600)
        assert "capacity-wait" in env.kinds("eval")
        env.advance(600)
        # Then explain tells why it waits: the pool is planned at what the quota leaves it
        answer = _explain(env, "eval")
        assert answer["status"] == "pending" and answer["planned_capacity_gpus"] == 48
        assert "pool p5 is planned at 48 of its 64 GPUs: the account's quota 'ml.p5.48xlarge for training job usage' leaves it no more" in answer["text"]
        # And it was admitted no more into GPUs the account cannot have: one launch met the quota
        assert env.kinds("eval").count("capacity-wait") == 1
