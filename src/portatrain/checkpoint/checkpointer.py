"""The DCP checkpointer: save, load and discover ``step_<N>`` checkpoints of a training run.

- :class:`Checkpointer` saves a training state with ``torch.distributed.checkpoint`` (DCP) every
  ``checkpoint.every`` steps and at the end, keeps the last K, and loads one back -- into the same
  or a different number of ranks (FSDP2 DTensors are resharded by DCP's planner);
- :func:`complete_checkpoints`, :func:`read_trainer_state` and :func:`inspect_checkpoint` find and
  check checkpoints without reading their tensors.

See ``portatrain.checkpoint`` for the on-disk layout and the atomicity rule.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portatrain.checkpoint.common import (
    FORMAT,
    METADATA,
    STEP_DIR,
    TRAINER_STATE,
    CheckpointError,
    barrier,
    broadcast_from_main,
    fsync_dir,
    get_rank,
    get_world_size,
    some,
    write_json,
)

# torch.distributed.checkpoint is imported inside the functions that use it: `portatrain --help`
# should not pay DCP's ~0.8 s import.

logger = logging.getLogger(__name__)


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
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint file {path / TRAINER_STATE} has format {state.get('format')!r}; "
            f"this portatrain reads {FORMAT!r}"
        )
    return state


class Checkpointer:
    """Saves and loads training state under ``folder``; see the module docstring for the layout.

    Every method is collective: call it on every rank.
    """

    def __init__(self, folder: Path, *, keep: int, is_main: bool, every: int = 0) -> None:
        self.folder = Path(folder)
        self.keep = keep
        """Complete checkpoints kept after a save; <= 0 keeps all."""
        self.every = every
        self.is_main = is_main
        self.last_step: int | None = None
        """Step of the checkpoint saved or loaded last (the final save is skipped when it is current)."""

    def due(self, step: int) -> bool:
        """Whether ``checkpoint.every`` asks for a save after optimizer step ``step``."""
        return self.every > 0 and step % self.every == 0

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: Mapping[str, Any],
        dataloader_state: Mapping[str, Any] | None,
        rng_state: Mapping[str, Any],
        config_yaml: str,
    ) -> Path:
        """Write ``step_<step>`` atomically and drop checkpoints beyond the newest ``keep``.

        ``state`` is the JSON-able trainer state (counters, LR scheduler, recipe, model args...),
        the same on every rank; ``dataloader_state`` and ``rng_state`` are this rank's own.
        An existing ``step_<step>`` is left as it is (a complete checkpoint is never overwritten).
        """
        final = self.folder / f"step_{step:07d}"
        if broadcast_from_main(final.exists() if self.is_main else None):
            logger.info("checkpoint %s already exists; not overwriting it", final)
            self.last_step = step
            return final
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp = final.with_name(final.name + ".tmp")
        if self.is_main:
            for stale in self.folder.glob("step_*.tmp"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()

        model_sd, optim_sd = get_state_dict(model, optimizer)
        rank = get_rank()
        tensors = {
            "model": model_sd,
            "optim": optim_sd["state"],
            "rng": {f"rank{rank}": {k: v for k, v in rng_state.items() if isinstance(v, torch.Tensor)}},
        }
        write_json(tmp / f"dataloader_rank{rank}.json", dataloader_state)
        if self.is_main:
            full_state = {
                "format": FORMAT,
                **state,
                "world_size": get_world_size(),
                "optimizer_param_groups": optim_sd["param_groups"],
            }
            write_json(tmp / TRAINER_STATE, full_state)
            (tmp / "config.yaml").write_text(config_yaml)
        # DCP writes .metadata last, on rank 0, after gathering every rank's write results.
        dcp.save(tensors, checkpoint_id=str(tmp))
        barrier()
        if self.is_main:
            tmp.rename(final)
            fsync_dir(self.folder)
            if self.keep > 0:
                for old in complete_checkpoints(self.folder)[: -self.keep]:
                    shutil.rmtree(old)
        barrier()
        self.last_step = step
        return final

    def load(
        self,
        path: Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rng_template: Mapping[str, Any],
    ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
        """Load model and optimizer (resharded to the current layout) from ``path``.

        Returns ``(trainer_state, dataloader_state, rng_state)``: the JSON state written by
        :meth:`save`, this rank's loader state (rank 0's when the world size changed: the sampler's
        position is global), and this rank's RNG state (None when the world size changed: the
        saved ranks are not these ranks). ``rng_template`` is the current RNG state, for shapes.
        Raises :class:`CheckpointError` naming the file and the mismatch.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = Path(path)
        state, metadata = inspect_checkpoint(path)

        model_sd, optim_sd = get_state_dict(model, optimizer)
        _check_shapes(path, metadata, model_sd)
        same_world = state.get("world_size") == get_world_size()
        rank = get_rank()
        tensors: dict[str, Any] = {"model": model_sd, "optim": optim_sd["state"]}
        rng_key = f"rng.rank{rank}."
        if same_world and any(k.startswith(rng_key) for k in metadata.state_dict_metadata):
            rng = {k: v.clone() for k, v in rng_template.items() if isinstance(v, torch.Tensor)}
            tensors["rng"] = {f"rank{rank}": rng}
        try:
            dcp.load(tensors, checkpoint_id=str(path))
            param_groups = _restore_param_groups(state["optimizer_param_groups"], optim_sd["param_groups"])
            set_state_dict(
                model,
                optimizer,
                model_state_dict=tensors["model"],
                optim_state_dict={"state": tensors["optim"], "param_groups": param_groups},
            )
        except CheckpointError:
            raise
        # DCP reports failures as CheckpointException, a BaseException: name the checkpoint, keep the cause.
        except (Exception, dcp.CheckpointException) as exc:
            raise CheckpointError(f"could not load checkpoint {path}: {type(exc).__name__}: {exc}") from exc

        loader_file = path / f"dataloader_rank{rank if same_world else 0}.json"
        loader_state = json.loads(loader_file.read_text()) if loader_file.is_file() else None
        self.last_step = int(state["step"])
        return state, loader_state, tensors.get("rng", {}).get(f"rank{rank}")


