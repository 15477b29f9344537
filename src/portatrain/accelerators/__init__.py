"""Accelerator registry and discovery.

``resolve_accelerator("auto")`` tries tpu -> neuron -> cuda and verifies each candidate with a
probe allocation before choosing it, ending at cpu. A device named explicitly that cannot be
used raises :class:`DeviceUnavailableError` with the reason and the install hint. Importing this
package imports no vendor module.
"""

from __future__ import annotations

import logging
import os

from portatrain.accelerators.base import Accelerator, DeviceUnavailableError
from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.accelerators.cuda import CUDAAccelerator
from portatrain.accelerators.mps import MPSAccelerator
from portatrain.accelerators.neuron import NeuronAccelerator
from portatrain.accelerators.sim.adapter import SimAccelerator  # builds nothing until selected
from portatrain.accelerators.tpu import TPUAccelerator

__all__ = ["ACCELERATORS", "AUTO_ORDER", "Accelerator", "DeviceUnavailableError", "resolve_accelerator"]

logger = logging.getLogger(__name__)

ACCELERATORS: dict[str, type[Accelerator]] = {
    cls.name: cls
    for cls in (
        CPUAccelerator,
        CUDAAccelerator,
        TPUAccelerator,
        NeuronAccelerator,
        MPSAccelerator,
        SimAccelerator,
    )
}
AUTO_ORDER = ("tpu", "neuron", "cuda", "cpu")


def _try(name: str, index: int) -> tuple[Accelerator | None, str | None]:
    acc = ACCELERATORS[name](index)
    reason = acc.unavailable_reason()
    if reason is None:
        try:
            acc.probe()
        except Exception as exc:
            reason = f"probe allocation on {acc.device} failed: {type(exc).__name__}: {exc}"
    return (acc, None) if reason is None else (None, reason)


_announced: set[str] = set()
"""Devices ``device=auto`` has announced choosing in this process (a dry run asks twice)."""


def resolve_accelerator(kind: str = "auto", index: int = 0) -> Accelerator:
    """Return a verified accelerator for ``device.type=kind``."""
    if kind == "auto":
        for name in AUTO_ORDER:
            # Skip uninstalled vendor stacks without importing anything.
            if not ACCELERATORS[name](index).vendor_installed():
                continue
            acc, reason = _try(name, index)
            if acc is not None:
                chosen = acc.describe()
                # Once per job (rank 0, once a process), at info; the candidates passed over (CUDA on
                # every CPU-only torch, which ships the module) are debug lines, read on request.
                first = chosen not in _announced and os.environ.get("RANK", "0") == "0"
                logger.log(logging.INFO if first else logging.DEBUG, "device=auto selected %s", chosen)
                _announced.add(chosen)
                return acc
            logger.debug("device=auto skipped %s: %s", name, reason)
        raise AssertionError("unreachable: cpu is always available")
    if kind not in ACCELERATORS:
        raise DeviceUnavailableError(
            f"device={kind!r} is not a known device; choose one of auto, {', '.join(ACCELERATORS)}"
        )
    acc, reason = _try(kind, index)
    if acc is None:
        hint = ACCELERATORS[kind].install_hint
        raise DeviceUnavailableError(
            f"device={kind} was requested but cannot be used: {reason}. Fix: {hint}; "
            f"or run with device=auto to use the best available device."
        )
    return acc
