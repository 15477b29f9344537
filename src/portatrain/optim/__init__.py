"""The optimizer stage: AdamW with decoupled weight decay (none on norms and biases) and a warm-up +
decay learning-rate schedule.

- :func:`optim_problems` -- the ``optim`` group's problems (``portatrain.validate`` asks for them);
- :func:`param_groups` / :func:`build_optimizer` -- AdamW, weight decay on matrices only;
- :func:`lr_lambda` / :func:`build_lr_scheduler` -- linear warm-up, then cosine/linear/constant decay
  to ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from portatrain.config import OptimConfig
from portatrain.errors import ConfigError

OPTIMIZERS = ("adamw",)
"""Allowed values of ``optim.name``."""
DECAYS = ("cosine", "linear", "constant")
"""Allowed values of ``optim.decay``: the LR's shape after warm-up."""


def optim_problems(cfg: OptimConfig) -> list[str]:
    """Every problem of the ``optim`` group (the validator's optimizer-stage check)."""
    problems = []
    if cfg.name not in OPTIMIZERS:
        problems.append(
            f"optim.name={cfg.name!r} is unknown; the available optimizer is {', '.join(OPTIMIZERS)}"
        )
    if cfg.decay not in DECAYS:
        problems.append(f"optim.decay={cfg.decay!r} is not one of {', '.join(DECAYS)}")
    if cfg.warmup_steps < 0 or cfg.lr <= 0:
        problems.append(f"optim.lr={cfg.lr} must be > 0 and optim.warmup_steps={cfg.warmup_steps} >= 0")
    if len(cfg.betas) != 2:
        problems.append(f"optim.betas={list(cfg.betas)} must have two values, e.g. [0.9, 0.95]")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        problems.append(f"optim.min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1] (a fraction of optim.lr)")
    return problems


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave 1-D parameters (norm scales, biases) undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups`; ``fused`` is the accelerator's default (``optim.fused`` wins)."""
    problems = optim_problems(cfg)
    if problems:
        raise ConfigError("invalid optim config:\n  - " + "\n  - ".join(problems))
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
