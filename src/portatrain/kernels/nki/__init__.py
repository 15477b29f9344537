"""NKI (Trainium) kernel overrides: ``kernels.py`` holds the kernels, ``bridge.py`` the PyTorch custom ops.

Importing this package loads nothing heavy; ``nki`` and ``torch_neuronx`` are imported by the
builders below, which run only for overrides named in ``kernels.enabled`` (or for a parity check).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def build(operation: str) -> Callable[..., torch.Tensor]:
    """``nki_<operation>``: the kernel on a NeuronCore through ``torch_neuronx.nki_op``."""
    from portatrain.kernels.nki.bridge import build_device

    return build_device(operation)


def build_simulate(operation: str) -> Callable[..., torch.Tensor]:
    """The same kernel in ``nki.simulate`` on CPU, through the shared custom-op registration."""
    from portatrain.kernels.nki.bridge import build_simulated

    return build_simulated(operation)
