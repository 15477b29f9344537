"""Preemption and Ctrl-C: SIGTERM (what schedulers and torchrun send before killing) and SIGINT -> save
and stop at a step boundary; a second SIGINT exits at once. Before training starts (while the Trainer
is being built), SIGTERM stops the run as Ctrl-C does (:func:`sigterm_interrupts`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    """SIGTERM (what schedulers and torchrun send before killing) or Ctrl-C (SIGINT) -> save and stop
    at a step boundary. A second SIGINT exits at once (status 130, no traceback, nothing saved:
    the newest complete checkpoint stays the one to resume from).

    The handler only sets a flag. :meth:`should_stop`, called once per step by every rank, agrees
    on it across ranks (a MAX all-reduce over a CPU/gloo group: the signal may reach ranks in
    different steps, and all must save at the same one). It costs one tiny host-side collective
    per step when there is more than one rank, and never a device synchronization.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
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
        if signum == signal.SIGINT and self.requested:
            # The user insists: leave now. os._exit, not an exception: a KeyboardInterrupt raised
            # inside a collective or a save would print a traceback and could be swallowed.
            print("second interrupt: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGINT)
        self.requested = True
        logger.warning(
            "received %s: saving a checkpoint at the next step boundary, then stopping%s",
            signal.Signals(signum).name,
            " (press Ctrl-C again to exit at once)" if signum == signal.SIGINT else "",
        )

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop. Collective when more than one rank."""
        if self._group is None:
            return self.requested
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``KeyboardInterrupt``, as Ctrl-C does: a stop request
    while the Trainer is being built (loading data, compiling, loading a checkpoint) ends the run
    cleanly -- the CLI prints "interrupted" and exits 130, nothing is saved -- instead of killing it
    without a word. Training itself uses :class:`PreemptionWatcher` (save, then stop).
    Main thread only (Python delivers signals there); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name} before training started")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
