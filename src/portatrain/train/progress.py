"""What the loop shows and records: a start banner, the progress bar (or, in a log file or on a
terminal without width, one plain line per logging step), the step's metrics at logging steps -- the
loop's one host sync --, each evaluation's results, and an end summary (also ``<run_dir>/summary.json``).
Messages printed while the bar is live go above it, never onto its line (``tqdm``'s
``logging_redirect_tqdm``).

:class:`StepLog` closes the logging window (one all-reduce, which also carries the non-finite counts),
lets the non-finite guard act, measures throughput and MFU over the window, and writes the metrics
(JSONL and the trackers) with the family's own figures (``ModelSpec.runtime``) and the trainer's
``dp_sums`` (each rank's share of a global mean, summed in one all-reduce).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from portatrain.metrics import (
    above_peak,
    checkpoint_metrics,
    memory_metrics,
    progress_postfix,
    throughput_metrics,
)
from portatrain.parallel import token_all_reduce
from portatrain.train.runtime import describe

logger = logging.getLogger(__name__)


class StepLog:
    """The console and the metrics of one ``fit`` of ``trainer`` (a :class:`~portatrain.trainer.Trainer`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        cfg = trainer.cfg.trainer
        self.steps = int(cfg.steps)
        shown = bool(cfg.progress) and trainer.dist.is_main
        # A terminal gets a live bar; a log file (SLURM output, CI, ``> file``) or a terminal that
        # reports no width (where tqdm draws nothing) one plain line per logging step instead.
        interactive = sys.stderr.isatty() and shutil.get_terminal_size((80, 24)).columns > 0
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
        self.first_step = trainer.step
        self.last: dict[str, Any] = {}
        self.evals: dict[str, float] = {}
        self.noted_above_peak = False
        self._redirect = ExitStack()
        if shown and interactive:  # log records printed above the live bar
            self._redirect.enter_context(logging_redirect_tqdm())
        if trainer.dist.is_main:
            self._banner()

    def _banner(self) -> None:
        t = self.trainer
        cfg, rt = t.cfg, describe(t.runtime)
        params = sum(p.numel() for p in t.model.parameters())  # this rank's share under FSDP/TP/PP
        trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
        rows = int(cfg.data.batch_size) * int(cfg.trainer.grad_accum) * t.dp_world_size
        layout = " ".join(f"{k}={v}" for k, v in rt["layout"].items() if v != 1) or "one device"
        start = f"step {t.step}" + (f" (resumed from {t.resume_from})" if t.resume_from else "")
        logger.info(
            "%s: %s %s, %s parameters%s on %s x %s (%s, %s); %d steps of %d rows x %d positions from %s",
            cfg.recipe,
            cfg.model.name,
            cfg.model.flavor,
            _count(params),
            f" ({_count(trainable)} trainable)" if trainable != params else "",
            rt["world_size"],
            rt["device"],
            layout,
            rt["dtype"],
            self.steps,
            rows,
            int(cfg.data.seq_len),
            start,
        )
        logger.info("run directory %s (config.yaml, metrics.jsonl, checkpoints/)", t.run_dir)
        if t.peak_flops:  # where MFU's denominator comes from, said once (on CPU: an estimate)
            logger.info(
                "MFU over a peak of %.4g TFLOP/s per device: %s", t.peak_flops / 1e12, t.peak_flops_source
            )

    def evaluated(self, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Run ``evaluate`` (its compilation watched, the runtime audit paused), log its results to the
        metrics and the console, then the trainer's ``on_eval_end``."""
        t = self.trainer
        with t.compile_monitor.watch(what="evaluation"), t.runtime_audit.paused():
            metrics = evaluate()
        t.metrics.log({"step": t.step, **metrics})
        self.evals.update(metrics)
        if t.dist.is_main and metrics:
            shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, int | float))
            logger.info("step %d/%d  %s", t.step, self.steps, shown)
        t.on_eval_end(t.step, metrics)
        return metrics

    def close(self) -> None:
        """Close the bar and, on rank 0, print the end summary and write ``summary.json``."""
        self.bar.close()  # closed already at the loop's end: a no-op
        self._redirect.close()
        t = self.trainer
        if not t.dist.is_main:
            return
        wall = time.perf_counter() - self.started
        summary = {
            "recipe": t.cfg.recipe,
            "steps": t.step,
            "trained_steps": t.step - self.first_step,
            "stopped_early": bool(t.preempted),
            "wall_s": round(wall, 1),
            "loss": self.last.get("loss"),
            **{k: v for k, v in self.evals.items() if isinstance(v, int | float)},
            "tokens_seen": t.tokens_seen,
            "tokens_per_s": round(self.last["tokens_per_s"], 1) if "tokens_per_s" in self.last else None,
            "run_dir": str(t.run_dir),
            "checkpoints": str(t.run_dir / "checkpoints") if t.cfg.checkpoint.enabled else None,
            "metrics": str(t.run_dir / "metrics.jsonl"),
            "config": str(t.run_dir / "config.yaml"),
            **describe(t.runtime),
        }
        losses = [f"{k} {summary[k]:.4g}" for k in ("loss", "eval_loss") if isinstance(summary.get(k), float)]
        logger.info(
            "%s %d steps in %.0f s%s; %s tokens seen; checkpoints, metrics.jsonl, config.yaml and "
            "summary.json in %s",
            "stopped after" if t.preempted else "trained",
            summary["trained_steps"],
            wall,
            f" ({', '.join(losses)})" if losses else "",
            f"{t.tokens_seen:,}",
            t.run_dir,
        )
        try:
            (t.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as exc:  # a full or read-only disk: the run itself is saved already
            logger.warning("could not write %s: %s", t.run_dir / "summary.json", exc)

    def log(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """A logging step after ``metrics`` (``train_step``'s): returns what was logged."""
        t = self.trainer
        audit = t.runtime_audit.window_end()  # before this block's own (expected) syncs
        t.accelerator.synchronize()
        totals = t.window.close(t.runtime.all_reduce_sum, device=t.device, extra=t.nonfinite.counts)
        bad_steps, bad_losses = totals.extra
        t.nonfinite.check(bad_steps, bad_losses, metrics, t.step)
        t.tokens_seen += totals.tokens
        note = above_peak(
            t.peak_flops,
            t.peak_flops_source,
            flops=totals.flops,
            elapsed_s=totals.elapsed_s,
            num_devices=t.dist.world_size,
        )
        if note and not self.noted_above_peak and t.dist.is_main:
            logger.info(note)  # once a run: every window after it reads against the same peak
            self.noted_above_peak = True
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
        self.last = last
        return last

    def _dp_sums(self, sums: dict[str, torch.Tensor] | None) -> dict[str, float]:
        if not sums:
            return {}
        totals = self.trainer.runtime.all_reduce_sum(torch.stack([v.detach().float() for v in sums.values()]))
        return dict(zip(sums, totals.tolist(), strict=True))


def _count(n: int) -> str:
    """``1,234,567 (1.23M)``: exact, then readable."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.2f}{unit})"
    return f"{n:,}"
