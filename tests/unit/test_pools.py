"""Where a run a team launched is counted: the pools whose capacity it runs on (`pools_running`)."""

from __future__ import annotations

import pytest

from preemptor.core.pools import PoolConfig, fallback_onto_another_pool, pools_running, queue_name

P5 = PoolConfig(name="p5", instance_type="ml.p5.48xlarge", instances=8)
P5_SPOT = PoolConfig(name="p5-spot", instance_type="ml.p5.48xlarge", instances=4, capacity_type="spot")
P5_SPOT_OR_NOT = P5_SPOT.model_copy(update={"name": "p5-spot-or-not", "on_demand_fallback": True})
P4 = PoolConfig(name="p4", instance_type="ml.p4d.24xlarge", fallback_instance_types=("ml.p5.48xlarge",), instances=4)
ANY = PoolConfig(name="any", instances=2)
G5 = PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue", fallback_job_queues=("g5-on-demand",))
G6 = PoolConfig(name="g6", service="batch", gpus=32, job_queue="arn:aws:batch:us-east-1:123456789012:job-queue/g6-queue")
UNQUEUED = PoolConfig(name="unqueued", service="batch", gpus=8)
POOLS = (P4, P5_SPOT, P5, ANY, P5_SPOT_OR_NOT, G5, G6, UNQUEUED)


def names(tiers: tuple[tuple[PoolConfig, ...], ...]) -> list[list[str]]:
    return [[p.name for p in tier] for tier in tiers]


@pytest.mark.parametrize(
    "types, spot, expected",
    [
        # Its own type before a fallback type; with the way it is bought unknown, either way
        (("ml.p5.48xlarge",), None, [["p5-spot", "p5", "p5-spot-or-not", "p4"], ["any"]]),
        # On spot: the spot pools, then those of its type bought on demand
        (("ml.p5.48xlarge",), True, [["p5-spot", "p5-spot-or-not"], ["p5", "p4"], ["any"]]),
        # On demand: the on-demand pools and a spot pool that falls back to on-demand
        (("ml.p5.48xlarge",), False, [["p5", "p5-spot-or-not", "p4"], ["p5-spot"], ["any"]]),
        # Every instance group's type must be the pool's
        (("ml.p4d.24xlarge", "ml.p5.48xlarge"), None, [["p4"], ["any"]]),
        (("ml.g5.48xlarge",), None, [["any"]]),
    ],
)
def test_a_training_job_is_on_the_pools_with_its_instance_types_bought_its_way_first(types, spot, expected):
    assert names(pools_running(POOLS, "sagemaker", instance_types=types, spot=spot)) == expected


def test_a_training_job_on_a_type_no_pool_has_is_on_none_when_every_pool_names_its_type():
    assert pools_running((P5, P4), "sagemaker", instance_types=("ml.g5.48xlarge",)) == ()


@pytest.mark.parametrize(
    "queue, expected",
    [
        ("g5-queue", [["g5"], ["g6", "unqueued"]]),
        ("arn:aws:batch:us-east-1:123456789012:job-queue/g5-on-demand", [["g5"], ["g6", "unqueued"]]),
        ("g6-queue", [["g6"], ["g5", "unqueued"]]),
        # A queue of no pool's may share any pool's compute environments
        ("team-queue", [["g5", "g6", "unqueued"]]),
    ],
)
def test_a_batch_job_is_on_the_pool_whose_queue_runs_it_else_maybe_on_any(queue, expected):
    assert names(pools_running(POOLS, "batch", job_queue=queue)) == expected


def test_a_queue_is_known_by_its_name_or_its_arn():
    assert queue_name("arn:aws:batch:us-east-1:123456789012:job-queue/g6-queue") == queue_name("g6-queue") == "g6-queue"


CE = "arn:aws:batch:us-east-1:123456789012:compute-environment/"
# g5's queues run on the g5 fleet (its fallback on on-demand instances), g6's on its own;
# research's queue shares g6's, eval's runs on instances of its own.
ENVIRONMENTS = {
    "g5-queue": frozenset({CE + "g5-spot"}),
    "g5-on-demand": frozenset({CE + "g5-on-demand"}),
    "g6-queue": frozenset({CE + "g6"}),
    "research-queue": frozenset({CE + "research", CE + "g6"}),
    "eval-queue": frozenset({CE + "eval"}),
    "g5-backfill": frozenset({CE + "g5-on-demand"}),
}


