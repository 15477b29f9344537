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
