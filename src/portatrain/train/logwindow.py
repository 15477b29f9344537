"""The logging window: what the Trainer counts between two logging steps, for throughput and MFU.

:class:`LoggingWindow` adds up this rank's real tokens, model FLOPs and optimizer steps since the last
logged step, and the wall time they took -- minus what is not training (compile warm-up, evaluation,
saves: the Trainer restarts the clock after each). At a logging step :meth:`LoggingWindow.close`
sums the counts over the data-parallel ranks in the one all-reduce that step makes anyway (the caller
adds its own device-side counters to it, e.g. the non-finite guard's), and the window starts over.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowTotals:
    """One closed window, summed over the data-parallel ranks."""

    tokens: int
    flops: int
    steps: int
    elapsed_s: float
    extra: list[int]
    """The caller's counters, summed over the ranks like the rest."""


class LoggingWindow:
    """Tokens, FLOPs and steps since the last logged step, and the time they took (host-side counts:
    adding to the window never touches the device)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new window now."""
        self.tokens, self.flops, self.steps = 0, 0, 0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Time from now on: what ran since (warm-up, evaluation, a save) is not training throughput."""
        self.start = time.perf_counter()

    def add(self, tokens: int, flops: int) -> None:
        """One optimizer step of this rank: its real tokens and model FLOPs."""
        self.tokens += tokens
        self.flops += flops
        self.steps += 1

    def close(
        self,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        *,
        device: torch.device,
        extra: torch.Tensor,
    ) -> WindowTotals:
        """The window's totals over the ranks (collective: one all-reduce of ``[tokens, flops, *extra]``).

        Call it after the device has synchronized, so the time includes the window's last step. The
        window is not reset: :meth:`reset` once the step has been logged, so logging is not counted.
        """
        elapsed = time.perf_counter() - self.start
        counts = torch.cat([torch.tensor([float(self.tokens), float(self.flops)], device=device), extra])
        tokens, flops, *rest = (int(x) for x in all_reduce_sum(counts).tolist())
        return WindowTotals(tokens=tokens, flops=flops, steps=self.steps, elapsed_s=elapsed, extra=rest)


__all__ = ["LoggingWindow", "WindowTotals"]
