"""The Qwen 3 dense family: arguments and flavours (``model.py``) and Hugging Face config (``hf.py``);
the rest is the shared decoder (``portatrain.models.common``) with per-head q/k norms.

``QWEN3`` is what the registry (``portatrain.models.SPECS``) lists; nothing outside this folder
imports the family's modules to train, checkpoint, export or plan a Qwen 3.
"""

from __future__ import annotations

from portatrain.models.common import decoder_spec
from portatrain.models.qwen3 import hf
from portatrain.models.qwen3.model import (
    QWEN3_FLAVORS,
    QWEN3_PUBLISHED_PARAMS,
    Qwen3,
    Qwen3Args,
    TransformerBlock,
)

# Every model.* config key is a Qwen3Args field of the same name (head_dim included).
QWEN3 = decoder_spec("qwen3", Qwen3, Qwen3Args, QWEN3_FLAVORS, hf, published_params=QWEN3_PUBLISHED_PARAMS)

__all__ = ["QWEN3", "QWEN3_FLAVORS", "Qwen3", "Qwen3Args", "TransformerBlock"]
