"""Parallelism: the layout (:class:`ParallelDims`), its ``DeviceMesh``, and the glue that applies a
model family's parallel plan (its ``ModelSpec.parallelize``) with the config's settings.

Stage order, as torchtitan applies it (``torchtitan/models/llama3/parallelize.py`` in
https://github.com/pytorch/torchtitan): parallel dims + mesh -> model on meta ->
:func:`parallelize_model` (TP -> activation checkpointing -> compile -> FSDP2) -> ``to_empty`` ->
init under :func:`full_tensor_init`.

This package sits below the models: a family's ``parallelize.py`` imports its helpers, and it
imports no model family; the caller hands it the family's plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from portatrain.config import ParallelConfig
from portatrain.dtypes import dtype_from_name
from portatrain.parallel.parallel_dims import ParallelDims, expected_world_size
from portatrain.parallel.pipeline import build_pipeline
from portatrain.parallel.utils import (
    clip_grad_norm_,
    dp_all_reduce,
    full_tensor_init,
    token_all_max,
    token_all_reduce,
)

__all__ = [
    "ParallelDims",
    "build_pipeline",
    "clip_grad_norm_",
    "dp_all_reduce",
    "expected_world_size",
    "full_tensor_init",
    "parallelize_model",
    "token_all_max",
    "token_all_reduce",
]


def parallelize_model(
    model: nn.Module,
    parallelize: Callable[..., nn.Module],
    parallel_dims: ParallelDims,
    parallel_cfg: ParallelConfig,
    *,
    compile_block: Callable[[nn.Module], nn.Module] | None,
    compute_dtype: torch.dtype,
    adapt: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply a family's plan (``spec.parallelize``) with the settings of ``parallel_cfg``.

    FSDP2's parameter dtype defaults to the run's compute dtype (``trainer.dtype``: bf16 on
    accelerators, fp32 on CPU); ``parallel.param_dtype`` overrides it. Gradients are reduced in
    ``parallel.reduce_dtype`` (fp32 by default). ``compile_block`` compiles one block in place
    (``portatrain.compile.block_compiler``), or is None when compilation is off. ``adapt`` changes
    the model after tensor parallel (LoRA's adapters), or is None.
    """
    par = parallel_cfg
    return parallelize(
        model,
        parallel_dims,
        activation_checkpointing=par.activation_checkpointing,
        compile_block=compile_block,
        param_dtype=dtype_from_name(par.param_dtype) if par.param_dtype else compute_dtype,
        reduce_dtype=dtype_from_name(par.reduce_dtype),
        **({"adapt": adapt} if adapt is not None else {}),
    )
