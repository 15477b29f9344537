"""``python -m tests.slurm_trainer [overrides]``: portatrain's CLI with a Trainer that sleeps
``PORTATRAIN_TEST_STEP_SLEEP`` seconds after every step -- in a SLURM job's first allocation only
(``SLURM_RESTART_COUNT`` unset or 0).

The SLURM tests (``tests/test_slurm.py``) interrupt a running job: a requeue at step k, a time-limit
warning that comes 20-50 s after the start (SLURM checks time limits every 30 s), a cancel. On a
fast machine the tiny debug model would finish before any of them; the sleep keeps the first
allocation running for as long as the test needs, at no CPU cost, and the requeued allocation then
finishes at full speed. Sleeping changes no loss: the losses still equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from portatrain.cli import main
from portatrain.trainer import Trainer


class FirstAllocationSlowTrainer(Trainer):
    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        super().on_step_end(step, metrics)
        if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            time.sleep(float(os.environ.get("PORTATRAIN_TEST_STEP_SLEEP", "0")))


if __name__ == "__main__":
    main(trainer_cls=FirstAllocationSlowTrainer)
