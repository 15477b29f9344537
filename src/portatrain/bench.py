"""``portatrain bench recipe=... device=...``: cold start and steady state, measured apart.

A first step that compiles is not throughput, and throughput is not what a user waits for before
the first step. The bench reports both, measured apart as MLPerf Training separates time-to-train
from throughput (https://github.com/mlcommons/training_policies/blob/master/training_rules.adoc):

- **cold start**: wall time from the start of the command (config composed) to the end of step 1,
  compilation included, split into ``setup_s`` (building the Trainer: device, data, model built on
  meta, parallelized, materialized; ``model_build_s`` is the model part) and ``first_step_s``;
- **steady state**: ``bench.warmup_steps`` more steps run and are discarded, then ``bench.steps``
  are measured: median and p90 step time, tokens/s (real tokens, ``labels != -100``), model
  TFLOP/s per device and MFU (see ``portatrain.metrics``), peak memory, and the cost per million
  tokens at ``bench.price_per_hour``.

It runs the ordinary Trainer (or the subclass passed in) with evaluation and checkpointing off; the
one addition, in a subclass made here, is ``accelerator.synchronize()`` and a timestamp at the end
of every step: per-step times need a drained device, so only bench mode pays for them. Rank 0 writes
``<run_dir>/bench.json`` and ``<run_dir>/bench_step_times.png`` (when matplotlib is installed).
"""

from __future__ import annotations

import json
import logging
import math
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from portatrain.config import BenchConfig, Config
from portatrain.errors import ConfigError
from portatrain.metrics import GIB, above_peak, memory_high_water, throughput_metrics

if TYPE_CHECKING:  # imported by run_bench: the validator reads bench_problems without the Trainer
    from portatrain.trainer import Trainer

logger = logging.getLogger(__name__)


def bench_problems(bench_cfg: BenchConfig) -> list[str]:
    """Every problem with the ``bench`` config group, each with its fix."""
    problems = []
    if bench_cfg.steps < 1:
        problems.append(f"bench.steps={bench_cfg.steps} must be >= 1 (100 or more for a stable median)")
    if bench_cfg.warmup_steps < 0:
        problems.append(f"bench.warmup_steps={bench_cfg.warmup_steps} must be >= 0")
    if bench_cfg.price_per_hour is not None and bench_cfg.price_per_hour < 0:
        problems.append(f"bench.price_per_hour={bench_cfg.price_per_hour} must be >= 0 (USD per hour)")
    return problems


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]): a value that was actually measured."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def cost_per_million_tokens(price_per_hour: float | None, tokens_per_s: float) -> float | None:
    """USD per 1e6 tokens: hourly price over tokens per hour, times a million."""
    if price_per_hour is None or tokens_per_s <= 0:
        return None
    return price_per_hour / (tokens_per_s * 3600) * 1e6


def timed_trainer_class(base: type[Trainer]) -> type[Trainer]:
    """``base`` plus timestamps: model build start/end and a synchronized end of every step."""

    class BenchTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.bench_marks: dict[str, float] = {}
            self.bench_steps: list[tuple[float, int, int]] = []  # (end time, tokens, flops) per step
            super().__init__(*args, **kwargs)

        def build_model(self):
            self.bench_marks["model_start"] = time.perf_counter()
            return super().build_model()

        def _materialize(self, model):
            model = super()._materialize(model)
            self.accelerator.synchronize()
            self.bench_marks["model_end"] = time.perf_counter()
            return model

        def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
            super().on_step_end(step, metrics)
            self.accelerator.synchronize()  # bench only: a step's time must include its device work
            self.bench_steps.append(
                (time.perf_counter(), int(metrics["tokens"]), int(metrics.get("flops", 0)))
            )

    BenchTrainer.__name__ = BenchTrainer.__qualname__ = f"Bench{base.__name__}"
    return BenchTrainer


def run_bench(cfg: Config, trainer_cls: type[Trainer] | None = None) -> dict[str, Any]:
    """Run the bench for a composed config; return the results (rank 0 also writes and prints them)."""
    from portatrain.trainer import Trainer

    start = time.perf_counter()
    problems = bench_problems(cfg.bench)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    warmup, measured = int(cfg.bench.warmup_steps), int(cfg.bench.steps)
    cfg = OmegaConf.merge(
        cfg,
        {
            "trainer": {"steps": 1 + warmup + measured, "eval_every": 0},
            "checkpoint": {"enabled": False, "resume": "none"},
        },
    )
    trainer = timed_trainer_class(trainer_cls or Trainer)(cfg)
    constructed = time.perf_counter()
    try:
        trainer.fit()
        results = _summarize(trainer, cfg, start=start, constructed=constructed)
        if trainer.dist.is_main:
            _report(trainer.run_dir, results)
        return results
    finally:
        trainer.close()


