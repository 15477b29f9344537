"""The DCP checkpointer: save and load ``step_<N>`` checkpoints of a training run.

- :class:`Checkpointer` saves a training state with ``torch.distributed.checkpoint`` (DCP) every
  ``checkpoint.every`` steps and at the end, keeps the last K, and loads one back -- into the same
  or a different number of ranks (FSDP2 DTensors are resharded by DCP's planner);
- a model with frozen parameters (LoRA) saves its trainable ones and references its frozen base,
  written or hashed once per run, and every load reads the base through that reference first
  (``base.py``);
- what a resumed optimizer's parameter groups become is the optimizer stage's policy
  (``portatrain.optim.resume``), handed to :meth:`Checkpointer.load`; the checkpointer only checks
  that the saved groups fit.

Its parts live beside it: finding and checking checkpoints without reading tensors
(``discovery.py``; :func:`complete_checkpoints`, :func:`read_trainer_state` and
:func:`inspect_checkpoint` are re-exported here), renaming a save in and rotating
(``rotation.py``), the save in flight of ``async_mode=thread|process`` (``staging.py``), and the
one-line report of a failed save or an unreadable checkpoint (``diagnostics.py``), and reading a
checkpoint back into a model (``restore.py``; :func:`load_model_weights`, the weights only, is
re-exported here).

See ``portatrain.checkpoint`` for the on-disk layout and the atomicity rule.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portatrain.checkpoint.base import (
    BASE_DIR,
    has_frozen_parameters,
    init_from_reference,
    trainable_options,
    write_base,
)
from portatrain.checkpoint.common import (
    FORMAT,
    TRAINER_STATE,
    CheckpointError,
    any_rank,
    get_rank,
    get_world_size,
    remove_leftovers,
    write_json,
)
from portatrain.checkpoint.diagnostics import raise_save_failure, unreadable
from portatrain.checkpoint.discovery import complete_checkpoints as complete_checkpoints
from portatrain.checkpoint.discovery import inspect_checkpoint
from portatrain.checkpoint.discovery import read_trainer_state as read_trainer_state
from portatrain.checkpoint.restore import check_shapes, load_base, read_dataloader_file, saved_dtypes
from portatrain.checkpoint.restore import load_model_weights as load_model_weights
from portatrain.checkpoint.rotation import publish
from portatrain.checkpoint.safe_metadata import safe_reader
from portatrain.checkpoint.staging import AsyncSaves
from portatrain.checkpoint.verify import ALGORITHM, checksums, flat_tensors, verify_loaded

# torch.distributed.checkpoint is imported inside the functions that use it: `portatrain --help`
# should not pay DCP's ~0.8 s import.

logger = logging.getLogger(__name__)

ParamGroupPolicy = Callable[[list[dict[str, Any]], list[dict[str, Any]], Path], list[dict[str, Any]]]
"""``policy(saved, current, path)``: the parameter groups an optimizer resumed from ``path`` loads,
given the checkpoint's and the current optimizer's (``portatrain.optim.resume.resume_param_groups``)."""


class Checkpointer:
    """Saves and loads training state under ``folder``; see the module docstring for the layout.

    Every method is collective: call it on every rank.
    """

    def __init__(
        self,
        folder: Path,
        *,
        keep: int,
        is_main: bool,
        every: int = 0,
        checksums: bool = True,
        async_mode: str = "none",
        pinned_staging: Callable[[], None] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.async_mode = async_mode
        """``none``, ``thread`` or ``process`` (``portatrain.checkpoint.staging``): with the latter two,
        :meth:`save` returns once the state is staged and the write goes on in the background."""
        self.blocked_s = 0.0
        """Seconds the caller spent inside :meth:`save` and :meth:`wait` (the loop's cost of checkpoints)."""
        # pinned_staging: the device's synchronize where its adapter stages into pinned host memory
        # (``Accelerator.pinned_staging``), else None: plain host buffers and blocking copies.
        self._async = None if async_mode == "none" else AsyncSaves(async_mode, pinned_staging=pinned_staging)
        self.keep = keep
        """Complete checkpoints kept after a save; <= 0 keeps all."""
        self.every = every
        self.is_main = is_main
        self.checksums = checksums
        """Write content checksums with every save (``portatrain.checkpoint.verify``); off only to
        measure what they cost (``scripts/bench_checksum.py``)."""
        self.last_step: int | None = None
        """Step of the checkpoint saved or loaded last (the final save is skipped when it is current)."""
        self.last_verified: str | None = None
        """How the checkpoint of ``last_step`` was found finite: ``"saved"`` (the caller checked the
        state it handed to :meth:`save`) or ``"loaded"`` (:meth:`load` verified its checksums and
        finiteness); None when there is none."""
        self.base: dict[str, str] | None = None
        """The frozen base this run's checkpoints reference (``portatrain.checkpoint.base``): set by
        the first save of a model with frozen parameters (written, or the hashed ``init_from``), or
        by :meth:`load`; None for a model without frozen parameters."""
        self._frozen: bool | None = None  # whether the model has frozen parameters (asked once)
        self._loaded = False  # the weights came from a checkpoint, not from init_from

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
        init_from: str | None = None,
    ) -> Path:
        """Write ``step_<step>`` atomically and drop checkpoints beyond the newest ``keep``.

        ``state`` is the JSON-able trainer state (counters, LR scheduler, recipe, model args...),
        the same on every rank; ``dataloader_state`` and ``rng_state`` are this rank's own.
        ``init_from`` is the Hugging Face directory the run's weights were loaded from
        (``model.init_from``), if any: a model with frozen parameters that did not resume from a
        checkpoint references it as its base instead of writing one.

        The state given is always written, or a :class:`CheckpointError` is raised (on every rank):
        an existing ``step_<step>`` -- a broken one, or one left by a run that was rolled back to an
        earlier checkpoint -- is never trusted but replaced: the new one is written as
        ``step_<step>.tmp``, the old one renamed aside, the new one renamed in, the old one deleted.
        Complete checkpoints of later steps (an abandoned timeline after such a roll-back) are renamed
        ``step_<M>.superseded``, so ``checkpoint.resume=auto`` never picks them. Rotation renames a
        checkpoint to ``step_<M>.deleting`` before deleting it: a kill mid-deletion leaves no
        half-deleted ``step_<M>``.

        With ``async_mode`` ``thread`` or ``process``, it first waits for the save in flight, then
        returns once the tensors are staged: the write, the rename and rotation happen in the
        background, and their failure is raised by the next :meth:`save` or :meth:`wait`.
        """
        self.wait()  # at most one save in flight: this one starts when the previous is committed
        start = time.perf_counter()
        try:
            return self._save(
                step,
                model=model,
                optimizer=optimizer,
                state=state,
                dataloader_state=dataloader_state,
                rng_state=rng_state,
                config_yaml=config_yaml,
                init_from=init_from,
            )
        finally:
            self.blocked_s += time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its :class:`CheckpointError`
        (on every rank). Collective when a save is in flight."""
        if self._async is None or not self._async.in_flight:
            return
        start = time.perf_counter()
        try:
            self._async.wait()
        finally:
            self.blocked_s += time.perf_counter() - start

    def close(self) -> None:
        """Wait for the save in flight, then release the background thread (and DCP's checkpoint
        process). Collective when a save is in flight."""
        try:
            self.wait()
        except CheckpointError as exc:  # after fit() failed: report it, don't mask that failure
            logger.error("%s", exc)
        finally:
            if self._async is not None:
                self._async.close()

    def _save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: Mapping[str, Any],
        dataloader_state: Mapping[str, Any] | None,
        rng_state: Mapping[str, Any],
        config_yaml: str,
        init_from: str | None,
    ) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        base = self._base_for(step, model, init_from)
        final = self.folder / f"step_{step:07d}"
        tmp = final.with_name(final.name + ".tmp")
        error: BaseException | None = None
        if self.is_main:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                remove_leftovers(self.folder)  # .tmp/.old/.deleting left by a process that was killed
                tmp.mkdir()
            except OSError as exc:
                error = exc
        if any_rank(error is not None):
            self._fail(step, final, tmp, error, {}, group=None)

        # The frozen parameters are the base's (referenced below), not the step's.
        model_sd, optim_sd = get_state_dict(model, optimizer, options=trainable_options())
        rank = get_rank()
        tensors = {
            "model": model_sd,
            "optim": optim_sd["state"],
            "rng": {f"rank{rank}": {k: v for k, v in rng_state.items() if isinstance(v, torch.Tensor)}},
        }
        # Collective (one all-reduce): what load() compares the tensors it reads with.
        sums = (
            checksums(flat_tensors({"model": model_sd, "optim": optim_sd["state"]}))
            if self.checksums
            else None
        )
        try:
            write_json(tmp / f"dataloader_rank{rank}.json", dataloader_state)
            if self.is_main:
                full_state = {
                    "format": FORMAT,
                    **state,
                    "world_size": get_world_size(),
                    "optimizer_param_groups": optim_sd["param_groups"],
                }
                if sums is not None:
                    full_state["checksums"] = {"algorithm": ALGORITHM, "tensors": sums}
                if base is not None:
                    full_state["base"] = base
                write_json(tmp / TRAINER_STATE, full_state)
                (tmp / "config.yaml").write_text(config_yaml)
        except OSError as exc:  # disk full on this rank: still join the collective save below
            error = exc
        if self._async is None:
            try:
                # DCP writes .metadata last, on rank 0, after gathering every rank's write results;
                # a failure on any rank is raised on every rank.
                dcp.save(tensors, checkpoint_id=str(tmp))
            except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
                error = error or exc
            self._commit(step, final, tmp, error, tensors, group=None)
            return final
        # Asynchronous: the loop waits for the staging copy only. The write, and the commit after it
        # (collectives on a gloo group of their own, never the loop's), run in the background.
        saves = self._async

        def commit(write_error: BaseException | None, staged: Any) -> None:
            self._commit(step, final, tmp, error or write_error, staged, group=saves.group)

        saves.start(tensors, tmp, commit)
        return final

    def _base_for(self, step: int, model: nn.Module, init_from: str | None) -> dict[str, str] | None:
        """The base this save references (None: the model has no frozen parameters). The first save
        of a run makes it: the ``init_from`` directory, hashed, when the weights came from there;
        else the frozen parameters written to ``<folder>/base``. A base loaded by :meth:`load` is
        kept when it is ``init_from`` or this run's own (another run's base is copied, once)."""
        if self._frozen is None:
            self._frozen = has_frozen_parameters(model)
        own = str((self.folder / BASE_DIR).resolve())
        if not self._frozen or (self.base is not None and self.base["kind"] == "init_from"):
            return self.base if self._frozen else None
        if self.base is not None and self.base["path"] == own:
            return self.base
        if init_from and not self._loaded:
            self.base = init_from_reference(init_from)
        else:
            self.base = write_base(self.folder, step, model, is_main=self.is_main)
        return self.base

    def _commit(
        self, step: int, final: Path, tmp: Path, error: BaseException | None, tensors: Any, *, group: Any
    ) -> None:
        """Every rank wrote its part (or one failed: raise on all): rank 0 renames the checkpoint in
        and rotates. Collective over ``group``."""
        if any_rank(error is not None, group):
            self._fail(step, final, tmp, error, tensors, group)
        if self.is_main:
            try:
                publish(self.folder, step, final, tmp, keep=self.keep)
            except OSError as exc:
                error = exc
        if any_rank(error is not None, group):
            self._fail(step, final, tmp, error, tensors, group)
        self.last_step, self.last_verified = step, "saved"
        if self.is_main:
            logger.info("saved checkpoint %s", final)

    def _fail(
        self, step: int, final: Path, tmp: Path, error: BaseException | None, tensors: Any, group: Any
    ) -> None:
        raise_save_failure(self.folder, step, final, tmp, error, tensors, is_main=self.is_main, group=group)

    def load(
        self,
        path: Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rng_template: Mapping[str, Any],
        param_groups: ParamGroupPolicy,
        read_loader_state: bool = True,
    ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
        """Load model and optimizer (resharded to the current layout) from ``path``.

        Returns ``(trainer_state, dataloader_state, rng_state)``: the JSON state written by
        :meth:`save`, this rank's loader state (rank 0's when the world size changed: the sampler's
        position is global; None when ``read_loader_state`` is false), and this rank's RNG state
        (None when the world size changed: the saved ranks are not these ranks). ``rng_template``
        is the current RNG state, for shapes; ``param_groups`` the resume policy for the optimizer's
        hyper-parameters (:data:`ParamGroupPolicy`). Raises :class:`CheckpointError` naming the file and
        the mismatch; a :class:`DamagedCheckpointError` when its tensors are unreadable, differ from
        the checksums written at save time, or hold a NaN/inf (the verdict is the same on every rank).

        The moments and step counts are restored; the parameter groups are what ``param_groups``
        makes of the saved and the current ones (the training run's: the config's hyper-parameters,
        a changed value logged; ``config.yaml`` records what the run now uses).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        path = Path(path)
        state, metadata = inspect_checkpoint(path)
        same_world = state.get("world_size") == get_world_size()
        rank = get_rank()
        # Read the loader state first: a missing or garbled file fails before any tensor is loaded.
        loader_state = read_dataloader_file(path, rank if same_world else 0) if read_loader_state else None

        has_base = "base" in state  # its frozen parameters are in the base it references
        options = trainable_options() if has_base else None
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        # Parts a run may add or drop (the model's ``optional_state`` prefixes, e.g. multi-token
        # prediction's depths): one the checkpoint lacks keeps its initialization and a fresh optimizer
        # state; one only the checkpoint holds is not read.
        optional = tuple(getattr(model, "optional_state", ()))
        saved = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
        fresh = [k for k in model_sd if optional and k.startswith(optional) and k not in saved]
        for key in fresh:
            del model_sd[key]
            optim_sd["state"].pop(key, None)
        check_shapes(path, metadata, model_sd, optional)
        tensors: dict[str, Any] = {"model": model_sd, "optim": optim_sd["state"]}
        rng_key = f"rng.rank{rank}."
        if same_world and any(k.startswith(rng_key) for k in metadata.state_dict_metadata):
            rng = {k: v.clone() for k, v in rng_template.items() if isinstance(v, torch.Tensor)}
            tensors["rng"] = {f"rank{rank}": rng}
        saved_groups = _checked_param_groups(path, state["optimizer_param_groups"], optim_sd["param_groups"])
        groups = param_groups(saved_groups, optim_sd["param_groups"], path)
        dtypes = saved_dtypes(metadata)
        base = load_base(path, state, model)
        try:
            dcp.load(tensors, storage_reader=safe_reader(str(path)))
            # Before anything is handed to the optimizer: the content is what was saved, and finite.
            verify_loaded(
                path,
                flat_tensors({"model": tensors["model"], "optim": tensors["optim"]}),
                state.get("checksums"),
                dtypes,
            )
            set_state_dict(
                model,
                optimizer,
                model_state_dict=tensors["model"],
                optim_state_dict={"state": tensors["optim"], "param_groups": groups},
                options=StateDictOptions(strict=not has_base and not fresh),
            )
        except CheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
            raise unreadable(path, exc) from None
        self.last_step, self.last_verified = int(state["step"]), "loaded"
        self.base, self._loaded = base, True
        return state, loader_state, tensors.get("rng", {}).get(f"rank{rank}")


def _checked_param_groups(
    path: Path, saved: list[dict[str, Any]], current: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The checkpoint's optimizer parameter groups, after checking that they are as many as the
    current optimizer's and readable."""
    if len(saved) != len(current):
        raise CheckpointError(
            f"checkpoint {path}: its optimizer has {len(saved)} parameter groups, this one {len(current)} "
            "(another optimizer or parameter grouping); resume with the recipe that saved it"
        )
    if not all(isinstance(old, dict) for old in saved):
        raise CheckpointError(f"checkpoint file {path / TRAINER_STATE}: optimizer_param_groups is damaged")
    return saved


def model_args_dict(model: nn.Module) -> dict[str, Any] | None:
    """The model's architecture as JSON (for export), when it is a dataclass-configured model."""
    args = getattr(model, "args", None)
    return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None
