"""The Llama 3 family: arguments and flavours (``model.py``) and Hugging Face config (``hf.py``); the
rest is the shared decoder (``portatrain.models.common``).

``LLAMA3`` is what the registry (``portatrain.models.SPECS``) lists; nothing outside this folder
imports the family's modules to train, checkpoint, export or plan a Llama.
"""

from __future__ import annotations

from portatrain.models.common import decoder_spec
from portatrain.models.llama import hf
from portatrain.models.llama.model import (
    LLAMA3_FLAVORS,
    LLAMA3_PUBLISHED_PARAMS,
    Llama,
    LlamaArgs,
    RopeScaling,
    TransformerBlock,
)

LLAMA3 = decoder_spec(
    "llama3",
    Llama,
    LlamaArgs,
    LLAMA3_FLAVORS,
    hf,
    published_params=LLAMA3_PUBLISHED_PARAMS,
    # head_dim is not settable: Llama derives it as dim / n_heads.
    config_overrides={
        "dim": "dim",
        "n_layers": "n_layers",
        "n_heads": "n_heads",
        "n_kv_heads": "n_kv_heads",
        "ffn_dim": "ffn_hidden_dim",
        "rope_theta": "rope_theta",
        "norm_eps": "norm_eps",
        "tie_embeddings": "tie_embeddings",
        "vocab_size": "vocab_size",
        "max_seq_len": "max_seq_len",
    },
)

__all__ = ["LLAMA3", "LLAMA3_FLAVORS", "Llama", "LlamaArgs", "RopeScaling", "TransformerBlock"]
