"""Rename a written checkpoint in, and rotate the old ones out (rank 0, once every rank has written).

Every step is a rename, so a process killed at any point leaves each ``step_<N>`` complete or absent
(see ``portatrain.checkpoint`` for the atomicity rule):

- an existing ``step_<N>`` (a broken save, or one left by a run rolled back past this step) is
  renamed ``step_<N>.old``, the new one renamed in, the old one deleted;
- complete checkpoints of later steps (the abandoned timeline after such a roll-back) are renamed
  ``step_<M>.superseded``, so ``checkpoint.resume=auto`` never picks them;
- beyond the newest ``keep``, a checkpoint is renamed ``step_<M>.deleting`` before it is deleted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from portatrain.checkpoint.common import fsync_dir, step_of
from portatrain.checkpoint.discovery import complete_checkpoints

logger = logging.getLogger(__name__)


def publish(folder: Path, step: int, final: Path, tmp: Path, *, keep: int) -> None:
    """Rename ``tmp`` to ``final`` (replacing it), supersede later steps, keep the newest ``keep``
    (<= 0 keeps all)."""
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
    fsync_dir(folder)
    if replaced:
        shutil.rmtree(aside)
    _supersede_newer(folder, step)
    if keep > 0:
        for old in complete_checkpoints(folder)[:-keep]:
            trash = old.with_name(old.name + ".deleting")
            old.rename(trash)  # atomic: the checkpoint is gone whole, or still complete
            fsync_dir(folder)
            shutil.rmtree(trash)
    fsync_dir(folder)


def _supersede_newer(folder: Path, step: int) -> None:
    newer = [p for p in complete_checkpoints(folder) if step_of(p) > step]
    if not newer:
        return
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
