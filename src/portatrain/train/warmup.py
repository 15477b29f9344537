"""Compile warm-up (``compile.warmup``): every batch shape compiled before step 1, then the recompile
guard armed (``portatrain.compile``).

:func:`compile_warmup` runs the trainer's ``forward_backward`` (and, when evaluation is on, an
eval-mode ``no_grad`` forward) on a synthetic batch of each shape of ``batch_shapes(cfg.data)`` whose
every label is valid. The optimizer does not step, gradients are cleared, the family's step state is
left as a skipped step leaves it and the RNG state restored: training then sees the same weights,
data and randomness as without warm-up.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from portatrain.compile import warmup_batches
from portatrain.data.loader import batch_shapes, build_collator

logger = logging.getLogger(__name__)


class _StopDuringWarmup(Exception):
    """A stop request (SIGTERM/SIGINT) arrived between compile warm-up shapes."""


def compile_warmup(trainer: Any) -> list[dict[str, Any]]:
    """Warm ``trainer`` (a :class:`~portatrain.trainer.Trainer`) up; returns per-shape cold-start
    times (logged and written to the metrics), or ``[]`` when a stop request came first (then
    ``trainer.preempted`` is set: every rank agrees, and fit() trains no step)."""
    cfg = trainer.cfg
    rng, start = trainer.accelerator.get_rng_state(), time.perf_counter()
    batches = warmup_batches(
        build_collator(cfg.data, pad_id=trainer.tokenizer.pad_id),  # the loader's collator
        batch_shapes(cfg.data),
        packed=cfg.data.collator == "packing",
        vocab_size=trainer.tokenizer.vocab_size,
    )

    def train(batch: dict[str, torch.Tensor]) -> None:
        # Compiling one shape can take tens of seconds: look for a stop request (SIGTERM, Ctrl-C)
        # before each, so a preempted job saves within the scheduler's grace period.
        if trainer.preemption.should_stop():
            raise _StopDuringWarmup
        trainer.forward_backward(batch, (batch["labels"] != -100).sum().float())

    @torch.no_grad()
    def evaluate(batch: dict[str, torch.Tensor]) -> None:
        trainer.model.eval()
        if trainer.pipeline is not None:  # the schedule's forward-only pass
            trainer.forward_loss(batch)
        else:
            with trainer.runtime.autocast():
                trainer.model(
                    batch["input_ids"], positions=batch.get("positions"), attn_mask=batch.get("attn_mask")
                )
        trainer.model.train()

    try:
        records = trainer.compile_monitor.warm_up(
            [trainer.runtime.to_device(b) for b in batches],
            train=train,
            evaluate=evaluate if cfg.trainer.eval_every and trainer.data.has_eval else None,
            synchronize=trainer.accelerator.synchronize,
        )
    except _StopDuringWarmup:
        trainer.preempted = True
        records = None
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.accelerator.set_rng_state(rng)
    if records is None:
        logger.warning("stop requested during compile warm-up (after %.1f s)", time.perf_counter() - start)
        return []
    # Forget what the synthetic batches left in the family's state (e.g. expert assignments), as a
    # skipped step would.
    trainer.model_hooks.post_optimizer_step(torch.zeros((), dtype=torch.bool, device=trainer.device))
    total = round(time.perf_counter() - start, 3)
    logger.info("compile warm-up: %d shape(s) in %.1f s", len(records), total)
    trainer.metrics.log(
        {
            "step": trainer.step,
            "compile_warmup": records,
            "compile_warmup_s": total,
            **trainer.compile_monitor.metrics(),
        }
    )
    return records
