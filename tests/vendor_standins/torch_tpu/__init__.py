"""Stand-in for TorchTPU (``torch_tpu``), after the torch_tpu 0.2.0 wheel on PyPI.

Reproduces what portatrain's TPU adapter depends on; each behaviour names the wheel file it was
taken from. Test knobs: ``STANDIN_TPU_DEVICES`` (TPU PCI functions on the "host", default 4),
``STANDIN_TPU_NAME`` (what the PCI IDs decode to, default "TPU v6e").

Two ways to stand in for the device itself:

- default: no tensors, ``torch.accelerator`` answered from :mod:`_privateuse1` state;
- ``STANDIN_ON_SIM=1``: portatrain's simulated device installed under the name ``tpu`` gives real
  tensors, allocator statistics and a process-group backend, and the TorchTPU behaviours below are
  layered on top of it (one device per process: ``SIM_DEVICE_COUNT=1`` unless set).

Not reproduced: the compiler, and autoload at ``import torch`` (the real package is an entry point
``[torch.backends] torch_tpu = torch_tpu._loader:load``; the adapter imports this one in ``load()``).
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import _privateuse1
import torch
import torch.distributed as dist

# torch_tpu/_internal/utils/annotations.py: callers in these packages are "the framework".
_FRAMEWORK = ("torch", "torch_tpu")
# torch_tpu/_internal/device/_device_module.py: _STRICT_INTERNAL_DEVICE_APIS.
_STRICT = os.environ.get("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "0") not in ("1", "true", "True")


ON_SIM = os.environ.get("STANDIN_ON_SIM") == "1"
_SIM = "portatrain.accelerators.sim"  # on the sim, it plays TorchTPU's runtime: its calls are "framework"


def _from_framework(depth: int) -> bool:
    module = sys._getframe(depth).f_globals.get("__name__", "")
    return module in _FRAMEWORK or module.startswith(("torch.", "torch_tpu.", _SIM))


def _internal(prefer: str):
    """annotations.py ``internal_or_experimental(internal_when=torch >= 2.11, strict=...)``: a
    call from outside torch/torch_tpu raises RuntimeError naming the ``torch.accelerator``
    replacement (or warns once with TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS=1)."""

    def wrap(fn):
        def wrapper(*args, **kwargs):
            if not _from_framework(2):
                msg = (
                    f"{fn.__name__} is internal to TorchTPU and can only be called by the PyTorch "
                    f"framework (torch and torch_tpu). Use {prefer} instead."
                )
                if _STRICT:
                    raise RuntimeError(msg)
                warnings.warn(msg, stacklevel=2)
            return fn(*args, **kwargs)

        wrapper.__name__ = fn.__name__
        return wrapper

    return wrap


def _experimental(fn):
    """annotations.py ``experimental``: usable from anywhere, a UserWarning once."""
    warned = False

    def wrapper(*args, **kwargs):
        nonlocal warned
        if not warned and not _from_framework(2):
            warnings.warn(
                f"{fn.__name__}() is experimental and subject to change without notice.", stacklevel=2
            )
            warned = True
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    return wrapper


# torch_tpu/_internal/utils/hardware.py get_tpu_device_count / get_tpu_device_name: PCI scan.
HOST_DEVICES = int(os.environ.get("STANDIN_TPU_DEVICES", "4"))
DEVICE_NAME = os.environ.get("STANDIN_TPU_NAME", "TPU v6e")
# One device per worker process: _device_module.py set_device "validates that the given device
# index matches the device index assigned to the current process"; under torchrun each worker is
# given one chip, seen as index 0 (the runtime maps LOCAL_RANK to the process's chip in compiled
# code). Before the runtime starts, device_count() is the host's PCI count (_device_module.py
# device_count: `elif cls._device_type == "tpu": return hardware.get_tpu_device_count()`).
STATE = _privateuse1.DeviceState("tpu", count=HOST_DEVICES, current=0, bound_index=0)
_GENERATORS = tuple(torch.Generator() for _ in range(HOST_DEVICES))
created_process_groups: list[tuple[int, int]] = []


def _make_public_module() -> types.ModuleType:
    """torch_tpu/_internal/public_api.py ``_PUBLIC_MODULES["torch.tpu"]``: the exported names.
    No ``memory_*`` function is among them (device statistics live behind torch.accelerator.memory)."""
    tpu = types.ModuleType("torch.tpu", "Public TorchTPU device module (`torch.tpu`).")

    @_internal("torch.accelerator.device_count")
    def device_count() -> int:
        return STATE.count

    @_internal("torch.accelerator.is_available")
    def is_available() -> bool:
        return STATE.count > 0

    @_internal("torch.accelerator.synchronize")
    def synchronize(device: int | None = None) -> None:
        STATE.synchronize()

    @_internal("torch.accelerator.set_device_index")
    def set_device(device: int) -> None:
        torch.accelerator.set_device_index(device)

    @_internal("torch.accelerator.current_device_index")
    def current_device() -> int:
        return 0

    # internal_when=torch >= (2, 13); prefer= names an API torch 2.13 does not have.
    @_internal("torch.accelerator.random.get_rng_state")
    def get_rng_state(device: object = "tpu") -> torch.Tensor:
        return _GENERATORS[0].get_state()

    @_experimental
    def set_rng_state(new_state: torch.Tensor, device: object = "tpu") -> None:
        _GENERATORS[0].set_state(new_state)

    @_experimental
    def get_device_name(device: object = None) -> str:
        return DEVICE_NAME

    @_experimental
    def manual_seed_all(seed: int) -> None:
        for generator in _GENERATORS:
            generator.manual_seed(seed)

    tpu.device_count = device_count
    tpu.is_available = is_available
    tpu.synchronize = synchronize
    tpu.set_device = set_device
    tpu.current_device = current_device
    tpu.get_rng_state = get_rng_state
    tpu.set_rng_state = set_rng_state
    tpu.get_device_name = get_device_name
    tpu.manual_seed_all = manual_seed_all
    tpu.manual_seed = manual_seed_all
    # _device_module.py __tt_api_stages__["default_generators"]: experimental, a tuple with one
    # torch.Generator per device, the generators torch.manual_seed seeds.
    tpu.default_generators = _GENERATORS
    tpu._is_in_bad_fork = lambda: False  # torch/random.py _seed_custom_device needs it
    return tpu


def _create_process_group(store, rank, size, timeout):  # noqa: ANN001
    """tpu_distributed.create_process_group stand-in: a gloo group (the stand-in has no device)."""
    created_process_groups.append((rank, size))
    return dist.ProcessGroupGloo(store, rank, size, timeout)


_LEGACY_CLOSED = {  # _device_module.py: internal_or_experimental(prefer=...) from torch 2.11 (RNG: 2.13)
    "device_count": "torch.accelerator.device_count",
    "is_available": "torch.accelerator.is_available",
    "synchronize": "torch.accelerator.synchronize",
    "set_device": "torch.accelerator.set_device_index",
    "current_device": "torch.accelerator.current_device_index",
    "get_rng_state": "torch.accelerator.random.get_rng_state",
}
# public_api.py exports no memory function on torch.tpu.
_NOT_EXPORTED = (
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
    "mem_get_info",
)


def _install_on_sim() -> None:
    """The sim device named ``tpu`` (real tensors, torch.accelerator through its C++ hooks), with
    TorchTPU's Python surface layered on its ``torch.tpu`` module."""
    os.environ.setdefault("SIM_DEVICE_COUNT", "1")  # each worker sees one device, tpu:0
    from portatrain.accelerators.sim import runtime

    # _loader.py registers both "tpu_dist" and "tpu" for device "tpu", and the "tpu" compile backend.
    runtime.install("tpu", dist_backend="tpu_dist", compile_backend="tpu")
    tpu = runtime.install("tpu", dist_backend="tpu")
    for name, prefer in _LEGACY_CLOSED.items():
        setattr(tpu, name, _internal(prefer)(getattr(tpu, name)))
    for name in _NOT_EXPORTED:
        if hasattr(tpu, name):
            delattr(tpu, name)
    tpu.get_device_name = _experimental(lambda device=None: DEVICE_NAME)
    tpu.get_device_name.__name__ = "get_device_name"


# torch_tpu/_loader.py load(): `if hardware.get_tpu_device_count(): _init_device("tpu")`.
# Without a TPU nothing is registered: torch.accelerator keeps reporting no accelerator.
if ON_SIM:
    _install_on_sim()
elif HOST_DEVICES:
    _privateuse1.rename_privateuse1(STATE.device_type)  # _loader.py rename_privateuse1_backend("tpu")
    _privateuse1.register_device_module("tpu", _make_public_module())
    _privateuse1.install(STATE)
    # _loader.py _init_device_impl: register_backend("tpu_dist", ..., devices=["tpu"]) and "tpu".
    dist.Backend.register_backend("tpu_dist", _create_process_group, devices=["tpu"])
    dist.Backend.register_backend("tpu", _create_process_group, devices=["tpu"])
