"""The layers every decoder family is built from: RMSNorm, SwiGLU feed-forward, grouped-query attention.

Each is single-device PyTorch, attention through ``F.scaled_dot_product_attention`` only
(``portatrain.models.attention``). The three small ops kernels may replace are called through module
attributes -- the kernel slots -- holding the pure-PyTorch references of
``portatrain.kernels.reference``: ``RMSNorm.rmsnorm_fn``, ``FeedForward.swiglu_fn`` and
``Attention.rope_fn``. ``portatrain.kernels.apply`` points them at opt-in kernels, so every family
built from these layers gets every kernel.

Parameter names are Hugging Face's (``q_proj``, ``gate_proj``, ``q_norm``...), so checkpoints map onto
``transformers`` by renaming the prefix alone (``portatrain.models.common.hf``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from portatrain.kernels.reference import rmsnorm, rope, swiglu
from portatrain.models.attention import causal_attention

QKNorm = Literal["none", "head", "proj"]
"""Where attention normalizes queries and keys (before RoPE):

* ``none`` -- not at all (Llama 3);
* ``head`` -- per head over ``head_dim``, one ``head_dim`` gain shared by all heads (Qwen 3);
* ``proj`` -- over the whole projection, all heads at once, one gain per channel (OLMo 2).
"""
QK_NORMS: tuple[str, ...] = ("none", "head", "proj")


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Truncated normal init cut at 3 std (``nn.init``'s default cut-off is an absolute +-2, a no-op at
    std 0.02)."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned gain and no bias
    (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.rmsnorm_fn = rmsnorm  # F.rms_norm, unless a kernel override replaces it
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The gain in the input's dtype: under autocast a norm may see bf16 activations (per-head
        # q/k norms, latent norms) beside its fp32 gain, and torch's fused rms_norm refuses mixed
        # dtypes (it falls back to a slower composite and warns). A no-op when they already agree.
        return self.rmsnorm_fn(x, self.weight.to(x.dtype), self.eps)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, https://arxiv.org/abs/2002.05202)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.swiglu_fn = swiglu  # silu(gate) * up, unless a kernel override replaces it

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.gate_proj.weight, std)
        trunc_normal_(self.up_proj.weight, std)
        trunc_normal_(self.down_proj.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu_fn(self.gate_proj(x), self.up_proj(x)))


class Attention(nn.Module):
    """Grouped-query causal self-attention with optional q/k RMSNorm, through SDPA only.

    ``n_heads * head_dim`` need not equal ``dim`` (Qwen 3 decouples them). k/v heads are shared as
    ``portatrain.models.attention`` describes (SDPA's ``enable_gqa`` without a mask, repeated heads
    with one). ``qk_norm`` is one of :data:`QK_NORMS`; the norms run before RoPE in every kind.
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
    ) -> None:
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        self.head_dim = head_dim
        self.qk_norm = qk_norm
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        if (
            qk_norm == "head"
        ):  # one gain of head_dim values, shared by every head (HF: "only on the head dim")
            self.q_norm = RMSNorm(head_dim, norm_eps)
            self.k_norm = RMSNorm(head_dim, norm_eps)
        elif qk_norm == "proj":  # one gain per channel of the whole projection
            self.q_norm = RMSNorm(n_heads * head_dim, norm_eps)
            self.k_norm = RMSNorm(n_kv_heads * head_dim, norm_eps)
        self.rope_fn = rope  # x * cos + rotate_half(x) * sin, unless a kernel override replaces it

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            trunc_normal_(linear.weight, std)
        trunc_normal_(self.o_proj.weight, out_std)
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
        # SDPA scales by 1/sqrt(q.shape[-1]) = 1/sqrt(head_dim), as HF does.
        out = causal_attention(q, k, v, attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))
