"""What the checkpoint modules share: :class:`CheckpointError`, the on-disk names, and rank helpers."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from portatrain.errors import UserError

FORMAT = "portatrain-dcp/1"
"""Written into ``trainer_state.json``; bumped when the layout changes incompatibly."""

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
METADATA = ".metadata"


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used: missing, incomplete, truncated, or saved for another model.

    The message names the file and the mismatch, and says how to fix it.
    """

    same_on_every_rank = True
    """Raised on every rank with the same message: under torchrun the CLI prints it once (rank 0)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose index names something other than DCP's own classes and tensors: loading it
    could run code, so nothing of it is read. ``checkpoint.resume=auto`` skips it and says why."""


def some(keys: list[str], limit: int = 6) -> str:
    """The first ``limit`` keys, and how many there are in all."""
    more = f" ... ({len(keys)} in all)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


DIGEST_KEY = "sha256"
"""The key under which a checkpoint's JSON object carries the SHA-256 of the rest of itself."""


def json_digest(value: Any) -> str:
    """SHA-256 of ``value``'s canonical JSON text, as it reads back (int keys become strings, so the
    digest of what was written equals the digest of what is read)."""
    canonical = json.dumps(json.loads(json.dumps(value)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def write_json(path: Path, value: Any) -> None:
    """Write a checkpoint's JSON file; an object also carries its own :func:`json_digest` under
    :data:`DIGEST_KEY`, which the readers check (``verify.check_json_digest``)."""
    try:
        if isinstance(value, dict):
            value = {**value, DIGEST_KEY: json_digest(value)}
        text = json.dumps(value, indent=1)
    except TypeError as exc:
        raise TypeError(f"checkpoint state for {path.name} must be JSON-serializable: {exc}") from None
    path.write_text(text)


def fsync_dir(folder: Path) -> None:
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


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_from_main(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


LEFTOVER_SUFFIXES = (".tmp", ".old", ".deleting")
"""Names a killed save or rotation can leave beside ``step_<N>``: never read, removed by the next save."""


def step_of(path: Path) -> int:
    """The step number of a ``step_<N>`` directory."""
    match = STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a step_<N> directory")
    return int(match.group(1))


def remove_leftovers(folder: Path) -> None:
    """Delete what killed saves and rotations left (``step_<N>.tmp/.old/.deleting``)."""
    for path in folder.iterdir():
        if path.name.startswith("step_") and path.name.endswith(LEFTOVER_SUFFIXES):
            shutil.rmtree(path, ignore_errors=True)


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (default: all; collective; one tiny
    all-gather, once per save)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    flags: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, bool(flag), group=group)
    return any(flags)


def root_causes(error: BaseException) -> list[BaseException]:
    """The exceptions behind ``error``: each rank's failure of a DCP ``CheckpointException``, or
    the end of the ``__cause__`` chain."""
    failures = getattr(error, "failures", None)
    found = [pair[0] for pair in failures.values()] if isinstance(failures, dict) and failures else [error]
    causes = []
    for exc in found:
        while exc.__cause__ is not None:
            exc = exc.__cause__
        causes.append(exc)
    return causes


def sum_over_ranks(value: int, group: Any = None) -> int:
    """``value`` summed over every rank of ``group`` (collective; a tiny all-gather, used on error
    paths only)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, int(value), group=group)
    return sum(values)


FULL_BELOW_BYTES = 1 << 20
"""A write that failed with less free space than this (1 MiB) failed because the disk is full."""


def free_bytes(folder: Path) -> int:
    """Bytes this process may still write on ``folder``'s filesystem (huge when it cannot be told)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 1 << 62


def bytes_on_disk(folder: Path) -> int:
    """Total size of the files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def is_disk_full(error: BaseException) -> bool:
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(
        error
    )


def short_cause(error: BaseException) -> str:
    """``Type: first line`` of an exception, without torch.load's advice to set weights_only=False
    (never the fix for a damaged checkpoint)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    for marker in (" Please file an issue", "(1) ", "In PyTorch 2.6", "weights_only"):
        if marker in text:
            text = text[: text.index(marker)].rstrip(" .:,;") or text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
