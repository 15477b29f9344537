"""What a resume takes from the checkpoint and what from the current config (the optimizer stage's policy).

The checkpoint gives the optimizer's moments and the schedule's position (``last_epoch``); the config
gives the hyper-parameters: a run resumed with a new ``optim.lr`` (or ``trainer.steps``, which
reshapes the decay) continues from the saved position on the new schedule. The same policy as
torchtitan's, which rebuilds its schedulers from the config and loads only their step
(``torchtitan/components/lr_scheduler.py``, ``LRSchedulersContainer.load_state_dict``).

- :func:`resume_param_groups` -- the optimizer's parameter groups a resume loads: the config's, each
  changed hyper-parameter logged (:func:`changed_hyperparameters`). The checkpointer checks the
  saved groups and is handed this policy by the train state (``portatrain.train.state``): the
  checkpoint stage, a neighbour of this one, never imports it;
- :func:`restore_lr_schedule` -- the schedule at the saved position with the config's peaks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

HYPERPARAMETERS = {
    "initial_lr": "optim.lr",
    "betas": "optim.betas",
    "eps": "optim.eps",
    "weight_decay": "optim.weight_decay",
}
"""The parameter-group hyper-parameters a resume compares, and the config key that sets each."""


def resume_param_groups(
    saved: list[dict[str, Any]], current: list[dict[str, Any]], source: Path
) -> list[dict[str, Any]]:
    """The parameter groups the optimizer resumed from checkpoint ``source`` loads: the current ones
    (the config's hyper-parameters win over the checkpoint's), each changed value logged once."""
    changes = changed_hyperparameters(saved, current)
    if changes:
        logger.warning(
            "resuming %s with changed optimizer settings, applied from the config: %s",
            source,
            "; ".join(changes),
        )
    return [dict(group) for group in current]


def changed_hyperparameters(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[str]:
    """Each hyper-parameter that differs between the saved and the current groups, as
    ``"optim.lr 0.001 -> 0.0005"`` (sorted)."""
    changes = set()
    for old, new in zip(saved, current):
        for key, name in HYPERPARAMETERS.items():
            before, after = old.get(key), new.get(key)
            if isinstance(after, tuple):
                before = tuple(before) if isinstance(before, list) else before
            if before is not None and after is not None and before != after:
                changes.add(f"{name} {before} -> {after}")
    return sorted(changes)


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
