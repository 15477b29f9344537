"""The run directory a trainer takes before anything is built or written: exclusive (its lock),
writable, the same directory on every rank, and the checkpoint in it to resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from portatrain.checkpoint import CheckpointError, read_trainer_state, resolve_resume
from portatrain.checkpoint.common import broadcast_from_main
from portatrain.config import Config
from portatrain.distributed import DistInfo
from portatrain.fault_tolerance import replica_run_dir
from portatrain.rundir import (
    RunDirLock,
    RunDirLockedError,
    RunDirNotWritableError,
    check_shared_run_dir,
    lock_run_dir,
)


@dataclass
class RunDir:
    path: Path
    """``run_dir``, or with fault tolerance this replica group's ``<run_dir>/replica_<id>``."""
    lock: RunDirLock | None
    """Rank 0's lock on the directory (None on other ranks); released by :meth:`release`."""
    resume_from: Path | None
    """The checkpoint ``checkpoint.resume`` names (``auto``: the newest in the directory), or None."""

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def open_run_dir(cfg: Config, dist: DistInfo) -> RunDir:
    """Take the run directory (refusing another run's, or one every rank cannot see) and find the
    checkpoint to resume; a resume past ``trainer.steps`` is a ``CheckpointError`` with the fix."""
    path = replica_run_dir(cfg.fault_tolerance, Path(cfg.run_dir))
    run_dir = RunDir(path, _lock(path, dist), None)
    try:
        # Every rank sees rank 0's run directory, or all stop here (a first save would hang).
        check_shared_run_dir(path)
        run_dir.resume_from = resolve_resume(cfg.checkpoint.resume, path / "checkpoints", recipe=cfg.recipe)
        if run_dir.resume_from is not None:
            saved_step = int(read_trainer_state(run_dir.resume_from)["step"])
            if saved_step > cfg.trainer.steps:
                raise CheckpointError(
                    f"checkpoint {run_dir.resume_from} is at step {saved_step}, past trainer.steps="
                    f"{cfg.trainer.steps}: there is nothing left to train. Set trainer.steps>{saved_step} "
                    "to train on (the LR schedule is recomputed for the new length), or resume from an "
                    "earlier step_* directory"
                )
    except BaseException:
        run_dir.release()  # a run that failed to start leaves the directory free
        raise
    return run_dir


def _lock(path: Path, dist: DistInfo) -> RunDirLock | None:
    """Rank 0 creates the run directory and takes its lock; every rank learns the outcome."""
    lock, error = None, None
    if dist.is_main:
        try:
            lock = lock_run_dir(path)
        except (RunDirLockedError, RunDirNotWritableError) as exc:
            error = (type(exc).__name__, str(exc))
    error = broadcast_from_main(error)
    if error is not None:
        kind = RunDirLockedError if error[0] == RunDirLockedError.__name__ else RunDirNotWritableError
        raise kind(error[1])
    return lock
