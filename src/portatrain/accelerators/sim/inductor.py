"""TorchInductor on the sim device: the CPU's C++ code generator pointed at device memory.

Sim memory is host memory, so inductor's C++ (OpenMP) kernels run on it unchanged; inductor only
needs to be told the device exists and is CPU-like: a scheduling and wrapper backend
(``register_backend_for_device``), a device interface and op overrides, and the scheduler's
``is_cpu`` test, which otherwise sends the device down GPU-only fusion paths. The wrapper emits a
plain call for the device's kernels (torch's wrapper only knows cpu and mps).

Use it with ``compile.backend=sim_inductor``. The backend is registered lazily (see
:func:`register_lazily`), so processes that never compile do not pay for importing inductor.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

BACKEND_NAME = "sim_inductor"

_enabled: set[str] = set()


def enable(device_type: str) -> None:
    """Teach inductor to compile for ``device_type`` (the sim's current name). Idempotent."""
    if device_type in _enabled:
        return
    import torch._inductor.scheduler as scheduler
    from torch._dynamo.device_interface import CpuInterface, register_interface_for_device
    from torch._inductor.codegen.common import register_backend_for_device, register_device_op_overrides
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.virtualized import V

    class SimWrapperCodegen(PythonWrapperCodegen):
        @staticmethod
        def create(
            is_subgraph: bool,
            subgraph_name: str | None,
            parent_wrapper: Any,
            partition_signatures: Any = None,
        ):
            if is_subgraph:
                return PythonWrapperCodegen.create(
                    is_subgraph, subgraph_name, parent_wrapper, partition_signatures
                )
            return SimWrapperCodegen()

        def _generate_kernel_call_helper(
            self, kernel_name: str, call_args: Any, *, device: Any = None, triton: bool = True, **kwargs: Any
        ) -> None:
            device = device or V.graph.get_current_device_or_throw()
            if not triton and device.type == device_type:
                self.writeline(self.wrap_kernel_call(kernel_name, call_args))
                return
            super()._generate_kernel_call_helper(
                kernel_name, call_args, device=device, triton=triton, **kwargs
            )

    register_backend_for_device(device_type, CppScheduling, SimWrapperCodegen, CppWrapperCpu)
    register_interface_for_device(device_type, CpuInterface)
    register_device_op_overrides(device_type, CpuDeviceOpOverrides())

    original_is_cpu = scheduler.BaseSchedulerNode.is_cpu

    def is_cpu(self: Any) -> bool:
        device = self.get_device()
        return original_is_cpu(self) or (device is not None and device.type in _enabled)

    scheduler.BaseSchedulerNode.is_cpu = is_cpu

    # "Which code generator serves this device": cpu -> config.cpu_backend, anything else -> the
    # GPU backend (triton). Imported by name into these modules, so patch each binding.
    import torch._inductor.codegen.common as common
    import torch._inductor.kernel.mm_common as mm_common
    import torch._inductor.utils as inductor_utils

    original_backend = inductor_utils.get_current_backend

    def get_current_backend(device: str | None = None) -> str:
        if not device:
            device = V.graph.get_current_device_or_throw().type
        return original_backend("cpu" if device in _enabled else device)

    for module in (inductor_utils, common, scheduler, mm_common):
        module.get_current_backend = get_current_backend
    _enabled.add(device_type)


def compile_fx(gm: Any, example_inputs: Any, **kwargs: Any) -> Callable[..., Any]:
    """The ``sim_inductor`` dynamo backend: enable the device, then compile as inductor does."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    from portatrain.accelerators.sim.settings import device_name

    enable(device_name())
    return inductor_compile_fx(gm, example_inputs, **kwargs)


def _register(registry: ModuleType) -> None:
    if BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(compile_fx, name=BACKEND_NAME)


def register_lazily() -> None:
    """Register ``sim_inductor`` with dynamo as soon as dynamo's backend registry is imported."""
    after_import("torch._dynamo.backends.registry", _register)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module finishes executing (the first time it is imported)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.callbacks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, callbacks = spec.loader, self.callbacks.pop(fullname)
        exec_module = loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            exec_module(module)
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


_finder = _AfterImport()


def after_import(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    if module_name in sys.modules:
        callback(sys.modules[module_name])
        return
    _finder.callbacks.setdefault(module_name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
