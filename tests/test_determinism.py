"""``trainer.deterministic=true``: two runs of one config on one device give bitwise-identical losses
(``portatrain.train.runtime.seed_run`` and the adapters' ``make_deterministic``), and a run that cannot
promise it says why in one warning line."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.accelerators.cuda import CUDAAccelerator
from portatrain.accelerators.tpu import TPUAccelerator
from portatrain.train.runtime import seed_run
from portatrain.trainer import Trainer
from tests.helpers import compose_config, fit, step_losses
from tests.test_sim import run_python

DETERMINISTIC = ["trainer.deterministic=true", "trainer.steps=3", "checkpoint.enabled=false"]


class DrawsFromEveryRNG(Trainer):
    """Research code that draws from Python's, NumPy's and torch's global generators in its loss (an
    augmentation, a sampled weight): its losses repeat only if every one of them is seeded."""

    def compute_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        scale = 1.0 + random.random() + float(np.random.rand()) + float(torch.rand(()))
        return super().compute_loss(logits, batch) * scale


@pytest.fixture(autouse=True)
def _restore_deterministic_flag():
    """The flag is process-wide: the rest of the suite gets it back as it was."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_two_cpu_runs_give_bitwise_identical_losses(tmp_path: Path) -> None:
    runs = []
    for name, noise in (("a", 1), ("b", 2)):
        random.seed(noise)  # whatever ran before the run leaves the global generators elsewhere
        np.random.seed(noise)
        torch.manual_seed(noise)
        fit(DETERMINISTIC, tmp_path / name, DrawsFromEveryRNG)
        runs.append(step_losses(tmp_path / name))
    assert list(runs[0]) == [1, 2, 3]
    assert runs[0] == runs[1]  # exact float equality, not approx
    assert torch.are_deterministic_algorithms_enabled()


def test_two_sim_runs_give_bitwise_identical_losses(tmp_path: Path) -> None:
    """One fresh process (installing the sim device cannot be undone), two runs in it."""
    out = run_python(
        f"""
        import json
        from pathlib import Path
        from tests.helpers import TINY, fit, step_losses
        from tests.test_determinism import DrawsFromEveryRNG

        overrides = [o for o in TINY if not o.startswith("device=")] + ["device=sim", *{DETERMINISTIC!r}]
        runs = []
        for name in ("a", "b"):
            fit(overrides, Path({str(tmp_path)!r}) / name, DrawsFromEveryRNG)
            runs.append(step_losses(Path({str(tmp_path)!r}) / name))
        print(json.dumps(runs))
        """,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    first, second = json.loads(out.strip().splitlines()[-1])
    assert list(first) == ["1", "2", "3"]
    assert first == second


def _seed(overrides: list[str], accelerator, caplog) -> list[str]:
    runtime = SimpleNamespace(accelerator=accelerator, dist=SimpleNamespace(is_main=True))
    with caplog.at_level(logging.WARNING, logger="portatrain.train.runtime"):
        seed_run(compose_config(["trainer.deterministic=true", *overrides]), runtime)
    return [r.getMessage() for r in caplog.records]


def test_what_cannot_promise_it_says_so_in_one_line(caplog, monkeypatch) -> None:
    assert _seed([], CPUAccelerator(), caplog) == []
    assert _seed(["compile.enabled=true", "compile.backend=aot_eager"], CPUAccelerator(), caplog) == []
    (compiled,) = _seed(["compile.enabled=true"], CPUAccelerator(), caplog)
    assert "'inductor'" in compiled and "\n" not in compiled
    caplog.clear()
    (vendor,) = _seed([], TPUAccelerator(), caplog)
    assert vendor.startswith("trainer.deterministic=true cannot promise") and "tpu:" in vendor
    # CUDA: the cuBLAS workspace is fixed through the adapter (no GPU needed to set it).
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # restored after the test, set or not
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert CUDAAccelerator().make_deterministic(None) is None
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
