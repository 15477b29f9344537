"""A research subclass of the portatrain Trainer: cross-entropy plus a z-loss on the logits.

Run it exactly like `portatrain` (same config groups and overrides):

    python examples/zloss_trainer.py trainer.steps=50
"""

from __future__ import annotations

import torch

from portatrain.cli import main
from portatrain.trainer import Trainer


class ZLossTrainer(Trainer):
    """Adds PaLM's z-loss, ``1e-4 * logsumexp(logits)^2``, which keeps the softmax normalizer near 1."""

    z_weight = 1e-4

    def compute_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        cross_entropy = super().compute_loss(logits, batch)  # a sum over target tokens, per the hook contract
        mask = batch["labels"] != -100
        log_z = torch.logsumexp(logits.float(), dim=-1)
        # torch.where keeps the shape static (log_z[mask] would be data-dependent: a host sync)
        return cross_entropy + self.z_weight * torch.where(mask, log_z**2, 0.0).sum()

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        print(f"step {step}: eval loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main(trainer_cls=ZLossTrainer)
