"""What a failed save or an unreadable checkpoint tells the user: one line, with the fix.

- :func:`raise_save_failure` -- after a failed save (its partial files removed): a full disk with
  how much a checkpoint needs and how much is free, or the first cause of any other failure; in both
  cases which checkpoint is still intact;
- :func:`unreadable` -- DCP's ``CheckpointException`` on load, reduced to the checkpoint and its
  first cause.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from portatrain.checkpoint.common import (
    FULL_BELOW_BYTES,
    CheckpointError,
    any_rank,
    bytes_on_disk,
    free_bytes,
    is_disk_full,
    mib,
    root_causes,
    short_cause,
    sum_over_ranks,
)
from portatrain.checkpoint.discovery import complete_checkpoints
from portatrain.checkpoint.verify import DamagedCheckpointError, state_bytes


def raise_save_failure(
    folder: Path,
    step: int,
    final: Path,
    tmp: Path,
    error: BaseException | None,
    tensors: Mapping[str, Any],
    *,
    is_main: bool,
    group: Any = None,
) -> NoReturn:
    """Remove this save's partial files and raise one message on every rank (collective over ``group``).

    A full disk does not always surface as ``ENOSPC``: ``torch.save`` inside DCP reports a short
    write as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``. So the free
    space is looked at too, before the partial files are removed: a failed write with (almost)
    nothing left is a full disk, and the message says how much the checkpoint needs.
    """
    causes = root_causes(error) if error is not None else []
    disk_full = any(is_disk_full(c) for c in causes) or free_bytes(folder) < FULL_BELOW_BYTES
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = complete_checkpoints(folder)
    kept = (
        f"the previous checkpoint {previous[-1].name} is intact"
        if previous
        else "no earlier checkpoint exists"
    )
    if any_rank(disk_full, group):
        # The previous checkpoint's size when there is one (same model, same files), else the
        # bytes of the tensors being saved.
        needed = bytes_on_disk(previous[-1]) if previous else sum_over_ranks(state_bytes(tensors), group)
        free = free_bytes(folder)
        raise CheckpointError(
            f"no space left on device while saving checkpoint step {step} into {folder}: a "
            f"checkpoint needs about {mib(needed)} and {mib(free)} is free once the partial save is "
            f"removed; nothing of step {step} was kept and {kept}. Free at least "
            f"{mib(max(needed - free, 0))} more (or lower checkpoint.keep, or choose a run_dir on a "
            "larger disk), then continue with checkpoint.resume=auto"
        )
    detail = short_cause(causes[0]) if causes else "another rank failed to write its part"
    raise CheckpointError(
        f"saving checkpoint {final} failed ({detail}); nothing of step {step} was kept and {kept}"
    ) from (causes[0] if causes and isinstance(causes[0], Exception) else None)


def unreadable(path: Path, exc: BaseException) -> DamagedCheckpointError:
    """DCP reports failures as CheckpointException, a BaseException: name the checkpoint and the
    first cause in one line (its remote tracebacks, and torch.load's advice to pass
    weights_only=False, help nobody whose checkpoint file was damaged)."""
    return DamagedCheckpointError(
        f"checkpoint {path} is corrupt: reading its tensors failed ({short_cause(root_causes(exc)[0])}); "
        "a *.distcp file was overwritten or damaged. Resume from an earlier step_* directory "
        "(checkpoint.resume=auto skips it)"
    )
