"""Hugging Face ``Qwen3MoeForCausalLM`` interop: per-expert tensors <-> the stacked layout, and config.

The Hub's checkpoints hold one tensor per expert (``mlp.experts.<e>.gate_proj.weight`` ``[I, H]``,
``up_proj``, ``down_proj`` ``[H, I]``); transformers 5 fuses them on load into
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` -- the layout our experts keep.
:func:`to_hf` writes the Hub's per-expert form, which transformers 4.51+ and 5 both load;
:func:`from_hf` reads either form.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from portatrain.models.common import hf as common
from portatrain.models.qwen3 import hf as qwen3_hf
from portatrain.models.qwen3_moe.model import Qwen3MoeArgs

ARCHITECTURE = "Qwen3MoeForCausalLM"
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Our keys -> the Hub's, each stacked expert tensor split into one tensor per expert."""
    out: dict[str, Any] = {}
    for key, value in common.to_hf(state_dict).items():
        match = _STACKED.match(key)
        if match is None:
            out[key] = value
        elif match[2] == "down_proj":
            out.update({f"{match[1]}.{e}.down_proj.weight": w for e, w in enumerate(value.unbind(0))})
        else:
            for e, w in enumerate(value.unbind(0)):
                gate, up = w.chunk(2, dim=0)
                out[f"{match[1]}.{e}.gate_proj.weight"] = gate
                out[f"{match[1]}.{e}.up_proj.weight"] = up
    return out


def from_hf(state_dict: Mapping[str, Any], *, tie_embeddings: bool | None = None) -> dict[str, Any]:
    """The Hub's per-expert keys (or transformers 5's fused ones) -> ours, experts stacked in order."""
    experts: dict[tuple[str, str], dict[int, Any]] = {}
    rest = {}
    for key, value in state_dict.items():
        match = _PER_EXPERT.match(key)
        if match is None:
            rest[key] = value
        else:
            experts.setdefault((match[1], match[3]), {})[int(match[2])] = value
    for (prefix, name), by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise KeyError(f"{prefix}.{name}: experts {sorted(by_index)} are not 0..{len(by_index) - 1}")
        stacked = torch.stack([by_index[e] for e in range(len(by_index))])
        if name == "down_proj":
            rest[f"{prefix}.down_proj"] = stacked
        else:
            rest.setdefault(f"{prefix}.gate_up_proj", {})[name] = stacked
    for key, value in list(rest.items()):
        if isinstance(value, dict):
            if set(value) != {"gate_proj", "up_proj"}:
                raise KeyError(f"{key}: needs both gate_proj and up_proj per expert, got {sorted(value)}")
            rest[key] = torch.cat([value["gate_proj"], value["up_proj"]], dim=1)
    return common.from_hf(rest, tie_embeddings=tie_embeddings, architecture=ARCHITECTURE)


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
