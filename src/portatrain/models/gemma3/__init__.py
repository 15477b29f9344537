"""The Gemma 3 text family: arguments and flavours (``model.py``) and Hugging Face config (``hf.py``);
the rest is the shared decoder (``portatrain.models.common``) with sliding-window layers, two RoPE
bases, per-head q/k norms and a norm on each side of every sub-layer. ``GEMMA3`` is what the registry
lists."""

from __future__ import annotations

from portatrain.models.common import decoder_spec
from portatrain.models.gemma3 import hf
from portatrain.models.gemma3.model import GEMMA3_FLAVORS, GEMMA3_PUBLISHED_PARAMS, Gemma3, Gemma3Args

# Every model.* config key is a Gemma3Args field of the same name (head_dim, sliding_window included).
GEMMA3 = decoder_spec(
    "gemma3", Gemma3, Gemma3Args, GEMMA3_FLAVORS, hf, published_params=GEMMA3_PUBLISHED_PARAMS
)

__all__ = ["GEMMA3", "GEMMA3_FLAVORS", "Gemma3", "Gemma3Args"]
