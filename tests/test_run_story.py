"""A run tells its story (issue 39): a start banner, each evaluation's results, an end summary on the
console (rank 0), the summary also in ``<run_dir>/summary.json``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.helpers import fit, read_metrics


def test_banner_evaluations_and_summary_on_screen_and_in_summary_json(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="portatrain")
    trainer = fit(["trainer.steps=3", "trainer.eval_every=2", "trainer.progress=true"], tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("portatrain.train.progress")]
    banner, where = lines[0], lines[1]
    assert banner.startswith("debug: llama3 debug, ") and " parameters on 1 x cpu " in banner, banner
    assert "3 steps of 4 rows x 64 positions from step 0" in banner, banner
    assert where == f"run directory {tmp_path} (config.yaml, metrics.jsonl, checkpoints/)"
    evals = [m for m in read_metrics(tmp_path) if "eval_loss" in m]
    assert [line for line in lines if line.startswith("step") and "eval_loss" in line] == [
        f"step {m['step']}/3  eval_loss {m['eval_loss']:.4g}" for m in evals
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    last = [m for m in read_metrics(tmp_path) if "loss" in m][-1]
    assert summary["steps"] == summary["trained_steps"] == trainer.step == 3
    assert summary["loss"] == pytest.approx(last["loss"]) and summary["eval_loss"] == pytest.approx(
        evals[-1]["eval_loss"]
    )
    assert summary["tokens_seen"] == last["tokens_seen"] and summary["run_dir"] == str(tmp_path)
    assert lines[-1].startswith("trained 3 steps in ") and f"summary.json in {tmp_path}" in lines[-1]
    assert f"loss {last['loss']:.4g}, eval_loss {evals[-1]['eval_loss']:.4g}" in lines[-1]
