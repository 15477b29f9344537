"""The layers every decoder family is built from: RMSNorm, gated feed-forward, grouped-query attention.

Each is single-device PyTorch, attention through ``F.scaled_dot_product_attention`` only
(``portatrain.models.attention``). The three small ops kernels may replace are called through module
attributes -- the kernel slots -- holding the pure-PyTorch references of
``portatrain.kernels.reference``: ``RMSNorm.rmsnorm_fn``, ``FeedForward.swiglu_fn`` and
``Attention.rope_fn``. ``portatrain.kernels.apply`` points them at opt-in kernels, so every family
built from these layers gets every kernel.

Parameter names are Hugging Face's (``q_proj``, ``gate_proj``, ``q_norm``...), so checkpoints map onto
``transformers`` by renaming the prefix alone (``portatrain.models.common.hf``).

Gemma's variants are options here, not copies: a norm gain stored as an offset from 1
(``unit_offset``), a GELU-tanh gate (``activation="gelu_tanh"``, which no kernel computes, so that
feed-forward has no slot), an attention scale of its own (``softmax_scale``). GPT-OSS adds projection
biases and attention sinks (``bias``, ``sinks``; ``portatrain.models.common.masks``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.kernels.reference import rmsnorm, rope, swiglu
from portatrain.models.attention import causal_attention
from portatrain.models.common.masks import sink_attention

QKNorm = Literal["none", "head", "proj"]
"""Where attention normalizes queries and keys (before RoPE):

* ``none`` -- not at all (Llama 3);
* ``head`` -- per head over ``head_dim``, one ``head_dim`` gain shared by all heads (Qwen 3);
* ``proj`` -- over the whole projection, all heads at once, one gain per channel (OLMo 2).
"""
QK_NORMS: tuple[str, ...] = ("none", "head", "proj")
Activation = Literal["silu", "gelu_tanh"]
"""A gated feed-forward's gate: ``silu`` (SwiGLU, the kernel slot ``swiglu_fn``) or ``gelu_tanh``
(GEGLU with the tanh approximation of GELU, Gemma; Shazeer 2020, https://arxiv.org/abs/2002.05202)."""
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Truncated normal init cut at 3 std (``nn.init``'s default cut-off is an absolute +-2, a no-op at
    std 0.02)."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned gain and no bias
    (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467).

    ``unit_offset``: the stored weight is the gain minus 1 (Gemma's ``1 + weight``, initialized to
    zeros), so Gemma's checkpoints load as they are; the kernel slot still gets the gain itself.
    """

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim))
        self.rmsnorm_fn = rmsnorm  # F.rms_norm, unless a kernel override replaces it
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The gain in the input's dtype: under autocast a norm may see bf16 activations (per-head
        # q/k norms, latent norms) beside its fp32 gain, and torch's fused rms_norm refuses mixed
        # dtypes (it falls back to a slower composite and warns). A no-op when they already agree.
        # Gemma's offset is added in fp32 first (its reference computes ``1 + weight`` in fp32).
        gain = 1 + self.weight.float() if self.unit_offset else self.weight
        return self.rmsnorm_fn(x, gain.to(x.dtype), self.eps)


def gelu_tanh_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GEGLU's activation with tanh-approximated GELU (HF ``gelu_pytorch_tanh``): ``gelu(gate) * up``."""
    return F.gelu(gate, approximate="tanh") * up


class FeedForward(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (Shazeer 2020, https://arxiv.org/abs/2002.05202);
    SwiGLU (``silu``, through the ``swiglu_fn`` slot) unless ``activation`` says ``gelu_tanh``."""

    def __init__(self, dim: int, hidden_dim: int, activation: Activation = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        if activation == "silu":  # no slot otherwise: a SwiGLU kernel must not replace another gate
            self.swiglu_fn = swiglu  # silu(gate) * up, unless a kernel override replaces it

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.gate_proj.weight, std)
        trunc_normal_(self.up_proj.weight, std)
        trunc_normal_(self.down_proj.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = self.swiglu_fn(gate, up) if self.activation == "silu" else gelu_tanh_glu(gate, up)
        return self.down_proj(hidden)


class Attention(nn.Module):
    """Grouped-query causal self-attention with optional q/k RMSNorm, through SDPA only.

    ``n_heads * head_dim`` need not equal ``dim`` (Qwen 3 decouples them). k/v heads are shared as
    ``portatrain.models.attention`` describes (SDPA's ``enable_gqa`` without a mask, repeated heads
    with one). ``qk_norm`` is one of :data:`QK_NORMS`; the norms run before RoPE in every kind.
    ``softmax_scale``: None for ``1/sqrt(head_dim)``; ``bias``: the four projections have biases;
    ``sinks``: one learned sink logit per query head (:func:`~portatrain.models.common.masks.sink_attention`);
    ``norm_unit_offset``: the q/k norms' gains are stored as offsets from 1 (Gemma).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        norm_eps: float,
        qk_norm: QKNorm = "none",
        softmax_scale: float | None = None,
        bias: bool = False,
        sinks: bool = False,
        norm_unit_offset: bool = False,
    ) -> None:
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        self.head_dim = head_dim
        self.qk_norm = qk_norm
        self.softmax_scale = softmax_scale
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias)
        if (
            qk_norm == "head"
        ):  # one gain of head_dim values, shared by every head (HF: "only on the head dim")
            self.q_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)
        elif qk_norm == "proj":  # one gain per channel of the whole projection
            self.q_norm = RMSNorm(n_heads * head_dim, norm_eps, unit_offset=norm_unit_offset)
            self.k_norm = RMSNorm(n_kv_heads * head_dim, norm_eps, unit_offset=norm_unit_offset)
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.rope_fn = rope  # x * cos + rotate_half(x) * sin, unless a kernel override replaces it
        self.qk_clip = None  # optim.qk_clip: the logits' running max (portatrain.models.common.qk_clip)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            trunc_normal_(linear.weight, std)
        trunc_normal_(self.o_proj.weight, out_std)
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.sinks is not None:
            trunc_normal_(self.sinks, std)
        if self.qk_norm != "none":
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        # Heads are read off the projected width (-1), not the config, so a tensor-parallel plan
        # that column-shards the projections (fewer heads per rank) needs no change here.
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        if self.qk_norm == "head":  # [B, S, heads, head_dim]: per head and position
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rope_fn(q, cos, sin), self.rope_fn(k, cos, sin)
        if self.qk_clip is not None:
            self.qk_clip.observe(q, k, attn_mask, self.softmax_scale)
        # SDPA scales by 1/sqrt(q.shape[-1]) = 1/sqrt(head_dim) unless told otherwise, as HF does.
        if self.sinks is None:
            out = causal_attention(q, k, v, attn_mask, self.softmax_scale)
        else:  # (a tensor-parallel rank's heads would need their share of the sinks: refused by the plan)
            out = sink_attention(q, k, v, attn_mask, self.sinks, self.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))
