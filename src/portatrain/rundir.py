"""Run-directory checks that must hold on every launcher: every rank writes into the same directory.

A multi-host run saves its checkpoints collectively into ``run_dir``: each rank writes its shards,
rank 0 writes the index and renames the folder once all are done. If the hosts do not share that
directory (no shared volume in a Kubernetes job, a node-local path in a SLURM job), nothing fails
until the first save, which then hangs -- rank 0 waiting in DCP's gather for files it cannot see,
the others in the closing barrier -- and leaves no complete checkpoint anywhere.

:func:`check_shared_run_dir` finds that out at start-up, in a second: rank 0 writes a marker file
with a fresh token into the run directory, every other rank looks for it (by its own view of
``run_dir``, which for a relative path depends on its working directory), and all ranks learn the
result, so every rank stops with the same message instead of one of them hanging. Call it after the
process group exists and before anything is resumed or saved.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from portatrain.errors import UserError

MARKER_PREFIX = ".portatrain-shared-check-"
"""Name prefix of the marker file rank 0 writes (and removes) in the run directory."""


class SharedStorageError(UserError):
    """The ranks of a run do not see the same run directory (printed without a traceback)."""


def check_shared_run_dir(run_dir: str | Path, *, timeout_s: float = 10.0) -> None:
    """Raise :class:`SharedStorageError` on every rank unless every rank sees rank 0's ``run_dir``.

    Collective over the default process group; a no-op for a single process. Rank 0 creates
    ``run_dir`` if needed. A rank that does not see the marker at once looks again for up to
    ``timeout_s`` seconds (a network filesystem may show a new file late), so a shared directory
    costs one round trip and a non-shared one ``timeout_s``.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    folder = Path(run_dir).absolute()
    marker = None
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        marker = folder / f"{MARKER_PREFIX}{token}"
        marker.write_text(token)
        box: list[object] = [token]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    token = str(box[0])
    seen = True
    if rank != 0:
        seen = _wait_for_marker(folder / f"{MARKER_PREFIX}{token}", token, timeout_s)
    views: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (rank, socket.gethostname(), str(folder), seen))
    if marker is not None:  # every rank has looked: the marker has served
        marker.unlink(missing_ok=True)
    blind = [view for view in views if not view[3]]  # type: ignore[index]
    if blind:
        raise SharedStorageError(_message(views[0], blind))  # type: ignore[arg-type]


def _wait_for_marker(marker: Path, token: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if marker.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _message(main: tuple[int, str, str, bool], blind: list[tuple[int, str, str, bool]]) -> str:
    _, main_host, main_dir, _ = main
    shown = blind[:4]
    where = "; ".join(f"rank {rank} on {host} looked in {path}" for rank, host, path, _ in shown)
    if len(blind) > len(shown):
        where += f"; and {len(blind) - len(shown)} more rank(s)"
    return (
        f"the run directory is not shared by all ranks: rank 0 on {main_host} wrote a marker file into "
        f"{main_dir}, but {len(blind)} rank(s) do not see it ({where}). Checkpoints are saved "
        "collectively into the run directory, so the first save would hang. Put run_dir on storage "
        "every host mounts at the same path: on SLURM a shared filesystem (submit from a directory on "
        "it, or set run_dir=/shared/path/...); on Kubernetes a ReadWriteMany volume "
        "(launch.volume_claim=CLAIM; the run directory is then placed on it)."
    )


# -- the run-directory lock --------------------------------------------------------------------
# Two runs in one directory interleave their checkpoints, config and metrics. The run holds an
# exclusive flock on <run_dir>/.portatrain.lock from start to exit. The kernel releases a flock
# when its process dies, however it dies (SIGKILL, OOM, a node reboot for a local disk), so a
# crashed run never leaves a lock to clean up: the next run simply takes it. The file's content
# (host, PID, start time) is only there to name the holder in the error.

LOCK_FILE = ".portatrain.lock"


class RunDirLockedError(UserError):
    """Another live process holds the run directory's lock."""

    same_on_every_rank = True


class RunDirNotWritableError(UserError):
    """The run directory cannot be created or written (read-only, permissions)."""

    same_on_every_rank = True


class RunDirLock:
    """An exclusive lock on a run directory (see :func:`lock_run_dir`); :meth:`release` is idempotent."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a Trainer dropped without close() still frees its directory
        with contextlib.suppress(Exception):
            self.release()


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Create ``run_dir`` if needed, check it is writable, and take its exclusive lock.

    Raises :class:`RunDirNotWritableError` when the directory cannot be created or written (checked
    here, before training, not at the first save) and :class:`RunDirLockedError` naming the holder's
    host and PID when another live process holds it. Call it on one process per run (rank 0).
    """
    import fcntl

    folder = Path(run_dir).absolute()
    lock_path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _not_writable(folder, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirLockedError(
            f"run directory {folder} is in use by another run ({holder}); two runs in one directory "
            "would mix their checkpoints and metrics. Wait for it to finish or stop it, or choose "
            "another run_dir=..."
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"host={socket.gethostname()} pid={os.getpid()} since={time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(),
            0,
        )
        probe = folder / f".portatrain-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        checkpoints = folder / "checkpoints"
        if checkpoints.is_dir() and not os.access(checkpoints, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(checkpoints))
    except OSError as exc:
        os.close(fd)
        raise _not_writable(exc.filename or folder, exc) from None
    return RunDirLock(lock_path, fd)


def _not_writable(path: str | Path, exc: OSError) -> RunDirNotWritableError:
    return RunDirNotWritableError(
        f"run directory {path} is not writable ({exc.strerror}): checkpoints and "
        "metrics could not be saved. Choose a writable run_dir=... or fix its permissions"
    )


def remove_unused_lock(run_dir: str | Path) -> bool:
    """Delete ``run_dir``'s lock file if no process holds it (a run that failed to start left it
    alone in an otherwise empty directory); True when removed."""
    import fcntl

    lock_path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock_path.unlink()  # while holding it: nobody can take it between the check and the unlink
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def discard_unsaved_run(run_dir: str | Path) -> bool:
    """Empty ``run_dir`` of what a run that failed on a user error wrote before it saved any
    checkpoint (its config, metrics, compile cache, lock), so the same command can run again once
    the mistake is fixed; True when emptied. Call only for a directory that was empty when the run
    started; one that holds a complete checkpoint is left alone."""
    import shutil

    folder = Path(run_dir)
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir()):
        return False
    try:
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError:
        return False
    return True


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return (
        text.replace("host=", "host ").replace("pid=", "PID ").replace("since=", "since ") or "holder unknown"
    )


__all__ = [
    "LOCK_FILE",
    "MARKER_PREFIX",
    "RunDirLock",
    "RunDirLockedError",
    "RunDirNotWritableError",
    "SharedStorageError",
    "check_shared_run_dir",
    "lock_run_dir",
    "discard_unsaved_run",
    "remove_unused_lock",
]
