"""Training metrics: what a step costs, and the sinks that record it (rank 0 only).

What this file does:
- ``model_flops``: model FLOPs of a step's micro-batches, from the architecture's
  ``flops_per_token(seq_len)`` and the real (``labels != -100``) tokens, counted on the host;
- ``resolve_peak_flops``: the per-device peak MFU divides by (``metrics.peak_tflops``, else the
  accelerator adapter's datasheet table or, on CPU, its measured matmul peak);
- ``throughput_metrics`` / ``memory_metrics``: the step-time, tokens/s, MFU and memory fields of a
  log record; ``progress_postfix`` condenses them for the progress bar;
- sinks: ``JSONLSink`` (``<run_dir>/metrics.jsonl``, one JSON object per line) and
  ``TensorBoardSink`` (``<run_dir>/tensorboard``, opt-in with ``metrics.tensorboard=true``), fanned
  out by ``MetricsLogger``.

MFU here is model FLOPs utilization in the PaLM sense: the FLOPs the model needs per real token
(forward and backward, attention included, activation recomputation *not* included) times real
tokens per second, over the summed dense peak of every device in the job.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from portatrain.data.collate import IGNORE_INDEX
from portatrain.errors import ConfigError

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator

logger = logging.getLogger(__name__)

GIB = 2**30


# -- accounting ----------------------------------------------------------------------------------
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
    source = "measured matmul" if accelerator.device_type == "cpu" else "datasheet"
    return peak, f"{name}, {dtype_name}, {source}"


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
    elapsed_s = max(elapsed_s, 1e-9)
    per_device = flops / elapsed_s / num_devices
    return {
        "step_time_s": elapsed_s / max(steps, 1),
        "tokens_per_s": tokens / elapsed_s,
        "tokens_per_s_per_device": tokens / elapsed_s / num_devices,
        "tflops_per_device": per_device / 1e12,
        "mfu": per_device / peak_flops if peak_flops else None,
    }


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
    if record.get("moe_load_max_mean") is not None:  # a mixture of experts: the busiest expert's load
        postfix["moe_load"] = f"{record['moe_load_max_mean']:.2f}"
    if record.get("moe_dropped") is not None:
        postfix["moe_drop"] = f"{100 * record['moe_dropped']:.1f}%"
    return postfix


# -- sinks ---------------------------------------------------------------------------------------
class JSONLSink:
    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)  # line-buffered: a killed run keeps every logged line

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars under ``<run_dir>/tensorboard``: ``train/<key>``, ``eval/<key>``, ``memory/<key>``.

    ``torch.utils.tensorboard`` needs the ``tensorboard`` package; it is imported here, only when
    the sink is enabled, so plain runs never pay for it.
    """

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                f"metrics.tensorboard=true needs the tensorboard package ({exc}); "
                "pip install 'portatrain[tensorboard]' or set metrics.tensorboard=false"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            group = "eval" if key.startswith("eval") else "memory" if key.startswith("memory") else "train"
            self._writer.add_scalar(f"{group}/{key}", value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Fans a record out to every sink; a no-op on ranks other than 0."""

    def __init__(
        self, run_dir: Path, *, enabled: bool, jsonl: bool = True, tensorboard: bool = False
    ) -> None:
        self.sinks: list[Any] = []
        if enabled and jsonl:
            self.sinks.append(JSONLSink(run_dir / "metrics.jsonl"))
        if enabled and tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
