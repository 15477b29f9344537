"""Precision as an axis: the simulated device trains in the precision of the device it impersonates.

``device=sim`` with ``PORTATRAIN_SIM_AS=tpu`` (or ``neuron``) takes that device's default dtype,
bf16, where ``trainer.dtype=auto``; plain ``sim`` stays fp32. Both mixture-of-experts families then
train in both dispatch modes on the impersonating sim, against the same runs on the CPU in bf16.

The other bf16 cases sit beside their fp32 ones, in the same launches: every family
(``tests/test_conformance.py``), context and tensor parallel with FSDP2's bf16 parameters
(``tests/test_context_parallel.py``), expert parallel in both dispatches
(``tests/test_expert_parallel.py``) and pipeline parallel (``tests/test_pipeline.py``). Every
tolerance is derived from bf16's unit roundoff and the model's depth in ``tests/helpers.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from portatrain.models import model_args
from tests.helpers import ROOT, bf16_tolerance, compose_config, decoder_roundings
from tests.test_sim import run_python

MOE_MODELS = ("qwen3_moe_debug", "deepseek_v3_debug")


def test_the_sim_default_dtype_follows_the_impersonated_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from portatrain.accelerators import ACCELERATORS
    from portatrain.accelerators.sim import settings
    from portatrain.accelerators.sim.adapter import SimAccelerator
    from portatrain.plan import training_dtype

    if settings.installed() is not None:
        pytest.skip(f"the sim device is installed in this process as {settings.installed()!r}")
    monkeypatch.delenv(settings.SIM_AS_ENV, raising=False)
    assert SimAccelerator().default_dtype == training_dtype("auto", "sim") == torch.float32
    for name in ("tpu", "neuron"):
        monkeypatch.setenv(settings.SIM_AS_ENV, name)
        assert SimAccelerator().default_dtype == ACCELERATORS[name]().default_dtype == torch.bfloat16
        assert training_dtype("auto", "sim") == torch.bfloat16  # what the dry run and the plan say


def test_moe_dispatches_train_in_bf16_on_the_sim_impersonating_a_tpu() -> None:
    """Two steps of each MoE family in each dispatch on ``device=sim`` as ``tpu`` (``trainer.dtype``
    left at ``auto``) and on the CPU in bf16, in one fresh process (the sim renames PrivateUse1 for
    good). The sim runs the CPU's kernels under the accelerators' autocast lists (CUDA's), so the two
    are two bf16 computations of one model: within the bound of ``tests/helpers.py`` for the
    family's depth (measured: losses within 1e-4, gradient norms within 1.2e-3, relative)."""
    code = """
        import json
        import os
        import tempfile
        from pathlib import Path
        from portatrain.trainer import Trainer
        from tests.helpers import BF16, TINY, compose_config, train_records

        out = {}
        for model in os.environ["MOE_MODELS"].split(","):
            for dispatch in ("capacity", "dropless"):
                for device in ("sim", "cpu"):
                    overrides = [o for o in TINY if not o.startswith("device=")] + [
                        f"device={device}", f"model={model}", f"model.moe_dispatch={dispatch}",
                        "trainer.steps=2", "checkpoint.enabled=false", "metrics.peak_tflops=1",
                    ]
                    if device == "cpu":
                        overrides += BF16
                    run_dir = Path(tempfile.mkdtemp()) / "run"
                    trainer = Trainer(compose_config(overrides, run_dir))
                    try:
                        trainer.fit()
                    finally:
                        trainer.close()
                    records = [(r["loss"], r["grad_norm"]) for r in train_records(run_dir)]
                    out[f"{model} {dispatch} {device}"] = [str(trainer.device), str(trainer.dtype), records]
        print(json.dumps(out))
    """
    env = {
        "PORTATRAIN_SIM_AS": "tpu",
        "MOE_MODELS": ",".join(MOE_MODELS),
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
    }
    runs = json.loads(run_python(code, env=env).strip().splitlines()[-1])
    for model in MOE_MODELS:
        n_layers = model_args(compose_config([f"model={model}"]).model).n_layers
        loss_bound = bf16_tolerance(2 * decoder_roundings(n_layers))
        grad_bound = bf16_tolerance(2 * decoder_roundings(n_layers, backward=True))
        for dispatch in ("capacity", "dropless"):
            sim_device, sim_dtype, sim = runs[f"{model} {dispatch} sim"]
            cpu_device, cpu_dtype, cpu = runs[f"{model} {dispatch} cpu"]
            assert (sim_device, sim_dtype) == ("tpu:0", "torch.bfloat16"), (model, dispatch)
            assert (cpu_device, cpu_dtype) == ("cpu", "torch.bfloat16")
            assert len(sim) == len(cpu) == 2, (model, dispatch, sim, cpu)
            for (loss, norm), (cpu_loss, cpu_norm) in zip(sim, cpu, strict=True):
                assert loss == pytest.approx(cpu_loss, rel=loss_bound), (model, dispatch, sim, cpu)
                assert norm == pytest.approx(cpu_norm, rel=grad_bound), (model, dispatch, sim, cpu)
