"""What the loop shows and records at a logging step: the progress bar (or, in a log file, one plain
line per logging step) and the step's metrics -- the loop's one host sync.

:class:`StepLog` closes the logging window (one all-reduce, which also carries the non-finite counts),
lets the non-finite guard act, measures throughput and MFU over the window, and writes the metrics
(JSONL and the trackers) with the family's own figures (``ModelSpec.runtime``) and the trainer's
``dp_sums`` (each rank's share of a global mean, summed in one all-reduce).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from portatrain.metrics import (
    checkpoint_metrics,
    memory_metrics,
    peak_covering,
    progress_postfix,
    throughput_metrics,
)
from portatrain.parallel import token_all_reduce

logger = logging.getLogger(__name__)


class StepLog:
    """The console and the metrics of one ``fit`` of ``trainer`` (a :class:`~portatrain.trainer.Trainer`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        cfg = trainer.cfg.trainer
        self.steps = int(cfg.steps)
        shown = bool(cfg.progress) and trainer.dist.is_main
        # A terminal gets a live bar; a log file (SLURM output, CI, ``> file``) one plain line per
        # logging step instead of a carriage-return frame per step.
        interactive = sys.stderr.isatty()
        self.lines = shown and not interactive
        self.bar = tqdm(
            total=self.steps,
            initial=trainer.step,
            disable=not (shown and interactive),
            desc=trainer.cfg.recipe,
            unit="step",
            dynamic_ncols=True,
        )
        self.started = time.perf_counter()  # checkpoint_blocked_frac's wall time

    def log(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """A logging step after ``metrics`` (``train_step``'s): returns what was logged."""
        t = self.trainer
        audit = t.runtime_audit.window_end()  # before this block's own (expected) syncs
        t.accelerator.synchronize()
        totals = t.window.close(t.runtime.all_reduce_sum, device=t.device, extra=t.nonfinite.counts)
        bad_steps, bad_losses = totals.extra
        t.nonfinite.check(bad_steps, bad_losses, metrics, t.step)
        t.tokens_seen += totals.tokens
        t.peak_flops, t.peak_flops_source = peak_covering(
            t.peak_flops,
            t.peak_flops_source,
            flops=totals.flops,
            elapsed_s=totals.elapsed_s,
            num_devices=t.dist.world_size,
        )
        last = {
            "step": t.step,
            # Each rank's loss is its token sum over the GLOBAL token count: sum, not mean.
            "loss": float(token_all_reduce(metrics["loss"], t.parallel_dims)),
            "grad_norm": float(metrics["grad_norm"]),
            "lr": t.lr_scheduler.get_last_lr()[0],
            "tokens_seen": t.tokens_seen,
            **throughput_metrics(
                tokens=totals.tokens,
                flops=totals.flops,
                elapsed_s=totals.elapsed_s,
                steps=totals.steps,
                num_devices=t.dist.world_size,
                peak_flops=t.peak_flops,
            ),
            **memory_metrics(t.accelerator.memory_stats()),
            **t.compile_monitor.metrics(),
            **t.model_hooks.metrics(),  # the family's: e.g. this rank's experts' load, aux loss, drops
            **t.optimizer_step.metrics(),  # e.g. steps the loss-spike guard skipped
            **self._dp_sums(metrics.get("dp_sums")),
            **audit,
        }
        if t.cfg.checkpoint.enabled:
            last.update(checkpoint_metrics(t.checkpointer.blocked_s, time.perf_counter() - self.started))
        if t.nonfinite_skipped:
            last["nonfinite_skipped"] = t.nonfinite_skipped
        t.metrics.log(last)
        self.bar.set_postfix(progress_postfix(last))
        if self.lines:
            summary = "  ".join(f"{k} {v}" for k, v in progress_postfix(last).items())
            logger.info("step %d/%d  %s", t.step, self.steps, summary)
        t.window.reset()
        return last

    def _dp_sums(self, sums: dict[str, torch.Tensor] | None) -> dict[str, float]:
        if not sums:
            return {}
        totals = self.trainer.runtime.all_reduce_sum(torch.stack([v.detach().float() for v in sums.values()]))
        return dict(zip(sums, totals.tolist(), strict=True))
