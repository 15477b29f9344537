"""Hugging Face ``DeepseekV3ForCausalLM`` interop: keys (experts per expert on the Hub, stacked here)
and ``config.json``.

Configs are dicts in the layout of deepseek-ai/DeepSeek-V3's ``config.json`` (``rope_theta`` and a
``rope_scaling`` of type ``yarn`` at top level), which transformers 5 reads as-is. The routing bias
(``mlp.gate.e_score_correction_bias``) is a tensor of the checkpoint both ways.

Multi-token prediction: the published checkpoint stores its one depth as the layer after the main
model's (``model.layers.61``, ``num_nextn_predict_layers: 1``): the block's own keys, ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, and copies of the embedding and the output head
(``embed_tokens``, ``shared_head.head``), which vLLM and SGLang read. Depth ``k`` here is
``mtp.layers.<k>`` (``.block.*`` the block, ``.norm`` the depth's final norm); both directions rename
between the two, and the copies are written out and dropped on the way in (the model shares the
main embedding and head). A model without depths never asks for layer 61, so it loads the published
checkpoint as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portatrain.models.common import hf as common
from portatrain.models.common.rope import YarnScaling
from portatrain.models.deepseek_v3.model import DeepseekV3Args

ARCHITECTURE = "DeepseekV3ForCausalLM"


_MTP_OWN = ("enorm", "hnorm", "eh_proj")  # a depth's keys outside its block, under both names
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the shared weights, repeated per depth


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Our keys -> the Hub's, each stacked expert tensor split into one tensor per expert; multi-token
    prediction's depths as the layers after the main model's, with their copies of the shared weights."""
    ours = dict(state_dict)
    depths = {key.removeprefix("mtp.layers."): ours.pop(key) for key in list(ours) if key.startswith("mtp.")}
    n_layers = 1 + max((int(key.split(".")[1]) for key in ours if key.startswith("layers.")), default=-1)
    embed = ours.get("embed_tokens.weight")
    head = ours.get("lm_head.weight", embed)
    for key, value in depths.items():
        k, rest = key.split(".", 1)
        layer = f"layers.{n_layers + int(k)}"
        if rest.startswith("block."):
            ours[f"{layer}.{rest.removeprefix('block.')}"] = value
        elif rest.startswith("norm."):
            ours[f"{layer}.shared_head.{rest}"] = value
        else:
            ours[f"{layer}.{rest}"] = value
        if rest == "enorm.weight" and embed is not None:
            # Copies, not the same tensors: safetensors refuses to write one storage under two names.
            ours.update({f"{layer}.{name}": w.clone() for name, w in zip(_MTP_COPIES, (embed, head))})
    return common.experts_to_hf(common.to_hf(ours))


def from_hf(state_dict: Mapping[str, Any], *, tie_embeddings: bool | None = None) -> dict[str, Any]:
    """The Hub's per-expert keys (or transformers 5's fused ones) -> ours, experts stacked in order;
    layers holding an ``eh_proj`` (and those after them) are multi-token prediction's depths."""
    theirs = dict(state_dict)
    depth_layers = [
        int(k.split(".")[2]) for k in theirs if k.startswith("model.layers.") and ".eh_proj." in k
    ]
    if depth_layers:
        first = min(depth_layers)
        for key in [k for k in theirs if k.startswith("model.layers.") and int(k.split(".")[2]) >= first]:
            value = theirs.pop(key)
            _, _, index, rest = key.split(".", 3)
            if rest in _MTP_COPIES:
                continue
            depth = f"model.mtp.layers.{int(index) - first}"
            if rest.startswith("shared_head."):
                theirs[f"{depth}.{rest.removeprefix('shared_head.')}"] = value
            elif rest.split(".")[0] in _MTP_OWN:
                theirs[f"{depth}.{rest}"] = value
            else:
                theirs[f"{depth}.block.{rest}"] = value
    return common.from_hf(
        common.experts_from_hf(theirs), tie_embeddings=tie_embeddings, architecture=ARCHITECTURE
    )


def hf_config(args: DeepseekV3Args, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``DeepseekV3Config`` dict (``config.json`` content) describing ``args``."""
    scaling = args.rope_scaling
    return {
        **common.decoder_config(
            args, architecture=ARCHITECTURE, model_type="deepseek_v3", torch_dtype=torch_dtype
        ),
        "head_dim": args.qk_rope_head_dim,  # transformers' convention (it overwrites the key so)
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": args.rope_interleave,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "yarn",
            "factor": float(scaling.factor),
            "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
            "beta_fast": float(scaling.beta_fast),
            "beta_slow": float(scaling.beta_slow),
            "mscale": float(scaling.mscale),
            "mscale_all_dim": float(scaling.mscale_all_dim),
        },
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "n_shared_experts": args.n_shared_experts,
        "first_k_dense_replace": args.first_k_dense_replace,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "routed_scaling_factor": float(args.routed_scaling_factor),
        "norm_topk_prob": args.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": args.mtp_layers,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> DeepseekV3Args:
    """Read a ``DeepseekV3Config`` dict into :class:`DeepseekV3Args`; ``ValueError`` listing what is not
    implemented (softmax scoring, another RoPE scaling, biases) or when it is not a DeepSeek-V3 config."""
    own = []
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        own.append(f"scoring_func={config['scoring_func']!r}: only 'sigmoid' (DeepSeek-V3's) is implemented")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        own.append(f"topk_method={config['topk_method']!r}: only 'noaux_tc' (DeepSeek-V3's) is implemented")
    if config.get("moe_layer_freq", 1) != 1:
        own.append(
            f"moe_layer_freq={config['moe_layer_freq']}: only 1 (every block after the dense ones) is implemented"
        )
    rope, rope_theta, rope_type = common.checked_rope(
        config,
        family="DeepseekV3",
        model_type="deepseek_v3",
        rope_types=("default", "yarn"),
        default_theta=10000.0,
        problems=tuple(own),
    )
    scaling = None
    if rope_type == "yarn":
        # transformers: without ``mscale_all_dim`` neither temperature coefficient is read.
        mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
        scaling = YarnScaling(
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=float(rope.get("mscale") or 1.0) if mscale_all_dim else 1.0,
            mscale_all_dim=mscale_all_dim,
        )
    return DeepseekV3Args(
        **common.decoder_args(config, default_max_seq_len=163840),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        ffn_dim=config["intermediate_size"],
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        rope_interleave=bool(config.get("rope_interleave", True)),
        n_experts=config["n_routed_experts"] if "n_routed_experts" in config else config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        moe_ffn_dim=config["moe_intermediate_size"],
        n_shared_experts=config.get("n_shared_experts") or 0,
        first_k_dense_replace=config.get("first_k_dense_replace") or 0,
        n_group=config.get("n_group") or 1,
        topk_group=config.get("topk_group") or 1,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        # num_nextn_predict_layers is not read: the depths are opt-in (model.mtp_layers), as the
        # flavours are the main model; init_from reads layer 61 when the model has a depth.
    )


__all__ = ["ARCHITECTURE", "args_from_hf_config", "from_hf", "hf_config", "to_hf"]
