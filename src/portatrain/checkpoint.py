"""Checkpoints that survive everything: sharded, atomic, resumable, reshardable.

What this file does:

- :class:`Checkpointer` saves a training state with ``torch.distributed.checkpoint`` (DCP) every
  ``checkpoint.every`` steps and at the end, keeps the last K, and loads one back -- into the same
  or a different number of ranks (FSDP2 DTensors are resharded by DCP's planner);
- :func:`resolve_resume` turns ``checkpoint.resume`` (``none``/``auto``/a path) into a directory,
  and refuses to start a new run over another run's checkpoints;
- :class:`PreemptionWatcher` turns SIGTERM into "save at the next step boundary, then stop";
- :func:`load_hf_weights` initializes a model from a local Hugging Face safetensors directory,
  each rank reading only the slices it holds;
- :class:`CheckpointError` is the one error a user sees for a missing, truncated or mismatched
  checkpoint; the CLI prints it without a traceback.

Layout of ``<run_dir>/checkpoints/step_<N>/``::

    .metadata                DCP's index of every tensor chunk (written last, by rank 0)
    __<rank>_0.distcp        tensors: model, optimizer state, each rank's RNG state
    trainer_state.json       step, tokens seen, LR scheduler, optimizer hyper-parameters,
                             model architecture, recipe, world size (rank 0)
    dataloader_rank<R>.json  each rank's StatefulDataLoader state
    config.yaml              the resolved config of the run that saved it

Only tensors go through DCP, everything else is JSON: DCP stores non-tensor values with
``torch.save`` and reads them back with ``torch.load(weights_only=False)``, which would execute
whatever a checkpoint file contains. DCP's own ``.metadata`` index is still a pickle, so load only
checkpoints you trust.

Atomicity: a save writes ``step_<N>.tmp`` and rank 0 renames it to ``step_<N>`` after every rank
has finished (DCP writes ``.metadata`` only then). A process killed mid-save leaves a ``.tmp``
directory that :func:`complete_checkpoints` ignores and the next save deletes, so the previous
checkpoint stays the newest complete one. A complete checkpoint is never overwritten.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch.distributed.checkpoint is imported inside the functions that use it: the CLI imports this
# module for CheckpointError, and `portatrain --help` should not pay DCP's ~0.8 s import.

logger = logging.getLogger(__name__)

FORMAT = "portatrain-dcp/1"
"""Written into ``trainer_state.json``; bumped when the layout changes incompatibly."""

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TRAINER_STATE = "trainer_state.json"
_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, truncated, or saved for another model.

    The message names the file and the mismatch, and says how to fix it.
    """


# -- discovery --------------------------------------------------------------------------------


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints under ``folder`` (``step_<N>``, DCP index and trainer state present), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / _METADATA).is_file() and (p / _TRAINER_STATE).is_file()]


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
    if _rank() == 0:  # one process looks at the filesystem; the others get its answer
        try:
            result = _resolve_resume(spec, folder, recipe)
        except (CheckpointError, OSError) as exc:  # reported on every rank, not only this one
            error = str(exc)
    result, error = _broadcast_from_main((result, error))
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
        if _STEP_DIR.match(path.name) is None and complete_checkpoints(path / "checkpoints"):
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
    for name in (_METADATA, _TRAINER_STATE):
        if not (path / name).is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: {path / name} is missing (an interrupted save, or "
                f"not a portatrain checkpoint); resume from an earlier step_* directory"
            )
    try:
        state = json.loads((path / _TRAINER_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path / _TRAINER_STATE} is unreadable: {exc}") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint file {path / _TRAINER_STATE} has format {state.get('format')!r}; "
            f"this portatrain reads {FORMAT!r}"
        )
    return state


# -- save / load ------------------------------------------------------------------------------


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
        if _broadcast_from_main(final.exists() if self.is_main else None):
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
        _barrier()

        model_sd, optim_sd = get_state_dict(model, optimizer)
        rank = _rank()
        tensors = {
            "model": model_sd,
            "optim": optim_sd["state"],
            "rng": {f"rank{rank}": {k: v for k, v in rng_state.items() if isinstance(v, torch.Tensor)}},
        }
        _write_json(tmp / f"dataloader_rank{rank}.json", dataloader_state)
        if self.is_main:
            full_state = {
                "format": FORMAT,
                **state,
                "world_size": _world_size(),
                "optimizer_param_groups": optim_sd["param_groups"],
            }
            _write_json(tmp / _TRAINER_STATE, full_state)
            (tmp / "config.yaml").write_text(config_yaml)
        # DCP writes .metadata last, on rank 0, after gathering every rank's write results.
        dcp.save(tensors, checkpoint_id=str(tmp))
        _barrier()
        if self.is_main:
            tmp.rename(final)
            _fsync_dir(self.folder)
            if self.keep > 0:
                for old in complete_checkpoints(self.folder)[: -self.keep]:
                    shutil.rmtree(old)
        _barrier()
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
        same_world = state.get("world_size") == _world_size()
        rank = _rank()
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


def load_dataloader_state(loader: Any, state: Mapping[str, Any], path: Path) -> None:
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
            f"checkpoint file {path / _METADATA} is unreadable ({type(exc).__name__}: {exc}); "
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
        problems.append(f"in the model but not in the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_some(unexpected)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path / _METADATA} does not fit this model:\n  - "
            + "\n  - ".join(problems)
            + f"\nResume with the model settings it was saved with (see {path / 'config.yaml'}), "
            "or start a new run_dir."
        )


