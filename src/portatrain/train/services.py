"""What watches a training run, built from the config: the checkpointer, the non-finite guard, the
optimizer step they guard and the metrics sinks (each a stage of its own; this module only wires them
to the run)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from portatrain.checkpoint import Checkpointer
from portatrain.config import Config
from portatrain.metrics import MetricsLogger
from portatrain.parallel import token_all_reduce
from portatrain.train.nonfinite import NonFiniteGuard
from portatrain.train.runtime import Runtime
from portatrain.train.spike import SpikeGuard
from portatrain.train.state import TrainState
from portatrain.train.step import OptimizerStep


def build_checkpointer(cfg: Config, runtime: Runtime, run_dir: Path) -> Checkpointer:
    """Checkpoints under ``<run_dir>/checkpoints`` (``checkpoint.*``); pinned host staging where the
    adapter has it."""
    accelerator = runtime.accelerator
    return Checkpointer(
        run_dir / "checkpoints",
        keep=cfg.checkpoint.keep,
        every=cfg.checkpoint.every,
        is_main=runtime.dist.is_main,
        async_mode=cfg.checkpoint.async_mode,
        pinned_staging=accelerator.synchronize if accelerator.pinned_staging else None,
    )


def build_nonfinite_guard(cfg: Config, runtime: Runtime, checkpointer: Checkpointer) -> NonFiniteGuard:
    """Non-finite steps (``trainer.on_nonfinite``): counted on the device every step, read at the
    logging sync and before every save, with no extra host sync (``portatrain.train.nonfinite``)."""
    return NonFiniteGuard(
        cfg.trainer.on_nonfinite,
        device=runtime.device,
        all_reduce_sum=runtime.all_reduce_sum,
        dp_world_size=runtime.parallel_dims.dp,  # the ranks its counts are summed over
        checkpointer=checkpointer,
        is_main=runtime.dist.is_main,
        lr=cfg.optim.lr,
    )


def build_metrics(cfg: Config, runtime: Runtime, run_dir: Path, *, resumed: bool) -> MetricsLogger:
    """Rank 0's metrics sinks (``metrics.*``: JSONL, TensorBoard, W&B, MLflow); the config they get
    is redacted first, and a resumed run continues the trackers' runs."""
    return MetricsLogger(
        run_dir,
        enabled=runtime.dist.is_main,
        jsonl=cfg.metrics.jsonl,
        tensorboard=cfg.metrics.tensorboard,
        wandb=cfg.metrics.wandb,
        mlflow=cfg.metrics.mlflow,
        config=cfg,
        resumed=resumed,
    )


def build_optimizer_step(
    cfg: Config,
    runtime: Runtime,
    state: TrainState,
    guard: NonFiniteGuard,
    post_step: list[Callable[[torch.Tensor], None]],
    checkpointer: Checkpointer | None = None,
) -> OptimizerStep:
    """The run's optimizer step over ``state``'s optimizer and schedule: clipping (``optim.grad_clip``)
    across the pipeline stages too, the non-finite ``guard``, the loss-spike guard
    (``trainer.spike_guard``, whose window becomes part of the train state; ``action=rewind`` goes back
    to ``checkpointer``'s newest checkpoint) and the ``post_step`` hooks."""
    dims = runtime.parallel_dims
    step = OptimizerStep(
        state.optimizer,
        state.lr_scheduler,
        grad_clip=cfg.optim.grad_clip,
        pp_mesh=dims.pp_mesh if dims.pp_enabled else None,
        guard=guard,
        post_step=post_step,
        spike_guard=SpikeGuard.build(cfg.trainer.spike_guard, runtime.device),
        global_sum=partial(token_all_reduce, parallel_dims=dims),
        rewind=partial(state.rewind, checkpointer, recipe=cfg.recipe) if checkpointer is not None else None,
        is_main=runtime.dist.is_main,
    )
    if step.spike_guard is not None:  # its window resumes with the run
        state.parts["spike_guard"] = step.spike_guard
    return step
