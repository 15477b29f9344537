"""Pure-PyTorch references for every overridable operation -- what models run by default.

Each function is the exact arithmetic the Llama/Qwen model files used before overrides existed, so
switching every override off reproduces the original model bit for bit. Kernel overrides must
match these (forward and gradients) within the tolerances in :mod:`portatrain.kernels.parity`.

* :func:`rmsnorm` -- ``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.
* :func:`swiglu` -- the SwiGLU activation ``silu(gate) * up`` (the projections stay ``nn.Linear``).
* :func:`rope` -- rotary embedding in Hugging Face's half-split ``rotate_half`` layout.

This module imports only torch: models import it directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension with a learned gain and no bias."""
    # F.rms_norm is a single fused kernel on CPU and CUDA and decomposes elsewhere.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up`` (elementwise; both ``[..., ffn_dim]``)."""
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension, split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each ``(i, i + head_dim/2)`` channel pair of ``x`` ``[B, H, S, head_dim]`` by its angle.

    ``cos``/``sin`` are ``[S, head_dim]`` (shared by every row) or ``[B, 1, S, head_dim]`` (per-row
    positions, e.g. packed documents), usually fp32 tables; they are cast to ``x``'s dtype like
    Hugging Face does, so bf16 runs stay bf16. The tables hold each angle twice
    (``cat(angles, angles)``), which the kernels rely on for their backward pass.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
