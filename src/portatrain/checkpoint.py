"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded, atomic, keep-last-K.

Layout: ``<run_dir>/checkpoints/step_<N>/`` holds the DCP shards of the model, optimizer,
LR scheduler, dataloader and progress counters. A save goes to ``step_<N>.tmp`` and is renamed
into place only after every rank finished writing, so a crash mid-save leaves the previous
checkpoint as the newest complete one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints (no ``.tmp`` suffix, DCP metadata present), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / ".metadata").is_file()]


class Checkpointer:
    def __init__(self, folder: Path, *, keep: int, is_main: bool) -> None:
        self.folder = folder
        self.keep = keep
        self.is_main = is_main

    def _state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, step: int, model: nn.Module, optimizer: Any, extra: dict[str, Any]) -> Path:
        """Write ``step_<step>`` atomically; ``extra`` holds small picklable state (scheduler, loader, counters)."""
        final = self.folder / f"step_{step:07d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save({**self._state(model, optimizer), "extra": extra}, checkpoint_id=str(tmp))
        _barrier()
        if self.is_main:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in complete_checkpoints(self.folder)[: -self.keep] if self.keep > 0 else []:
                shutil.rmtree(old)
        _barrier()
        return final
