"""Hugging Face ``LlamaForCausalLM`` interop: state-dict renaming and config translation.

Our module names are HF's minus the ``model.`` prefix and our RoPE uses HF's half-split layout,
so weights convert by renaming alone (tensors pass through untouched, DTensors included). This
file needs no ``transformers`` import: configs are plain dicts, in the layout of the
``config.json`` files Meta publishes on the Hub (``rope_theta`` + ``rope_scaling`` at top level),
which transformers 4.x reads as-is and 5.x converts to its ``rope_parameters``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portatrain.models.llama.model import LlamaArgs, RopeScaling

_HF_PREFIX = "model."
_LM_HEAD = "lm_head.weight"
_EMBED = "embed_tokens.weight"


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Rename our keys to ``LlamaForCausalLM`` keys.

    A tied model has no ``lm_head.weight``, and none is emitted: HF's own checkpoints of tied
    models (Llama 3.2 1B/3B) omit it too, and ``from_pretrained`` re-ties it from
    ``tie_word_embeddings``. To load into an instantiated HF model use ``strict=False``; the only
    missing key is then ``lm_head.weight``, already tied to the embedding.
    """
    return {(key if key == _LM_HEAD else _HF_PREFIX + key): value for key, value in state_dict.items()}


def from_hf(state_dict: Mapping[str, Any], *, tie_embeddings: bool | None = None) -> dict[str, Any]:
    """Rename ``LlamaForCausalLM`` keys to ours.

    Args:
        state_dict: an HF checkpoint (or ``hf_model.state_dict()``).
        tie_embeddings: the target model's ``args.tie_embeddings``. ``True`` drops ``lm_head.weight``
            (an in-memory HF state dict of a tied model lists the shared matrix twice). ``False``
            keeps it, or copies the embedding when the checkpoint is tied, which unties it.
            ``None`` keeps whatever the checkpoint has.

    Keys that are not Llama weights raise ``KeyError``; HF's derived RoPE buffers
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
        raise KeyError(f"not LlamaForCausalLM weights: {sorted(unknown)[:10]} ({len(unknown)} keys)")
    if tie_embeddings:
        out.pop(_LM_HEAD, None)
    elif tie_embeddings is False and _LM_HEAD not in out:
        out[_LM_HEAD] = out[_EMBED].clone()
    return out


def hf_config(args: LlamaArgs, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``LlamaConfig`` dict (``config.json`` content) describing ``args``.

    Tokenizer-specific fields (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) are left to
    the exporter, which knows the tokenizer. ``max_position_embeddings`` is ``args.max_seq_len``.
    """
    rope_scaling = None
    if args.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(args.rope_scaling.factor),
            "low_freq_factor": float(args.rope_scaling.low_freq_factor),
            "high_freq_factor": float(args.rope_scaling.high_freq_factor),
            "original_max_position_embeddings": int(args.rope_scaling.original_max_position_embeddings),
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": rope_scaling,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "torch_dtype": torch_dtype,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> LlamaArgs:
    """Read a ``LlamaConfig`` dict (``config.json``, or ``LlamaConfig.to_dict()``) into :class:`LlamaArgs`.

    Accepts the Hub layout (``rope_theta``/``rope_scaling``) and transformers 5's
    ``rope_parameters``. Raises ``ValueError`` listing every feature this model does not implement.
    """
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]

    problems = []
    if rope_type not in ("default", "llama3"):
        problems.append(f"rope_type={rope_type!r}: only 'default' and 'llama3' are implemented")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}: only 'silu' (SwiGLU) is implemented")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            problems.append(f"{key}=True: biases are not implemented")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        problems.append(f"head_dim={head_dim} != hidden_size/num_attention_heads = {hidden // heads}")
    if problems:
        raise ValueError("unsupported Llama config:\n  - " + "\n  - ".join(problems))

    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    return LlamaArgs(
        dim=hidden,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
