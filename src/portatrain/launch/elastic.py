"""``portatrain torchrun ARGS``: torchrun, ending with status 0 when a stop signal was saved cleanly.

torchrun forwards SIGTERM (what schedulers and ``kill`` send) to its workers, gives them
``--shutdown-timeout`` seconds, and then exits 1 whatever they did: its agent re-raises the signal
as an exception (``torch/distributed/elastic/agent/server/api.py``, ``LocalElasticAgent.run``). A
portatrain worker saves a checkpoint on SIGTERM and stops, which is a success: a scheduler that sees
status 1 marks the job failed, and a requeue-on-failure policy runs it again.

This command runs torchrun's own entry point (``torch.distributed.run.main``, every argument as
torchrun takes it) in this process. Each worker records in a folder of this agent's
(``$PORTATRAIN_STOP_DIR``, made here) that it started and, when it ends well -- finished, or stopped
on request after saving the step it stopped at -- that it ended cleanly
(:func:`record_worker_start`, :func:`record_worker_clean_end`). On a stop signal the command exits 0
when every worker of this host ended cleanly, else ``128 + signal`` as a shell would report it.
Without a signal the status is torchrun's: 0, or 1 when workers failed past ``--max-restarts``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

STOP_DIR_ENV = "PORTATRAIN_STOP_DIR"
"""Where this host's workers record their start and clean end (set by :func:`run_torchrun`)."""


def record_worker_start() -> None:
    """In a worker launched by ``portatrain torchrun``: this rank started (a restart rewrites it)."""
    _mark("started")


def record_worker_clean_end() -> None:
    """In a worker launched by ``portatrain torchrun``: this rank ended well."""
    _mark("clean")


def _mark(what: str) -> None:
    folder = os.environ.get(STOP_DIR_ENV)
    if folder:
        (Path(folder) / f"{what}.rank{os.environ.get('RANK', '0')}").touch()


def _all_clean(folder: Path) -> bool:
    started = {p.suffix for p in folder.glob("started.*")}
    clean = {p.suffix for p in folder.glob("clean.*")}
    return bool(started) and started <= clean


def run_torchrun(argv: list[str]) -> int:
    """Run torchrun with ``argv``; the exit status (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    with tempfile.TemporaryDirectory(prefix="portatrain-stop-") as folder:
        os.environ[STOP_DIR_ENV] = folder  # inherited by every worker torchrun starts
        try:
            torchrun_main(argv)
        except SignalException as exc:
            if _all_clean(Path(folder)):
                print(
                    f"portatrain torchrun: stopped by {exc.sigval.name}; every worker saved and ended cleanly",
                    file=sys.stderr,
                )
                return 0
            return 128 + int(exc.sigval)
        except ChildFailedError as exc:
            print(exc.format_msg(), file=sys.stderr)
            return 1
    return 0
