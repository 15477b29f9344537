"""The optimizer stage: AdamW with decoupled weight decay (none on norms and biases) and a warm-up +
decay learning-rate schedule.

- :func:`optim_problems` -- the ``optim`` group's problems (``portatrain.validate`` asks for them);
- :func:`param_groups` / :func:`build_optimizer` -- AdamW, weight decay on matrices only; or
  ``optim.name=muon``: Muon on the blocks' matrices and AdamW on the rest, one optimizer
  (``portatrain.optim.muon``);
- :func:`lr_lambda` / :func:`build_lr_scheduler` -- linear warm-up, then cosine/linear/constant decay
  to ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from portatrain.config import OptimConfig
from portatrain.dtypes import dtype_problem
from portatrain.errors import ConfigError
from portatrain.optim.muon import ADJUST_LR, Muon, split_params

OPTIMIZERS = ("adamw", "muon")
"""Allowed values of ``optim.name``."""
DECAYS = ("cosine", "linear", "constant")
"""Allowed values of ``optim.decay``: the LR's shape after warm-up."""


def optim_problems(cfg: OptimConfig) -> list[str]:
    """Every problem of the ``optim`` group (the validator's optimizer-stage check)."""
    problems = []
    if cfg.name not in OPTIMIZERS:
        problems.append(
            f"optim.name={cfg.name!r} is unknown; the available optimizers are {', '.join(OPTIMIZERS)}"
        )
    if cfg.name == "muon":
        problems += _muon_problems(cfg.muon)
    if cfg.decay not in DECAYS:
        problems.append(f"optim.decay={cfg.decay!r} is not one of {', '.join(DECAYS)}")
    if cfg.warmup_steps < 0 or cfg.lr <= 0:
        problems.append(f"optim.lr={cfg.lr} must be > 0 and optim.warmup_steps={cfg.warmup_steps} >= 0")
    if len(cfg.betas) != 2:
        problems.append(f"optim.betas={list(cfg.betas)} must have two values, e.g. [0.9, 0.95]")
    if cfg.qk_clip is not None and cfg.qk_clip < 0:
        problems.append(f"optim.qk_clip={cfg.qk_clip} must be > 0 (the report's: 100), or null (0) for off")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        problems.append(f"optim.min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1] (a fraction of optim.lr)")
    return problems


def _muon_problems(muon) -> list[str]:  # noqa: ANN001 (MuonConfig, or its DictConfig)
    problems = []
    if not 0.0 <= muon.momentum < 1.0:
        problems.append(f"optim.muon.momentum={muon.momentum} must be in [0, 1), e.g. 0.95")
    if not 1 <= muon.ns_steps <= 99:
        problems.append(f"optim.muon.ns_steps={muon.ns_steps} must be in [1, 99] (5 is Muon's default)")
    if len(muon.ns_coefficients) != 3:
        problems.append(
            f"optim.muon.ns_coefficients={list(muon.ns_coefficients)} must have three values (a, b, c), "
            "e.g. [3.4445, -4.775, 2.0315]"
        )
    if muon.ns_eps <= 0:
        problems.append(f"optim.muon.ns_eps={muon.ns_eps} must be > 0, e.g. 1e-7")
    problems += dtype_problem("optim.muon.ns_dtype", muon.ns_dtype)
    if muon.adjust_lr not in ADJUST_LR:
        problems.append(f"optim.muon.adjust_lr={muon.adjust_lr!r} is not one of {', '.join(ADJUST_LR)}")
    if muon.lr is not None and muon.lr <= 0:
        problems.append(f"optim.muon.lr={muon.lr} must be > 0, or null for optim.lr")
    if muon.weight_decay is not None and muon.weight_decay < 0:
        problems.append(
            f"optim.muon.weight_decay={muon.weight_decay} must be >= 0, or null for optim.weight_decay"
        )
    return problems


def param_groups(
    model: nn.Module, weight_decay: float, params: list[nn.Parameter] | None = None
) -> list[dict]:
    """Decay matrices and embeddings; leave 1-D parameters (norm scales, biases) undecayed. ``params``:
    a subset of ``model``'s (default: every trainable one)."""
    decay, no_decay = [], []
    for p in model.parameters() if params is None else params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups`; ``fused`` is the accelerator's default (``optim.fused`` wins)."""
    problems = optim_problems(cfg)
    if problems:
        raise ConfigError("invalid optim config:\n  - " + "\n  - ".join(problems))
    fused = cfg.fused if cfg.fused is not None else fused
    if cfg.name == "muon":
        muon = cfg.muon
        hidden, rest = split_params(model)
        matrices = {
            "params": hidden,
            "algorithm": "muon",
            "lr": cfg.lr if muon.lr is None else muon.lr,
            "weight_decay": cfg.weight_decay if muon.weight_decay is None else muon.weight_decay,
        }
        # Three groups always (one may be empty, e.g. a pipeline stage without the embedding): every
        # rank's optimizer then has the same groups, as the checkpoint expects.
        return Muon(
            [matrices, *({**g, "algorithm": "adamw"} for g in param_groups(model, cfg.weight_decay, rest))],
            lr=cfg.lr,
            momentum=muon.momentum,
            nesterov=muon.nesterov,
            ns_coefficients=tuple(muon.ns_coefficients),
            ns_steps=muon.ns_steps,
            ns_eps=muon.ns_eps,
            ns_dtype=muon.ns_dtype,
            adjust_lr=muon.adjust_lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            fused=fused,
        )
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=fused,
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
