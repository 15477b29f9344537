"""What a resume takes from the checkpoint and what from the current config (the optimizer stage's policy).

The checkpoint gives the optimizer's moments and the schedule's position (``last_epoch``); the config
gives the hyper-parameters: a run resumed with a new ``optim.lr`` (or ``trainer.steps``, which
reshapes the decay) continues from the saved position on the new schedule. The same policy as
torchtitan's, which rebuilds its schedulers from the config and loads only their step
(``torchtitan/components/lr_scheduler.py``, ``LRSchedulersContainer.load_state_dict``).
"""

from __future__ import annotations

from typing import Any

import torch


def restore_lr_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> None:
    """Load ``saved`` (a schedule's ``state_dict()``) keeping the current peaks and shape: the
    optimizer's learning rates become the current schedule's at the saved position."""
    base_lrs = list(scheduler.base_lrs)
    position = int(saved["last_epoch"])
    lrs = [base * fn(position) for base, fn in zip(base_lrs, scheduler.lr_lambdas, strict=True)]
    scheduler.load_state_dict(
        {**saved, "base_lrs": base_lrs, "_last_lr": lrs, "lr_lambdas": [None] * len(lrs)}
    )
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
