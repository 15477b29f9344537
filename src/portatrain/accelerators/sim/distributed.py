"""The sim device's process-group backend (filled in with csrc/dist.cpp)."""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "simccl"


def register(ext: Any, name: str) -> None:
    """Register the ``simccl`` backend for device ``name`` (no-op until built)."""
