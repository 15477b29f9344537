"""Hugging Face ``Qwen3ForCausalLM`` config translation (key renaming is shared: ``models/common/hf.py``).

Configs are plain dicts in the layout of the ``config.json`` files the Qwen team publishes
(``rope_theta`` at top level, ``rope_scaling: null``), which transformers 4.51+ reads as-is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portatrain.models.common import hf as common
from portatrain.models.common.hf import to_hf
from portatrain.models.qwen3.model import Qwen3Args

ARCHITECTURE = "Qwen3ForCausalLM"
from_hf = common.from_hf_for(ARCHITECTURE)


def hf_config(args: Qwen3Args, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``Qwen3Config`` dict (``config.json`` content) describing ``args``."""
    config = common.decoder_config(
        args, architecture=ARCHITECTURE, model_type="qwen3", torch_dtype=torch_dtype
    )
    return {
        **config,
        "attention_dropout": 0.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> Qwen3Args:
    """Read a ``Qwen3Config`` dict (``config.json``, or ``Qwen3Config.to_dict()``) into :class:`Qwen3Args`.

    Raises ``ValueError`` listing every feature this model does not implement (RoPE scaling such as
    YaRN, sliding-window layers, biases, another activation), and when the config is not a Qwen 3 one.
    """
    _, rope_theta, _ = common.checked_rope(
        config, family="Qwen3", model_type="qwen3", rope_types=("default",), default_theta=1_000_000.0
    )
    return Qwen3Args(
        **common.decoder_args(config, default_max_seq_len=40960),
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        ffn_dim=config["intermediate_size"],
        rope_theta=rope_theta,
    )


__all__ = ["ARCHITECTURE", "args_from_hf_config", "from_hf", "hf_config", "to_hf"]
