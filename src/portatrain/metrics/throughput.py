"""What a training step costs: FLOPs, throughput, MFU, memory (the numbers of a log record).

- ``model_flops``: model FLOPs of a step's micro-batches, from the architecture's
  ``flops_per_token(seq_len)`` and the real (``labels != -100``) tokens, counted on the host;
- ``resolve_peak_flops``: the per-device peak MFU divides by (``metrics.peak_tflops``, else the
  accelerator adapter's datasheet table or, on CPU, its matmul peak measured once per machine and
  cached), fixed for the whole run; ``above_peak`` says when a window runs above it;
- ``throughput_metrics`` / ``memory_metrics`` / ``checkpoint_metrics``: the step-time, tokens/s,
  MFU, memory and checkpoint-wait fields of a log record; ``progress_postfix`` condenses them for
  the progress bar.

MFU here is model FLOPs utilization in the PaLM sense: the FLOPs the model needs per real token
(forward and backward, attention included, activation recomputation *not* included) times real
tokens per second, over the summed dense peak of every device in the job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from portatrain.data.collate import IGNORE_INDEX

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator

logger = logging.getLogger(__name__)

GIB = 2**30


def model_flops(
    batches: Iterable[dict[str, torch.Tensor]], flops_per_token: Callable[[int], int] | None
) -> int:
    """Training FLOPs of one optimizer step: per micro-batch, real tokens x ``flops_per_token(S)``.

    ``S`` is the batch's row length (the attention span the model computes over, so a bucketed
    batch of 64 positions costs less attention than one of 256). Padding positions do work but are
    not counted: MFU measures useful work. Labels are counted on the host (the loader's tensors,
    before they move), so this never syncs a device. Returns 0 when the model has no FLOPs model.
    """
    if flops_per_token is None:
        return 0
    total = 0
    for batch in batches:
        labels = batch["labels"]
        total += int((labels != IGNORE_INDEX).sum()) * flops_per_token(labels.shape[-1])
    return total


def resolve_peak_flops(
    accelerator: Accelerator, dtype: torch.dtype, override_tflops: float | None = None
) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for MFU, and where the number came from (for logs and bench reports)."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12, f"metrics.peak_tflops={override_tflops}"
    name = accelerator.device_name()
    peak = accelerator.peak_flops(dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    if peak is None:
        logger.info(
            "no peak-FLOPs figure for %s in %s: MFU is not reported; set metrics.peak_tflops",
            name,
            dtype_name,
        )
        return None, f"unknown for {name} ({dtype_name})"
    return peak, f"{name}, {dtype_name}, {accelerator.peak_flops_source(dtype)}"


def above_peak(
    peak: float | None, source: str, *, flops: float, elapsed_s: float, num_devices: int
) -> str | None:
    """None while a window of ``flops`` over ``elapsed_s`` on ``num_devices`` (as
    :func:`throughput_metrics` takes them) runs at or below ``peak``; else one line saying why MFU
    reads above 100%, for the caller to log once.

    A rate above the peak means the figure is low, not the run fast: a datasheet figure or
    ``metrics.peak_tflops`` below what the device does, a CPU measurement that a warmer clock or a
    quieter moment beats, or a FLOPs model counting more than runs. The peak is *not* moved: an MFU
    whose denominator changed mid-run would mean something else after the change than before it
    (it was raised to the achieved rate once, so every later window read 100%, or below it only
    because the peak had moved). The line is INFO, not a warning: the run is fine, the figure is
    an estimate.
    """
    achieved = _per_device(flops, elapsed_s, num_devices)
    if peak is None or achieved <= peak:
        return None
    return (
        f"MFU reads above 100%: the step ran at {achieved / 1e12:.4g} TFLOP/s per device, above the "
        f"peak of {peak / 1e12:.4g} TFLOP/s ({source}); the peak stays as it is for the whole run, "
        "set metrics.peak_tflops to choose it"
    )


def throughput_metrics(
    *,
    tokens: int,
    flops: float,
    elapsed_s: float,
    steps: int,
    num_devices: int,
    peak_flops: float | None,
) -> dict[str, float | None]:
    """Rates of a window of ``steps`` optimizer steps that took ``elapsed_s`` seconds.

    ``tokens`` and ``flops`` are summed over every rank, ``num_devices`` counts every device of the
    job (data- and model-parallel alike), so MFU is job-wide: model FLOP/s over the summed peak.
    """
    per_device = _per_device(flops, elapsed_s, num_devices)
    elapsed_s = max(elapsed_s, 1e-9)
    return {
        "step_time_s": elapsed_s / max(steps, 1),
        "tokens_per_s": tokens / elapsed_s,
        "tokens_per_s_per_device": tokens / elapsed_s / num_devices,
        "tflops_per_device": per_device / 1e12,
        "mfu": per_device / peak_flops if peak_flops else None,
    }


def checkpoint_metrics(blocked_s: float, wall_s: float) -> dict[str, float]:
    """The loop's cost of checkpoints so far: seconds it was blocked saving (or waiting for a save in
    flight, ``checkpoint.async_mode``) and that time's fraction of the training wall time."""
    return {"checkpoint_blocked_s": blocked_s, "checkpoint_blocked_frac": blocked_s / max(wall_s, 1e-9)}


def _per_device(flops: float, elapsed_s: float, num_devices: int) -> float:
    return flops / max(elapsed_s, 1e-9) / num_devices


def memory_high_water(stats: dict[str, int]) -> int | None:
    """The high-water mark of ``Accelerator.memory_stats()``: the device allocator's peak where it
    keeps one (``peak_allocated``), else the process's peak RSS (CPU), else the current figure."""
    for key in ("peak_allocated", "peak_rss", "allocated", "rss"):
        if key in stats:
            return int(stats[key])
    return None


def memory_metrics(stats: dict[str, int]) -> dict[str, int | None]:
    """Log fields for one rank's memory: ``memory_peak_bytes`` plus each statistic, in bytes."""
    return {
        "memory_peak_bytes": memory_high_water(stats),
        **{f"memory_{k}_bytes": int(v) for k, v in stats.items()},
    }


def progress_postfix(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's summary of a log record: loss, tokens/s, MFU and peak memory."""
    postfix = {"loss": f"{record['loss']:.3f}", "tok_s": f"{record['tokens_per_s']:,.0f}"}
    if record.get("mfu") is not None:
        postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
    if record.get("memory_peak_bytes") is not None:
        postfix["mem"] = f"{record['memory_peak_bytes'] / GIB:.2f}G"
    if record.get("checkpoint_blocked_frac"):  # the share of wall time the loop waited on saves
        postfix["ckpt"] = f"{100 * record['checkpoint_blocked_frac']:.1f}%"
    if record.get("moe_load_max_mean") is not None:  # a mixture of experts: the busiest expert's load
        postfix["moe_load"] = f"{record['moe_load_max_mean']:.2f}"
    if record.get("moe_dropped") is not None:
        postfix["moe_drop"] = f"{100 * record['moe_dropped']:.1f}%"
    return postfix
