"""How many reconcile passes adopting a team's run takes under the chaos sweep's rates: not a
test (too long for `make test`), a measure of the safety net's liveness.

    PYTHONPATH=functions/controller:functions/tools:functions/training:tests \\
        .venv/bin/python tests/storm/adoption_probe.py batch 12 36

For each seed: a team's own run on the pool (a SageMaker training job, or a Batch job on the
pool's queue), tagged to be adopted, whose every event was lost; reconcile runs every 5
minutes until it has adopted the run (at most 40 passes). Prints the passes each seed took,
their distribution, and the errors the passes reported, most frequent first. Measured at
19dee12, batch seeds 12-35: 3.29 passes on average, 10 at most; with reconcile's second look
(7f9102b..b17439e): 1.71, 4 at most.
"""

from __future__ import annotations

import argparse
import collections

from emulation import START, batch_queues, emulation, team_training_job
from storm.chaos_sweep import CHAOS

from preemptor.config import PoolConfig
from preemptor.service.reconcile import UNKNOWN_RUN_GRACE_S
from preemptor_tools.local import moto_patches
from preemptor_tools.local.hostile import HostileWorld
from preemptor_tools.local.scenario import Chaos

MAX_PASSES = 40
TAGS = {"preemptor:team": "research", "preemptor:priority": "high", "preemptor:gpus": "8"}


def passes_to_adopt(service: str, seed: int, errors: collections.Counter) -> int:
    """The reconcile passes it took to adopt the team's run (MAX_PASSES + 1: never), each
    pass's errors counted in `errors`."""
    chaos = Chaos(seed=seed, **CHAOS)
    pools = [PoolConfig(name="g5", service="batch", gpus=32, job_queue="g5-queue")] if service == "batch" else None
    with emulation(hostile=lambda clock: HostileWorld(clock, START, chaos=chaos), **({"pools": pools} if pools else {})) as env:
        env.fleet.close()  # no fleet to tell its events
        if service == "batch":
            batch_queues(env, "g5-queue")
            job = env.stack.client("batch").submit_job(
                jobName="team-run", jobQueue="g5-queue", jobDefinition="g5-training", tags={**TAGS, "preemptor:pool": "g5"}
            )
            moto_patches.set_batch_job_status(job["jobId"], "RUNNING")
        else:
            team_training_job(env, "team-run", {**TAGS, "preemptor:pool": "p5"})
        env.advance(UNKNOWN_RUN_GRACE_S + 60)
        for n in range(1, MAX_PASSES + 1):
            try:
                result = env.stack.invoke_lambda(env.stack.resources["ReconcileFunction"], {})
            except Exception as error:  # noqa: BLE001 - the invocation died: counted, the next pass tries
                errors[f"invocation: {type(error).__name__}"] += 1
            else:
                for e in result["errors"]:
                    errors[f"{e.get('part') or ('run' if 'run' in e else 'job')}: {e['error']}: {e.get('detail', '')[:70]}"] += 1
            if env.store.get("team-run") is not None:
                return n
            env.advance(300)
        return MAX_PASSES + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("service", choices=("sagemaker", "batch"))
    parser.add_argument("first", type=int, help="first seed")
    parser.add_argument("end", type=int, help="seed after the last")
    args = parser.parse_args()
    errors: collections.Counter = collections.Counter()
    taken = []
    for seed in range(args.first, args.end):
        taken.append(passes_to_adopt(args.service, seed, errors))
        print(f"{args.service} seed {seed}: adopted after {taken[-1]} passes", flush=True)
    print(f"mean {sum(taken) / len(taken):.2f} passes, max {max(taken)}; passes: {dict(sorted(collections.Counter(taken).items()))}")
    for what, count in errors.most_common(12):
        print(f"{count:5d}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
