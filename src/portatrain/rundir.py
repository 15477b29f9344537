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
        "(parallel.launch.volume_claim=CLAIM; the run directory is then placed on it)."
    )


__all__ = ["MARKER_PREFIX", "SharedStorageError", "check_shared_run_dir"]
