"""A pure-Python training loop that uses the Preemptor training helper.

    .venv/bin/python examples/training/train.py --steps 200 --checkpoint-dir /tmp/ckpt

The "model" is a weight and a running checksum updated deterministically at every step,
so a run that was stopped and resumed ends with exactly the numbers of a run that never
stopped (it prints them last). On start it prints `resumed at step K` when it finds a
checkpoint; on SIGTERM it checkpoints at the end of the step in progress and exits 0.
On AWS Batch it mirrors its checkpoints to `PREEMPTOR_CHECKPOINT_S3_URI`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from preemptor_training import Checkpointer, Stopped


class Model:
    """A stand-in for a network: the state a checkpoint must carry across a restart."""

    def __init__(self) -> None:
        self.weight = 1.0
        self.checksum = 0

    def train_step(self, step: int) -> None:
        self.weight = self.weight * 0.999 + (step % 7) * 0.001
        self.checksum = (self.checksum * 31 + step) % 1_000_000_007

    def save(self, directory: Path, step: int) -> None:
        (directory / "model.json").write_text(json.dumps({"step": step, "weight": self.weight, "checksum": self.checksum}))

    def load(self, directory: Path) -> None:
        state = json.loads((directory / "model.json").read_text())
        self.weight, self.checksum = state["weight"], state["checksum"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="steps to train in all")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.02, help="time one step takes")
    parser.add_argument("--every-s", type=float, default=600.0, help="periodic checkpoint interval")
    parser.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    parser.add_argument("--s3-uri", default=None, help="checkpoint location (default: PREEMPTOR_CHECKPOINT_S3_URI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")

    model = Model()
    checkpointer = Checkpointer(
        args.checkpoint_dir, save=model.save, load=model.load, every_s=args.every_s, keep=args.keep, s3_uri=args.s3_uri
    )
    try:
        with checkpointer as ckpt:
            start = ckpt.resume()
            if ckpt.last is not None:
                print(f"resumed at step {start}", flush=True)
            for step in range(start, args.steps):
                time.sleep(args.step_seconds)  # the forward and backward passes
                model.train_step(step)
                print(f"step {step} done", flush=True)
                ckpt.step_done(step)
    except Stopped as stopped:
        at = stopped.manifest.step if stopped.manifest else "?"
        print(f"stopped: checkpoint at step {at}", flush=True)
        raise
    print(f"finished {args.steps} steps: weight={model.weight!r} checksum={model.checksum}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
