"""The local sinks of a log record (rank 0 only), and the scalar names every sink but JSONL uses.

- ``scalars``: a record's finite numbers as ``train/<key>``, ``eval/<key>``, ``memory/<key>``;
- ``JSONLSink``: ``<run_dir>/metrics.jsonl``, one JSON object per line;
- ``TensorBoardSink``: ``<run_dir>/tensorboard``, opt-in with ``metrics.tensorboard=true``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from portatrain.errors import ConfigError


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's finite numbers, named as every sink but JSONL names them: ``train/<key>``,
    ``eval/<key>``, ``memory/<key>`` (the step is the x-axis, not a scalar); a key that already
    names its group (``eval/<task>/<metric>`` from lm-eval tasks) keeps its name."""
    named = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        if "/" in key:
            named[key] = value
            continue
        group = "eval" if key.startswith("eval") else "memory" if key.startswith("memory") else "train"
        named[f"{group}/{key}"] = value
    return named


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
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, global_step=record.get("step"))

    def close(self) -> None:
        self._writer.close()
