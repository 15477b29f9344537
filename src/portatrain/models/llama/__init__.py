"""Llama 3 family: model, flavours, and (in ``hf.py``, imported on demand) the Hugging Face adapter."""

from portatrain.models.llama.model import (
    LLAMA3_FLAVORS,
    Llama,
    LlamaArgs,
    RopeScaling,
    TransformerBlock,
)

__all__ = ["LLAMA3_FLAVORS", "Llama", "LlamaArgs", "RopeScaling", "TransformerBlock"]
