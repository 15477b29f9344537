"""The GPT-OSS family (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", https://arxiv.org/abs/2508.10925;
reference code openai/gpt-oss ``gpt_oss/torch/model.py``): arguments, flavours, the sparse block.

GPT-OSS is the shared pre-norm decoder (``portatrain.models.common``) with these differences, each a
shared part switched on in :class:`GptOssArgs`:

1. **Alternating sliding-window and full attention** (128-token window on even layers;
   ``portatrain.models.common.masks``), **attention sinks** (a learned logit per head, an extra key
   column of SDPA's float mask) and **biased q/k/v/o projections**.
2. **A mixture of experts in every block** (``portatrain.models.common.moe``): 32 or 128 experts,
   top-4, a router with a bias whose top-k logits are softmaxed, experts with biases and a clamped
   gate (:func:`~portatrain.models.common.moe.clamped_swiglu`: limit 7, sigmoid gain 1.702).
3. **YaRN** (theta 150,000, 32x from 4,096 positions, the ramp's ends not rounded: ``truncate=False``),
   its temperature ``0.1 ln 32 + 1`` applied to the cos/sin tables.

Untied embeddings, RMSNorm eps 1e-5, no q/k norm. Names are ``GptOssForCausalLM``'s (``hf.py`` maps
the experts' interleaved gate/up columns to the stacked halves the shared experts keep).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from portatrain.models.common.decoder import Decoder, DecoderArgs, TransformerBlock
from portatrain.models.common.moe import GroupedExperts, MoE, Router, clamped_swiglu
from portatrain.models.common.rope import YarnScaling

_YARN = YarnScaling(
    factor=32.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,  # the tables' temperature 0.1 ln(factor) + 1 (HF: attention_factor from factor alone)
    mscale_all_dim=0.0,  # and no change to the softmax scale
    truncate=False,
)


@dataclass(frozen=True)
class GptOssArgs(DecoderArgs):
    """GPT-OSS's arguments (defaults: gpt-oss-120b; HF names in the docstrings)."""

    attention_bias: ClassVar[bool] = True
    attention_sinks: ClassVar[bool] = True
    expert_bias: ClassVar[bool] = True
    """The experts' projections have biases (read by the memory estimate)."""
    expert_saved_widths: ClassVar[int] = 9
    """Tensors of the experts' width each assignment keeps for backward (the memory estimate; SwiGLU
    keeps 4): gate/up with their biases (2), the clamped gate, its sigmoid, the gated product, the
    clamped up, up + 1, their product and the routing-weighted result."""
    positive_fields: ClassVar[tuple[str, ...]] = (
        *DecoderArgs.positive_fields,
        "head_dim",
        "moe_ffn_dim",
        "n_experts",
        "top_k",
        "sliding_window",
    )

    head_dim: int = 64
    """Width of one attention head (HF ``head_dim``; 64 heads x 64 = 4096 != dim 2880)."""
    moe_ffn_dim: int = 2880
    """Each expert's gated width (HF ``intermediate_size``)."""
    n_experts: int = 128
    """Routed experts per block (HF ``num_local_experts``)."""
    top_k: int = 4
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    swiglu_limit: float = 7.0
    """Clamp of the experts' gate and up projections (HF's name)."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the experts' gate (HF's name)."""
    aux_loss_coef: float = 0.9
    """Weight of the load-balancing loss (HF ``router_aux_loss_coef``; the published config.json's)."""
    sliding_window: int = 128
    """Keys a sliding layer's query sees, itself included (HF's name); even layers slide."""
    rope_scaling: YarnScaling | None = field(default_factory=lambda: _YARN)
    """YaRN scaling (HF ``rope_scaling``); None for plain RoPE."""
    # Shared fields whose GPT-OSS defaults differ.
    dim: int = 2880
    n_layers: int = 36
    n_heads: int = 64
    n_kv_heads: int = 8
    vocab_size: int = 201_088
    rope_theta: float = 150_000.0

    @property
    def ffn_dim(self) -> int:
        """Every block is sparse: the experts' width."""
        return self.moe_ffn_dim

    def is_sparse(self, layer: int) -> bool:
        return True

    def is_sliding(self, layer: int) -> bool:
        return layer % 2 == 0

    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        experts = self.top_k if active else self.n_experts
        expert = 3 * self.dim * self.moe_ffn_dim + 2 * self.moe_ffn_dim + self.dim  # weights and biases
        return experts * expert + self.n_experts * (self.dim + 1)  # + the router's weight and bias

    def num_params(self, exclude_embedding: bool = False, *, active: bool = False) -> int:
        """:meth:`DecoderArgs.num_params`, except that ``active`` leaves the input embedding out, as
        the model card counts active parameters (3.6B and 5.1B; a lookup, not a matmul)."""
        total = super().num_params(exclude_embedding, active=active)
        return total - self.vocab_size * self.dim if active and not exclude_embedding else total

    def family_problems(self) -> list[str]:
        problems = []
        if 0 < self.n_experts < self.top_k:
            problems.append(
                f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts}; set model.top_k<={self.n_experts}"
            )
        if self.swiglu_limit <= 0:
            problems.append(f"model.swiglu_limit={self.swiglu_limit} must be positive")
        if self.aux_loss_coef < 0:
            problems.append(f"model.aux_loss_coef={self.aux_loss_coef} must be >= 0 (0 turns it off)")
        if self.rope_scaling is not None:
            problems += self.rope_scaling.problems()
        return problems


