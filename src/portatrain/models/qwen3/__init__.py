"""The Qwen 3 dense family: model (``model.py``), flavours, parallel plan (``parallelize.py``), Hugging
Face mapping (``hf.py``) and memory estimate (``memory.py``), gathered into one
:class:`~portatrain.models.spec.ModelSpec`.

``QWEN3`` is what the registry (``portatrain.models.SPECS``) lists; nothing outside this folder
imports the family's modules to train, checkpoint, export or plan a Qwen 3.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from portatrain.models.qwen3 import hf
from portatrain.models.qwen3.memory import estimate_memory
from portatrain.models.qwen3.model import QWEN3_FLAVORS, Qwen3, Qwen3Args, TransformerBlock
from portatrain.models.spec import HFMapping, ModelSpec


def parallelize(model: nn.Module, parallel_dims: Any, **options: Any) -> nn.Module:
    """:func:`portatrain.models.qwen3.parallelize.parallelize_qwen3`, imported when first used: the
    registry is imported by the config validator, which should not pay for FSDP and tensor parallel."""
    from portatrain.models.qwen3.parallelize import parallelize_qwen3

    return parallelize_qwen3(model, parallel_dims, **options)


QWEN3 = ModelSpec(
    name="qwen3",
    model_cls=Qwen3,
    args_cls=Qwen3Args,
    flavors=QWEN3_FLAVORS,
    parallelize=parallelize,
    hf=HFMapping(
        architecture="Qwen3ForCausalLM",
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        config=hf.hf_config,
        args_from_config=hf.args_from_hf_config,
    ),
    estimate_memory=estimate_memory,
    # Every model.* config key is a Qwen3Args field of the same name (head_dim included).
    config_overrides={},
)

__all__ = ["QWEN3", "QWEN3_FLAVORS", "Qwen3", "Qwen3Args", "TransformerBlock"]
