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
    """Build the model ``checkpoint`` records on ``cfg``'s device and layout and load its weights,
    through the shared runtime and model stages (``portatrain.train``) without compilation."""
    from portatrain.checkpoint import inspect_checkpoint, load_model_weights
    from portatrain.converters import ModelConverters
    from portatrain.converters.lora import LoraAdapters
    from portatrain.data.tokenizer import build_tokenizer
    from portatrain.parallel import parallelize_model
    from portatrain.train.build import build_model, checkpoint_spec, runtime_options
    from portatrain.train.runtime import build_runtime

    state, _ = inspect_checkpoint(checkpoint)  # before any process group: a bad path is one line
    spec, args = checkpoint_spec(checkpoint, state, what="evaluated")
    tokenizer = build_tokenizer(state.get("tokenizer", "byte"))
    runtime = build_runtime(cfg)
    lora = state.get("lora")  # a LoRA fine-tune: its adapters, added as training added them
    converters = ModelConverters(
        [LoraAdapters(LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=lora["modules"]))]
        if lora
        else []
    )

    def parallelize(model: nn.Module) -> nn.Module:
        return parallelize_model(
            model,
            spec.parallelize,
            runtime.parallel_dims,
            cfg.parallel,
            compile_block=None,
            compute_dtype=runtime.dtype,
            adapt=converters.adapter(),
        )

    def materialize(model: nn.Module) -> nn.Module:
        model.to_empty(device=runtime.device)
        with torch.no_grad():
            model.init_weights()  # the RoPE tables (not in checkpoints); the weights are loaded next
        return model

    built = build_model(
        runtime,
        spec,
        runtime_options(cfg.model, runtime, grad_accum=0),  # no auxiliary loss
        construct=partial(spec.model_cls, args),
        parallelize=parallelize,
        materialize=materialize,
        converters=converters,
        parallel=cfg.parallel,
    )
    state = load_model_weights(checkpoint, built.model)
    return CheckpointModel(
        model=built.model.eval(),
        tokenizer=tokenizer,
        accelerator=runtime.accelerator,
        dtype=runtime.dtype,
        tp=runtime.parallel_dims.tp,
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


def evaluate_model_tasks(
    model: nn.Module, tokenizer: Any, names: list[str], settings: EvalConfig, runtime: Any
) -> dict[str, float]:
    """lm-eval's ``names`` on ``model`` as it is, between training steps (the Trainer's
    ``evaluate_tasks``): every rank takes part, each over every request; the metrics come back on local
    rank 0 (``{}`` elsewhere); the random states are left as they were. ``runtime`` is
    the run's :class:`~portatrain.train.runtime.Runtime`."""
    from portatrain.evaluation import flat_metrics, run_tasks

    lm = harness_lm(
        model,
        tokenizer,
        settings,
        device=runtime.device,
        dtype=runtime.dtype,
        tp=runtime.parallel_dims.tp,
        progress=False,
    )
    rng = runtime.accelerator.get_rng_state()
    with eval_mode(model):
        results = run_tasks(lm, names, settings, bootstrap_iters=0, quiet=True)
    runtime.accelerator.set_rng_state(rng)
    return flat_metrics(results)  # shown on screen with the step's other results (train/progress.py)
