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
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from portatrain.checkpoint.common import (
    FORMAT,
    FULL_BELOW_BYTES,
    METADATA,
    STEP_DIR,
    TRAINER_STATE,
    CheckpointError,
    UnsafeCheckpointError,
    any_rank,
    bytes_on_disk,
    free_bytes,
    fsync_dir,
    get_rank,
    get_world_size,
    is_disk_full,
    mib,
    remove_leftovers,
    root_causes,
    short_cause,
    some,
    step_of,
    sum_over_ranks,
    write_json,
)
from portatrain.checkpoint.safe_metadata import UnsafeMetadataError, safe_reader
from portatrain.checkpoint.verify import (
    ALGORITHM,
    DamagedCheckpointError,
    check_json_digest,
    checksums,
    flat_tensors,
    state_bytes,
    verify_loaded,
)

# torch.distributed.checkpoint is imported inside the functions that use it: `portatrain --help`
# should not pay DCP's ~0.8 s import.

logger = logging.getLogger(__name__)

LEGACY_MODEL_NAME = "llama3"
"""The family of checkpoints saved before ``trainer_state.json`` recorded ``model_name``."""


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
        self.pinned_staging = pinned_staging
        """The device's synchronize where its adapter stages into pinned host memory
        (``Accelerator.pinned_staging``), else None: plain host buffers and blocking copies."""
        """``none``, ``thread`` or ``process`` (``portatrain.checkpoint.staging``): with the latter two,
        :meth:`save` returns once the state is staged and the write goes on in the background."""
        self.blocked_s = 0.0
        """Seconds the caller spent inside :meth:`save` and :meth:`wait` (the loop's cost of checkpoints)."""
        self._in_flight: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._group: Any = None
        if async_mode == "process":
            from portatrain.checkpoint.staging import spawn_problem

            problem = spawn_problem()
            if problem is not None:
                raise CheckpointError(problem)
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
            )
        finally:
            self.blocked_s += time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its :class:`CheckpointError`
        (on every rank). Collective when a save is in flight."""
        if self._in_flight is None:
            return
        start = time.perf_counter()
        future, self._in_flight = self._in_flight, None
        try:
            future.result()
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
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None
            if self.async_mode == "process":
                from portatrain.checkpoint.staging import stop_checkpoint_process

                stop_checkpoint_process()

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
    ) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

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
            self._fail(step, final, tmp, error, {})

        model_sd, optim_sd = get_state_dict(model, optimizer)
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
                write_json(tmp / TRAINER_STATE, full_state)
                (tmp / "config.yaml").write_text(config_yaml)
        except OSError as exc:  # disk full on this rank: still join the collective save below
            error = exc
        if self.async_mode == "none":
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
        staged = self._stage(tensors)
        upload = dcp.async_save(
            staged,
            checkpoint_id=str(tmp),
            process_group=self._group,
            async_checkpointer_type=_checkpointer_type(self.async_mode),
            async_stager=_already_staged(),
        )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._in_flight = self._executor.submit(self._finish, step, final, tmp, error, staged, upload)
        return final

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The CPU copy DCP writes in the background (``portatrain.checkpoint.staging``)."""
        from portatrain.checkpoint.staging import Stager

        if self._stager is None:
            process = self.async_mode == "process"
            if process and not dist.is_initialized():
                # DCP's checkpoint process joins a gloo group of the training ranks: a single process
                # makes a group of one (its world size stays 1 for everything else).
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            if dist.is_initialized() and dist.get_world_size() > 1:
                # Collective (every rank saves at the same step): the background commit's own group.
                self._group = dist.new_group(backend="gloo")
            self._stager = Stager(synchronize=self.pinned_staging, share_memory=process)
        return self._stager.stage(tensors)

    def _finish(
        self, step: int, final: Path, tmp: Path, error: BaseException | None, tensors: Any, upload: Future
    ) -> None:
        """Background: wait for DCP's write, then commit as a synchronous save does."""
        import torch.distributed.checkpoint as dcp

        try:
            upload.result()
        except (Exception, dcp.CheckpointException) as exc:
            error = error or exc
        self._commit(step, final, tmp, error, tensors, group=self._group)

    def _commit(
        self, step: int, final: Path, tmp: Path, error: BaseException | None, tensors: Any, *, group: Any
    ) -> None:
        """Every rank wrote its part (or one failed: raise on all): rank 0 renames the checkpoint in
        and rotates. Collective over ``group``."""
        if any_rank(error is not None, group):
            self._fail(step, final, tmp, error, tensors, group)
        if self.is_main:
            try:
                self._publish(step, final, tmp)
            except OSError as exc:
                error = exc
        if any_rank(error is not None, group):
            self._fail(step, final, tmp, error, tensors, group)
        self.last_step, self.last_verified = step, "saved"
        if self.is_main:
            logger.info("saved checkpoint %s", final)

    def _publish(self, step: int, final: Path, tmp: Path) -> None:
        """Rank 0, once every rank has written: rename the new checkpoint in, then rotate."""
        aside = final.with_name(final.name + ".old")
        replaced = final.exists()
        if replaced:
            logger.warning(
                "checkpoint %s already exists (a broken save, or a run rolled back past this step): "
                "replacing it with this run's step %d",
                final,
                step,
            )
            final.rename(aside)
        tmp.rename(final)
        fsync_dir(self.folder)
        if replaced:
            shutil.rmtree(aside)
        newer = [p for p in complete_checkpoints(self.folder) if step_of(p) > step]
        if newer:
            logger.warning(
                "checkpoint(s) %s are ahead of this run's step %d (left by a run this one was rolled "
                "back from); renaming them *.superseded so checkpoint.resume=auto continues this run",
                ", ".join(p.name for p in newer),
                step,
            )
            for path in newer:
                target = path.with_name(path.name + ".superseded")
                shutil.rmtree(target, ignore_errors=True)
                path.rename(target)
        if self.keep > 0:
            for old in complete_checkpoints(self.folder)[: -self.keep]:
                trash = old.with_name(old.name + ".deleting")
                old.rename(trash)  # atomic: the checkpoint is gone whole, or still complete
                fsync_dir(self.folder)
                shutil.rmtree(trash)
        fsync_dir(self.folder)

    def _fail(
        self,
        step: int,
        final: Path,
        tmp: Path,
        error: BaseException | None,
        tensors: Mapping[str, Any],
        group: Any = None,
    ) -> None:
        """Remove this save's partial files and raise one message on every rank (collective).

        A full disk does not always surface as ``ENOSPC``: ``torch.save`` inside DCP reports a short
        write as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``. So the free
        space is looked at too, before the partial files are removed: a failed write with (almost)
        nothing left is a full disk, and the message says how much the checkpoint needs.
        """
        causes = root_causes(error) if error is not None else []
        disk_full = any(is_disk_full(c) for c in causes) or free_bytes(self.folder) < FULL_BELOW_BYTES
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = complete_checkpoints(self.folder)
        kept = (
            f"the previous checkpoint {previous[-1].name} is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        if any_rank(disk_full, group):
            # The previous checkpoint's size when there is one (same model, same files), else the
            # bytes of the tensors being saved.
            needed = bytes_on_disk(previous[-1]) if previous else sum_over_ranks(state_bytes(tensors), group)
            free = free_bytes(self.folder)
            raise CheckpointError(
                f"no space left on device while saving checkpoint step {step} into {self.folder}: a "
                f"checkpoint needs about {mib(needed)} and {mib(free)} is free once the partial save is "
                f"removed; nothing of step {step} was kept and {kept}. Free at least "
                f"{mib(max(needed - free, 0))} more (or lower checkpoint.keep, or choose a run_dir on a "
                "larger disk), then continue with checkpoint.resume=auto"
            )
        detail = short_cause(causes[0]) if causes else "another rank failed to write its part"
        raise CheckpointError(
            f"saving checkpoint {final} failed ({detail}); nothing of step {step} was kept and {kept}"
        ) from (causes[0] if causes and isinstance(causes[0], Exception) else None)

    def load(
        self,
        path: Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rng_template: Mapping[str, Any],
        read_loader_state: bool = True,
    ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
        """Load model and optimizer (resharded to the current layout) from ``path``.

        Returns ``(trainer_state, dataloader_state, rng_state)``: the JSON state written by
        :meth:`save`, this rank's loader state (rank 0's when the world size changed: the sampler's
        position is global; None when ``read_loader_state`` is false), and this rank's RNG state
        (None when the world size changed: the saved ranks are not these ranks). ``rng_template``
        is the current RNG state, for shapes. Raises :class:`CheckpointError` naming the file and
        the mismatch; a :class:`DamagedCheckpointError` when its tensors are unreadable, differ from
        the checksums written at save time, or hold a NaN/inf (the verdict is the same on every rank).

        Optimizer hyper-parameters (``optim.lr``, ``betas``, ``eps``, ``weight_decay``) come from the
        current config, not the checkpoint: the moments and step counts are restored, and a changed
        value is applied and logged (``config.yaml`` records what the run now uses).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = Path(path)
        state, metadata = inspect_checkpoint(path)
        same_world = state.get("world_size") == get_world_size()
        rank = get_rank()
        # Read the loader state first: a missing or garbled file fails before any tensor is loaded.
        loader_state = _read_loader_state(path, rank if same_world else 0) if read_loader_state else None

        model_sd, optim_sd = get_state_dict(model, optimizer)
        _check_shapes(path, metadata, model_sd)
        tensors: dict[str, Any] = {"model": model_sd, "optim": optim_sd["state"]}
        rng_key = f"rng.rank{rank}."
        if same_world and any(k.startswith(rng_key) for k in metadata.state_dict_metadata):
            rng = {k: v.clone() for k, v in rng_template.items() if isinstance(v, torch.Tensor)}
            tensors["rng"] = {f"rank{rank}": rng}
        param_groups = _current_param_groups(path, state["optimizer_param_groups"], optim_sd["param_groups"])
        saved_dtypes = _saved_dtypes(metadata)
        try:
            dcp.load(tensors, storage_reader=safe_reader(str(path)))
            # Before anything is handed to the optimizer: the content is what was saved, and finite.
            verify_loaded(
                path,
                flat_tensors({"model": tensors["model"], "optim": tensors["optim"]}),
                state.get("checksums"),
                saved_dtypes,
            )
            set_state_dict(
                model,
                optimizer,
                model_state_dict=tensors["model"],
                optim_state_dict={"state": tensors["optim"], "param_groups": param_groups},
            )
        except CheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
            raise _unreadable(path, exc) from None
        self.last_step, self.last_verified = int(state["step"]), "loaded"
        return state, loader_state, tensors.get("rng", {}).get(f"rank{rank}")


def _saved_dtypes(metadata: Any) -> dict[str, torch.dtype]:
    """The dtype of each tensor in a checkpoint (a tensor loaded into another one cannot be compared)."""
    return {
        k: v.properties.dtype for k, v in metadata.state_dict_metadata.items() if hasattr(v, "properties")
    }


def _unreadable(path: Path, exc: BaseException) -> DamagedCheckpointError:
    """DCP reports failures as CheckpointException, a BaseException: name the checkpoint and the
    first cause in one line (its remote tracebacks, and torch.load's advice to pass
    weights_only=False, help nobody whose checkpoint file was damaged)."""
    return DamagedCheckpointError(
        f"checkpoint {path} is corrupt: reading its tensors failed ({short_cause(root_causes(exc)[0])}); "
        "a *.distcp file was overwritten or damaged. Resume from an earlier step_* directory "
        "(checkpoint.resume=auto skips it)"
    )


def load_model_weights(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load only the model's weights from checkpoint ``path`` (resharded to the model's layout, checked
    against the checksums written at save time and for finiteness, like :meth:`Checkpointer.load`);
    returns its ``trainer_state.json``. For a model that is evaluated, not trained on: no optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    state, metadata = inspect_checkpoint(path)
    model_sd = get_model_state_dict(model)
    _check_shapes(path, metadata, model_sd)
    saved_dtypes = _saved_dtypes(metadata)
    try:
        dcp.load({"model": model_sd}, storage_reader=safe_reader(str(path)))
        verify_loaded(path, flat_tensors({"model": model_sd}), state.get("checksums"), saved_dtypes)
        set_model_state_dict(model, model_sd)
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as exc:
        raise _unreadable(path, exc) from None
    return state


def _checkpointer_type(async_mode: str) -> Any:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return AsyncCheckpointerType.PROCESS if async_mode == "process" else AsyncCheckpointerType.THREAD


def _already_staged() -> Any:
    from portatrain.checkpoint.staging import AlreadyStaged

    return AlreadyStaged()


def _read_loader_state(path: Path, rank: int) -> dict[str, Any] | None:
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


# Optimizer hyper-parameters compared on resume (and the config key that sets each).
_HYPER = {
    "initial_lr": "optim.lr",
    "betas": "optim.betas",
    "eps": "optim.eps",
    "weight_decay": "optim.weight_decay",
}


def _current_param_groups(
    path: Path, saved: list[dict[str, Any]], current: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The current optimizer's parameter groups (the config's hyper-parameters win), after checking
    that the checkpoint has as many; a changed hyper-parameter is logged."""
    if len(saved) != len(current):
        raise CheckpointError(
            f"checkpoint {path}: its optimizer has {len(saved)} parameter groups, this one {len(current)} "
            "(another optimizer or parameter grouping); resume with the recipe that saved it"
        )
    changes = set()
    for old, new in zip(saved, current):
        if not isinstance(old, dict):
            raise CheckpointError(
                f"checkpoint file {path / TRAINER_STATE}: optimizer_param_groups is damaged"
            )
        for key, name in _HYPER.items():
            before, after = old.get(key), new.get(key)
            if isinstance(after, tuple):
                before = tuple(before) if isinstance(before, list) else before
            if before is not None and after is not None and before != after:
                changes.add(f"{name} {before} -> {after}")
    if changes:
        logger.warning(
            "resuming %s with changed optimizer settings, applied from the config: %s",
            path,
            "; ".join(sorted(changes)),
        )
    return [dict(group) for group in current]


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


def _check_shapes(path: Path, metadata: Any, model_sd: Mapping[str, Any]) -> None:
    """Compare the model's tensors with the checkpoint's; raise once listing every difference."""
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
