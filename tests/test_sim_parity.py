"""``portatrain parity``: the sim device against the fp32 CPU reference, clean and with a planted bug.

The bug lives only on the device side, as a device-kernel bug would: a Trainer subclass (passed
through ``portatrain.cli.main(trainer_cls=...)``, as research code does) gives one RMSNorm a wrong
epsilon when its accelerator is the sim. Parity must fail and name that module. Each run is a fresh
process (installing the sim device renames PrivateUse1 for the whole process).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers import python

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "parity",
    "device=sim",
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.steps=2",
]

SCRIPT = """
import sys
from portatrain.cli import main
from portatrain.trainer import Trainer

class DeviceBug(Trainer):
    def build_model(self):
        model = super().build_model()
        if self.accelerator.device_type == "sim":
            model.get_submodule("layers.1.post_attention_layernorm").eps = 0.5
        return model

sys.argv = ["portatrain", *sys.argv[1:]]
main(trainer_cls=DeviceBug)
"""


def _parity(tmp_path: Path, bug: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "parity_main.py"
    script.write_text(
        SCRIPT if bug else SCRIPT.replace("main(trainer_cls=DeviceBug)", "main(trainer_cls=Trainer)")
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        python(str(script), *ARGS, f"run_dir={tmp_path / 'run'}"),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )


def test_parity_passes_on_a_correct_device(tmp_path: Path) -> None:
    out = _parity(tmp_path, bug=False)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert (
        "PASS: step 1's module outputs and gradients, and every step's loss and optimizer update, are within "
        "tolerance" in out.stdout
    )
    assert "parity: sim (float32) vs cpu (float32)" in out.stdout


def test_parity_names_the_module_with_a_planted_bug(tmp_path: Path) -> None:
    out = _parity(tmp_path, bug=True)
    assert out.returncode == 1, out.stdout + out.stderr[-4000:]
    verdict = out.stdout.strip().splitlines()[-1]
    assert verdict.startswith(
        "FAIL: first divergence at step 1: activation of 'layers.1.post_attention_layernorm'"
    )
