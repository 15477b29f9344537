"""Hugging Face ``Olmo2ForCausalLM`` config translation (key renaming is shared: ``models/common/hf.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portatrain.models.common import hf as common
from portatrain.models.common.hf import to_hf
from portatrain.models.olmo2.model import Olmo2Args

ARCHITECTURE = "Olmo2ForCausalLM"
from_hf = common.from_hf_for(ARCHITECTURE)


def hf_config(args: Olmo2Args, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """An ``Olmo2Config`` dict (``config.json`` content) describing ``args``."""
    config = common.decoder_config(
        args, architecture=ARCHITECTURE, model_type="olmo2", torch_dtype=torch_dtype
    )
    return {**config, "attention_dropout": 0.0, "rope_scaling": None}


def args_from_hf_config(config: Mapping[str, Any]) -> Olmo2Args:
    """Read an ``Olmo2Config`` dict into :class:`Olmo2Args`; ``ValueError`` lists what is not implemented."""
    _, rope_theta, _ = common.checked_rope(
        config, family="OLMo 2", model_type="olmo2", rope_types=("default",), default_theta=10000.0
    )
    return Olmo2Args(
        **common.decoder_args(config, default_max_seq_len=4096),
        ffn_dim=config["intermediate_size"],
        rope_theta=rope_theta,
    )


__all__ = ["ARCHITECTURE", "args_from_hf_config", "from_hf", "hf_config", "to_hf"]
