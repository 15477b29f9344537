"""Resume policy: which checkpoint a run continues from, and whether its data order can continue.

- :func:`resolve_resume` turns ``checkpoint.resume`` (``none``/``auto``/a path) into a directory,
  and refuses to start a new run over another run's checkpoints;
- :func:`find_checkpoint` resolves the ``checkpoint=PATH|auto`` of the commands that read one;
- :func:`load_dataloader_state` restores the loader's position, or explains why it cannot.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from portatrain.checkpoint.common import (
    STEP_DIR,
    CheckpointError,
    UnsafeCheckpointError,
    broadcast_from_main,
    get_rank,
)
from portatrain.checkpoint.discovery import complete_checkpoints, inspect_checkpoint, read_trainer_state

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader

logger = logging.getLogger(__name__)


def resolve_resume(spec: str | None, folder: Path, *, recipe: str | None = None) -> Path | None:
    """The checkpoint directory to resume from, or None to start fresh. Same answer on every rank.

    ``spec`` is ``checkpoint.resume``: ``none`` starts a new run and fails if ``folder`` already
    holds checkpoints (they belong to another run, and a new run would mix its saves and metrics
    with them); ``auto`` takes the newest complete checkpoint in ``folder``, or starts fresh if
    there is none (the first attempt of an elastic job); anything else is a checkpoint directory.
    With ``recipe``, a checkpoint saved by another recipe is refused here, before anything is built.
    """
    result: Path | None = None
    error: str | None = None
    if get_rank() == 0:  # one process looks at the filesystem; the others get its answer
        try:
            result = _resolve_resume(spec, folder, recipe)
        except (CheckpointError, OSError) as exc:  # reported on every rank, not only this one
            error = str(exc)
    result, error = broadcast_from_main((result, error))
    if error is not None:
        raise CheckpointError(error)
    return result


def _resolve_resume(spec: str | None, folder: Path, recipe: str | None) -> Path | None:
    spec = "none" if spec in (None, "", "none", "None") else str(spec)
    existing = complete_checkpoints(folder)
    if spec == "none":
        run_dir = folder.parent
        if existing:
            raise CheckpointError(
                f"run directory {run_dir} already holds {len(existing)} checkpoint(s) (newest: "
                f"{existing[-1].name}) and checkpoint.resume=none would start a new run over them. "
                f"Continue that run with checkpoint.resume=auto, or start a new one with a different "
                f"run_dir=... (or another PORTATRAIN_RUN_ID)."
            )
        used = [name for name in RUN_FILES if (run_dir / name).exists()]
        if used:
            raise CheckpointError(
                f"run directory {run_dir} already holds {' and '.join(used)} of another run (which saved "
                "no checkpoint) and checkpoint.resume=none would overwrite them. Start the new run with "
                "a different run_dir=... (or another PORTATRAIN_RUN_ID), or delete that directory."
            )
        return None
    if spec == "auto":
        return newest_usable(folder, recipe)
    path = Path(spec)
    if STEP_DIR.match(path.name) is None and complete_checkpoints(path / "checkpoints"):
        path = complete_checkpoints(path / "checkpoints")[-1]  # a run directory: its newest checkpoint
    inspect_checkpoint(path)
    _check_recipe(path, read_trainer_state(path), recipe)
    return path


RUN_FILES = ("config.yaml", "metrics.jsonl")
"""What a run writes into its directory besides checkpoints (a new run must not overwrite them)."""


def newest_usable(folder: Path, recipe: str | None = None, *, below: int | None = None) -> Path | None:
    """The newest checkpoint in ``folder`` (below step ``below``) that passes the checks made
    without reading tensors; each newer, broken one is skipped with a warning naming what is wrong."""
    candidates = (
        sorted(
            ((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()),
            reverse=True,
        )
        if folder.is_dir()
        else []
    )
    for step, path in candidates:
        if below is not None and step >= below:
            continue
        try:
            state, _ = inspect_checkpoint(path)
        except UnsafeCheckpointError as exc:  # not read: nothing of it ran
            logger.warning(
                "checkpoint.resume=auto: skipping UNSAFE checkpoint %s (not loaded): %s", path, exc
            )
            continue
        except CheckpointError as exc:
            logger.warning("checkpoint.resume=auto: skipping broken checkpoint %s: %s", path, exc)
            continue
        _check_recipe(path, state, recipe)
        return path
    if below is None:
        logger.info("checkpoint.resume=auto: no complete checkpoint in %s; starting at step 0", folder)
    return None


def _check_recipe(path: Path, state: dict[str, Any], recipe: str | None) -> None:
    if recipe is not None and state.get("recipe") not in (None, recipe):
        raise CheckpointError(
            f"checkpoint {path} was saved by recipe {state['recipe']!r}, not {recipe!r}: resuming "
            f"continues the run that saved it. Resume with recipe={state['recipe']}, or start "
            f"recipe={recipe} from its weights: `portatrain export checkpoint={path} out=DIR`, "
            f"then model.init_from=DIR."
        )


def find_checkpoint(spec: str, run_dir: Path) -> Path:
    """A checkpoint to read (``portatrain export``, ``portatrain eval``): ``auto``, the newest complete one
    under ``run_dir``; a run directory: its newest; else ``spec`` itself."""
    if spec != "auto":
        path = Path(spec)
        newest = complete_checkpoints(path / "checkpoints")
        return newest[-1] if newest else path
    newest = complete_checkpoints(run_dir / "checkpoints")
    if not newest:
        raise CheckpointError(
            f"checkpoint=auto: no complete checkpoint under {run_dir / 'checkpoints'}; pass "
            "checkpoint=<a step_N directory>, or run_dir=<the training run's directory>"
        )
    return newest[-1]


def load_dataloader_state(loader: StatefulDataLoader, state: Mapping[str, Any], path: Path) -> None:
    """Restore a StatefulDataLoader's position; a data order that no longer matches is a CheckpointError.

    The sampler's position counts GLOBAL batches (``data.batch_size * dp world size`` rows), so it
    carries over to another number of ranks exactly when the global batch size is unchanged.
    """
    expected = set(loader.state_dict()) if hasattr(loader, "state_dict") else set(state)
    if not isinstance(state, Mapping) or set(state) != expected:
        raise CheckpointError(
            f"checkpoint {path}: its data-loader state is damaged (keys {sorted(state) if isinstance(state, Mapping) else type(state).__name__}, "
            f"expected {sorted(expected)}); resume from an earlier step_* directory, or set "
            "checkpoint.restore_data=false to train on with a fresh data order (restarting at epoch 0)"
        )
    try:
        # torchdata applies a loaded state lazily, at the next iter(); check the sampler's part now,
        # on a copy, so a mismatch is reported here, at start-up.
        sampler, sampler_state = getattr(loader, "batch_sampler", None), state.get("_index_sampler_state")
        if sampler_state is not None and hasattr(sampler, "load_state_dict"):
            copy.deepcopy(sampler).load_state_dict(sampler_state)
        loader.load_state_dict(dict(state))
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: its data-loader state is damaged ({type(exc).__name__}: {exc}); resume "
            "from an earlier step_* directory, or set checkpoint.restore_data=false to train on with a "
            "fresh data order (restarting at epoch 0)"
        ) from None
    except ValueError as exc:
        raise CheckpointError(
            f"checkpoint {path}: cannot continue its data order: {exc}. To continue it exactly, keep "
            "data.batch_size * data-parallel ranks equal to the saved run's; to train on with a fresh "
            "data order instead (restarting at epoch 0), set checkpoint.restore_data=false."
        ) from None
