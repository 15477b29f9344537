"""The non-finite guard: what a training step with a NaN/inf loss or gradient norm does
(``trainer.on_nonfinite``), kept out of the Trainer's loop.

:class:`NonFiniteGuard` counts bad steps on the device every step (no host sync), reads the counts at
the loop's logging sync, and then stops the run (``stop``: :class:`NonFiniteError`, before anything
non-finite is saved) or counts the skipped steps (``skip_step``: such a step leaves the weights and
the optimizer state as they were, decided on the device). Before every save it checks that the
state about to be written is finite -- weights and optimizer moments, by the rule checkpoint loads
and ``portatrain export`` apply (``portatrain.checkpoint.verify.nonfinite_keys``) -- so a message
that calls a checkpoint finite is one that was checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from portatrain.checkpoint import Checkpointer, nonfinite_keys
from portatrain.checkpoint.common import some
from portatrain.errors import UserError

logger = logging.getLogger(__name__)

NONFINITE_MODES = ("stop", "skip_step")
"""``trainer.on_nonfinite``: what a step with a non-finite loss or gradient norm does."""


class NonFiniteError(UserError):
    """Training produced a non-finite loss or gradient norm (``trainer.on_nonfinite=stop``)."""

    same_on_every_rank = True


class NonFiniteGuard:
    """Counts non-finite steps on the device and acts on them at the loop's syncs.

    ``all_reduce_sum`` sums a tensor over the data-parallel ranks; ``checkpointer`` tells the stop
    message which checkpoint to resume from and how it was checked; ``fix_lr`` is ``optim.lr``, quoted
    in the advice.
    """

    def __init__(
        self,
        mode: str,
        *,
        device: torch.device,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        dp_world_size: int,
        checkpointer: Checkpointer,
        is_main: bool,
        lr: float,
    ) -> None:
        self.skip = mode == "skip_step"
        self._all_reduce_sum = all_reduce_sum
        self._dp_world_size = dp_world_size
        self._checkpointer = checkpointer
        self._is_main = is_main
        self._lr = lr
        self.counts = torch.zeros(2, device=device)
        """Since the last sync: [steps with a non-finite gradient norm (global: all ranks agree on it),
        micro-batch losses of this rank that were non-finite]."""
        self._first = torch.zeros((), device=device)  # step of the first one (0: none)
        self.skipped = 0
        """Steps skipped for a non-finite loss or gradient norm so far (``on_nonfinite=skip_step``)."""

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, ok: torch.Tensor, *, skip: bool = False
    ) -> None:
        """``optimizer.step()``; with ``skip_step`` (or ``skip``: another guard, e.g. the loss-spike
        guard, may veto steps) a step where ``ok`` is false leaves parameters and optimizer state as
        they were -- decided on the device, no host sync."""
        if not (self.skip or skip):
            optimizer.step()
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        fused = all(group.get("fused") for group in optimizer.param_groups)
        if fused and not any(hasattr(p, "to_local") for p in params):
            # Fused AdamW skips on the device when found_inf is set (the GradScaler protocol), and
            # takes back its step count.
            optimizer.found_inf = (~ok).float()
            optimizer.grad_scale = None
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale
            return

        # Any other optimizer: keep a copy of what a step changes and put it back where not ok.
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        tensors = [local(p.data) for p in params]
        for p in params:
            tensors += [local(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        before = [t.detach().clone() for t in tensors]
        known = {id(t) for t in tensors}
        optimizer.step()
        with torch.no_grad():
            for t, old in zip(tensors, before):
                t.copy_(torch.where(ok.to(t.device), t, old))
            for p in params:  # state this (first) step created: as if it had not run, zeros
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and id(local(v)) not in known:
                        local(v).copy_(torch.where(ok.to(v.device), local(v), torch.zeros_like(local(v))))

    def count(self, step: int, grad_ok: torch.Tensor, loss_ok: torch.Tensor) -> None:
        """Device-side bookkeeping of optimizer step ``step`` (no host sync): counts, and the first bad step."""
        bad = torch.stack([~grad_ok, ~loss_ok]).to(self.counts.dtype)
        first_missing = self._first == 0
        self._first = torch.where(first_missing & (bad.sum() > 0), float(step), self._first)
        self.counts = self.counts + bad

    def check(self, bad_steps: int, bad_losses: int, metrics: dict[str, Any], step: int) -> None:
        """At a sync: ``bad_steps`` non-finite gradient norms (summed over the dp ranks, which agree on
        them) and ``bad_losses`` non-finite losses since the last sync -> stop, or count the skipped
        steps. ``step`` is the current step, ``metrics`` its loss and gradient norm (for the message)."""
        bad_steps //= self._dp_world_size
        first = int(self._first.item()) if bad_steps or bad_losses else 0
        self.counts.zero_()
        self._first.zero_()
        if not (bad_steps or bad_losses):
            return
        if self.skip:
            self.skipped += bad_steps
            if self._is_main and bad_steps:
                logger.warning(
                    "skipped %d optimizer step(s) with a non-finite gradient norm (first: step %d; %d "
                    "skipped in all; trainer.on_nonfinite=skip_step)",
                    bad_steps,
                    first or step,
                    self.skipped,
                )
            elif self._is_main:
                logger.warning(
                    "a non-finite loss with finite gradients at step %d: the step was applied", first or step
                )
            return
        raise NonFiniteError(
            f"the loss or gradient norm became non-finite at step {first or step} (last step: loss "
            f"{float(metrics['loss']):.4g}, grad norm {float(metrics['grad_norm']):.4g}); training stopped "
            f"without saving, and {self._newest_checkpoint()}. Lower optim.lr (now {self._lr}), lengthen "
            "optim.warmup_steps or set optim.grad_clip, then continue with checkpoint.resume=auto; or set "
            "trainer.on_nonfinite=skip_step to skip such steps"
        )

    def assert_finite_state(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Before a save at ``step`` (collective): no pending non-finite step, and every weight and
        optimizer moment finite on every rank."""
        bad_steps, bad_losses = (int(x) for x in self._all_reduce_sum(self.counts).tolist())
        self.check(bad_steps, bad_losses, {"loss": float("nan"), "grad_norm": float("nan")}, step)
        names = {p: name for name, p in model.named_parameters()}
        tensors = {f"model.{name}": p for p, name in names.items()}
        for p, state in optimizer.state.items():
            tensors.update(
                {
                    f"optim.{names.get(p, id(p))}.{k}": v
                    for k, v in state.items()
                    if isinstance(v, torch.Tensor)
                }
            )
        bad = nonfinite_keys(tensors)
        if bad:
            raise NonFiniteError(
                f"the training state is non-finite at step {step} ({some(bad)}); not saving it, and "
                f"{self._newest_checkpoint()}. Lower optim.lr or set optim.grad_clip, then continue with "
                "checkpoint.resume=auto"
            )

    def _newest_checkpoint(self) -> str:
        """What the stop message may say of the newest checkpoint: only what was checked."""
        newest, how = self._checkpointer.last_step, self._checkpointer.last_verified
        if newest is None:
            return "this run saved or loaded no checkpoint"
        return f"the newest checkpoint (step {newest}) was checked finite when it was {how}"


__all__ = ["NONFINITE_MODES", "NonFiniteError", "NonFiniteGuard"]
