"""Hugging Face ``Qwen3MoeForCausalLM`` interop: per-expert tensors <-> the stacked layout, and config.

The Hub's checkpoints hold one tensor per expert (``mlp.experts.<e>.gate_proj.weight`` ``[I, H]``,
``up_proj``, ``down_proj`` ``[H, I]``); transformers 5 fuses them on load into
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` -- the layout our experts keep.
:func:`to_hf` writes the Hub's per-expert form, which transformers 4.51+ and 5 both load;
:func:`from_hf` reads either form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from portatrain.models.common import hf as common
from portatrain.models.qwen3 import hf as qwen3_hf
from portatrain.models.qwen3_moe.model import Qwen3MoeArgs

ARCHITECTURE = "Qwen3MoeForCausalLM"


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Our keys -> the Hub's, each stacked expert tensor split into one tensor per expert."""
    return common.experts_to_hf(common.to_hf(state_dict))


def from_hf(state_dict: Mapping[str, Any], *, tie_embeddings: bool | None = None) -> dict[str, Any]:
    """The Hub's per-expert keys (or transformers 5's fused ones) -> ours, experts stacked in order."""
    return common.from_hf(
        common.experts_from_hf(state_dict), tie_embeddings=tie_embeddings, architecture=ARCHITECTURE
    )


def hf_config(args: Qwen3MoeArgs, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``Qwen3MoeConfig`` dict (``config.json`` content) describing ``args``."""
    return {
        **qwen3_hf.hf_config(args, torch_dtype=torch_dtype),
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_moe",
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "norm_topk_prob": args.norm_topk_prob,
        "router_aux_loss_coef": args.aux_loss_coef,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "output_router_logits": False,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> Qwen3MoeArgs:
    """Read a ``Qwen3MoeConfig`` dict into :class:`Qwen3MoeArgs`; ``ValueError`` on what is not implemented."""
    dense = qwen3_hf.args_from_hf_config(
        {**config, "model_type": "qwen3"} if config.get("model_type") == "qwen3_moe" else config
    )
    return Qwen3MoeArgs(
        **{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)},
        n_experts=config["num_experts"] if "num_experts" in config else config["num_local_experts"],  # (5.x)
        top_k=config["num_experts_per_tok"],
        moe_ffn_dim=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
    )


__all__ = ["ARCHITECTURE", "args_from_hf_config", "from_hf", "hf_config", "to_hf"]
