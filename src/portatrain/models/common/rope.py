"""Rotary position embedding tables, in Hugging Face's half-split ``rotate_half`` layout.

The rotation itself is :func:`portatrain.kernels.reference.rope` (a kernel slot, ``rope_fn``, on every
attention module); this file computes the fp32 ``cos``/``sin`` tables it reads. Plain RoPE (Su et al.
2021, https://arxiv.org/abs/2104.09864) and Llama 3.1's frequency scaling (:class:`RopeScaling`, HF
``rope_type="llama3"``) are implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (HF ``rope_type="llama3"``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept,
    those longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, and the band between is interpolated smoothly. This is how Llama 3.1 extends an
    8k-token pre-training context to 128k.
    """

    factor: float = 8.0
    """Divisor applied to the low frequencies (8 for Llama 3.1, 32 for Llama 3.2 1B/3B)."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are left alone."""
    original_max_position_embeddings: int = 8192
    """Context length the unscaled model was pre-trained at."""


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/head_dim)``, with Llama 3.1 scaling when ``scaling`` is set.

    Same arithmetic, in fp32, as Meta's ``apply_scaling`` (meta-llama/llama-models,
    ``models/llama3/reference_impl/model.py``) and HF's ``_compute_llama3_parameters``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) never completed a turn within the pre-training context:
    # stretch them by `factor` so positions up to factor * original length stay in familiar range.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # In between, blend the stretched and the original frequency linearly in 1/wavelength.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_tables(
    head_dim: int,
    theta: float,
    max_seq_len: int,
    scaling: RopeScaling | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[max_seq_len, head_dim]`` in fp32.

    HF layout: the ``head_dim/2`` angles are repeated (``cat(angles, angles)``), pairing channel
    ``i`` with channel ``i + head_dim/2``. Meta's original Llama code pairs adjacent channels
    (2i, 2i+1) instead; HF permutes q/k weights on conversion so that its layout is equivalent, and
    we use HF's so its checkpoints load without any permutation.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()
