"""Hugging Face ``Gemma3ForCausalLM`` config translation (key renaming is shared: ``models/common/hf.py``).

Configs are written in the layout of google/gemma-3-1b-pt's ``config.json`` (``rope_theta``,
``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern`` at top level), which
transformers 4.50+ reads as-is; transformers 5's per-layer-type ``rope_parameters`` and its explicit
``layer_types`` are read too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portatrain.models.common import hf as common
from portatrain.models.common.hf import to_hf
from portatrain.models.common.rope import LinearScaling
from portatrain.models.gemma3.model import Gemma3Args

ARCHITECTURE = "Gemma3ForCausalLM"
from_hf = common.from_hf_for(ARCHITECTURE)


def hf_config(args: Gemma3Args, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``Gemma3TextConfig`` dict (``config.json`` content) describing ``args``."""
    config = common.decoder_config(
        args, architecture=ARCHITECTURE, model_type="gemma3_text", torch_dtype=torch_dtype
    )
    del config["hidden_act"]  # Gemma's key is hidden_activation
    scaling = args.rope_scaling
    return {
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": args.query_pre_attn_scalar,
        "sliding_window": args.sliding_window,
        "sliding_window_pattern": args.sliding_window_pattern,
        "layer_types": [
            "sliding_attention" if args.is_sliding(i) else "full_attention" for i in range(args.n_layers)
        ],
        "rope_local_base_freq": float(args.rope_local_theta),
        "rope_scaling": None if scaling is None else {"rope_type": "linear", "factor": float(scaling.factor)},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _rope(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(global, local)`` RoPE parameters from either layout (Hub 4.x or transformers 5)."""
    nested = config.get("rope_parameters") or {}
    if "full_attention" in nested:
        return dict(nested["full_attention"] or {}), dict(nested.get("sliding_attention") or {})
    full = dict(config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    return full, {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}


def args_from_hf_config(config: Mapping[str, Any]) -> Gemma3Args:
    """Read a ``Gemma3TextConfig`` dict into :class:`Gemma3Args`.

    Raises ``ValueError`` listing every feature this model does not implement (logit soft-capping,
    bidirectional attention, biases, another activation or RoPE type, a layer order other than
    every ``sliding_window_pattern``-th layer global), and when the config is not a Gemma 3 text one.
    """
    found = config.get("model_type", "gemma3_text")
    if found != "gemma3_text":
        raise ValueError(
            f"model_type={found!r} is not a Gemma 3 text config (expected 'gemma3_text'; for a multimodal "
            "'gemma3' checkpoint, its text_config describes the language model)"
        )
    full, local = _rope(config)
    full_type, local_type = (
        full.get("rope_type", full.get("type", "default")),
        local.get("rope_type", "default"),
    )
    problems = []
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            problems.append(f"{key}={config[key]}: logit soft-capping is not implemented")
    if config.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True: only causal attention is implemented")
    if config.get("attention_bias"):
        problems.append("attention_bias=True: biases are not implemented")
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        problems.append(
            f"hidden_activation={config['hidden_activation']!r}: only 'gelu_pytorch_tanh' is implemented"
        )
    if full_type not in ("default", "linear"):
        problems.append(f"global rope_type={full_type!r}: only 'default' and 'linear' are implemented")
    if local_type != "default":
        problems.append(f"local rope_type={local_type!r}: only 'default' is implemented")
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    layers = config["num_hidden_layers"]
    expected = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if config.get("layer_types") is not None and list(config["layer_types"]) != expected:
        problems.append(
            f"layer_types={config['layer_types']}: only every sliding_window_pattern-th ({pattern}) layer global "
            "is implemented"
        )
    if problems:
        raise ValueError("unsupported Gemma 3 config:\n  - " + "\n  - ".join(problems))
    heads = config["num_attention_heads"]
    return Gemma3Args(
        **common.decoder_args(config, default_max_seq_len=131_072),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_dim=config["intermediate_size"],
        query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256),
        sliding_window=config.get("sliding_window") or 4096,
        sliding_window_pattern=pattern,
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        rope_scaling=LinearScaling(float(full["factor"])) if full_type == "linear" else None,
    )


__all__ = ["ARCHITECTURE", "args_from_hf_config", "from_hf", "hf_config", "to_hf"]
