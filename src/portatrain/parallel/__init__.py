"""Parallelism: the layout (:class:`ParallelDims`), its ``DeviceMesh``, and the glue that applies a
model family's ``parallelize.py`` from the config.

Stage order (see STYLE.md): parallel dims + mesh -> model on meta -> :func:`parallelize_model`
(TP -> activation checkpointing -> compile -> FSDP2) -> ``to_empty`` -> init under
:func:`full_tensor_init`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from portatrain.parallel.parallel_dims import ParallelDims, expected_world_size
from portatrain.parallel.utils import clip_grad_norm_, dp_all_reduce, full_tensor_init

__all__ = [
    "PARALLELIZERS",
    "ParallelDims",
    "clip_grad_norm_",
    "dp_all_reduce",
    "expected_world_size",
    "full_tensor_init",
    "parallelize_model",
]

PARALLELIZERS: dict[str, str] = {"llama3": "portatrain.models.llama.parallelize:parallelize_llama"}
"""Model family -> ``module:function`` applying its parallel plan (imported when used)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_model(
    model: nn.Module,
    cfg: Any,
    parallel_dims: ParallelDims,
    *,
    accelerator: Any,
    compute_dtype: torch.dtype,
) -> nn.Module:
    """Apply the model family's plan with the settings of ``cfg.parallel`` and ``cfg.compile``.

    FSDP2's parameter dtype defaults to the run's compute dtype (``trainer.dtype``: bf16 on
    accelerators, fp32 on CPU); ``parallel.param_dtype`` overrides it. Gradients are reduced in
    ``parallel.reduce_dtype`` (fp32 by default).
    """
    module_name, fn_name = PARALLELIZERS[cfg.model.name].split(":")
    parallelize = getattr(importlib.import_module(module_name), fn_name)
    par = cfg.parallel
    return parallelize(
        model,
        parallel_dims,
        activation_checkpointing=par.activation_checkpointing,
        compile_cfg=cfg.compile,
        accelerator=accelerator,
        param_dtype=_DTYPES[par.param_dtype] if par.param_dtype else compute_dtype,
        reduce_dtype=_DTYPES[par.reduce_dtype],
    )
