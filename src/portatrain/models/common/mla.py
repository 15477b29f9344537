"""Multi-head latent attention (DeepSeek-V2, https://arxiv.org/abs/2405.04434, section 2.1; DeepSeek-V3).

Keys and values are expanded from one low-rank latent per token (``kv_lora_rank`` wide, what an
inference cache keeps), queries optionally from another (``q_lora_rank``). Each head's query and
key are two parts: ``qk_nope_head_dim`` channels from the latents, without position, and
``qk_rope_head_dim`` rotary channels -- the queries' per head, the keys' one part shared by every head
(decoupled RoPE: a rotation cannot pass through the latent's up-projection). Values are
``v_head_dim`` wide, which may differ from the ``qk_nope + qk_rope`` of queries and keys:
``F.scaled_dot_product_attention`` accepts a value head of its own width, so attention is still SDPA
alone. During training the latents are expanded to full keys and values (the cheaper order when
every position is a query; the absorbed order serves decoding).

Names are Hugging Face's ``DeepseekV3Attention``'s (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``
or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so checkpoints
map by renaming the prefix alone. Rotary channels are rotated in the half-split layout of
``portatrain.models.common.rope``; DeepSeek's checkpoints store them interleaved in pairs
(``rope_interleave``), which are regrouped into halves first, as transformers does -- the same
permutation of queries and keys leaves every attention score unchanged, so weights load as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from portatrain.kernels.reference import rope
from portatrain.models.attention import causal_attention
from portatrain.models.common.layers import RMSNorm, trunc_normal_

LATENT_NORM_EPS = 1e-6
"""Epsilon of the two latent norms: DeepSeek's reference (``RMSNorm(kv_lora_rank)`` in
deepseek-ai/DeepSeek-V3 ``inference/model.py``) and transformers use the default 1e-6 there, whatever
the residual norms' ``rms_norm_eps``."""


class LatentAttention(nn.Module):
    """Causal multi-head latent attention through SDPA only.

    Args:
        dim: model width. n_heads: attention heads (every head has its own key and value).
        q_lora_rank: width of the query latent; None projects queries directly (DeepSeek-V2-Lite,
            Moonlight).
        kv_lora_rank: width of the key/value latent.
        qk_nope_head_dim, qk_rope_head_dim: the two parts of a query/key head.
        v_head_dim: width of a value head.
        softmax_scale: attention's scale (YaRN raises it; default ``1/sqrt(qk head width)``).
        rope_interleave: the rotary channels' projections are stored in interleaved pairs.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float | None = None,
        rope_interleave: bool = False,
    ) -> None:
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.softmax_scale, self.rope_interleave = softmax_scale, rope_interleave
        if q_lora_rank is None:
            self.q_proj = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.rope_fn = rope  # x * cos + rotate_half(x) * sin, unless a kernel override replaces it
        self.qk_clip = None  # optim.qk_clip: the logits' running max (portatrain.models.common.qk_clip)

    def init_weights(self, std: float, out_std: float) -> None:
        for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
            if hasattr(self, name):
                trunc_normal_(getattr(self, name).weight, std)
        trunc_normal_(self.o_proj.weight, out_std)
        for norm in (getattr(self, "q_a_layernorm", None), self.kv_a_layernorm):
            if norm is not None:
                norm.reset_parameters()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self._queries(x).view(batch, seq_len, -1, self.qk_head_dim).transpose(1, 2)  # [B, H, S, qk]
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = k_rope.view(batch, 1, seq_len, self.qk_rope_head_dim)  # one rotary key for all heads
        if self.rope_interleave:  # pairs (0, 1), (2, 3), ... -> first and second halves
            q_rope, k_rope = _halves(q_rope), _halves(k_rope)
        q_rope, k_rope = self.rope_fn(q_rope, cos, sin), self.rope_fn(k_rope, cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(batch, seq_len, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if self.qk_clip is not None:
            self.qk_clip.observe(q, k, attn_mask, self.softmax_scale)
        out = causal_attention(q, k, v, attn_mask, scale=self.softmax_scale)  # [B, H, S, v_head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Even channels, then odd ones: interleaved rotary pairs in ``rope_fn``'s half-split layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
