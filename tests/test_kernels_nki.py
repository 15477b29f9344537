"""NKI kernels against the PyTorch references in NKI's CPU simulator (``nki.simulate``).

The ``nki`` package is served from AWS's Neuron pip repository, not PyPI (PyPI's ``nki`` is an
empty placeholder without ``simulate``), so these tests skip, saying so, wherever it is missing.
The device path (``torch_neuronx.nki_op`` on a NeuronCore) needs a Trainium host.
"""

from __future__ import annotations

import pytest
import torch

from portatrain.kernels import OVERRIDES
from portatrain.kernels.parity import CHECKS, run_check

_SIMULATOR_MISSING = CHECKS["nki"].unavailable()


@pytest.mark.skipif(_SIMULATOR_MISSING is not None, reason=f"nki.simulate unavailable: {_SIMULATOR_MISSING}")
@pytest.mark.parametrize("operation", ["rmsnorm", "swiglu", "rope"])
def test_nki_kernel_matches_reference_in_simulator(operation: str) -> None:
    results = run_check(OVERRIDES[f"nki_{operation}"])
    assert results and all(r.dtype == torch.float32 for r in results)
    for r in results:
        assert r.ok, r


@pytest.mark.skipif(
    getattr(torch, "neuron", None) is None, reason="needs a Trainium host with torch_neuronx and nki"
)
@pytest.mark.parametrize("operation", ["rmsnorm", "swiglu", "rope"])
def test_nki_op_on_neuron_matches_reference(operation: str) -> None:  # pragma: no cover - Trainium only
    from portatrain.kernels.parity import CASES, run_case

    kernel = OVERRIDES[f"nki_{operation}"].build()
    for case in CASES[operation]:
        result = run_case(f"nki_{operation}", kernel, case, device="neuron")
        assert result.ok, result


# --- the torch side of the simulator bridge, with NumPy stand-ins for the kernels ---
# Runs everywhere: checks the reshaping, 128-row padding, slicing back and the autograd wiring of
# bridge.py against the kernels' shape contract. It says nothing about the NKI kernels themselves.


def _np_stand_ins():
    import numpy as np

    def rows_ok(*arrays):
        for a in arrays:
            assert a.ndim == 2 and a.shape[0] % 128 == 0, a.shape  # the kernels' contract

    def rmsnorm_fwd_kernel(x, w, eps):
        rows_ok(x)
        assert w.shape == (1, x.shape[1])
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rmsnorm_bwd_kernel(x, w, g, eps):
        rows_ok(x, g)
        inv = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        normed, gw = x * inv, g * w
        return inv * (gw - normed * (gw * normed).mean(-1, keepdims=True)), g * normed

    def swiglu_fwd_kernel(a, b):
        rows_ok(a, b)
        return a / (1 + np.exp(-a)) * b

    def swiglu_bwd_kernel(a, b, g):
        rows_ok(a, b, g)
        s = 1 / (1 + np.exp(-a))
        silu = a * s
        return g * b * (s + silu * (1 - s)), g * silu

    def rope_kernel(x, cos, sin):
        assert x.ndim == 4 and x.shape[2] % 128 == 0 and cos.ndim == 3, (x.shape, cos.shape)
        half = x.shape[-1] // 2
        rotated = np.concatenate((-x[..., half:], x[..., :half]), -1)
        return x * cos[:, None] + rotated * sin[:, None]

    return {
        f.__name__: f
        for f in (rmsnorm_fwd_kernel, rmsnorm_bwd_kernel, swiglu_fwd_kernel, swiglu_bwd_kernel, rope_kernel)
    }


@pytest.mark.skipif(_SIMULATOR_MISSING is None, reason="the real nki.simulate is installed: tested above")
@pytest.mark.parametrize("operation", ["rmsnorm", "swiglu", "rope"])
def test_simulator_bridge_pads_reshapes_and_wires_autograd(
    operation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import types

    from portatrain.kernels.parity import CASES, run_case

    stand_ins = _np_stand_ins()
    fake_nki = types.ModuleType("nki")
    fake_nki.jit = lambda fn: fn
    fake_nki.simulate = lambda kernel: stand_ins[kernel.__name__]
    fake_nki.language = types.ModuleType("nki.language")
    monkeypatch.setitem(sys.modules, "nki", fake_nki)
    monkeypatch.setitem(sys.modules, "nki.language", fake_nki.language)
    for mod in ("portatrain.kernels.nki.kernels", "portatrain.kernels.nki.bridge"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    from portatrain.kernels.nki import build_simulate

    try:
        kernel = build_simulate(operation)
        cases = [c for c in CASES[operation] if c.dtype == torch.float32]
        assert cases
        for case in cases:
            result = run_case(f"nki_{operation}", kernel, case)
            assert result.ok, result
    finally:  # the modules imported against the fake nki must not outlive the test
        for mod in ("portatrain.kernels.nki.kernels", "portatrain.kernels.nki.bridge"):
            sys.modules.pop(mod, None)
