"""Rotary position embedding tables, in Hugging Face's half-split ``rotate_half`` layout.

The rotation itself is :func:`portatrain.kernels.reference.rope` (a kernel slot, ``rope_fn``, on every
attention module); this file computes the fp32 ``cos``/``sin`` tables it reads. Plain RoPE (Su et al.
2021, https://arxiv.org/abs/2104.09864), Llama 3.1's frequency scaling (:class:`RopeScaling`, HF
``rope_type="llama3"``), linear position interpolation (:class:`LinearScaling`, HF
``rope_type="linear"``, as Gemma 3's global layers use) and YaRN (:class:`YarnScaling`, HF
``rope_type="yarn"``, as DeepSeek-V3 and GPT-OSS use) are implemented.
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


@dataclass(frozen=True)
class LinearScaling:
    """Linear position interpolation (Chen et al. 2023, https://arxiv.org/abs/2306.15595; HF
    ``rope_type="linear"``): every frequency divided by ``factor``, as if positions were ``factor``
    times closer. Gemma 3 4B-27B scale their global layers' RoPE so (factor 8, 32k -> 128k)."""

    factor: float = 8.0
    """Divisor of every frequency."""

    def problems(self, prefix: str = "model.rope_scaling") -> list[str]:
        return [] if self.factor >= 1 else [f"{prefix}.factor={self.factor} must be >= 1 (1: no scaling)"]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023, https://arxiv.org/abs/2309.00071; HF ``rope_type="yarn"``), as
    DeepSeek-V3 extends a 4k pre-training context to 128k.

    Frequencies that turn more than ``beta_fast`` times within the original context are kept
    (extrapolated), those turning fewer than ``beta_slow`` times are divided by ``factor``
    (interpolated), with a linear ramp between. Attention logits grow with the stretched context;
    YaRN compensates by a temperature ``mscale(factor) = 0.1 * m * ln(factor) + 1``, applied to the
    cos/sin tables as ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and to the softmax
    scale as ``mscale(factor, mscale_all_dim) ** 2`` (DeepSeek's split; both 1.0 in its config, so
    only the softmax scale changes: :meth:`softmax_scale`).
    """

    factor: float = 40.0
    """Context extension: positions up to ``factor * original_max_position_embeddings``."""
    original_max_position_embeddings: int = 4096
    """Context length the unscaled model was pre-trained at."""
    beta_fast: float = 32.0
    """Rotations within the original context above which a frequency is kept."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is fully interpolated."""
    mscale: float = 1.0
    """Temperature coefficient of the cos/sin tables (numerator)."""
    mscale_all_dim: float = 1.0
    """Temperature coefficient shared by the tables (denominator) and the softmax scale."""
    truncate: bool = True
    """Round the ramp's ends to whole channel pairs (HF's default, DeepSeek-V3); GPT-OSS ramps
    between the exact, fractional ones (HF ``truncate: false``)."""

    def temperature(self, coefficient: float) -> float:
        """``0.1 * coefficient * ln(factor) + 1`` (1 without extension)."""
        return 1.0 if self.factor <= 1 else 0.1 * coefficient * math.log(self.factor) + 1.0

    def table_scale(self) -> float:
        """Factor on the cos/sin tables (HF ``attention_factor``)."""
        return self.temperature(self.mscale) / self.temperature(self.mscale_all_dim)

    def softmax_scale(self, head_dim: int) -> float:
        """Attention's softmax scale for q/k heads ``head_dim`` wide (HF ``yarn_apply_mscale``)."""
        return head_dim**-0.5 * self.temperature(self.mscale_all_dim) ** 2

    def problems(self, prefix: str = "model.rope_scaling") -> list[str]:
        """Inconsistent settings, each naming the value and the fix."""
        problems = []
        if self.factor < 1:
            problems.append(f"{prefix}.factor={self.factor} must be >= 1 (1: no extension)")
        if self.original_max_position_embeddings <= 0:
            problems.append(
                f"{prefix}.original_max_position_embeddings={self.original_max_position_embeddings} must be positive"
            )
        if not self.beta_fast > self.beta_slow > 0:
            problems.append(
                f"{prefix}.beta_fast={self.beta_fast} must exceed {prefix}.beta_slow={self.beta_slow} > 0 "
                "(YaRN ramps between them; the paper uses 32 and 1)"
            )
        return problems


def _yarn_inv_freq(
    inv_freq: torch.Tensor, rotary_dim: int, theta: float, scaling: YarnScaling
) -> torch.Tensor:
    """HF's ``_compute_yarn_parameters`` in fp32."""

    def correction_dim(rotations: float) -> float:  # the channel pair that turns ``rotations`` times
        return (
            rotary_dim
            * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    ramp = (torch.arange(rotary_dim // 2, device=inv_freq.device, dtype=torch.float32) - low) / max(
        high - low, 0.001
    )
    extrapolated = 1 - ramp.clamp(0, 1)  # 1: keep the frequency, 0: divide it by ``factor``
    return inv_freq / scaling.factor * (1 - extrapolated) + inv_freq * extrapolated


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | LinearScaling | YarnScaling | None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/head_dim)``, scaled as ``scaling`` says (Llama 3.1, linear or YaRN).

    Llama 3.1: same arithmetic, in fp32, as Meta's ``apply_scaling`` (meta-llama/llama-models,
    ``models/llama3/reference_impl/model.py``) and HF's ``_compute_llama3_parameters``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
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
    scaling: RopeScaling | LinearScaling | YarnScaling | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[max_seq_len, head_dim]`` in fp32.

    HF layout: the ``head_dim/2`` angles are repeated (``cat(angles, angles)``), pairing channel
    ``i`` with channel ``i + head_dim/2``. Meta's original Llama code pairs adjacent channels
    (2i, 2i+1) instead; HF permutes q/k weights on conversion so that its layout is equivalent, and
    we use HF's so its checkpoints load without any permutation. YaRN scales both tables by its
    :meth:`YarnScaling.table_scale`.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    scale = scaling.table_scale() if isinstance(scaling, YarnScaling) else 1.0
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()
