"""The loss-spike guard (``trainer.spike_guard``): a step whose loss is far above the recent ones is
not applied.

A spike -- one bad batch, a numerical blow-up starting -- pushes the weights where a long run may never
come back from. :class:`SpikeGuard` keeps the last ``window`` global step losses on the device; a step
whose loss exceeds ``factor`` times their median is skipped in lockstep on every rank (every rank sees
the same global loss): no weight update, no optimizer-state change, counted and logged
(``spike_skipped``). Only applied steps enter the window, so a run of spikes cannot raise the bar for
itself. Nothing syncs with the host per step: the decision is a device bool the optimizer step
applies, and the count is read at logging steps.

``action=rewind`` goes further: the run goes back to its newest checkpoint (weights, optimizer,
schedule, RNG, counters, this window) but not to its data position, so the batches from that
checkpoint up to the spike are skipped -- what PaLM did by hand ("restarted training from a
checkpoint roughly 100 steps before the spike started, and skipped roughly 200-500 data batches",
Chowdhery et al. 2022, https://arxiv.org/abs/2204.02311, section 5.1). Acting on the host costs one
host read of the decision per step. Before the first checkpoint there is nothing to go back to: the
step is skipped as ``skip`` does, with a warning.

``action=skip`` is MaxText's approach (skipping steps on loss spikes over a rolling window,
https://github.com/AI-Hypercomputer/maxtext); torchtitan stops only on NaN
(https://github.com/pytorch/torchtitan/issues/916).
"""

from __future__ import annotations

from typing import Any

import torch

ACTIONS = ("skip", "rewind")
"""Allowed values of ``trainer.spike_guard.action``."""


def spike_guard_problems(cfg: Any) -> list[str]:
    """Problems of ``trainer.spike_guard`` (``window=0`` turns it off), each with its fix."""
    problems = []
    if cfg.window < 0:
        problems.append(f"trainer.spike_guard.window={cfg.window} must be >= 0 (0 turns the guard off)")
    if cfg.window > 0 and not cfg.factor > 1:
        problems.append(
            f"trainer.spike_guard.factor={cfg.factor} must be > 1: a step is skipped when its loss "
            "exceeds factor x the median of the last window steps (e.g. 3.0)"
        )
    if cfg.action not in ACTIONS:
        problems.append(f"trainer.spike_guard.action={cfg.action!r} is not one of {', '.join(ACTIONS)}")
    return problems


def rewind_problems(cfg: Any, checkpoint: Any) -> list[str]:
    """``action=rewind`` goes back to a checkpoint: the run must save some (``checkpoint.*``)."""
    if not (cfg.window > 0 and cfg.action == "rewind"):
        return []
    if checkpoint.enabled and checkpoint.every > 0:
        return []
    return [
        "trainer.spike_guard.action=rewind goes back to the newest checkpoint, but checkpoint.enabled="
        f"{str(checkpoint.enabled).lower()} checkpoint.every={checkpoint.every} saves none during the run; set "
        "checkpoint.enabled=true checkpoint.every=N (e.g. 100), or trainer.spike_guard.action=skip"
    ]


class SpikeGuard:
    """The rolling window of global step losses and the skip decision (module docstring)."""

    @classmethod
    def build(cls, cfg: Any, device: torch.device) -> SpikeGuard | None:
        """The guard ``trainer.spike_guard`` asks for, or None (``window=0``: off)."""
        if not cfg.window:
            return None
        return cls(int(cfg.window), float(cfg.factor), device=device, action=str(cfg.action))

    def __init__(self, window: int, factor: float, *, device: torch.device, action: str = "skip") -> None:
        self.factor = float(factor)
        self.action = action
        self.rewinds = 0
        """Times ``action=rewind`` went back to a checkpoint (a host count: a rewind restores the rest)."""
        self.losses = torch.zeros(window, device=device)
        self.seen = torch.zeros((), dtype=torch.long, device=device)
        """Applied steps whose loss entered the window (the window is full once this reaches its size)."""
        self.skipped = torch.zeros((), device=device)

    def check(self, loss: torch.Tensor) -> torch.Tensor:
        """Whether the step of global ``loss`` may be applied (a device bool). Until the window has
        filled, every finite step may."""
        window = self.losses.numel()
        full = self.seen >= window
        median = self.losses.median()
        spike = full & (loss > self.factor * median)
        ok = ~spike
        self.skipped = self.skipped + spike.float()
        return ok

    def applied(self, loss: torch.Tensor, applied: torch.Tensor) -> None:
        """Record the loss of a step that was ``applied`` (a device bool; a skipped step leaves the
        window as it was)."""
        slot = self.seen % self.losses.numel()
        current = self.losses[slot]
        self.losses = self.losses.index_put((slot.view(1),), torch.where(applied, loss, current).view(1))
        self.seen = self.seen + applied.long()

    def metrics(self) -> dict[str, float]:
        """Steps skipped so far (a host read: logging steps only)."""
        skipped = int(self.skipped.item())
        found = {"spike_skipped": skipped} if skipped else {}
        return {**found, "spike_rewinds": self.rewinds} if self.rewinds else found

    def state_dict(self) -> dict[str, Any]:
        return {"losses": self.losses.tolist(), "seen": int(self.seen), "skipped": int(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["losses"]) != self.losses.numel():  # another window size: start the window anew
            return
        device = self.losses.device
        self.losses = torch.tensor(state["losses"], dtype=self.losses.dtype, device=device)
        self.seen = torch.tensor(int(state["seen"]), device=device)
        self.skipped = torch.tensor(float(state["skipped"]), device=device)
