"""``StepProfiler``: records exactly the configured window of steps, and nothing when off or past it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from portatrain.config import ProfileConfig
from portatrain.errors import ConfigError
from portatrain.profiling import StepProfiler, profile_problems

CPU = [torch.profiler.ProfilerActivity.CPU]


def _run(profiler: StepProfiler, steps: int, first: int = 0) -> None:
    x = torch.ones(8, 8)
    for step in range(first + 1, first + steps + 1):
        with torch.profiler.record_function(f"train_step_{step}"):
            x = x @ x / 8
        profiler.step()
    profiler.close()


def _profiled_steps(out: Path) -> set[str]:
    (trace,) = out.glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("train_step_")}


def test_window_records_only_its_steps(tmp_path: Path) -> None:
    cfg = ProfileConfig(enabled=True, start_step=3, steps=2)
    _run(StepProfiler(cfg, tmp_path, first_step=0, activities=CPU, worker_name="rank0"), steps=6)
    assert _profiled_steps(tmp_path) == {"train_step_3", "train_step_4"}


def test_window_at_step_one_has_no_warmup_step(tmp_path: Path) -> None:
    cfg = ProfileConfig(enabled=True, start_step=1, steps=1)
    _run(StepProfiler(cfg, tmp_path, first_step=0, activities=CPU, worker_name="rank0"), steps=3)
    assert _profiled_steps(tmp_path) == {"train_step_1"}


def test_disabled_or_resumed_past_the_window_records_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(StepProfiler(ProfileConfig(), tmp_path / "off", first_step=0, activities=CPU, worker_name="r"), 3)
    assert not (tmp_path / "off").exists()
    cfg = ProfileConfig(enabled=True, start_step=2, steps=2)
    with caplog.at_level(logging.WARNING, logger="portatrain.profiling"):
        profiler = StepProfiler(cfg, tmp_path / "late", first_step=5, activities=CPU, worker_name="r")
    _run(profiler, steps=3, first=5)
    assert not (tmp_path / "late").exists()
    assert "nothing profiled" in caplog.text


def test_a_window_cut_short_is_saved_on_close(tmp_path: Path) -> None:
    cfg = ProfileConfig(enabled=True, start_step=2, steps=10)
    _run(StepProfiler(cfg, tmp_path, first_step=0, activities=CPU, worker_name="rank0"), steps=3)
    assert _profiled_steps(tmp_path) >= {"train_step_2"}


def test_problems() -> None:
    assert profile_problems(ProfileConfig(enabled=False, steps=0)) == []  # off: not checked
    (problem,) = profile_problems(ProfileConfig(enabled=True, start_step=0, steps=0))
    assert "profile.start_step=0" in problem and "profile.steps=0" in problem
    with pytest.raises(ConfigError, match="must both be >= 1"):
        StepProfiler(
            ProfileConfig(enabled=True, steps=0),
            Path("unused"),
            first_step=0,
            activities=CPU,
            worker_name="r",
        )
