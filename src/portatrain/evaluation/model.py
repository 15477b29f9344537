"""The model an evaluation runs: portatrain's own, on its device and mesh, wrapped for lm-eval.

- :func:`load_checkpoint_model` -- ``portatrain eval``'s model: the architecture and tokenizer a
  checkpoint records (``trainer_state.json``, as ``portatrain export`` reads them), built on meta,
  parallelized by the family's plan over the configured layout (``parallel.*``, under torchrun as
  for training; no compilation: lm-eval's requests come in every length), materialized on the
  device (a LoRA fine-tune with its adapters) and loaded with the model's weights only (``load_model_weights``: resharded by DCP,
  checksummed, no optimizer state);
- :func:`harness_lm` -- a :class:`~portatrain.evaluation.lm.PortatrainLM` over any such model (the
  Trainer's own between steps), in eval mode, without gradients, under the run's autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portatrain.config import Config, EvalConfig, LoraConfig


@dataclass
class CheckpointModel:
    """A checkpoint's model, ready to evaluate."""

    model: nn.Module
    tokenizer: Any
    accelerator: Any
    dtype: torch.dtype
    tp: int
    """Tensor-parallel degree (rows are padded to a multiple of it)."""
    checkpoint: Path
    step: int


def load_checkpoint_model(cfg: Config, checkpoint: Path) -> CheckpointModel:
    """Build the model ``checkpoint`` records on ``cfg``'s device and layout and load its weights."""
    from portatrain.accelerators import resolve_accelerator
    from portatrain.checkpoint import (
        LEGACY_MODEL_NAME,
        CheckpointError,
        inspect_checkpoint,
        load_model_weights,
    )
    from portatrain.data.tokenizer import build_tokenizer
    from portatrain.distributed import dist_info_from_env, init_distributed
    from portatrain.dtypes import dtype_from_name
    from portatrain.finetune.lora import apply_lora
    from portatrain.models import SPECS, moe_dispatch
    from portatrain.models.common.moe import configure_moe
    from portatrain.parallel import ParallelDims, parallelize_model

    state, _ = inspect_checkpoint(checkpoint)  # before any process group: a bad path is one line
    spec = SPECS.get(state.get("model_name", LEGACY_MODEL_NAME))
    if spec is None or not state.get("model_args"):
        raise CheckpointError(
            f"checkpoint {checkpoint}: its model (family {state.get('model_name')!r}) is not a registered "
            f"model family with recorded arguments (known: {', '.join(SPECS)}); only those can be evaluated"
        )
    args = spec.args_from_dict(state["model_args"])
    tokenizer = build_tokenizer(state.get("tokenizer", "byte"))

    dist = dist_info_from_env()
    index = cfg.device.index if cfg.device.index is not None else dist.local_rank
    accelerator = resolve_accelerator(cfg.device.type, index)
    accelerator.set_device()
    dims = ParallelDims.from_config(cfg.parallel, world_size=dist.world_size)
    init_distributed(accelerator, dist)
    dims.build_mesh(accelerator.device_type)
    dtype = accelerator.default_dtype if cfg.trainer.dtype == "auto" else dtype_from_name(cfg.trainer.dtype)

    with torch.device("meta"):
        model = spec.model_cls(args)
    configure_moe(
        model,
        dispatch=moe_dispatch(cfg.model, static_shapes=accelerator.static_shapes),
        capacity_factor=cfg.model.capacity_factor,
        aux_loss_scale=0.0,
        supports_grouped_mm=accelerator.supports_grouped_mm,
    )
    lora = state.get("lora")  # a LoRA fine-tune: its adapters, added as training added them
    model = parallelize_model(
        model,
        spec.parallelize,
        dims,
        cfg.parallel,
        compile_block=None,
        compute_dtype=dtype,
        adapt=partial(
            apply_lora, cfg=LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=lora["modules"])
        )
        if lora
        else None,
    )
    model.to_empty(device=accelerator.device)
    with torch.no_grad():
        model.init_weights()  # the RoPE tables (not in checkpoints); the weights are loaded next
    state = load_model_weights(checkpoint, model)
    return CheckpointModel(
        model=model.eval(),
        tokenizer=tokenizer,
        accelerator=accelerator,
        dtype=dtype,
        tp=dims.tp,
        checkpoint=Path(checkpoint),
        step=int(state["step"]),
    )


def harness_lm(
    model: nn.Module,
    tokenizer: Any,
    settings: EvalConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    tp: int,
    progress: bool = True,
) -> Any:
    """An lm-eval model over ``model``: forwards without gradients, under autocast to ``dtype``."""
    from portatrain.evaluation.lm import PortatrainLM

    autocast_on = dtype != torch.float32

    @torch.no_grad()
    def forward(tokens: torch.Tensor, **inputs: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=autocast_on):
            return model(tokens, **inputs)

    return PortatrainLM(
        forward,
        tokenizer,
        max_length=model.args.max_seq_len,
        device=device,
        batch_size=settings.batch_size,
        max_gen_toks=settings.max_gen_toks,
        pad_multiple=tp,
        progress=progress,
    )


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` inside, the previous mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
