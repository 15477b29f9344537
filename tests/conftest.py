"""Shared fixtures: tiny configs composed through Hydra exactly as the CLI composes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from portatrain.cli import config_dir
from portatrain.config import register_configs

ROOT = Path(__file__).resolve().parents[1]

# Small enough that a few steps take a fraction of a second on one core.
TINY = [
    "device=cpu",
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.steps=4",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "optim.warmup_steps=2",
]


def compose_config(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = compose("config", overrides=overrides)
    if run_dir is not None:
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    return cfg


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> DictConfig:
    return compose_config(TINY, run_dir=tmp_path / "run")


def run_cli(
    args: list[str], *, cwd: Path, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m portatrain ARGS`` in a fresh process."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "portatrain", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
