"""Metric sinks: one JSON object per line in ``<run_dir>/metrics.jsonl`` (rank 0 only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JSONLSink:
    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)  # line-buffered: a killed run keeps every logged line

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class MetricsLogger:
    """Fans a record out to every sink; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, *, enabled: bool, jsonl: bool = True) -> None:
        self.sinks: list[Any] = []
        if enabled and jsonl:
            self.sinks.append(JSONLSink(run_dir / "metrics.jsonl"))

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
