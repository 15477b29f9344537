"""Hugging Face ``LlamaForCausalLM`` config translation (key renaming is shared: ``models/common/hf.py``).

Configs are plain dicts in the layout of the ``config.json`` files Meta publishes on the Hub
(``rope_theta`` + ``rope_scaling`` at top level).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portatrain.models.common import hf as common
from portatrain.models.common.hf import to_hf
from portatrain.models.llama.model import LlamaArgs, RopeScaling

ARCHITECTURE = "LlamaForCausalLM"
from_hf = common.from_hf_for(ARCHITECTURE)


def hf_config(args: LlamaArgs, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``LlamaConfig`` dict (``config.json`` content) describing ``args``."""
    rope_scaling = None
    if args.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(args.rope_scaling.factor),
            "low_freq_factor": float(args.rope_scaling.low_freq_factor),
            "high_freq_factor": float(args.rope_scaling.high_freq_factor),
            "original_max_position_embeddings": int(args.rope_scaling.original_max_position_embeddings),
        }
    config = common.decoder_config(
        args, architecture=ARCHITECTURE, model_type="llama", torch_dtype=torch_dtype
    )
    if rope_scaling is not None and rope_scaling["original_max_position_embeddings"] >= args.max_seq_len:
        # A model trained on rows shorter than Llama 3.1's pre-scaling context (the debug flavour: 512
        # of 8192). transformers warns on every load unless original_max_position_embeddings <
        # max_position_embeddings; the field only sizes tables there (the llama3 frequencies come from
        # rope_scaling alone) and model.init_from does not compare it, so state the context the scaled
        # frequencies were made for.
        scaled = int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"])
        config["max_position_embeddings"] = max(scaled, rope_scaling["original_max_position_embeddings"] + 1)
    return {**config, "mlp_bias": False, "rope_scaling": rope_scaling}


def args_from_hf_config(config: Mapping[str, Any]) -> LlamaArgs:
    """Read a ``LlamaConfig`` dict (``config.json``, or ``LlamaConfig.to_dict()``) into :class:`LlamaArgs`.

    Raises ``ValueError`` listing every feature this model does not implement.
    """
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    problems = ()
    if head_dim is not None and head_dim != hidden // heads:
        problems = (f"head_dim={head_dim} != hidden_size/num_attention_heads = {hidden // heads}",)
    rope, rope_theta, rope_type = common.checked_rope(
        config,
        family="Llama",
        model_type=None,
        rope_types=("default", "llama3"),
        default_theta=10000.0,
        problems=problems,
    )

    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    return LlamaArgs(
        **common.decoder_args(config, default_max_seq_len=2048),
        ffn_hidden_dim=config["intermediate_size"],
        rope_theta=rope_theta,
        rope_scaling=scaling,
    )


__all__ = ["ARCHITECTURE", "args_from_hf_config", "from_hf", "hf_config", "to_hf"]
