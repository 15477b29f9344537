"""What the checkpoint modules share: :class:`CheckpointError`, the on-disk names, and rank helpers."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from portatrain.errors import UserError

FORMAT = "portatrain-dcp/1"
"""Written into ``trainer_state.json``; bumped when the layout changes incompatibly."""

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
METADATA = ".metadata"


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used: missing, incomplete, truncated, or saved for another model.

    The message names the file and the mismatch, and says how to fix it.
    """


def some(keys: list[str], limit: int = 6) -> str:
    """The first ``limit`` keys, and how many there are in all."""
    more = f" ... ({len(keys)} in all)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def write_json(path: Path, value: Any) -> None:
    try:
        text = json.dumps(value, indent=1)
    except TypeError as exc:
        raise TypeError(f"checkpoint state for {path.name} must be JSON-serializable: {exc}") from None
    path.write_text(text)


def fsync_dir(folder: Path) -> None:
    """Make the rename durable (a crash right after it must not resurrect the .tmp name)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_from_main(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
