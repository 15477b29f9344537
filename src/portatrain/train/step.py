"""One optimizer step, shared by every trainer (the language-model loss, DPO, a research subclass).

After the micro-batches' backward passes, :class:`OptimizerStep` does, in this order:

1. fault tolerance: average the gradients over the replica groups (``fault_tolerance.enabled``);
2. clip to ``optim.grad_clip`` by the global norm (across FSDP/TP meshes and pipeline stages; the
   gradients of the embedding two pipeline stages hold summed first: ``portatrain.parallel.pipeline``);
3. fault tolerance: commit, or drop the step when a replica group failed during it (nothing applied;
   the loop redoes it with the next batches);
4. the optimizer's step, skipped on the device when the norm is not finite (``trainer.on_nonfinite``,
   ``portatrain.train.nonfinite``) or the loss spikes (``trainer.spike_guard``,
   ``portatrain.train.spike``); in lockstep: every rank sees the same global norm and loss. A spike
   with ``action=rewind`` instead restores the newest checkpoint and drops the step (as fault
   tolerance does: the loop goes on with the next batches);
5. the post-step hooks: the model converters' (FP8 weight scales for the next all-gather) and the
   family's (``ModelSpec.runtime``: DeepSeek-V3's router bias), told whether the step was applied;
6. the non-finite bookkeeping, zeroing the gradients, the LR schedule's step.

No host sync: every decision stays on the device until the logging step reads it (but for
``action=rewind``, which the host carries out: it reads the spike decision each step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from portatrain.parallel import clip_grad_norm_
from portatrain.parallel.pipeline import sum_shared_grads
from portatrain.train.spike import SpikeGuard

logger = logging.getLogger(__name__)


class OptimizerStep:
    """Applies one step's gradients (module docstring). ``guard`` is the run's non-finite guard
    (``portatrain.train.nonfinite.NonFiniteGuard``); ``post_step`` hooks take the device bool ``ok``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        grad_clip: float,
        pp_mesh: Any,
        guard: Any,
        post_step: Iterable[Callable[[torch.Tensor], None]] = (),
        spike_guard: SpikeGuard | None = None,
        global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        rewind: Callable[[], Any] | None = None,
        is_main: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.max_grad_norm = grad_clip if grad_clip > 0 else float("inf")
        self.pp_mesh = pp_mesh
        self.guard = guard
        self.post_step = list(post_step)
        self.spike_guard = spike_guard
        self.global_sum = global_sum
        """Sums a tensor over the ranks that hold different tokens (the spike guard's global loss)."""
        self.rewind = rewind
        """``trainer.spike_guard.action=rewind``: restores the newest checkpoint on every rank, keeping
        the data position; returns it, or None when there is none yet
        (``portatrain.train.state.TrainState.rewind``)."""
        self.is_main = is_main  # rank 0 says what a rewind did, once
        self.replica_groups: Any = None
        """``fault_tolerance.enabled``: the torchft replica groups (``portatrain.fault_tolerance``),
        set once they are joined."""

    def metrics(self) -> dict[str, float]:
        """The step's own figures at a logging step (steps the spike guard skipped)."""
        return self.spike_guard.metrics() if self.spike_guard is not None else {}

    def clip(self, model: nn.Module) -> torch.Tensor:
        """Clip the gradients by their global norm (one norm across FSDP/TP meshes and pipeline
        stages); returns the norm before clipping."""
        if self.pp_mesh is not None:  # the embedding and its last-stage copy step alike (Megatron-LM's)
            sum_shared_grads(model.parameters())
        params = [p for p in model.parameters() if p.grad is not None]
        return clip_grad_norm_(params, self.max_grad_norm, pp_mesh=self.pp_mesh)

    def __call__(self, model: nn.Module, *, step: int, loss: torch.Tensor) -> torch.Tensor | None:
        """Apply the gradients as optimizer step ``step`` (1-based); ``loss`` is this rank's share of
        the step's global loss (summed over the ranks: the global mean). Returns the gradient norm, or
        None when the step was dropped (fault tolerance; a spike guard's rewind)."""
        groups = self.replica_groups
        if groups is not None:  # averaged over the replica groups too
            groups.average_gradients(model.parameters())
        grad_norm = self.clip(model)
        if groups is not None and not groups.should_commit():
            self.optimizer.zero_grad(set_to_none=True)
            return None
        finite = ok = torch.isfinite(grad_norm)  # the same on every rank: skipping stays in lockstep
        spikes = self.spike_guard
        if spikes is not None:
            global_loss = self.global_sum(loss.detach()) if self.global_sum is not None else loss.detach()
            calm = spikes.check(global_loss)
            ok = finite & calm
            # rewind: the host acts, so it reads the decision (the same on every rank) each step.
            if spikes.action == "rewind" and not bool(calm) and self._rewind(step, global_loss):
                return None
        self.guard.optimizer_step(self.optimizer, ok, skip=spikes is not None)
        if spikes is not None:
            spikes.applied(global_loss, ok)
        for hook in self.post_step:
            hook(ok)
        self.guard.count(step, finite, torch.isfinite(loss))
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return grad_norm

    def _rewind(self, step: int, loss: torch.Tensor) -> bool:
        """Go back to the newest checkpoint for the spike at ``step`` (collective); False when there is
        none yet, and the step is then skipped as ``action=skip`` skips it."""
        median = float(self.spike_guard.losses.median())
        back_to = self.rewind() if self.rewind is not None else None
        if back_to is None:
            if self.is_main:
                logger.warning(
                    "loss spike at step %d (%.4g > %g x median %.4g) before the first checkpoint: the step "
                    "is skipped, not rewound",
                    step,
                    float(loss),
                    self.spike_guard.factor,
                    median,
                )
            return False
        self.optimizer.zero_grad(set_to_none=True)
        self.spike_guard.rewinds += 1
        if self.is_main:
            logger.warning(
                "loss spike at step %d (%.4g > %g x median %.4g): rewound to %s; the batches since it are "
                "skipped",
                step,
                float(loss),
                self.spike_guard.factor,
                median,
                back_to,
            )
        return True
