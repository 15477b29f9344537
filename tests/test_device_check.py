"""``scripts/device_check.py --dry-run``: the GPU script's plumbing on the CPU, in this process.

Parity, the bench of each recipe with the plan beside its peak, and the MoE block, at tiny sizes. The
CPU here declares FP8 only (MXFP8 undeclared), so the ``mxfp8`` row is the one-line refusal a GPU
without MXFP8 (an H200) prints; a model the plan says cannot fit is skipped, not run.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from portatrain.accelerators.cpu import CPUAccelerator
from tests.helpers import ROOT

pytest.importorskip("torchao", reason="the FP8 rows need torchao (pip install -e '.[dev]')")


def _script():  # noqa: ANN202 (a module)
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_every_section_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(CPUAccelerator, "low_precision_matmuls", lambda self: {"float8": "emulated"})
    results = _script().main(["--dry-run", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "device_check.json").read_text()) == json.loads(json.dumps(results))
    assert results["parity"]["ok"] and results["parity"]["steps"] == 1
    bf16, rowwise, mxfp8 = results["throughput"]
    for row in (bf16, rowwise):
        assert row["tokens_per_s"] > 0 and row["plan_bytes"] > 0 and row["peak_bytes"] > 0, row
    assert mxfp8["refused"].startswith("quantize.linear=mxfp8: device cpu") and "\n" not in mxfp8["refused"]
    assert set(results["moe"]["seconds"]) >= {"dense", "ours-dropless", "ours-capacity", "ours-matmuls"}
    table = printed[printed.index("device_check on") :]
    assert "llama3 debug  float8_rowwise" in table and "declares no MXFP8 matmuls" in table
    assert "vs bf16" in table and "plan/peak" in table and "dense / this" in table


def test_a_model_the_plan_cannot_fit_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    monkeypatch.setattr(script, "device_memory", lambda accelerator: 1024)
    (row,) = script.check_throughput(script.DRY_RUN, tmp_path, CPUAccelerator())
    assert row["refused"].startswith("skipped: the plan needs") and "of the device's 0 GiB" in row["refused"]