def _restore_param_groups(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON turned tuples (AdamW's ``betas``) into lists; give them back their current type."""
    if len(saved) != len(current):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one {len(current)}"
        )
    restored = []
    for old, new in zip(saved, current):
        group = dict(old)
        for key, value in group.items():
            if isinstance(new.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)
        restored.append(group)
    return restored


def inspect_checkpoint(path: Path) -> tuple[dict[str, Any], Any]:
    """Validate a checkpoint without reading its tensors: ``(trainer state, DCP metadata)``.

    Checks that the JSON state and DCP's index are readable and that every data file the index
    points into exists and is long enough; raises :class:`CheckpointError` naming the bad file.
    """
    path = Path(path)
    state = read_trainer_state(path)
    metadata = _read_dcp_metadata(path)
    _check_files(path, metadata)
    return state, metadata


def _read_dcp_metadata(path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
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


def _check_shapes(path: Path, metadata: Any, model_sd: Mapping[str, Any]) -> None:
    """Compare the model's tensors with the checkpoint's; raise once listing every difference."""
    saved = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    ours = {k: tuple(v.shape) for k, v in model_sd.items()}
    problems = [
        f"{k}: checkpoint {list(saved[k])}, model {list(ours[k])}"
        for k in ours
        if k in saved and saved[k] != ours[k]
    ]
    missing = [k for k in ours if k not in saved]
    unexpected = [k for k in saved if k not in ours]
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


def model_args_dict(model: nn.Module) -> dict[str, Any] | None:
    """The model's architecture as JSON (for export), when it is a dataclass-configured model."""
    args = getattr(model, "args", None)
    return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None
