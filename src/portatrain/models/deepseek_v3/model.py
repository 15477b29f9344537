"""The DeepSeek-V3 family (671B-A37B; Moonlight-16B-A3B; also Kimi K2's architecture): arguments,
flavours, the block.

DeepSeek-V3 (https://arxiv.org/abs/2412.19437) is the shared pre-norm decoder with three differences,
each a shared part:

1. **Multi-head latent attention** (``portatrain.models.common.mla``): queries and keys/values from
   low-rank latents, a decoupled rotary part, value heads narrower than query/key heads, YaRN
   rotary scaling (``portatrain.models.common.rope.YarnScaling``) with its softmax temperature.
2. **Dense blocks first, then mixtures of experts with shared experts**: the first
   ``first_k_dense_replace`` blocks have a SwiGLU of width ``ffn_dim``; every later one has
   ``n_experts`` routed experts of width ``moe_ffn_dim`` plus ``n_shared_experts`` always-on ones.
3. **Auxiliary-loss-free, group-limited routing** (``portatrain.models.common.moe.BiasedRouter``):
   sigmoid scores, a per-expert selection bias moved by ``bias_update_rate`` after each optimizer
   step, ``topk_group`` of ``n_group`` groups open per token, weights scaled by
   ``routed_scaling_factor``.

4. **Multi-token prediction** (``portatrain.models.common.mtp``, the paper's section 2.2), off unless
   ``mtp_layers > 0``: that many depths after the main model, each a mixture-of-experts block, their
   loss weighted by ``mtp_loss_weight``. The published checkpoint's one depth is ``model.layers.61``
   (``hf.py`` reads and writes it when ``mtp_layers=1``); transformers' model has none.

Names are ``DeepseekV3ForCausalLM``'s (``hf.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from portatrain.models.common.decoder import Decoder, DecoderArgs, TransformerBlock
from portatrain.models.common.mla import LatentAttention
from portatrain.models.common.moe import BiasedRouter, MoE
from portatrain.models.common.rope import YarnScaling, rope_tables


@dataclass(frozen=True)
class DeepseekV3Args(DecoderArgs):
    """DeepSeek-V3's arguments (defaults: the 671B model; HF names in the docstrings).

    ``n_kv_heads`` must equal ``n_heads``: every head expands its own key and value from the latent.
    ``head_dim`` is the query/key head width (``qk_nope_head_dim + qk_rope_head_dim``).
    """

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    n_kv_heads: int = 128
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 163840
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    """YaRN scaling of the rotary channels; None for plain RoPE (HF ``rope_scaling``)."""
    ffn_dim: int = 18432
    """SwiGLU width of the dense blocks (HF ``intermediate_size``)."""
    q_lora_rank: int | None = 1536
    """Query latent width; None projects queries directly (HF's name)."""
    kv_lora_rank: int = 512
    """Key/value latent width (HF's name)."""
    qk_nope_head_dim: int = 128
    """Query/key channels per head without position (HF's name)."""
    qk_rope_head_dim: int = 64
    """Rotary query/key channels per head (HF's name)."""
    v_head_dim: int = 128
    """Value channels per head (HF's name)."""
    rope_interleave: bool = True
    """The rotary channels' weights are stored in interleaved pairs, as DeepSeek's checkpoints are
    (HF's name); False: in halves."""
    n_experts: int = 256
    """Routed experts per sparse block (HF ``n_routed_experts``)."""
    top_k: int = 8
    """Routed experts per token (HF ``num_experts_per_tok``)."""
    moe_ffn_dim: int = 2048
    """Each expert's SwiGLU width (HF ``moe_intermediate_size``)."""
    n_shared_experts: int = 1
    """Always-on experts per sparse block, one SwiGLU ``n_shared_experts * moe_ffn_dim`` wide."""
    first_k_dense_replace: int = 3
    """Blocks before the first mixture of experts (HF's name)."""
    n_group: int = 8
    """Expert groups for group-limited routing (HF's name)."""
    topk_group: int = 4
    """Groups a token's experts may come from (HF's name)."""
    routed_scaling_factor: float = 2.5
    """Factor on the routed experts' weights (HF's name)."""
    norm_topk_prob: bool = True
    """Renormalize the chosen experts' scores to sum to 1 before scaling."""
    bias_update_rate: float = 0.001
    """Per-step change of each expert's selection bias toward even load (the paper's gamma, 0.001
    for most of pre-training); 0 freezes the bias."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss; 0: balanced by the bias alone (auxiliary-loss-free)."""
    mtp_layers: int = 0
    """Multi-token-prediction depths (the paper's D; the published model has 1, HF
    ``num_nextn_predict_layers``); 0 trains without them."""
    mtp_loss_weight: float = 0.3
    """Weight of the multi-token-prediction loss (the paper's lambda: 0.3 for the first 10T tokens, then 0.1)."""

    @property
    def head_dim(self) -> int:
        """Query/key head width (the value head is ``v_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention's scale: ``1/sqrt(head_dim)``, times YaRN's temperature when scaled."""
        if self.rope_scaling is None:
            return self.head_dim**-0.5
        return self.rope_scaling.softmax_scale(self.head_dim)

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.n_experts > 0

    @property
    def attention_params(self) -> int:
        h, heads = self.dim, self.n_heads
        if self.q_lora_rank is None:
            q = h * heads * self.head_dim
        else:  # down-projection, its norm, up-projection
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.head_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h + 2 * h  # + o_proj and the block's two norms

    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        if not self.is_sparse(layer):
            return 3 * self.dim * self.ffn_dim
        experts = (self.top_k if active else self.n_experts) + self.n_shared_experts
        return experts * 3 * self.dim * self.moe_ffn_dim + self.n_experts * self.dim  # + the router

    def flops_per_token(self, seq_len: int) -> int:
        """:meth:`DecoderArgs.flops_per_token` with attention's two matmuls at their own widths:
        ``QK^T`` over ``head_dim``, ``AV`` over ``v_head_dim``."""
        blocks = self.n_layers + self.mtp_layers
        dense = super().flops_per_token(seq_len) - 12 * blocks * self.q_dim * seq_len
        return dense + 6 * blocks * self.n_heads * (self.head_dim + self.v_head_dim) * seq_len

    def family_problems(self) -> list[str]:
        problems = [
            f"model.{name}={getattr(self, name)} must be positive"
            for name in (
                "ffn_dim",
                "kv_lora_rank",
                "qk_rope_head_dim",
                "v_head_dim",
                "n_experts",
                "top_k",
                "moe_ffn_dim",
                "n_group",
                "topk_group",
            )
            if getattr(self, name) <= 0
        ]
        for name in ("qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace", "bias_update_rate"):
            if getattr(self, name) < 0:
                problems.append(f"model.{name}={getattr(self, name)} must be >= 0")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            problems.append(
                f"model.q_lora_rank={self.q_lora_rank} must be positive, or null for no query latent"
            )
        if self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2:
            problems.append(
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even: RoPE rotates channel pairs; "
                f"set model.qk_rope_head_dim={self.qk_rope_head_dim + 1}"
            )
        if self.n_kv_heads != self.n_heads:
            problems.append(
                f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads}: latent attention "
                f"expands a key and a value for every head from one latent; unset model.n_kv_heads"
            )
        if 0 < self.n_experts < self.top_k:
            problems.append(
                f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts}; set model.top_k<={self.n_experts}"
            )
        if self.n_group > 0 and self.n_experts > 0:
            if self.n_experts % self.n_group:
                divisors = [d for d in range(1, self.n_experts + 1) if self.n_experts % d == 0]
                problems.append(
                    f"model.n_experts={self.n_experts} is not divisible by model.n_group={self.n_group}: "
                    f"experts are routed in equal groups; set model.n_group in {divisors}"
                )
            elif self.topk_group > self.n_group:
                problems.append(
                    f"model.topk_group={self.topk_group} exceeds model.n_group={self.n_group}: a token cannot "
                    f"use more groups than exist; set model.topk_group<={self.n_group}"
                )
            elif self.topk_group > 0 and self.top_k > self.topk_group * (self.n_experts // self.n_group):
                problems.append(
                    f"model.top_k={self.top_k} exceeds the {self.topk_group * (self.n_experts // self.n_group)} "
                    f"experts of model.topk_group={self.topk_group} open groups of "
                    f"{self.n_experts // self.n_group}; raise model.topk_group or lower model.top_k"
                )
        if self.routed_scaling_factor <= 0:
            problems.append(f"model.routed_scaling_factor={self.routed_scaling_factor} must be positive")
        if self.mtp_layers < 0 or self.mtp_loss_weight < 0:
            problems.append(
                f"model.mtp_layers={self.mtp_layers}, model.mtp_loss_weight={self.mtp_loss_weight}: both must be "
                ">= 0 (mtp_layers=0 turns multi-token prediction off)"
            )
        if self.aux_loss_coef < 0:
            problems.append(f"model.aux_loss_coef={self.aux_loss_coef} must be >= 0 (0 turns it off)")
        if self.rope_scaling is not None:
            problems += self.rope_scaling.problems()
        return problems


_671B = DeepseekV3Args()

# Published dimensions: config.json of deepseek-ai/DeepSeek-V3 and moonshotai/Moonlight-16B-A3B on
# the Hugging Face Hub.
DEEPSEEK_V3_FLAVORS: dict[str, DeepseekV3Args] = {
    # ~0.7M parameters for CPU tests: 8 experts in 4 groups, 2 open, top-2, one shared expert; the
    # first block dense; a query latent; value heads narrower than query/key heads; YaRN on.
    "debug": dataclasses.replace(
        _671B,
        dim=128,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=258,
        max_seq_len=512,
        ffn_dim=256,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=24,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=32,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128),
    ),
    "16b_a3b": dataclasses.replace(
        _671B,
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=163840,
        norm_eps=1e-5,
        rope_theta=50000.0,
        max_seq_len=8192,
        rope_scaling=None,
        ffn_dim=11264,
        q_lora_rank=None,
        n_experts=64,
        top_k=6,
        moe_ffn_dim=1408,
        n_shared_experts=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
    ),
    "671b": _671B,
}