_120B = GptOssArgs()

# Published dimensions: config.json of openai/gpt-oss-20b and openai/gpt-oss-120b on the Hugging Face
# Hub (the model card's table 1).
GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    # ~0.5M parameters for CPU tests: 8 experts, top-2; sliding and full layers alternate, so the
    # two-block cut the tests run has one of each; a 16-token window, shorter than the test rows;
    # heads wider than dim / n_heads, as in the published sizes; YaRN on.
    "debug": dataclasses.replace(
        _120B,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        moe_ffn_dim=64,
        n_experts=8,
        top_k=2,
        vocab_size=258,
        max_seq_len=512,
        sliding_window=16,
        rope_scaling=dataclasses.replace(_YARN, factor=4.0, original_max_position_embeddings=128),
    ),
    "20b": dataclasses.replace(_120B, n_layers=24, n_experts=32),
    "120b": _120B,
}

GPT_OSS_PUBLISHED_PARAMS: dict[str, int] = {"20b": 20_914_757_184, "120b": 116_829_156_672}
"""Total parameters (model card, table 1: 20.91B and 116.83B)."""
GPT_OSS_PUBLISHED_ACTIVE: dict[str, int] = {"20b": 3_608_307_264, "120b": 5_132_849_472}
"""Active parameters per token, without the input embedding (model card: 3.61B and 5.13B)."""


class GptOss(Decoder):
    """A GPT-OSS language model: the shared decoder with biased, sink-attending, expert blocks."""

    def build_block(self, args: GptOssArgs, layer_id: int) -> nn.Module:
        experts = GroupedExperts(
            args.n_experts,
            args.dim,
            args.moe_ffn_dim,
            bias=True,
            activation=functools.partial(clamped_swiglu, alpha=args.swiglu_alpha, limit=args.swiglu_limit),
        )
        moe = MoE(
            args.dim,
            args.moe_ffn_dim,
            args.n_experts,
            args.top_k,
            norm_topk_prob=True,
            aux_loss_coef=args.aux_loss_coef,
            router=Router(args.dim, args.n_experts, args.top_k, norm_topk_prob=True, bias=True),
            experts=experts,
        )
        return TransformerBlock(args, mlp=moe)


__all__ = [
    "GPT_OSS_FLAVORS",
    "GPT_OSS_PUBLISHED_ACTIVE",
    "GPT_OSS_PUBLISHED_PARAMS",
    "GptOss",
    "GptOssArgs",
]
