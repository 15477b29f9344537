"""The Qwen 3 mixture-of-experts family: Qwen 3 with the shared MoE layer (``model.py``) and the
per-expert Hugging Face mapping (``hf.py``). ``QWEN3_MOE`` is what the registry lists."""

from __future__ import annotations

from portatrain.models.common import decoder_spec
from portatrain.models.qwen3_moe import hf
from portatrain.models.qwen3_moe.model import (
    QWEN3_MOE_FLAVORS,
    QWEN3_MOE_PUBLISHED_PARAMS,
    Qwen3Moe,
    Qwen3MoeArgs,
)

QWEN3_MOE = decoder_spec(
    "qwen3_moe", Qwen3Moe, Qwen3MoeArgs, QWEN3_MOE_FLAVORS, hf, published_params=QWEN3_MOE_PUBLISHED_PARAMS
)

__all__ = ["QWEN3_MOE", "QWEN3_MOE_FLAVORS", "Qwen3Moe", "Qwen3MoeArgs"]
