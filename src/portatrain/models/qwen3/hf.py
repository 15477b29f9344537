"""Hugging Face ``Qwen3ForCausalLM`` interop: state-dict renaming and config translation.

Our module names are HF's minus the ``model.`` prefix (q/k norms included) and our RoPE uses HF's
half-split layout, so weights convert by renaming alone; tensors pass through untouched, DTensors
included. No ``transformers`` import: configs are plain dicts in the layout of the ``config.json``
files the Qwen team publishes (``rope_theta`` at top level, ``rope_scaling: null``), which
transformers 4.51+ reads as-is and 5.x converts to its ``rope_parameters``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portatrain.models.qwen3.model import Qwen3Args

_HF_PREFIX = "model."
_LM_HEAD = "lm_head.weight"
_EMBED = "embed_tokens.weight"


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Rename our keys to ``Qwen3ForCausalLM`` keys.

    A tied model has no ``lm_head.weight`` and none is emitted, as in the Qwen team's own tied
    checkpoints (0.6B-4B); ``from_pretrained`` re-ties it from ``tie_word_embeddings``.
    """
    return {(key if key == _LM_HEAD else _HF_PREFIX + key): value for key, value in state_dict.items()}


def from_hf(state_dict: Mapping[str, Any], *, tie_embeddings: bool | None = None) -> dict[str, Any]:
    """Rename ``Qwen3ForCausalLM`` keys to ours.

    Args:
        state_dict: an HF checkpoint (or ``hf_model.state_dict()``).
        tie_embeddings: the target model's ``args.tie_embeddings``. ``True`` drops ``lm_head.weight``
            (an in-memory HF state dict of a tied model lists the shared matrix twice). ``False``
            keeps it, or copies the embedding when the checkpoint is tied, which unties it.
            ``None`` keeps whatever the checkpoint has.

    Keys that are not Qwen 3 weights raise ``KeyError``; HF's derived RoPE buffers are dropped.
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
        raise KeyError(f"not Qwen3ForCausalLM weights: {sorted(unknown)[:10]} ({len(unknown)} keys)")
    if tie_embeddings:
        out.pop(_LM_HEAD, None)
    elif tie_embeddings is False and _LM_HEAD not in out:
        out[_LM_HEAD] = out[_EMBED].clone()
    return out


def hf_config(args: Qwen3Args, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``Qwen3Config`` dict (``config.json`` content) describing ``args``.

    Tokenizer-specific fields (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) are left to
    the exporter, which knows the tokenizer. ``max_position_embeddings`` is ``args.max_seq_len``.
    """
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "torch_dtype": torch_dtype,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> Qwen3Args:
    """Read a ``Qwen3Config`` dict (``config.json``, or ``Qwen3Config.to_dict()``) into :class:`Qwen3Args`.

    Accepts the Hub layout (``rope_theta``/``rope_scaling``) and transformers 5's
    ``rope_parameters``. Raises ``ValueError`` listing every feature this model does not implement
    (RoPE scaling such as YaRN, sliding-window layers, biases, another activation), and when the
    config is not a Qwen 3 one.
    """
    model_type = config.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise ValueError(f"model_type={model_type!r} is not a Qwen 3 dense config (expected 'qwen3')")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))

    problems = []
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r}: only plain RoPE ('default') is implemented")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}: only 'silu' (SwiGLU) is implemented")
    if config.get("attention_bias"):
        problems.append("attention_bias=True: biases are not implemented")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window=True: sliding-window attention is not implemented")
    if problems:
        raise ValueError("unsupported Qwen3 config:\n  - " + "\n  - ".join(problems))

    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return Qwen3Args(
        dim=hidden,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_seq_len=config.get("max_position_embeddings", 40960),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