def _some(keys: list[str], limit: int = 6) -> str:
    more = f" ... ({len(keys)} in all)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


# -- preemption -------------------------------------------------------------------------------


class PreemptionWatcher:
    """SIGTERM (what schedulers and torchrun send before killing) -> save and stop at a step boundary.

    The handler only sets a flag. :meth:`should_stop`, called once per step by every rank, agrees
    on it across ranks (a MAX all-reduce over a CPU/gloo group: the signal may reach ranks in
    different steps, and all must save at the same one). It costs one tiny host-side collective
    per step when there is more than one rank, and never a device synchronization.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.requested = False
        self._previous: dict[int, Any] = {}
        self._group: Any = None

    def install(self) -> None:
        """Take over the signals (main thread only: Python delivers signals there)."""
        if dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            # Collective: every rank installs at the same point (the start of fit()).
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        logger.warning(
            "received %s: saving a checkpoint at the next step boundary, then stopping",
            signal.Signals(signum).name,
        )

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop. Collective when more than one rank."""
        if self._group is None:
            return self.requested
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


# -- Hugging Face import ----------------------------------------------------------------------


def load_hf_weights(model: nn.Module, hf_dir: str | Path) -> None:
    """Initialize ``model`` (a portatrain Llama, possibly FSDP2-sharded) from a local HF directory.

    Reads ``config.json`` to check the architecture, then the ``*.safetensors`` files through
    DCP's ``HuggingFaceStorageReader``: each rank reads only the slices of the tensors it holds
    (safetensors slicing on memory-mapped files), so no rank ever materializes the full model.
    Weights are cast to the model's dtype. A tied HF checkpoint (no ``lm_head.weight``) loaded
    into an untied model initializes the output projection from the embedding.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from portatrain.models.llama.hf import args_from_hf_config, from_hf, to_hf

    hf_dir = Path(hf_dir)
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"model.init_from={hf_dir}: {config_file} is missing; point it at a Hugging Face model "
            "directory (config.json + *.safetensors), e.g. one written by `portatrain export` or "
            "save_pretrained()"
        )
    if not any(hf_dir.glob("*.safetensors")):
        raise CheckpointError(
            f"model.init_from={hf_dir}: no *.safetensors file there (only safetensors weights are "
            "read; convert .bin files with save_pretrained(safe_serialization=True))"
        )
    try:
        theirs = args_from_hf_config(json.loads(config_file.read_text()))
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"model.init_from: {config_file} is not a usable Llama config: {exc}") from None
    ours = getattr(model, "args", None)
    if ours is not None:
        _check_hf_args(config_file, theirs, ours)

    reader = HuggingFaceStorageReader(str(hf_dir))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CheckpointError(f"model.init_from: cannot read the safetensors in {hf_dir}: {exc}") from None
    state = to_hf(get_model_state_dict(model))
    available = metadata.state_dict_metadata
    missing = [k for k in state if k not in available]
    untie = missing == ["lm_head.weight"] and "model.embed_tokens.weight" in available
    if missing and not untie:
        raise CheckpointError(f"model.init_from: {hf_dir} lacks tensors this model needs: {_some(missing)}")
    wrong = [
        f"{k}: file {list(available[k].size)}, model {list(v.shape)}"
        for k, v in state.items()
        if k in available and tuple(available[k].size) != tuple(v.shape)
    ]
    if wrong:
        raise CheckpointError(
            f"model.init_from: {hf_dir} does not fit this model:\n  - " + "\n  - ".join(wrong)
        )
    head = state.pop("lm_head.weight") if untie else None
    try:
        dcp.load(state, storage_reader=reader)
        if head is not None:  # the HF model ties its head to the embedding; this one has its own
            dcp.load(
                {"model.embed_tokens.weight": head}, storage_reader=HuggingFaceStorageReader(str(hf_dir))
            )
            state["lm_head.weight"] = head
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        raise CheckpointError(
            f"model.init_from: reading {hf_dir} failed: {type(exc).__name__}: {exc}"
        ) from exc
    set_model_state_dict(model, from_hf(state))


def _check_hf_args(config_file: Path, theirs: Any, ours: Any) -> None:
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps", "rope_theta")
    problems = [
        f"{name}: {config_file.name} has {getattr(theirs, name)}, the model {getattr(ours, name)}"
        for name in fields
        if getattr(theirs, name) != getattr(ours, name)
    ]
    if theirs.rope_scaling != ours.rope_scaling:
        problems.append(
            f"rope_scaling: {config_file.name} has {theirs.rope_scaling}, the model {ours.rope_scaling}"
        )
    if ours.tie_embeddings and not theirs.tie_embeddings:
        problems.append("tie_embeddings: the file has a separate lm_head, the model ties it to the embedding")
    if problems:
        raise CheckpointError(
            f"model.init_from: {config_file} describes another architecture than this recipe's model:\n  - "
            + "\n  - ".join(problems)
            + "\nPick the recipe/model.flavor that matches it (or set model.vocab_size/max_seq_len)."
        )


# -- helpers ----------------------------------------------------------------------------------


def model_args_dict(model: nn.Module) -> dict[str, Any] | None:
    """The model's architecture as JSON (for export), when it is a dataclass-configured model."""
    args = getattr(model, "args", None)
    return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None


def _write_json(path: Path, value: Any) -> None:
    try:
        text = json.dumps(value, indent=1)
    except TypeError as exc:
        raise TypeError(f"checkpoint state for {path.name} must be JSON-serializable: {exc}") from None
    path.write_text(text)


def _fsync_dir(folder: Path) -> None:
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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_main(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