@pytest.mark.parametrize(
    "queue, expected",
    [
        # A pool's own queue decides first; then the pools its compute environments are shared with
        ("g5-queue", [["g5"]]),
        ("g6-queue", [["g6"]]),
        # A queue of no pool's: the pools with a queue on one of its compute environments
        ("research-queue", [["g6"]]),
        ("g5-backfill", [["g5"]]),
        # On compute environments no pool's queue uses: it holds none of their GPUs
        ("eval-queue", []),
        # A queue Batch did not list: any pool, as before
        ("unlisted-queue", [["g5", "g6", "unqueued"]]),
    ],
)
def test_a_batch_job_in_a_queue_of_no_pools_is_on_the_pools_sharing_its_compute_environments(queue, expected):
    assert names(pools_running(POOLS, "batch", job_queue=queue, compute_environments=ENVIRONMENTS)) == expected


P4_OWN = PoolConfig(name="p4", instance_type="ml.p4d.24xlarge", instances=4)


@pytest.mark.parametrize(
    "pools, expected",
    [
        # A fallback type another pool owns: its runs would take that pool's instances
        ((P5.model_copy(update={"fallback_instance_types": ("ml.p4d.24xlarge",)}), P4_OWN),
         "pool 'p5' falls back to ml.p4d.24xlarge (on-demand), which is pool 'p4''s own: p5's runs there would take the"
         " account's instances that p4 counts as its own, and p4 could stop none of them for its jobs; drop the fallback,"
         " or give it to one pool"),
        # Spot first, then on demand: the on-demand fallback is the on-demand pool's
        ((P5_SPOT_OR_NOT, P5), "pool 'p5-spot-or-not' falls back to ml.p5.48xlarge (on-demand), which is pool 'p5''s own"),
        # A Batch fallback queue another pool owns (by name or ARN)
        ((G5, PoolConfig(name="od", service="batch", gpus=16, job_queue="arn:aws:batch:us-east-1:123456789012:job-queue/g5-on-demand")),
         "pool 'g5' falls back to job queue g5-on-demand, which is pool 'od''s own: g5's runs there would take the compute"
         " environments' capacity that od counts as its own"),
        # Two pools that own one type split it (the account holds the sum); spot and on
        # demand are separate quotas; a fallback no pool owns takes nobody's
        ((P5, P5.model_copy(update={"name": "p5-b"})), None),
        ((P5_SPOT, P5), None),
        ((P5.model_copy(update={"fallback_instance_types": ("ml.p4d.24xlarge",)}), P4_OWN.model_copy(update={"capacity_type": "spot"})), None),
        ((P5.model_copy(update={"fallback_instance_types": ("ml.p4d.24xlarge",)}), P5_SPOT.model_copy(update={"name": "x", "fallback_instance_types": ("ml.p4d.24xlarge",)})), None),
        ((G5, G6, UNQUEUED), None),
    ],
)
def test_a_pool_may_not_fall_back_onto_what_another_pool_owns(pools, expected):
    found = fallback_onto_another_pool(pools)
    assert found == expected if expected is None else found.startswith(expected), found


# SageMaker's ResourceLimitExceeded at CreateTrainingJob, as AWS words it.
QUOTA_REFUSED = (
    "CreateTrainingJob train-r2: ResourceLimitExceeded: The account-level service limit '{quota}' is {limit} Instances, "
    "with current utilization of {limit} Instances and a request delta of 2 Instances. Please use AWS Service Quotas to "
    "request an increase for this quota. If AWS Service Quotas is not available, contact AWS support to request an increase "
    "for this quota."
)


@pytest.mark.parametrize(
    "quota, limit, offering",
    [
        ("ml.p5.48xlarge for training job usage", 6, "ml.p5.48xlarge"),
        ("ml.g5.12xlarge for spot training job usage", 1, "ml.g5.12xlarge:spot"),
    ],
    ids=["on-demand", "spot"],
)
def test_a_quota_refusal_names_its_quota_its_offering_and_its_value(quota, limit, offering):
    from preemptor.core.pools import quota_limit

    found = quota_limit(QUOTA_REFUSED.format(quota=quota, limit=limit))
    assert (found.name, found.offering, found.instances) == (quota, offering, limit)


def test_a_limit_that_is_no_instance_quota_names_none():
    from preemptor.core.pools import quota_limit

    assert quota_limit("ResourceLimitExceeded: The account-level service limit 'Number of instances across all training jobs' is 20 Instances") is None
    assert quota_limit("ResourceLimitExceeded: Rate exceeded") is None
