"""AdamW with decoupled weight decay (none on norms and biases) and a warm-up + decay schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from portatrain.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave 1-D parameters (norm scales, biases) undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, fused: bool = False) -> torch.optim.Optimizer:
    if cfg.name != "adamw":
        raise ValueError(f"optim.name={cfg.name!r} is unknown; the available optimizer is 'adamw'")
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=cfg.fused if cfg.fused is not None else fused,
    )


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based; step 0 gets a non-zero LR)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    # Read the config once: fn runs every step, and a DictConfig attribute read costs ~10 us.
    schedule = {
        "warmup_steps": int(cfg.warmup_steps),
        "total_steps": int(total_steps),
        "decay": str(cfg.decay),
        "min_lr_ratio": float(cfg.min_lr_ratio),
    }

    def fn(step: int) -> float:
        return lr_lambda(step, **schedule)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