def _summarize(trainer: Trainer, cfg: Config, *, start: float, constructed: float) -> dict[str, Any]:
    warmup, steps = int(cfg.bench.warmup_steps), int(cfg.bench.steps)
    ends = [end for end, _, _ in trainer.bench_steps]
    step_times = [ends[0] - constructed] + [b - a for a, b in zip(ends, ends[1:])]
    window = trainer.bench_steps[1 + warmup :]
    times = step_times[1 + warmup :]
    local = torch.tensor([float(sum(s[1] for s in window)), float(sum(s[2] for s in window))])
    tokens, flops = (float(x) for x in trainer._all_reduce_sum(local).tolist())
    note = above_peak(
        trainer.peak_flops,
        trainer.peak_flops_source,
        flops=flops,
        elapsed_s=sum(times),
        num_devices=trainer.dist.world_size,
    )
    if note and trainer.dist.is_main:
        logger.info(note)
    rates = throughput_metrics(
        tokens=int(tokens),
        flops=flops,
        elapsed_s=sum(times),
        steps=len(times),
        num_devices=trainer.dist.world_size,
        peak_flops=trainer.peak_flops,
    )
    median = statistics.median(times)
    memory = trainer.accelerator.memory_stats()
    marks = trainer.bench_marks
    flops_per_token = trainer.flops_per_token
    return {
        "recipe": cfg.recipe,
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "device": trainer.accelerator.describe(),
        "device_name": trainer.accelerator.device_name(),
        "world_size": trainer.dist.world_size,
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "compile": bool(cfg.compile.enabled),
        "batch_size": int(cfg.data.batch_size),
        "seq_len": int(cfg.data.seq_len),
        "grad_accum": int(cfg.trainer.grad_accum),
        "collator": cfg.data.collator,
        "flops_per_token": flops_per_token(int(cfg.data.seq_len)) if flops_per_token else None,
        # Cold start.
        "setup_s": constructed - start,
        "model_build_s": marks["model_end"] - marks["model_start"] if "model_end" in marks else None,
        "first_step_s": step_times[0],
        "cold_start_s": ends[0] - start,
        # Steady state.
        "warmup_steps": warmup,
        "measured_steps": steps,
        "step_time_median_s": median,
        "step_time_p90_s": percentile(times, 90),
        "step_time_mean_s": rates["step_time_s"],
        "tokens_per_step": tokens / len(times),
        "tokens_per_s": rates["tokens_per_s"],
        "tokens_per_s_at_median_step": tokens / len(times) / median,
        "tokens_per_s_per_device": rates["tokens_per_s_per_device"],
        "tflops_per_device": rates["tflops_per_device"],
        "mfu": rates["mfu"],
        "peak_tflops_per_device": trainer.peak_flops / 1e12 if trainer.peak_flops else None,
        "peak_source": trainer.peak_flops_source,
        "memory_peak_bytes": memory_high_water(memory),
        "memory": memory,
        "price_per_hour": cfg.bench.price_per_hour,
        "cost_per_million_tokens": cost_per_million_tokens(cfg.bench.price_per_hour, rates["tokens_per_s"]),
        "step_times_s": step_times,
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _report(run_dir: Path, results: dict[str, Any]) -> None:
    json_path = run_dir / "bench.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    png_path = run_dir / "bench_step_times.png"
    wrote_png = plot_step_times(results, png_path)
    print(format_summary(results))
    print(f"  wrote         {json_path}" + (f", {png_path.name}" if wrote_png else ""))


def format_summary(r: dict[str, Any]) -> str:
    """The human-readable bench report."""
    ms = 1e3
    lines = [
        f"portatrain bench: {r['recipe']} ({r['model']}) on {r['device']} [{r['device_name']}], {r['dtype']}, "
        f"compile={'on' if r['compile'] else 'off'}, batch {r['batch_size']} x {r['seq_len']} "
        f"x accum {r['grad_accum']}, world {r['world_size']}",
        f"  cold start    {r['cold_start_s']:.2f} s to the end of step 1 = setup {r['setup_s']:.2f} s"
        + (f" (model build {r['model_build_s']:.2f} s)" if r["model_build_s"] is not None else "")
        + f" + first step {r['first_step_s']:.2f} s",
        f"  steady state  {r['measured_steps']} steps after {r['warmup_steps']} warm-up: step time median "
        f"{r['step_time_median_s'] * ms:.1f} ms, p90 {r['step_time_p90_s'] * ms:.1f} ms",
        f"  throughput    {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_per_device']:,.0f} per device), "
        f"{r['tflops_per_device']:.3f} TFLOP/s per device",
    ]
    if r["mfu"] is not None:
        lines.append(
            f"  MFU           {100 * r['mfu']:.1f}% of {r['peak_tflops_per_device']:.3g} TFLOP/s ({r['peak_source']})"
        )
    else:
        lines.append(f"  MFU           n/a: peak {r['peak_source']}; set metrics.peak_tflops")
    if r["memory_peak_bytes"] is not None:
        lines.append(f"  memory peak   {r['memory_peak_bytes'] / GIB:.2f} GiB")
    if r["cost_per_million_tokens"] is not None:
        lines.append(
            f"  cost          ${r['cost_per_million_tokens']:.4g} per million tokens at ${r['price_per_hour']}/h"
        )
    return "\n".join(lines)


def plot_step_times(results: dict[str, Any], path: Path) -> bool:
    """Step time of every step (log scale), unmeasured steps shaded. False when matplotlib is missing.

    Draws on a bare ``Figure`` (Agg canvas): no pyplot, so the caller's matplotlib backend is untouched.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("  (matplotlib is not installed, a dev extra: skipping the step-time plot)")
        return False
    times_ms = [t * 1e3 for t in results["step_times_s"]]
    unmeasured = 1 + results["warmup_steps"]
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.axvspan(0.5, unmeasured + 0.5, color="0.9", label=f"cold start + {results['warmup_steps']} warm-up")
    ax.plot(range(1, len(times_ms) + 1), times_ms, marker=".", markersize=3, linewidth=0.8)
    ax.axhline(results["step_time_median_s"] * 1e3, color="C1", label="median (measured)")
    ax.axhline(results["step_time_p90_s"] * 1e3, color="C1", linestyle="--", label="p90 (measured)")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("step time (ms)")
    ax.set_title(
        f"{results['recipe']} on {results['device']}, {results['dtype']}, compile={results['compile']}"
    )
    ax.legend(loc="upper right", fontsize="small")
    fig.savefig(path, dpi=100)
    return True
