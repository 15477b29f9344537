"""``portatrain [train] [overrides]``: build the Trainer from the config, fit, close."""

from __future__ import annotations

import os
from pathlib import Path

from portatrain.commands import CommandContext
from portatrain.config import Config
from portatrain.errors import UserError

SECTIONS = ("trainer", "data", "optim", "checkpoint", "fault_tolerance")
EXAMPLE = "portatrain trainer.steps=50 optim.lr=1e-3 run_dir=runs/debug/demo"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.launch.elastic import record_worker_clean_end, record_worker_start
    from portatrain.rundir import discard_unsaved_run
    from portatrain.trainer import Trainer

    if ctx.trainer_cls is None and cfg.finetune.method == "dpo":
        from portatrain.dpo_trainer import DPOTrainer as Trainer  # preference pairs, DPO's step

    run_dir = Path(cfg.run_dir)
    fresh = not run_dir.is_dir() or not any(run_dir.iterdir())
    record_worker_start()
    try:
        trainer = (ctx.trainer_cls or Trainer)(cfg)
        try:
            trainer.fit()
        finally:
            trainer.close()
        # Finished, or stopped on request after saving the step it stopped at: a clean end, which
        # `portatrain torchrun` reports as status 0 after a SIGTERM.
        saved = not cfg.checkpoint.enabled or trainer.checkpointer.last_step == trainer.step
        if not trainer.preempted or saved:
            record_worker_clean_end()
    except UserError:
        # A mistake the user fixes and reruns (a damaged shard, a device out of memory...): a new run
        # that saved nothing leaves nothing behind, or the rerun would be refused as another run's.
        if fresh and os.environ.get("RANK", "0") == "0":
            discard_unsaved_run(run_dir)
        raise
