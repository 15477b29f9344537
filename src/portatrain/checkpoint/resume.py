"""Resume policy: which checkpoint a run continues from, and whether its data order can continue.

- :func:`resolve_resume` turns ``checkpoint.resume`` (``none``/``auto``/a path) into a directory,
  and refuses to start a new run over another run's checkpoints;
- :func:`load_dataloader_state` restores the loader's position, or explains why it cannot.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from portatrain.checkpoint.checkpointer import complete_checkpoints, read_trainer_state
from portatrain.checkpoint.common import STEP_DIR, CheckpointError, broadcast_from_main, get_rank

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
        if existing:
            run_dir = folder.parent
            raise CheckpointError(
                f"run directory {run_dir} already holds {len(existing)} checkpoint(s) (newest: "
                f"{existing[-1].name}) and checkpoint.resume=none would start a new run over them. "
                f"Continue that run with checkpoint.resume=auto, or start a new one with a different "
                f"run_dir=... (or another PORTATRAIN_RUN_ID)."
            )
        return None
    if spec == "auto":
        if not existing:
            logger.info("checkpoint.resume=auto: no complete checkpoint in %s; starting at step 0", folder)
            return None
        path = existing[-1]
    else:
        path = Path(spec)
        if STEP_DIR.match(path.name) is None and complete_checkpoints(path / "checkpoints"):
            path = complete_checkpoints(path / "checkpoints")[-1]  # a run directory: its newest checkpoint
    state = read_trainer_state(path)
    if recipe is not None and state.get("recipe") not in (None, recipe):
        raise CheckpointError(
            f"checkpoint {path} was saved by recipe {state['recipe']!r}, not {recipe!r}: resuming "
            f"continues the run that saved it. Resume with recipe={state['recipe']}, or start "
            f"recipe={recipe} from its weights: `portatrain export checkpoint={path} out=DIR`, "
            f"then model.init_from=DIR."
        )
    return path


def load_dataloader_state(loader: StatefulDataLoader, state: Mapping[str, Any], path: Path) -> None:
    """Restore a StatefulDataLoader's position; a data order that no longer matches is a CheckpointError.

    The sampler's position counts GLOBAL batches (``data.batch_size * dp world size`` rows), so it
    carries over to another number of ranks exactly when the global batch size is unchanged.
    """
    try:
        # torchdata applies a loaded state lazily, at the next iter(); check the sampler's part now,
        # on a copy, so a mismatch is reported here, at start-up.
        sampler, sampler_state = getattr(loader, "batch_sampler", None), state.get("_index_sampler_state")
        if sampler_state is not None and hasattr(sampler, "load_state_dict"):
            copy.deepcopy(sampler).load_state_dict(sampler_state)
        loader.load_state_dict(dict(state))
    except ValueError as exc:
        raise CheckpointError(
            f"checkpoint {path}: cannot continue its data order: {exc}. To continue it exactly, keep "
            "data.batch_size * data-parallel ranks equal to the saved run's; to train on with a fresh "
            "data order instead (restarting at epoch 0), set checkpoint.restore_data=false."
        ) from None
