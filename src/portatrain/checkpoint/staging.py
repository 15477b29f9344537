"""Asynchronous saves: copy the training state aside (staging), then let DCP write the copy while
training goes on (``checkpoint.async_mode=thread|process``).

- :data:`ASYNC_MODES` -- the choices of ``checkpoint.async_mode``;
- :class:`Stager` -- the staging copy. It copies every tensor into CPU buffers allocated at the first
  save and reused by every later one (pinned on CUDA, so the device-to-host copy is one DMA; in shared
  memory for ``process``, so handing the copy to DCP's checkpoint process moves no bytes). DCP's own
  default stager allocates fresh buffers at every save: on CPU its first-touch page faults made
  ``async_save`` block for 17-20% of a synchronous save; a copy into warm buffers is a ``memcpy``;
- :class:`AlreadyStaged` -- the ``AsyncStager`` handed to ``dcp.async_save``, which then stages
  nothing itself;
- :class:`AsyncSaves` -- the save in flight: staging, ``dcp.async_save``, and the commit thread;
- :func:`stop_checkpoint_process` -- ends DCP's checkpoint process (``process`` mode) with the run;
- :func:`quiet_checkpoint_process` -- keeps that process off the training process's stderr (a failed
  save is the parent's one line, not the process's traceback before it).

The upload runs in ``torch.distributed.checkpoint.async_save``'s thread or process; what comes after
it (agreeing on success, renaming the checkpoint in, rotation) is the :class:`Checkpointer`'s, which
:class:`AsyncSaves` runs on its commit thread.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from portatrain.checkpoint.common import CheckpointError
from portatrain.checkpoint.verify import flat_tensors

logger = logging.getLogger(__name__)

ASYNC_MODES = ("none", "thread", "process")
"""``checkpoint.async_mode``: ``none`` (the loop waits for the whole save), ``thread`` (DCP writes the
staged copy from a background thread) or ``process`` (from a checkpoint process of its own, free of
the training process's GIL)."""


class Stager:
    """Copies a state dict into reusable CPU buffers (see the module docstring)."""

    def __init__(self, *, synchronize: Callable[[], None] | None, share_memory: bool) -> None:
        self.synchronize = synchronize  # pinned buffers and asynchronous copies when given
        self.share_memory = share_memory
        if share_memory:  # the copy goes to DCP's checkpoint process, started at the first save
            quiet_checkpoint_process()
        self._buffers: dict[str, Any] | None = None
        self._layout: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state`` (same structure; DTensors keep their placements). The copy is
        valid until the next call: the caller waits for the previous save before staging again."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state)
        if layout != self._layout:  # the first save, or the optimizer state grew (a new layout)
            self._buffers = _create_cpu_state_dict(
                state, pin_memory=self.synchronize is not None, share_memory=self.share_memory
            )
            self._layout = layout
        non_blocking = self.synchronize is not None  # pinned buffers: asynchronous copies, one sync
        staged = _copy_state_dict(state, self._buffers, non_blocking=non_blocking)
        if self.synchronize is not None:
            self.synchronize()
        return staged


def _layout(state: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, tuple(v.shape), v.dtype) for k, v in flat_tensors(state).items()]


