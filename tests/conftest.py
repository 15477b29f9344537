"""Shared fixtures. The helpers themselves live in ``tests/helpers.py`` (re-exported here for the
tests that import them from ``tests.conftest``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import DictConfig

from tests.helpers import ROOT, TINY, compose_config, run_cli

__all__ = ["ROOT", "TINY", "compose_config", "run_cli", "tiny_cfg"]


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> DictConfig:
    return compose_config(TINY, run_dir=tmp_path / "run")
