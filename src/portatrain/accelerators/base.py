"""The accelerator adapter contract.

One subclass per backend holds everything backend-specific: the torch device type, the
distributed backend, the compile backend, synchronize, memory statistics and RNG. Vendor
modules (``torch_tpu``, ``torch_neuronx``) are imported only inside the adapter's
:meth:`Accelerator.load`, which runs when that backend is selected or probed, never at
``import portatrain``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch


class DeviceUnavailableError(RuntimeError):
    """An explicitly requested device cannot be used; the message says why and how to fix it."""


class Accelerator:
    name: str = ""
    """Config name (``device.type=NAME``)."""
    device_type: str = ""
    """``torch.device`` type string."""
    vendor_module: str | None = None
    """Python module that registers the backend with torch, imported only by :meth:`load`."""
    install_hint: str = ""
    """How to get the missing stack, shown when the device was requested but is absent."""
    dist_backend: str | None = None
    """``torch.distributed`` backend; None lets torch pick the one the vendor registered for its device type."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend name."""
    static_shapes: bool = False
    """Whether the compiler wants ``dynamic=False`` (one graph per shape, shapes kept bounded)."""
    default_dtype: torch.dtype = torch.bfloat16
    """Training precision when ``trainer.dtype=auto``."""
    fused_adamw: bool = False
    """Whether ``torch.optim.AdamW(fused=True)`` is supported here."""

    def __init__(self, index: int = 0) -> None:
        self.index = index

    # -- discovery -------------------------------------------------------------------------
    def vendor_installed(self) -> bool:
        """True when the vendor module is importable, checked without importing it."""
        return self.vendor_module is None or importlib.util.find_spec(self.vendor_module) is not None

    def load(self) -> None:
        """Import the vendor module so torch knows the device type. Raise ImportError if absent."""
        if self.vendor_module is not None:
            importlib.import_module(self.vendor_module)

    def device_count(self) -> int:
        module = getattr(torch, self.device_type, None)
        count = getattr(module, "device_count", None)
        return int(count()) if callable(count) else 0

    def unavailable_reason(self) -> str | None:
        """None when usable; otherwise a one-line reason. Imports the vendor module if installed."""
        if not self.vendor_installed():
            return f"the Python package {self.vendor_module!r} is not installed"
        try:
            self.load()
        except Exception as exc:  # vendor import failures come in every exception type
            return f"importing {self.vendor_module} failed: {type(exc).__name__}: {exc}"
        count = self.device_count()
        if count <= self.index:
            return f"{count} {self.device_type} device(s) visible, need index {self.index}"
        return None

    def probe(self) -> None:
        """Allocate and compute on the device, then synchronize: proves the runtime works."""
        x = torch.ones(8, device=self.device)
        if float((x * 2).sum().item()) != 16.0:
            raise RuntimeError(f"probe allocation on {self.device} returned a wrong result")
        self.synchronize()

    # -- runtime ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.index)

    def set_device(self) -> None:
        module = getattr(torch, self.device_type, None)
        if module is not None and hasattr(module, "set_device"):
            module.set_device(self.index)

    def synchronize(self) -> None:
        module = getattr(torch, self.device_type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize(self.index)

    def memory_stats(self) -> dict[str, int]:
        """Allocator statistics in bytes: ``allocated``, ``reserved``, ``peak_allocated`` where known."""
        module = getattr(torch, self.device_type, None)
        stats: dict[str, int] = {}
        for key, fn in (
            ("allocated", "memory_allocated"),
            ("reserved", "memory_reserved"),
            ("peak_allocated", "max_memory_allocated"),
        ):
            if module is not None and hasattr(module, fn):
                stats[key] = int(getattr(module, fn)(self.index))
        return stats

    def reset_peak_memory(self) -> None:
        module = getattr(torch, self.device_type, None)
        if module is not None and hasattr(module, "reset_peak_memory_stats"):
            module.reset_peak_memory_stats(self.index)

    def manual_seed(self, seed: int) -> None:
        """Seed the host and this device's generators (torch.manual_seed covers registered devices)."""
        torch.manual_seed(seed)

    def get_rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        module = getattr(torch, self.device_type, None)
        if self.device_type != "cpu" and module is not None and hasattr(module, "get_rng_state"):
            state[self.device_type] = module.get_rng_state(self.index)
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        module = getattr(torch, self.device_type, None)
        if self.device_type in state and module is not None and hasattr(module, "set_rng_state"):
            module.set_rng_state(state[self.device_type], self.index)

    def describe(self) -> str:
        return f"{self.name}:{self.index}"

    # -- performance accounting (MFU, profiler) --------------------------------------------
    def device_name(self) -> str:
        """The hardware behind :attr:`device`, as the peak-FLOPs table and bench reports name it."""
        return self.describe()

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense peak FLOP/s of one device computing matmuls in ``dtype``; None when unknown.

        Dense means without 2:4 structured sparsity: datasheets often print the sparse figure,
        twice the dense one, and MFU is always quoted against dense. ``metrics.peak_tflops``
        overrides this for hardware missing from the adapter's table.
        """
        return None

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """``torch.profiler`` activities to record: host ops, plus this device's kernels where torch
        ships a profiler for its device type (CUDA, XPU, MTIA, HPU). Others record host ops only."""
        activity = getattr(torch.profiler.ProfilerActivity, self.device_type.upper(), None)
        cpu = torch.profiler.ProfilerActivity.CPU
        return [cpu] if activity in (None, cpu) else [cpu, activity]


def lookup_peak_tflops(
    table: tuple[tuple[tuple[str, ...], dict[str, float]], ...], device_name: str, precision: str
) -> float | None:
    """Dense peak TFLOP/s for ``device_name`` from ``table``: the first row one of whose name fragments
    occurs in the name (case-insensitive), so rows go from specific (``H100 PCIe``) to general
    (``H100``). ``precision`` is a dtype name (``bfloat16``, ``float32``) or ``tf32``."""
    name = device_name.lower()
    for fragments, peaks in table:
        if any(fragment.lower() in name for fragment in fragments):
            return peaks.get(precision)
    return None