class AlreadyStaged:
    """Hands ``dcp.async_save`` a state dict that :class:`Stager` has copied already (DCP's
    ``AsyncStager`` protocol; a plain class: ``import portatrain`` stays free of DCP's import)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def spawn_problem() -> str | None:
    """Why ``async_mode=process`` cannot start here, or None. DCP starts its checkpoint process with
    multiprocessing's *spawn*, which imports the entry script again in the new process: a script
    that calls ``main()`` without an ``if __name__ == "__main__":`` guard would start training there
    and the save would wait forever. (``python -m pkg`` and pip's console scripts are safe.)"""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    if (spec is not None and spec.name.endswith("__main__")) or path is None:
        return None  # a package's __main__ (spawn skips it) or an interactive session
    try:
        source = Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    if "__main__" in source:
        return None
    return (
        f"checkpoint.async_mode=process: the entry script {path} calls training without an "
        '`if __name__ == "__main__":` guard, and DCP\'s checkpoint process (started with '
        "multiprocessing's spawn) imports that script again, which would train in it too. Put the "
        "call under that guard, or use checkpoint.async_mode=thread"
    )


def stop_checkpoint_process() -> None:
    """End DCP's checkpoint process (``async_mode=process``) and forget it, so a later run in this
    process starts its own. DCP keeps it in a module global (``_CHECKPOINT_PROCESS``) and ends it only
    at interpreter exit; a forked child would otherwise inherit a handle to its parent's."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is None:
        return
    executor._CHECKPOINT_PROCESS = None
    try:
        process._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process._save_process.join(timeout=60)
    except (OSError, ValueError) as exc:  # it is gone already
        logger.debug("checkpoint process: %s", exc)


def quiet_checkpoint_process() -> None:
    """Start DCP's checkpoint process (``async_mode=process``) without its log handler.

    DCP's process entry (``_AsyncCheckpointProcess._checkpointing_subprocess`` in
    ``torch/distributed/checkpoint/_async_process_executor.py``) puts an INFO handler on its root logger,
    on the stderr it shares with the training process: every save printed five lines, and a failed one
    its whole traceback (25 lines for a full disk) before the training process's one-line error. Every
    outcome already reaches the training process, which reports it: the result or the exception
    through the process's pipe, its death as the pipe's end. So the entry is wrapped to log nothing.
    Idempotent; takes effect for a checkpoint process started afterwards.
    """
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._AsyncCheckpointProcess
    if process._checkpointing_subprocess is not _quiet_checkpointing_subprocess:
        process._checkpointing_subprocess = staticmethod(_quiet_checkpointing_subprocess)


def _quiet_checkpointing_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
    """DCP's checkpoint process entry, logging nothing. It runs in the process DCP spawns, where DCP's
    class is freshly imported (unwrapped): the call below is DCP's own entry."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    executor._init_logger = lambda rank: None
    # No handler would bring in logging's last resort, which prints warnings and errors to stderr.
    logging.getLogger().addHandler(logging.NullHandler())
    executor._AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, parent_conn)


class AsyncSaves:
    """The background half of ``async_mode=thread|process``, one save in flight at most: the staging
    copy, DCP's ``async_save`` of it, and the commit after the write on a thread of its own
    (``checkpoint-commit``), whose collectives run on a gloo group of their own, never the loop's."""

    def __init__(self, mode: str, *, pinned_staging: Callable[[], None] | None) -> None:
        if mode == "process":
            problem = spawn_problem()
            if problem is not None:
                raise CheckpointError(problem)
        self.mode = mode
        self.pinned_staging = pinned_staging
        self.group: Any = None
        """The commit's process group (None: the default group of a single process)."""
        self._stager: Stager | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: Future | None = None

    def start(
        self, tensors: dict[str, Any], tmp: Path, commit: Callable[[BaseException | None, Any], None]
    ) -> None:
        """Stage ``tensors`` (the caller waits for this copy only), start DCP's write of the copy into
        ``tmp``, and call ``commit(write_error, staged)`` in the background once the write is done."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        staged = self._stage(tensors)
        kind = AsyncCheckpointerType.PROCESS if self.mode == "process" else AsyncCheckpointerType.THREAD
        upload = dcp.async_save(
            staged,
            checkpoint_id=str(tmp),
            process_group=self.group,
            async_checkpointer_type=kind,
            async_stager=AlreadyStaged(),
        )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._in_flight = self._executor.submit(_commit_after, upload, staged, commit)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.result()

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def close(self) -> None:
        """Release the commit thread (and DCP's checkpoint process); call after :meth:`wait`."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self.mode == "process":
            stop_checkpoint_process()

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        if self._stager is None:
            process = self.mode == "process"
            if process and not dist.is_initialized():
                # DCP's checkpoint process joins a gloo group of the training ranks: a single process
                # makes a group of one (its world size stays 1 for everything else).
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            if dist.is_initialized() and dist.get_world_size() > 1:
                # Collective (every rank saves at the same step): the background commit's own group.
                self.group = dist.new_group(backend="gloo")
            self._stager = Stager(synchronize=self.pinned_staging, share_memory=process)
        return self._stager.stage(tensors)


def _commit_after(upload: Future, staged: Any, commit: Callable[[BaseException | None, Any], None]) -> None:
    """Background: wait for DCP's write, then commit as a synchronous save does."""
    import torch.distributed.checkpoint as dcp

    error: BaseException | None = None
    try:
        upload.result()
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        error = exc
    commit(error, staged)
