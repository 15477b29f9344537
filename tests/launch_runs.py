"""Several training runs in one ``torchrun`` launch (its processes start and join the process group once).

``python -m torch.distributed.run --nproc-per-node=N tests/launch_runs.py RUNS.json``, where RUNS.json
is a list of ``{"run_dir": ..., "overrides": [...]}``: each run is composed as the CLI composes it, trained
by a Trainer, and closed; the process group stays up between runs (torn down at exit).
A run with ``"stop_at": N`` is asked to stop after step N (rank 0 asks, as a SIGTERM to one rank would):
it saves and ends there, and a later run of the launch may resume it.
``tests.helpers.launch_runs`` runs it: the pipeline layouts and the conformance suite's FSDP2 runs of every
family are checked for the price of one start-up each.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from portatrain.trainer import Trainer
from portatrain.validate import validate
from tests.helpers import compose_config


class StopAt(Trainer):
    """Rank 0 alone asks to stop after step ``stop_at``; the ranks agree on it, save, and end."""

    stop_at = 0

    def on_step_end(self, step: int, metrics: dict) -> None:
        super().on_step_end(step, metrics)
        if step == self.stop_at and self.dist.is_main:
            self.preemption.requested = True


def main(path: str) -> None:
    runs = json.loads(Path(path).read_text())
    for run in runs:  # the process group stays up between runs, torn down at exit (portatrain.train.runtime)
        cfg = compose_config(run["overrides"], run_dir=run["run_dir"])
        validate(cfg)
        if run.get("stop_at"):
            trainer = StopAt(cfg)
            trainer.stop_at = run["stop_at"]
        else:
            trainer = Trainer(cfg)
        try:
            trainer.fit()
        except BaseException:
            traceback.print_exc()  # now: closing waits for the other ranks, which may wait for this one
            raise
        finally:
            trainer.close()
            dist.barrier()  # every rank done with this run before the next starts


if __name__ == "__main__":
    main(sys.argv[1])