DEEPSEEK_V3_PUBLISHED_PARAMS: dict[str, int] = {"671b": 671_026_404_352, "16b_a3b": 15_960_108_544}
"""Parameters of the published models. 671B: the checkpoint's main-model tensors hold 671,026,419,200
values (model card: 671B; 685B with the multi-token-prediction module), of which 58 x 256 are the
routing biases, buffers here. 16B-A3B: counted from the config's shapes (model card: 16B)."""
DEEPSEEK_V3_PUBLISHED_ACTIVE: dict[str, int] = {"671b": 37_552_282_624, "16b_a3b": 2_914_774_528}
"""Parameters a token passes through (model cards: 37B and 3B activated)."""


class DeepseekV3(Decoder):
    """A DeepSeek-V3 language model: latent attention, dense then mixture-of-experts blocks."""

    def build_block(self, args: DeepseekV3Args, layer_id: int) -> nn.Module:
        mlp = None  # the shared SwiGLU of width ffn_dim
        if args.is_sparse(layer_id):
            router = BiasedRouter(
                args.dim,
                args.n_experts,
                args.top_k,
                n_group=args.n_group,
                topk_group=args.topk_group,
                routed_scaling_factor=args.routed_scaling_factor,
                norm_topk_prob=args.norm_topk_prob,
                bias_update_rate=args.bias_update_rate,
            )
            mlp = MoE(
                args.dim,
                args.moe_ffn_dim,
                args.n_experts,
                args.top_k,
                norm_topk_prob=args.norm_topk_prob,
                n_shared_experts=args.n_shared_experts,
                aux_loss_coef=args.aux_loss_coef,
                router=router,
            )
        attn = LatentAttention(
            args.dim,
            args.n_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            softmax_scale=args.softmax_scale,
            rope_interleave=args.rope_interleave,
        )
        return TransformerBlock(args, mlp=mlp, attn=attn)

    def _rope_tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args  # only the rotary channels rotate
        return rope_tables(a.qk_rope_head_dim, a.rope_theta, a.max_seq_len, a.rope_scaling, device=device)


__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "DEEPSEEK_V3_PUBLISHED_ACTIVE",
    "DEEPSEEK_V3_PUBLISHED_PARAMS",
    "DeepseekV3",
    "DeepseekV3Args",
]
