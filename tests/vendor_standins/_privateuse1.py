"""What a real out-of-tree backend's C++ registration gives torch, reproduced in Python.

A real backend (TorchTPU, TorchNeuron) registers PrivateUse1 hooks and a ``DeviceAllocator`` in
C++; from then on ``torch.accelerator.*`` and ``torch.accelerator.memory.*`` answer for its
device type. Python cannot register those hooks, so :func:`install` rebinds the
``torch.accelerator`` functions the adapters call to a :class:`DeviceState`. The functions here
read the state directly, as the C++ hooks do; they never go through the vendor's Python
``torch.<device>`` module.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import torch


@dataclass
class DeviceState:
    device_type: str
    count: int
    """Devices ``torch.accelerator.device_count()`` reports."""
    current: int = 0
    bound_index: int | None = None
    """When set, the only index ``set_device_index`` accepts (a process bound to one device)."""
    synchronize_calls: int = 0
    completed_bytes: int = 0
    """Allocator bytes the device has finished allocating (what a statistics read sees)."""
    pending_bytes: int = 0
    """Bytes queued but not yet done: visible only after a synchronize (asynchronous allocator)."""
    peak_bytes: int = 0
    reserved_bytes: int = 0
    calls: list[str] = field(default_factory=list)

    def synchronize(self) -> None:
        self.synchronize_calls += 1
        self.completed_bytes += self.pending_bytes
        self.reserved_bytes = max(self.reserved_bytes, self.completed_bytes)
        self.peak_bytes = max(self.peak_bytes, self.completed_bytes)
        self.pending_bytes = 0


def rename_privateuse1(device_type: str) -> None:
    """``torch.device(device_type)`` parses from here on (irreversible, as with the real stacks)."""
    torch.utils.rename_privateuse1_backend(device_type)


def register_device_module(device_type: str, module: types.ModuleType) -> None:
    """Expose ``module`` as ``torch.<device_type>``, as the real stacks do with
    ``torch._register_device_module``."""
    sys.modules[f"torch.{device_type}"] = module
    torch._register_device_module(device_type, module)


def install(state: DeviceState) -> None:
    acc = torch.accelerator
    mem = torch.accelerator.memory

    def index_of(device: object = None) -> int:
        if device is None:
            return state.current
        if isinstance(device, int):
            return device
        return torch.device(device).index or 0

    def set_device_index(device: object) -> None:
        index = index_of(device)
        if state.bound_index is not None and index != state.bound_index:
            raise ValueError(
                f"Cannot set {state.device_type} device to index {index}, current process is bound to "
                f"device index {state.bound_index}"
            )
        if not 0 <= index < state.count:
            raise RuntimeError(f"invalid {state.device_type} device index {index} (count {state.count})")
        state.current = index

    def synchronize(device: object = None) -> None:
        state.calls.append(f"synchronize({index_of(device)})")
        state.synchronize()

    acc.current_accelerator = lambda check_available=False: torch.device(state.device_type)
    acc.is_available = lambda: state.count > 0
    acc.device_count = lambda: state.count
    acc.current_device_index = lambda: state.current if state.bound_index is None else state.bound_index
    acc.set_device_index = set_device_index
    acc.synchronize = synchronize
    mem.memory_allocated = lambda device=None: state.completed_bytes
    mem.memory_reserved = lambda device=None: state.reserved_bytes
    mem.max_memory_allocated = lambda device=None: state.peak_bytes

    def reset_peak(device: object = None) -> None:
        state.peak_bytes = state.completed_bytes

    mem.reset_peak_memory_stats = reset_peak
