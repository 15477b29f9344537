"""The train state: what a resume restores, described once.

:class:`TrainState` holds the counters (optimizer steps, tokens seen) and knows every other piece a
resume needs -- the model, the optimizer, the LR schedule, the data position and the RNG. The
checkpointer writes and reads it through :meth:`TrainState.record` and :meth:`TrainState.restore`;
fault tolerance sends a recovering replica group :meth:`TrainState.state_dict` (this rank's shards
of all of it, live) and applies it with :meth:`TrainState.load_state_dict`. A new piece of state is
added here, once, and both paths carry it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portatrain.accelerators import Accelerator
from portatrain.checkpoint import Checkpointer, DamagedCheckpointError, load_dataloader_state, newest_usable
from portatrain.checkpoint.common import broadcast_from_main
from portatrain.config import FaultToleranceConfig
from portatrain.fault_tolerance import (
    ReplicaGroups,
    load_module_state,
    load_optimizer_state,
    module_state,
    optimizer_state,
)
from portatrain.optim.resume import restore_lr_schedule, resume_param_groups

logger = logging.getLogger(__name__)


class TrainState:
    """The counters of a run and the parts a resume restores (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LambdaLR,
        loader: Any,
        accelerator: Accelerator,
    ) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.loader, self.accelerator = loader, accelerator
        self.step = 0
        """Optimizer steps taken."""
        self.tokens_seen = 0
        """Target tokens trained on, over every rank (counted at logging steps)."""
        self.parts: dict[str, Any] = {}
        """More resumable state, by name: objects with ``state_dict()`` (JSON-able) and
        ``load_state_dict()`` (e.g. the loss-spike guard's window); a part a checkpoint lacks starts anew."""

    def record(self) -> dict[str, Any]:
        """The counters and the LR schedule, for ``trainer_state.json`` (the tensors, data position
        and RNG go to the checkpoint's own files)."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            **(
                {"parts": {name: part.state_dict() for name, part in self.parts.items()}}
                if self.parts
                else {}
            ),
        }

    def restore(self, record: dict[str, Any], loader_state: Any, rng_state: Any, source: Path) -> None:
        """Apply a checkpoint's :meth:`record`, data position (None: start the data anew) and RNG state
        (the model and optimizer tensors are loaded by the checkpointer). The LR schedule keeps the
        current config's peaks (``portatrain.optim.resume``)."""
        restore_lr_schedule(self.lr_scheduler, self.optimizer, record["lr_scheduler"])
        if loader_state is not None:
            load_dataloader_state(self.loader, loader_state, source)
        if rng_state is not None:
            self.accelerator.set_rng_state(rng_state)
        self.step, self.tokens_seen = int(record["step"]), int(record["tokens_seen"])
        self._load_parts(record)

    def load(
        self, checkpointer: Checkpointer, path: Path, *, auto: bool, recipe: str, restore_data: bool
    ) -> Path:
        """Restore everything from checkpoint ``path``; returns the checkpoint actually loaded.

        The optimizer stage's resume policy (``portatrain.optim.resume``) decides the hyper-parameters:
        the config's. Every load checks the tensors it reads against the checksums written with them, and that they
        are finite. With ``auto`` (``checkpoint.resume=auto``) a checkpoint that fails (unreadable,
        damaged or non-finite: :class:`DamagedCheckpointError`) is skipped with a warning naming it,
        and the one before it is loaded (every rank agrees: rank 0 picks); otherwise that is the error.
        """
        while True:
            try:
                record, loader_state, rng_state = checkpointer.load(
                    path,
                    model=self.model,
                    optimizer=self.optimizer,
                    rng_template=self.accelerator.get_rng_state(),
                    param_groups=resume_param_groups,  # the optimizer stage's policy
                    read_loader_state=restore_data,
                )
                break
            except DamagedCheckpointError as exc:
                if not auto:
                    raise
                below = int(path.name.split("_")[-1])
                previous = broadcast_from_main(
                    newest_usable(path.parent, recipe, below=below) if checkpointer.is_main else None
                )
                if previous is None:
                    raise
                logger.warning("checkpoint.resume=auto: skipping %s (%s); trying %s", path, exc, previous)
                path = previous
        self.restore(record, loader_state if restore_data else None, rng_state, path)
        return path

    def rewind(self, checkpointer: Checkpointer, *, recipe: str) -> Path | None:
        """Go back to the newest checkpoint of this run (``trainer.spike_guard.action=rewind``):
        everything :meth:`load` restores except the data position, so the batches read since that
        checkpoint are skipped. Returns the checkpoint, or None when the run has none yet. Collective."""
        checkpointer.wait()  # a save still in flight is the newest
        if checkpointer.last_step is None:
            return None
        path = checkpointer.folder / f"step_{checkpointer.last_step:07d}"
        return self.load(checkpointer, path, auto=False, recipe=recipe, restore_data=False)

    def state_dict(self) -> dict[str, Any]:
        """What a healthy replica group sends a recovering one: this rank's shard of everything a
        resume restores."""
        return {
            "model": module_state(self.model),
            "optimizer": optimizer_state(self.optimizer),
            **self.record(),
            "data": self.loader.state_dict(),
            "rng": self.accelerator.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a healthy group's :meth:`state_dict` (live recovery); the loop then restarts its data
        iterator at the loaded position. The schedule is the sender's, exactly."""
        load_module_state(self.model, state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self._load_parts(state)
        load_dataloader_state(
            self.loader, state["data"], Path(f"<a healthy replica group, step {self.step}>")
        )
        self.accelerator.set_rng_state(state["rng"])

    def _load_parts(self, record: dict[str, Any]) -> None:
        saved = record.get("parts") or {}
        for name, part in self.parts.items():
            if name in saved:
                part.load_state_dict(saved[name])


def join_replica_groups(ft: FaultToleranceConfig, state: TrainState, runtime: Any) -> ReplicaGroups | None:
    """``fault_tolerance.enabled``: join the torchft replica groups (``portatrain.fault_tolerance``) at
    the state's step, exchanging :meth:`TrainState.state_dict` with a recovering group; else None.
    ``runtime`` is the run's :class:`~portatrain.train.runtime.Runtime`."""
    if not ft.enabled:
        return None
    return ReplicaGroups(
        ft,
        device_type=runtime.accelerator.device_type,
        rank=runtime.dist.rank,
        world_size=runtime.dist.world_size,
        state_dict=state.state_dict,
        load_state_dict=state.load_state_dict,
        broadcast=broadcast_from_main,
        step=state.step,
    )
