"""The model stage, shared by every command that runs a model (train, DPO, bench, parity, eval).

:func:`build_model` takes the model from its construction on the meta device to the device:

1. construct on meta (the family's ``model_cls``, or a Trainer's ``build_model()`` hook);
2. the family's runtime hooks (``ModelSpec.runtime``: e.g. the mixture of experts' dispatch and
   router-bias updates), kernel overrides (``kernels.enabled``) and the model converters' ``convert``
   (``quantize.linear``);
3. parallelize (the family's plan: TP -> converters' ``adapt`` (LoRA) -> activation checkpointing ->
   compile -> FSDP2), or with ``parallel.pp > 1`` split into this rank's pipeline stages, each
   parallelized the same way;
4. materialize on the device and initialize (the caller then loads a checkpoint or ``model.init_from``).

:func:`checkpoint_spec` is the other shared piece: a checkpoint's family and architecture, read from
its ``trainer_state.json`` (export and eval).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portatrain.config import Config, ModelConfig
from portatrain.converters import ModelConverters
from portatrain.kernels import KernelSet
from portatrain.kernels import apply as apply_kernels
from portatrain.models import SPECS, moe_dispatch
from portatrain.models.spec import ModelRuntime, ModelSpec, RuntimeOptions
from portatrain.parallel import build_pipeline, full_tensor_init, token_all_max, token_all_reduce
from portatrain.parallel.pipeline import Pipeline, stage_all_reduce
from portatrain.train.runtime import Runtime


@dataclass
class BuiltModel:
    """The model on the device, and what was built with it."""

    model: nn.Module
    """The parallelized model (with pipeline parallel: this rank's stages' parameters under the
    unsplit model's names)."""
    pipeline: Pipeline | None
    hooks: ModelRuntime
    """The family's hooks around the step (:attr:`ModelSpec.runtime`)."""
    flops_per_token: Any
    """The FLOPs per token the model executes (the architecture's ``model.flops_per_token(seq_len)``
    as the converters change it: LoRA's frozen base), or None."""


def runtime_options(
    model_cfg: ModelConfig, runtime: Runtime, *, grad_accum: int, qk_clip: float | None = None
) -> RuntimeOptions:
    """What the family's runtime hooks get: the device's dispatch (``model.moe_dispatch=auto``:
    fixed-capacity slots where the compiler wants static shapes), an auxiliary loss over the global batch
    (statistics summed over the ranks that see different tokens) weighted as a mean over the step's
    ``grad_accum`` micro-batches (0: evaluation, no auxiliary loss), and ``optim.qk_clip`` in training
    (its logits' maximum taken over the same ranks)."""
    dims = runtime.parallel_dims
    spread = dims.dp > 1 or runtime.context_parallel is not None
    return RuntimeOptions(
        moe_dispatch=moe_dispatch(model_cfg, static_shapes=runtime.accelerator.static_shapes),
        capacity_factor=model_cfg.capacity_factor,
        aux_loss_scale=1.0 / grad_accum if grad_accum else 0.0,
        reduce_stats=partial(token_all_reduce, parallel_dims=dims) if spread and grad_accum else None,
        supports_grouped_mm=runtime.accelerator.supports_grouped_mm,
        sum_stages=partial(stage_all_reduce, parallel_dims=dims) if dims.pp_enabled else None,
        qk_clip=qk_clip if grad_accum else None,
        reduce_max=partial(token_all_max, parallel_dims=dims) if spread else None,
    )


def build_model(
    runtime: Runtime,
    spec: ModelSpec,
    options: RuntimeOptions,
    *,
    construct: Callable[[], nn.Module],
    parallelize: Callable[[nn.Module], nn.Module],
    materialize: Callable[[nn.Module], nn.Module],
    converters: ModelConverters,
    kernels: KernelSet | None = None,
    parallel: Any = None,
) -> BuiltModel:
    """Steps 1-4 of the module docstring. ``parallelize`` applies the plan (calling
    ``converters.adapt`` after tensor parallel), ``materialize`` allocates and initializes;
    ``parallel`` (the ``parallel`` config) is needed only with pipeline parallel."""
    with torch.device("meta"):
        model = construct()
    # With a pipeline, the hooks are attached to the stages this rank runs (copies of the meta model).
    hooks = None if runtime.parallel_dims.pp_enabled else spec.runtime(model, options)
    # Kernels are swapped into the model's op slots before parallelize, so compiled blocks trace
    # each kernel as one custom op.
    if kernels is not None:  # kernels.enabled (a command without it, e.g. eval: the references)
        apply_kernels(model, kernels)
    converters.convert(model)
    pipeline = None
    if runtime.parallel_dims.pp_enabled:
        pipeline = build_pipeline(
            model,
            runtime.parallel_dims,
            parallel,
            device=runtime.device,
            prepare=lambda part: materialize(parallelize(part)),
            autocast=runtime.autocast,
        )
        built = pipeline.model
        hooks = spec.runtime(built, options)
    else:
        built = materialize(parallelize(model))
    flops_per_token = converters.flops_per_token(getattr(model, "flops_per_token", None))  # e.g. LoRA's
    return BuiltModel(built, pipeline, hooks, flops_per_token)


def initialize(model: nn.Module, runtime: Runtime, cfg: Config, converters: ModelConverters) -> nn.Module:
    """Allocate a meta model on the device and initialize it for training: the same seed on every rank
    (``trainer.seed``), sharded parameters getting their slice of the single-device weights
    (``parallel.init_full_tensors``), then what the converters added (LoRA's adapters)."""
    model.to_empty(device=runtime.device)
    torch.manual_seed(cfg.trainer.seed)
    with torch.no_grad(), full_tensor_init(cfg.parallel.init_full_tensors):
        model.init_weights(cfg.model.init_std)
        converters.init_weights(model)
    return model.train()


def checkpoint_spec(checkpoint: Path, state: dict[str, Any], *, what: str) -> tuple[ModelSpec, Any]:
    """The family and the architecture ``trainer_state.json`` (``state``) records; a
    ``CheckpointError`` naming ``checkpoint`` when either is missing (``what``: the command's verb)."""
    from portatrain.checkpoint import LEGACY_MODEL_NAME, CheckpointError

    if not state.get("model_args"):
        raise CheckpointError(
            f"checkpoint {checkpoint}: trainer_state.json records no model architecture (a custom "
            f"build_model?); only checkpoints of a registered model family can be {what}"
        )
    model_name = state.get("model_name", LEGACY_MODEL_NAME)
    spec = SPECS.get(model_name)
    if spec is None:
        raise CheckpointError(
            f"checkpoint {checkpoint}: model family {model_name!r} is not registered in this portatrain "
            f"(known: {', '.join(SPECS)})"
        )
    return spec, spec.args_from_dict(state["model_args"])
