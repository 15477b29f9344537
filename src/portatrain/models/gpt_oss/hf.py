"""Hugging Face ``GptOssForCausalLM`` interop: keys, the experts' layout, and ``config.json``.

transformers keeps each block's experts as ``mlp.experts.gate_up_proj [E, H, 2I]`` with the gate and
up columns interleaved (gate ``0::2``, up ``1::2``), ``gate_up_proj_bias [E, 2I]`` likewise,
``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``; the router is ``mlp.router``. The shared experts
(``portatrain.models.common.moe``) keep ``gate_up_proj [E, 2I, H]`` as gate rows then up rows and
``down_proj [E, H, I]``, and the router is ``mlp.gate``: :func:`to_hf` and :func:`from_hf` transpose
and (de)interleave, both ways exactly.

The Hub's checkpoints (openai/gpt-oss-20b, -120b) store the experts in MXFP4 (``gate_up_proj_blocks``
and ``_scales``, ``quantization_config.quant_method: mxfp4``); they are refused with the way to
dequantize them first (:data:`DEQUANTIZE`). Configs are dicts in that ``config.json``'s layout
(``rope_scaling`` of type ``yarn`` with ``truncate: false``), which transformers reads as-is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from portatrain.models.common import hf as common
from portatrain.models.common.rope import YarnScaling
from portatrain.models.gpt_oss.model import GptOssArgs

ARCHITECTURE = "GptOssForCausalLM"
DEQUANTIZE = (
    "dequantize it first: GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
    "dtype=torch.bfloat16).save_pretrained(out), then point model.init_from at out"
)
"""The fix for MXFP4 checkpoints (transformers' ``Mxfp4Config``)."""


def _interleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """Halves ``[gate; up]`` along ``dim`` -> interleaved ``gate0, up0, gate1, up1, ...``."""
    gate, up = gate_up.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _deinterleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved columns along ``dim`` -> halves ``[gate; up]``."""
    index = [slice(None)] * gate_up.dim()
    gates, ups = list(index), list(index)
    gates[dim], ups[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat([gate_up[tuple(gates)], gate_up[tuple(ups)]], dim=dim)


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Our keys and expert layout -> transformers'."""
    out = {}
    for key, value in common.to_hf(state_dict).items():
        if key.endswith(".mlp.gate.weight") or key.endswith(".mlp.gate.bias"):
            out[key.replace(".mlp.gate.", ".mlp.router.")] = value
        elif key.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H] halves -> [E, H, 2I] interleaved
            out[key] = _interleave(value, 1).transpose(1, 2)
        elif key.endswith(".mlp.experts.gate_up_proj_bias"):
            out[key] = _interleave(value, 1)
        elif key.endswith(".mlp.experts.down_proj"):  # [E, H, I] -> [E, I, H]
            out[key] = value.transpose(1, 2)
        else:
            out[key] = value
    return out


def from_hf(state_dict: Mapping[str, Any], *, tie_embeddings: bool | None = None) -> dict[str, Any]:
    """transformers' keys and expert layout -> ours; MXFP4 expert weights are a ``ValueError`` with the fix."""
    quantized = sorted(k for k in state_dict if k.endswith(("_blocks", "_scales")))
    if quantized:
        raise ValueError(
            f"{quantized[0]}: MXFP4-quantized expert weights ({len(quantized)} tensors); {DEQUANTIZE}"
        )
    renamed = {}
    for key, value in state_dict.items():
        if key.endswith(".mlp.router.weight") or key.endswith(".mlp.router.bias"):
            renamed[key.replace(".mlp.router.", ".mlp.gate.")] = value
        elif key.endswith(".mlp.experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] halves
            renamed[key] = _deinterleave(value.transpose(1, 2), 1)
        elif key.endswith(".mlp.experts.gate_up_proj_bias"):
            renamed[key] = _deinterleave(value, 1)
        elif key.endswith(".mlp.experts.down_proj"):
            renamed[key] = value.transpose(1, 2)
        else:
            renamed[key] = value
    return common.from_hf(renamed, tie_embeddings=tie_embeddings, architecture=ARCHITECTURE)


def hf_config(args: GptOssArgs, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``GptOssConfig`` dict (``config.json`` content) describing ``args``."""
    scaling = args.rope_scaling
    config = common.decoder_config(
        args, architecture=ARCHITECTURE, model_type="gpt_oss", torch_dtype=torch_dtype
    )
    return {
        **config,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "yarn",
            "factor": float(scaling.factor),
            "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
            "beta_fast": float(scaling.beta_fast),
            "beta_slow": float(scaling.beta_slow),
            "truncate": scaling.truncate,
        },
        "sliding_window": args.sliding_window,
        "layer_types": [
            "sliding_attention" if args.is_sliding(i) else "full_attention" for i in range(args.n_layers)
        ],
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "router_aux_loss_coef": float(args.aux_loss_coef),
        "swiglu_limit": float(args.swiglu_limit),
        "swiglu_alpha": float(args.swiglu_alpha),
        "output_router_logits": False,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> GptOssArgs:
    """Read a ``GptOssConfig`` dict into :class:`GptOssArgs`; ``ValueError`` listing what is not
    implemented (MXFP4 weights, another RoPE scaling or temperature, another layer order)."""
    own = []
    quantization = (config.get("quantization_config") or {}).get("quant_method")
    if quantization:
        own.append(
            f"quantization_config.quant_method={quantization!r}: quantized weights are not trained; {DEQUANTIZE}"
        )
    layers = config["num_hidden_layers"]
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if config.get("layer_types") is not None and list(config["layer_types"]) != expected:
        own.append(
            f"layer_types={config['layer_types']}: only sliding even layers and full odd ones are implemented"
        )
    # ``attention_bias`` is GPT-OSS's own (always on): the shared check would refuse it.
    shared = {k: v for k, v in config.items() if k != "attention_bias"}
    rope, rope_theta, rope_type = common.checked_rope(
        shared,
        family="GPT-OSS",
        model_type="gpt_oss",
        rope_types=("default", "yarn"),
        default_theta=150_000.0,
        problems=tuple(own),
    )
    if rope.get("attention_factor") is not None or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError("unsupported GPT-OSS config:\n  - a YaRN temperature other than 0.1 ln(factor) + 1")
    scaling = None
    if rope_type == "yarn":
        scaling = YarnScaling(
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=1.0,
            mscale_all_dim=0.0,
            truncate=bool(rope.get("truncate", True)),
        )
    return GptOssArgs(
        **common.decoder_args(config, default_max_seq_len=131_072),
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        moe_ffn_dim=config["intermediate_size"],
        n_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.9)),
        sliding_window=config.get("sliding_window") or 128,
        rope_theta=rope_theta,
        rope_scaling=scaling,
    )


__all__ = ["ARCHITECTURE", "DEQUANTIZE", "args_from_hf_config", "from_hf", "hf_config", "to_hf"]
