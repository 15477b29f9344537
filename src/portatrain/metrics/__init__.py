"""Training metrics: what a step costs, and the sinks that record it (rank 0 only).

One module per concern:

- ``throughput.py`` -- ``model_flops``, ``resolve_peak_flops`` / ``above_peak`` (the peak MFU
  divides by, fixed for the run, and the line to log when a window runs above it), ``throughput_metrics``, ``memory_metrics``,
  ``checkpoint_metrics`` and ``progress_postfix``: the numbers of a log record;
- ``sinks.py`` -- ``JSONLSink`` (``<run_dir>/metrics.jsonl``) and ``TensorBoardSink``
  (``<run_dir>/tensorboard``, opt-in), and ``scalars``, the names every sink but JSONL logs under;
- ``trackers.py`` -- experiment trackers, opt-in: ``WandbSink`` (``metrics.wandb=true``) and
  ``MLflowSink`` (``metrics.mlflow=URI``), their run ids kept in ``<run_dir>/trackers.json`` for a
  resumed run; a tracker that fails is one warning, never a stopped run. ``metrics_problems``
  checks the settings before anything runs.

``MetricsLogger`` (here) fans a record out to every sink.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from portatrain.metrics.sinks import JSONLSink, TensorBoardSink, scalars
from portatrain.metrics.throughput import (
    GIB,
    above_peak,
    checkpoint_metrics,
    memory_high_water,
    memory_metrics,
    model_flops,
    progress_postfix,
    resolve_peak_flops,
    throughput_metrics,
)
from portatrain.metrics.trackers import (
    TRACKERS_FILE,
    MLflowSink,
    WandbSink,
    metrics_problems,
    mlflow_uri_problem,
    start_trackers,
)

__all__ = [
    "GIB",
    "above_peak",
    "TRACKERS_FILE",
    "JSONLSink",
    "MetricsLogger",
    "MLflowSink",
    "TensorBoardSink",
    "WandbSink",
    "checkpoint_metrics",
    "memory_high_water",
    "memory_metrics",
    "metrics_problems",
    "mlflow_uri_problem",
    "model_flops",
    "progress_postfix",
    "resolve_peak_flops",
    "scalars",
    "throughput_metrics",
]


class MetricsLogger:
    """Fans a record out to every sink; a no-op on ranks other than 0 (which open no sink, start no
    tracker and import neither package).

    ``config`` (the run's config; redacted here, before any tracker sees it) and ``resumed`` (the run
    continues from a checkpoint: continue the trackers' runs too) matter only with a tracker on.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        jsonl: bool = True,
        tensorboard: bool = False,
        wandb: bool = False,
        mlflow: str | None = None,
        config: Any = None,
        resumed: bool = False,
    ) -> None:
        self.sinks: list[Any] = []
        if enabled and jsonl:
            self.sinks.append(JSONLSink(run_dir / "metrics.jsonl"))
        if enabled and tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if enabled and (wandb or mlflow is not None):
            self.sinks += start_trackers(run_dir, wandb=wandb, mlflow=mlflow, config=config, resumed=resumed)

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
