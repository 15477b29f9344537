"""The Qwen 3 mixture-of-experts family (30B-A3B, 235B-A22B): arguments, flavours, the sparse block.

Qwen 3 MoE is Qwen 3 (per-head q/k norms, ``head_dim`` 128) whose feed-forwards are the shared
mixture of experts (``portatrain.models.common.moe``): 128 routed experts of width
``moe_ffn_dim``, softmax top-8 with the top-k weights renormalized, no shared experts, and the
load-balancing loss at ``router_aux_loss_coef`` 0.001. Every block is sparse in the published sizes
(``decoder_sparse_step`` 1, no ``mlp_only_layers``); a dense block uses ``ffn_dim``. Names are
``Qwen3MoeForCausalLM``'s (``hf.py`` maps HF's per-expert tensors to the stacked layout and back).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from portatrain.models.common.decoder import TransformerBlock
from portatrain.models.common.moe import MoE
from portatrain.models.qwen3.model import Qwen3, Qwen3Args


@dataclass(frozen=True)
class Qwen3MoeArgs(Qwen3Args):
    """Qwen 3's arguments plus the experts (HF names in the docstrings)."""

    n_experts: int = 128
    """Routed experts per sparse block (HF ``num_experts``)."""
    top_k: int = 8
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_dim: int = 768
    """Each expert's SwiGLU width (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights to sum to 1."""
    aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss (HF ``router_aux_loss_coef``); 0 turns it off."""
    decoder_sparse_step: int = 1
    """Every ``decoder_sparse_step``-th block is sparse (HF's name)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks that stay dense whatever the step (HF's name)."""

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer`` has experts (HF's rule)."""
        return (
            layer not in self.mlp_only_layers
            and self.n_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        if not self.is_sparse(layer):
            return super().mlp_params(layer)
        experts = self.top_k if active else self.n_experts
        return experts * 3 * self.dim * self.moe_ffn_dim + self.n_experts * self.dim  # + the router

    def family_problems(self) -> list[str]:
        problems = [
            f"model.{name}={getattr(self, name)} must be positive"
            for name in ("n_experts", "top_k", "moe_ffn_dim", "decoder_sparse_step")
            if getattr(self, name) <= 0
        ]
        if 0 < self.n_experts < self.top_k:
            problems.append(
                f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts}: a token cannot be routed to "
                f"more experts than exist; set model.top_k<={self.n_experts}"
            )
        if self.aux_loss_coef < 0:
            problems.append(f"model.aux_loss_coef={self.aux_loss_coef} must be >= 0 (0 turns it off)")
        return problems


_30B = Qwen3MoeArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144)

_DEBUG_SHAPE = dict(
    dim=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256, vocab_size=258, max_seq_len=512
)

# Published dimensions: config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the Hugging
# Face Hub (head_dim 128, 4 kv heads, 128 experts, top-8, untied).
QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    # ~0.5M parameters for CPU tests: 8 experts, top-2, expert width a quarter of dim as 30B-A3B's
    # 768 of 2048 is 3/8; the last block dense, so both block kinds run.
    "debug": dataclasses.replace(
        _30B, **_DEBUG_SHAPE, moe_ffn_dim=32, n_experts=8, top_k=2, mlp_only_layers=(2,)
    ),
    "30b_a3b": _30B,
    "235b_a22b": dataclasses.replace(
        _30B, dim=4096, n_layers=94, n_heads=64, ffn_dim=12288, moe_ffn_dim=1536
    ),
}

QWEN3_MOE_PUBLISHED_PARAMS: dict[str, int] = {"30b_a3b": 30_532_122_624, "235b_a22b": 235_093_634_560}
"""Total parameters of the published checkpoints (model cards: 30.5B and 235B)."""
QWEN3_MOE_PUBLISHED_ACTIVE: dict[str, int] = {"30b_a3b": 3_353_032_704, "235b_a22b": 22_190_763_520}
"""Parameters a token passes through (model cards: 3.3B and 22B activated)."""


class Qwen3Moe(Qwen3):
    """A Qwen 3 MoE language model: the shared decoder with mixture-of-experts blocks."""

    def build_block(self, args: Qwen3MoeArgs, layer_id: int) -> nn.Module:
        if not args.is_sparse(layer_id):
            return TransformerBlock(args)
        moe = MoE(
            args.dim,
            args.moe_ffn_dim,
            args.n_experts,
            args.top_k,
            norm_topk_prob=args.norm_topk_prob,
            aux_loss_coef=args.aux_loss_coef,
        )
        return TransformerBlock(args, mlp=moe)


__all__ = [
    "QWEN3_MOE_FLAVORS",
    "QWEN3_MOE_PUBLISHED_ACTIVE",
    "QWEN3_MOE_PUBLISHED_PARAMS",
    "Qwen3Moe",
    "Qwen3MoeArgs",
]
