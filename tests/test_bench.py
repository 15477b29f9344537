"""``portatrain bench``: cold start apart from steady state, JSON + PNG, per-step sync in bench only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from portatrain.bench import cost_per_million_tokens, percentile, plot_step_times, run_bench
from portatrain.errors import ConfigError
from portatrain.trainer import Trainer
from tests.conftest import TINY, compose_config, run_cli
from tests.helpers import CountingCPU

BENCH = ["bench.warmup_steps=2", "bench.steps=5"]
FIELDS = {
    "setup_s",
    "model_build_s",
    "first_step_s",
    "cold_start_s",
    "step_time_median_s",
    "step_time_p90_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "peak_tflops_per_device",
    "memory_peak_bytes",
    "cost_per_million_tokens",
    "step_times_s",
}


def test_percentile_and_cost() -> None:
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], 50) == 3.0
    assert percentile([float(i) for i in range(1, 11)], 90) == 9.0  # nearest rank: a measured value
    assert percentile([7.0], 90) == 7.0
    # $3.60/h at 1000 tokens/s = 3.6e6 tokens/h: $1 per million tokens.
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million_tokens(None, 1000.0) is None


def test_bench_in_process_syncs_every_step_and_separates_cold_start(tmp_path: Path) -> None:
    made: list[CountingCPU] = []

    class CountingTrainer(Trainer):
        def __init__(self, cfg, accelerator=None):
            made.append(CountingCPU())
            super().__init__(cfg, accelerator=made[-1])

    cfg = compose_config(TINY + BENCH + ["bench.price_per_hour=2.0"], run_dir=tmp_path)
    results = run_bench(cfg, trainer_cls=CountingTrainer)

    assert results.keys() >= FIELDS
    assert len(results["step_times_s"]) == 1 + 2 + 5
    measured = results["step_times_s"][3:]
    assert results["step_time_median_s"] == sorted(measured)[2]
    assert results["step_time_p90_s"] == max(measured)
    assert results["cold_start_s"] >= results["setup_s"] + results["first_step_s"] - 1e-6
    assert results["cost_per_million_tokens"] == pytest.approx(2.0 / (results["tokens_per_s"] * 3600) * 1e6)
    assert 0 < results["mfu"] < 1.5
    # Bench mode synchronizes after every step (8) and after materializing (1); trainer.log_every=1
    # in TINY adds one per step of the Trainer's own logging (8).
    assert made[0].syncs == 8 + 1 + 8
    # Bench turns evaluation and checkpoints off and records what it ran.
    assert not (tmp_path / "checkpoints").exists()
    assert "steps: 8" in (tmp_path / "config.yaml").read_text()
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["step_times_s"] == results["step_times_s"]
    assert (tmp_path / "bench_step_times.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_settings_all_at_once(tmp_path: Path) -> None:
    cfg = compose_config(TINY + ["bench.steps=0", "bench.warmup_steps=-1"], run_dir=tmp_path)
    with pytest.raises(ConfigError) as err:
        run_bench(cfg)
    assert "bench.steps=0" in str(err.value) and "bench.warmup_steps=-1" in str(err.value)


def test_plot_is_skipped_with_a_message_without_matplotlib(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    results = {"step_times_s": [1.0, 0.1], "warmup_steps": 0}
    assert plot_step_times(results, tmp_path / "x.png") is False
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


def test_bench_command_writes_json_and_png(tmp_path: Path) -> None:
    out = run_cli(["bench", *TINY, *BENCH, "bench.price_per_hour=1.0", f"run_dir={tmp_path}"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "cold start" in out.stdout and "steady state" in out.stdout and "MFU" in out.stdout
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results.keys() >= FIELDS
    assert results["measured_steps"] == 5 and len(results["step_times_s"]) == 8
    assert (tmp_path / "bench_step_times.png").stat().st_size > 1000


def test_bench_command_reports_config_errors_without_traceback(tmp_path: Path) -> None:
    out = run_cli(["bench", *TINY, "bench.steps=0", f"run_dir={tmp_path}"], cwd=tmp_path)
    assert out.returncode == 2
    assert "bench.steps=0 must be >= 1" in out.stderr and "Traceback" not in out.stderr
