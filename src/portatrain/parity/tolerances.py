"""The tolerances parity judges by, derived from the arithmetic (the derivation is
``portatrain.parity``'s docstring): the unit roundoff of a dtype, a step's rounding tolerance, and
the bound on Adam's normalized update.
"""

from __future__ import annotations

import math

import torch

TAIL = 8.0
"""λ: standard deviations of the modelled rounding error a difference may reach (module docstring)."""
UPDATE_ROUNDINGS = 16
"""Roundings allowed an optimizer update (Adam's elementwise step is about ten in fp32)."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the gap between 1 and the next representable number (fp32 2^-24, bf16 2^-8)."""
    return torch.finfo(dtype).eps / 2


def step_tolerance(dtype: torch.dtype, *, reduction: int, stages: int) -> float:
    """Relative tolerance of one step's outputs, gradients and loss, computed in ``dtype`` on the
    target and in fp32 on the reference from identical weights: ``λ · sqrt(σ_t² + σ_r²)`` with
    ``σ = sqrt(stages) · (sqrt(reduction) · u_fp32 + u_dtype)`` (module docstring)."""
    accumulate = math.sqrt(max(1, reduction)) * unit_roundoff(torch.float32)

    def sigma(compute: torch.dtype) -> float:
        return math.sqrt(max(1, stages)) * (accumulate + unit_roundoff(compute))

    return TAIL * math.hypot(sigma(dtype), sigma(torch.float32))


def adam_update_bound(betas: tuple[float, float], step: int) -> float:
    """``c_t``, the largest ``|m̂| / sqrt(v̂)`` Adam can reach at ``step`` (1-based), whatever the
    gradients: with ``m̂ = Σ a_j g_j`` and ``v̂ = Σ b_j g_j²`` (the bias-corrected EMA weights),
    Cauchy-Schwarz gives ``|m̂| <= sqrt(Σ a_j² / b_j) · sqrt(v̂)``."""
    beta1, beta2 = betas
    if beta2 == 0.0:  # v̂ is the last gradient squared
        return 1.0 if beta1 == 0.0 else math.inf
    total = sum((beta1 * beta1 / beta2) ** j for j in range(step))
    return math.sqrt((1 - beta1) ** 2 * (1 - beta2**step) / ((1 - beta2) * (1 - beta1**step) ** 2) * total)
