"""The Llama 3 family: model (``model.py``), flavours, parallel plan (``parallelize.py``), Hugging Face
mapping (``hf.py``) and memory estimate, gathered into one :class:`~portatrain.models.spec.ModelSpec`.

``LLAMA3`` is what the registry (``portatrain.models.SPECS``) lists; nothing outside this folder
imports the family's modules to train, checkpoint, export or plan a Llama.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from portatrain.models.llama import hf
from portatrain.models.llama.model import (
    LLAMA3_FLAVORS,
    Llama,
    LlamaArgs,
    RopeScaling,
    TransformerBlock,
)
from portatrain.models.memory import estimate_memory
from portatrain.models.spec import HFMapping, ModelSpec

if TYPE_CHECKING:
    from portatrain.parallel.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, **options: Any) -> nn.Module:
    """:func:`portatrain.models.llama.parallelize.parallelize_llama`, imported when first used: the
    registry is imported by the config validator, which should not pay for FSDP and tensor parallel."""
    from portatrain.models.llama.parallelize import parallelize_llama

    return parallelize_llama(model, parallel_dims, **options)


LLAMA3 = ModelSpec(
    name="llama3",
    model_cls=Llama,
    args_cls=LlamaArgs,
    flavors=LLAMA3_FLAVORS,
    parallelize=parallelize,
    hf=HFMapping(
        architecture="LlamaForCausalLM",
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        config=hf.hf_config,
        args_from_config=hf.args_from_hf_config,
    ),
    estimate_memory=estimate_memory,
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
