"""Pallas (TPU) kernel overrides: ``kernels.py`` holds the kernels, ``bridge.py`` the PyTorch custom ops.

Importing this package loads nothing heavy; jax is imported by the builders below, which
:func:`portatrain.kernels.resolve` calls only for overrides named in ``kernels.enabled``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def build_tpu(operation: str) -> Callable[..., torch.Tensor]:
    """``pallas_<operation>``: the kernel on a TPU through ``torch.tpu.pallas.jax_op``."""
    from portatrain.kernels.pallas.bridge import build

    return build(operation, "tpu")


def build_interpret(operation: str) -> Callable[..., torch.Tensor]:
    """``pallas_interpret_<operation>``: the same kernel in JAX's CPU interpreter."""
    if getattr(torch, "tpu", None) is None:
        # No TPU in this process: keep JAX on its CPU backend instead of probing for TPUs (a
        # TPU_* variable in the environment makes it try libtpu and log a failure).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from portatrain.kernels.pallas.bridge import build

    return build(operation, "interpret")
