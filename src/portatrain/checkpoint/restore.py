"""Reading a checkpoint back into a model: what :meth:`Checkpointer.load` and
:func:`load_model_weights` share.

- :func:`check_shapes` -- the model's tensors against the checkpoint's index, every difference in
  one error (all ranks' shapes together: pipeline stages hold different layers);
- :func:`load_base` -- a checkpoint that references a frozen base (LoRA, ``base.py``) gets its
  frozen parameters from there first, the base's SHA-256 checked;
- :func:`read_verified` -- DCP's read, then the checksums written at save time and finiteness;
- :func:`read_dataloader_file` -- ``dataloader_rank<R>.json``, its digest checked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portatrain.checkpoint.base import (
    checked_reference,
    frozen_state_dict,
    read_base_state,
    trainable_options,
)
from portatrain.checkpoint.common import METADATA, CheckpointError, get_world_size, some
from portatrain.checkpoint.diagnostics import unreadable
from portatrain.checkpoint.discovery import inspect_checkpoint, read_index
from portatrain.checkpoint.hf import load_hf_weights
from portatrain.checkpoint.safe_metadata import safe_reader
from portatrain.checkpoint.verify import check_json_digest, flat_tensors, verify_loaded

LEGACY_MODEL_NAME = "llama3"
"""The family of checkpoints saved before ``trainer_state.json`` recorded ``model_name``."""


def saved_dtypes(metadata: Any) -> dict[str, torch.dtype]:
    """The dtype of each tensor in a checkpoint (a tensor loaded into another one cannot be compared)."""
    return {
        k: v.properties.dtype for k, v in metadata.state_dict_metadata.items() if hasattr(v, "properties")
    }


def load_model_weights(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load only the model's weights from checkpoint ``path`` (resharded to the model's layout, checked
    against the checksums written at save time and for finiteness, like :meth:`Checkpointer.load`);
    returns its ``trainer_state.json``. For a model that is evaluated, not trained on: no optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    path = Path(path)
    state, metadata = inspect_checkpoint(path)
    has_base = "base" in state  # its frozen parameters are in the base it references
    model_sd = get_model_state_dict(model, options=trainable_options() if has_base else None)
    check_shapes(path, metadata, model_sd)
    load_base(path, state, model)
    read_verified(path, metadata, {"model": model_sd}, state.get("checksums"))
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=not has_base))
    return state


def load_base(path: Path, state: Mapping[str, Any], model: nn.Module) -> dict[str, str] | None:
    """Load ``model``'s frozen parameters from the base checkpoint ``path`` references, once its
    SHA-256 is checked (``portatrain.checkpoint.base``); returns the reference, None for a checkpoint
    that holds every tensor itself. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reference = checked_reference(path, state)
    if reference is None:
        return None
    base = Path(reference["path"])
    if reference["kind"] == "init_from":
        load_hf_weights(model, base, family_of(path, state))
        return reference
    base_state, metadata = read_base_state(base), read_index(base)
    frozen = frozen_state_dict(model)
    check_shapes(base, metadata, frozen)
    read_verified(base, metadata, {"model": frozen}, base_state.get("checksums"))
    set_model_state_dict(model, frozen, options=StateDictOptions(strict=False))
    return reference


def read_verified(path: Path, metadata: Any, tensors: dict[str, Any], recorded: Any) -> None:
    """Read ``tensors`` from the DCP directory ``path``, then check them against the ``recorded``
    checksums and for finiteness (``verify.verify_loaded``; collective)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(tensors, storage_reader=safe_reader(str(path)))
        verify_loaded(path, flat_tensors(tensors), recorded, saved_dtypes(metadata))
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as exc:
        raise unreadable(path, exc) from None


def family_of(path: Path, state: Mapping[str, Any]) -> Any:
    """The ``ModelSpec`` of the family a checkpoint records (its Hugging Face names read its base)."""
    from portatrain.models import SPECS

    name = state.get("model_name", LEGACY_MODEL_NAME)
    if name not in SPECS:
        raise CheckpointError(
            f"checkpoint {path}: model family {name!r} is not registered in this portatrain "
            f"(known: {', '.join(SPECS)})"
        )
    return SPECS[name]


def read_dataloader_file(path: Path, rank: int) -> dict[str, Any] | None:
    """``dataloader_rank<R>.json``; missing or unreadable is an error, never a silent restart at epoch 0."""
    file = path / f"dataloader_rank{rank}.json"
    fix = (
        "resume from an earlier step_* directory, or set checkpoint.restore_data=false to train on "
        "with a fresh data order (restarting at epoch 0)"
    )
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing, so the data position is lost; {fix}")
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({exc}); {fix}") from None
    if value is not None and not isinstance(value, dict):
        raise CheckpointError(
            f"checkpoint file {file} holds a JSON {type(value).__name__}, not a loader state; {fix}"
        )
    return None if value is None else check_json_digest(file, value, fix)


def check_shapes(
    path: Path, metadata: Any, model_sd: Mapping[str, Any], optional: tuple[str, ...] = ()
) -> None:
    """Compare the model's tensors with the checkpoint's; raise once listing every difference.
    Keys starting with an ``optional`` prefix may be in the checkpoint and not in the model."""
    saved = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    ours = {k: tuple(v.shape) for k, v in model_sd.items()}
    if get_world_size() > 1:  # pipeline stages hold different layers: the model is all ranks' together
        import torch.distributed as dist

        gathered: list[Any] = [None] * get_world_size()
        dist.all_gather_object(gathered, ours)
        ours = {k: shape for rank_shapes in gathered for k, shape in rank_shapes.items()}
    problems = [
        f"{k}: checkpoint {list(saved[k])}, model {list(ours[k])}"
        for k in ours
        if k in saved and saved[k] != ours[k]
    ]
    missing = [k for k in ours if k not in saved]
    unexpected = [k for k in saved if k not in ours and not (optional and k.startswith(optional))]
    if missing:
        problems.append(f"in the model but not in the checkpoint: {some(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {some(unexpected)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path / METADATA} does not fit this model:\n  - "
            + "\n  - ".join(problems)
            + f"\nResume with the model settings it was saved with (see {path / 'config.yaml'}), "
            "or start a new run_dir."
        )
