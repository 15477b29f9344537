"""Hugging Face ``transformers`` interop shared by the families: key renaming and config pieces.

Every family's module names are HF's minus the ``model.`` prefix and its RoPE uses HF's half-split
layout, so weights convert by renaming alone (tensors pass through untouched, DTensors included). No
``transformers`` import: configs are plain dicts in the layout of the ``config.json`` files the
model authors publish, which transformers 4.x reads as-is and 5.x converts (``rope_theta`` into
``rope_parameters``). A family's ``hf.py`` keeps only its own config keys.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

_HF_PREFIX = "model."
_LM_HEAD = "lm_head.weight"
_EMBED = "embed_tokens.weight"


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Rename our keys to ``<Family>ForCausalLM`` keys.

    A tied model has no ``lm_head.weight``, and none is emitted: HF's own checkpoints of tied
    models (Llama 3.2 1B/3B, Qwen 3 0.6B-4B) omit it too, and ``from_pretrained`` re-ties it from
    ``tie_word_embeddings``. To load into an instantiated HF model use ``strict=False``; the only
    missing key is then ``lm_head.weight``, already tied to the embedding.
    """
    return {(key if key == _LM_HEAD else _HF_PREFIX + key): value for key, value in state_dict.items()}


def from_hf(
    state_dict: Mapping[str, Any], *, tie_embeddings: bool | None = None, architecture: str = "the model's"
) -> dict[str, Any]:
    """Rename ``<Family>ForCausalLM`` keys to ours.

    Args:
        state_dict: an HF checkpoint (or ``hf_model.state_dict()``).
        tie_embeddings: the target model's ``args.tie_embeddings``. ``True`` drops ``lm_head.weight``
            (an in-memory HF state dict of a tied model lists the shared matrix twice). ``False``
            keeps it, or copies the embedding when the checkpoint is tied, which unties it.
            ``None`` keeps whatever the checkpoint has.
        architecture: named in the error for keys that are not this family's weights.

    Keys outside ``model.`` and ``lm_head.weight`` raise ``KeyError``; HF's derived RoPE buffers
    (``rotary_emb.inv_freq``, in some older checkpoints) are dropped.
    """
    out: dict[str, Any] = {}
    unknown = []
    for key, value in state_dict.items():
        if key == _LM_HEAD:
            out[key] = value
        elif key.startswith(_HF_PREFIX):
            if "rotary_emb." not in key:
                out[key.removeprefix(_HF_PREFIX)] = value
        else:
            unknown.append(key)
    if unknown:
        raise KeyError(f"not {architecture} weights: {sorted(unknown)[:10]} ({len(unknown)} keys)")
    if tie_embeddings:
        out.pop(_LM_HEAD, None)
    elif tie_embeddings is False and _LM_HEAD not in out:
        out[_LM_HEAD] = out[_EMBED].clone()
    return out


def from_hf_for(architecture: str) -> Callable[..., dict[str, Any]]:
    """:func:`from_hf` whose errors name ``architecture`` (a family's ``HFMapping.from_hf``)."""
    return functools.partial(from_hf, architecture=architecture)


def decoder_config(args: Any, *, architecture: str, model_type: str, torch_dtype: str) -> dict[str, Any]:
    """The ``config.json`` keys every decoder family writes (a family adds its own).

    Tokenizer-specific fields (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) are left to
    the exporter, which knows the tokenizer. ``max_position_embeddings`` is ``args.max_seq_len``.
    """
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "torch_dtype": torch_dtype,
    }


def rope_parameters(config: Mapping[str, Any], default_theta: float) -> tuple[dict[str, Any], float, str]:
    """``(rope dict, rope_theta, rope_type)`` from the Hub layout (``rope_theta``/``rope_scaling``) or
    transformers 5's ``rope_parameters``."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", default_theta)))
    return rope, theta, rope.get("rope_type", rope.get("type", "default"))


def decoder_config_problems(config: Mapping[str, Any], *, rope_types: tuple[str, ...]) -> list[str]:
    """Features of an HF config that no shared part implements (each one line)."""
    problems = []
    rope_type = rope_parameters(config, 10000.0)[2]
    if rope_type not in rope_types:
        problems.append(f"rope_type={rope_type!r}: only {', '.join(map(repr, rope_types))} implemented")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}: only 'silu' (SwiGLU) is implemented")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            problems.append(f"{key}=True: biases are not implemented")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window=True: sliding-window attention is not implemented")
    return problems


def checked_rope(
    config: Mapping[str, Any],
    *,
    family: str,
    model_type: str | None,
    rope_types: tuple[str, ...],
    default_theta: float,
    problems: tuple[str, ...] = (),
) -> tuple[dict[str, Any], float, str]:
    """:func:`rope_parameters` of a config this family can load, else ``ValueError`` listing every
    unsupported feature (:func:`decoder_config_problems` plus the family's own ``problems``).

    ``model_type``: the config's expected ``model_type`` (None: not checked); a mismatch is an error.
    """
    found = config.get("model_type", model_type)
    if model_type is not None and found != model_type:
        raise ValueError(f"model_type={found!r} is not a {family} config (expected {model_type!r})")
    unsupported = [*decoder_config_problems(config, rope_types=rope_types), *problems]
    if unsupported:
        raise ValueError(f"unsupported {family} config:\n  - " + "\n  - ".join(unsupported))
    return rope_parameters(config, default_theta)


def decoder_args(config: Mapping[str, Any], *, default_max_seq_len: int) -> dict[str, Any]:
    """The shared arguments read off an HF config (``model.*`` names); a family adds its own."""
    heads = config["num_attention_heads"]
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "max_seq_len": config.get("max_position_embeddings", default_max_seq_len),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


# Mixtures of experts: the Hub's checkpoints (Qwen 3 MoE, DeepSeek-V3) hold one tensor per expert
# (``mlp.experts.<e>.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj`` ``[H, I]``); transformers
# 5 fuses them on load into ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` -- the
# layout our experts keep. :func:`experts_to_hf` writes the Hub's per-expert form, which transformers
# 4 and 5 both load; :func:`experts_from_hf` reads either form.

_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def experts_to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Each stacked expert tensor split into one tensor per expert (other keys untouched)."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
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


def experts_from_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Per-expert tensors stacked in expert order (fused ones and other keys untouched)."""
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
    return rest
