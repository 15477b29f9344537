"""Find and check checkpoints without reading their tensors.

- :func:`complete_checkpoints` -- the complete ``step_<N>`` directories of a run, oldest first;
- :func:`read_trainer_state` -- a checkpoint's ``trainer_state.json``, with every key a resume
  reads present and of its JSON type, and its digest checked;
- :func:`inspect_checkpoint` -- the trainer state plus DCP's index (:func:`read_index`: read with
  the restricted unpickler of ``safe_metadata.py``, and every data file the index points into present
  and long enough, so a truncated save is caught before a tensor is read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from portatrain.checkpoint.common import (
    FORMAT,
    METADATA,
    STEP_DIR,
    TRAINER_STATE,
    CheckpointError,
    UnsafeCheckpointError,
)
from portatrain.checkpoint.safe_metadata import UnsafeMetadataError, safe_reader
from portatrain.checkpoint.verify import check_json_digest


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints under ``folder`` (``step_<N>``, DCP index and trainer state present), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / METADATA).is_file() and (p / TRAINER_STATE).is_file()]


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The JSON part of a checkpoint; raises :class:`CheckpointError` naming what is missing."""
    path = Path(path)
    if path.name.endswith(".tmp"):
        raise CheckpointError(
            f"checkpoint {path} is an unfinished save (it was never renamed to its final name, so not "
            "every rank is known to have completed it); resume from a step_* directory without .tmp"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    for name in (METADATA, TRAINER_STATE):
        if not (path / name).is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: {path / name} is missing (an interrupted save, or "
                f"not a portatrain checkpoint); resume from an earlier step_* directory"
            )
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path / TRAINER_STATE} is unreadable: {exc}") from None
    file = path / TRAINER_STATE
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint file {file} holds a JSON {type(state).__name__}, not the object portatrain "
            "writes (the file was edited or replaced); resume from an earlier step_* directory"
        )
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint file {file} has format {state.get('format')!r}; this portatrain reads {FORMAT!r}"
        )
    wrong = [
        f"{key} ({'missing' if key not in state else type(state[key]).__name__ + ', not ' + kind.__name__})"
        for key, kind in _STATE_KEYS.items()
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool)
    ]
    if wrong:
        raise CheckpointError(
            f"checkpoint file {file} is damaged: {', '.join(wrong)} (the file was edited or truncated); "
            "resume from an earlier step_* directory"
        )
    return check_json_digest(file, state, "resume from an earlier step_* directory")


# What a resume reads from trainer_state.json, and its JSON type.
_STATE_KEYS: dict[str, type] = {
    "step": int,
    "tokens_seen": int,
    "lr_scheduler": dict,
    "optimizer_param_groups": list,
    "world_size": int,
}


def inspect_checkpoint(path: Path) -> tuple[dict[str, Any], Any]:
    """Validate a checkpoint without reading its tensors: ``(trainer state, DCP metadata)``.

    Checks that the JSON state and DCP's index are readable and that every data file the index
    points into exists and is long enough; raises :class:`CheckpointError` naming the bad file.
    """
    path = Path(path)
    state = read_trainer_state(path)
    return state, read_index(path)


def read_index(path: Path) -> Any:
    """DCP's index of the DCP directory ``path`` (a checkpoint, or a run's frozen base), read with the
    restricted unpickler, once every data file it points into is found present and long enough."""
    metadata = _read_dcp_metadata(path)
    _check_files(path, metadata)
    return metadata


def _read_dcp_metadata(path: Path) -> Any:
    try:
        return safe_reader(str(path)).read_metadata()
    except UnsafeMetadataError as exc:
        raise UnsafeCheckpointError(
            f"checkpoint {path} is unsafe and was not loaded: its index {path / METADATA}: {exc}. "
            "Load only checkpoints written by portatrain; delete this one, or resume from another step_* directory"
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path / METADATA} is unreadable ({type(exc).__name__}: {exc}); "
            "the file is truncated or corrupt -- resume from an earlier step_* directory"
        ) from None


def _check_files(path: Path, metadata: Any) -> None:
    """Every data file the index points into exists and is long enough (catches truncation early)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing; the checkpoint is incomplete")
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"checkpoint file {file} is truncated: {actual} bytes, the index needs {size}; "
                "resume from an earlier step_* directory"
            )
