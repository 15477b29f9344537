"""Install the sim device into this process: rename PrivateUse1, register ``torch.<name>``.

:func:`install` is the one entry point. It builds or loads the C++ extension, renames torch's
PrivateUse1 device to ``sim`` (or to the impersonated name from ``PORTATRAIN_SIM_AS``), registers a
device module with the ``torch.cuda``-like functions generic code calls (``device_count``,
``synchronize``, ``manual_seed_all``, ``Stream``, ``Event``, memory statistics), adds the
``Tensor.sim()``/``is_sim`` helpers, applies ``SIM_MEMORY_CAPACITY`` and the unsupported-op list,
and registers the ``simccl`` process-group backend. It changes process-global state and cannot be
undone, which is why nothing imports this module until the device is selected, and why every
setting is checked first (:mod:`.settings`): a bad one raises before anything changes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from portatrain.accelerators.sim import _build, counters, settings
from portatrain.accelerators.sim.errors import SimOutOfMemoryError
from portatrain.accelerators.sim.settings import CAPACITY_ENV, device_name, installed, parse_bytes
from portatrain.errors import UserError


def install(
    name: str | None = None,
    *,
    dist_backend: str | None = None,
    compile_backend: str | None = None,
    hardware_name: str | None = None,
) -> types.ModuleType:
    """Make the sim device usable as ``torch.device(name)``; return its ``torch.<name>`` module.

    ``name`` defaults to ``$PORTATRAIN_SIM_AS`` or ``sim``. Idempotent for the same name; a
    second name in one process is an error (torch allows one PrivateUse1 name per process).

    For impersonating a vendor stack, the names its adapter expects: ``dist_backend`` registers
    the process-group backend under that name too (``tpu_dist`` for ``cpu:gloo,tpu:tpu_dist``),
    ``compile_backend`` registers a ``torch.compile`` backend of that name (``tpu``) that runs
    ``aot_eager``, and ``hardware_name`` is what ``torch.<name>.get_device_name()`` returns.
    """
    # Every setting checked before anything changes: a bad one is one error, not half a device.
    settings.check_settings(name=name)
    name = name or device_name()
    current_name = installed()
    if current_name is not None:
        if current_name != name:
            raise RuntimeError(
                f"the sim device is already installed as {current_name!r} in this process and cannot "
                f"also be {name!r}: torch allows one PrivateUse1 name per process; use a new process"
            )
        _extras(name, dist_backend, compile_backend, hardware_name)
        return getattr(torch, name)
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", name):
        raise RuntimeError(
            f"PrivateUse1 is already taken by {current!r} in this process (another out-of-tree device "
            f"is loaded); the sim device cannot be installed as {name!r} alongside it"
        )
    ext = _build.load_extension()
    if current != name:
        torch.utils.rename_privateuse1_backend(name)
    ext.register_hooks()
    # Over-capacity allocations and unsupported ops hit under the action error are the user's to
    # fix: raised with types the CLI prints as one line (and that are still torch.OutOfMemoryError
    # and RuntimeError).
    ext.set_error_types(UserError, SimOutOfMemoryError)
    module = _device_module(ext, name)
    torch._register_device_module(name, module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    capacity = os.environ.get(CAPACITY_ENV)
    ext.set_capacity(parse_bytes(capacity) if capacity else 0)
    counters._attach(ext)
    from portatrain.accelerators.sim import distributed

    distributed.register(ext, name)
    from portatrain.accelerators.sim import inductor

    inductor.register_lazily()
    settings.mark_installed(name)
    _extras(name, dist_backend, compile_backend, hardware_name)
    # Autograd runs device backward on its own worker threads, which drop their last reference
    # to the finished graph task (and the Python objects it holds) just after waking the caller.
    # A process that exits right after backward() can finalize Python in between, and the worker,
    # blocked on the GIL, is then killed mid-unwind ("terminate called without an active
    # exception"). Yielding the GIL briefly at exit lets it finish first.
    atexit.register(time.sleep, 0.05)
    return module


def _extras(
    name: str, dist_backend: str | None, compile_backend: str | None, hardware_name: str | None
) -> None:
    """The vendor-facing names of an impersonated device (see :func:`install`)."""
    from portatrain.accelerators.sim import distributed

    ext = _build.load_extension()
    if dist_backend:
        distributed.register(ext, name, dist_backend)
    if compile_backend:
        from portatrain.accelerators.sim.inductor import after_import

        def alias(registry: types.ModuleType) -> None:
            if compile_backend not in registry._COMPILER_FNS:
                registry.register_backend(
                    lambda gm, inputs: registry.lookup_backend("aot_eager")(gm, inputs), name=compile_backend
                )

        after_import("torch._dynamo.backends.registry", alias)
    if hardware_name:
        module = getattr(torch, name)
        module.get_device_name = lambda device=None: hardware_name


def _device_module(ext: Any, name: str) -> types.ModuleType:
    """A ``torch.cuda``-shaped module: what FSDP2, DCP, autocast and torch.random look up by name."""
    module = types.ModuleType(
        f"torch.{name}", f"portatrain's simulated accelerator, registered as torch.{name}."
    )

    def _index(device: Any = None) -> int:
        if device is None:
            return ext.current_device()
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return ext.current_device() if device.index is None else device.index

    def synchronize(device: Any = None) -> None:
        ext.record_event("sync:synchronize")

    class device:  # noqa: N801 - mirrors torch.cuda.device
        """Context manager that makes ``index`` the current sim device."""

        def __init__(self, index: Any) -> None:
            self.index, self.previous = _index(index), None

        def __enter__(self) -> None:
            self.previous = ext.current_device()
            ext.set_device(self.index)

        def __exit__(self, *exc: object) -> None:
            ext.set_device(self.previous)

    functions = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "_lazy_init": lambda: None,
        "device_count": ext.device_count,
        "current_device": ext.current_device,
        "set_device": lambda device: ext.set_device(_index(device)),
        "synchronize": synchronize,
        "device": device,
        "get_device_name": lambda device=None: f"portatrain sim ({name}, CPU kernels)",
        # torch.autocast asks the device module which dtypes it may cast to.
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        "is_bf16_supported": lambda including_emulation=True: True,
        **_rng_functions(ext, _index),
        **_memory_functions(name, _index),
        **_stream_functions(ext, name, _index),
    }
    for key, value in functions.items():
        if value is not None:
            setattr(module, key, value)
    return module


def _rng_functions(ext: Any, index: Callable[[Any], int]) -> dict[str, Any]:
    """The device module's seeding and RNG-state functions, over each sim device's generator."""

    def manual_seed(seed: int) -> None:
        ext.default_generator(ext.current_device()).manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        for i in range(ext.device_count()):
            ext.default_generator(i).manual_seed(int(seed))

    return {
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "seed": lambda: manual_seed(torch.seed()),
        "seed_all": lambda: manual_seed_all(torch.seed()),
        "initial_seed": lambda: ext.default_generator(ext.current_device()).initial_seed(),
        "get_rng_state": lambda device=None: ext.default_generator(index(device)).get_state(),
        "set_rng_state": lambda state, device=None: ext.default_generator(index(device)).set_state(state),
        "get_rng_state_all": lambda: [
            ext.default_generator(i).get_state() for i in range(ext.device_count())
        ],
        "set_rng_state_all": lambda states: [
            ext.default_generator(i).set_state(s) for i, s in enumerate(states)
        ],
        "default_generators": tuple(ext.default_generator(i) for i in range(ext.device_count())),
    }


def _memory_functions(name: str, index: Callable[[Any], int]) -> dict[str, Any]:
    """The device module's memory statistics, from ``torch.accelerator``'s."""

    def stats(device: Any = None) -> dict[str, Any]:
        return torch.accelerator.memory_stats(torch.device(name, index(device)))

    return {
        "memory_allocated": lambda device=None: stats(device).get("allocated_bytes.all.current", 0),
        "max_memory_allocated": lambda device=None: stats(device).get("allocated_bytes.all.peak", 0),
        "memory_reserved": lambda device=None: stats(device).get("reserved_bytes.all.current", 0),
        "max_memory_reserved": lambda device=None: stats(device).get("reserved_bytes.all.peak", 0),
        "memory_stats": stats,
        "reset_peak_memory_stats": lambda device=None: torch.accelerator.reset_peak_memory_stats(
            torch.device(name, index(device))
        ),
        "mem_get_info": lambda device=None: torch.accelerator.get_memory_info(
            torch.device(name, index(device))
        ),
        "empty_cache": lambda: None,
    }


def _stream_functions(ext: Any, name: str, index: Callable[[Any], int]) -> dict[str, Any]:
    """The device module's streams and events, as ``torch.accelerator``'s."""

    @contextlib.contextmanager
    def stream(s: torch.Stream | None) -> Iterator[None]:
        if s is None:
            yield
            return
        previous = torch.accelerator.current_stream(s.device)
        torch.accelerator.set_stream(s)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    return {
        "Stream": lambda device=None, priority=0, **kwargs: torch.Stream(
            device=torch.device(name, index(device)), priority=priority
        ),
        "Event": lambda enable_timing=False, blocking=False, interprocess=False: torch.Event(
            device=torch.device(name, ext.current_device()), enable_timing=enable_timing
        ),
        "current_stream": lambda device=None: torch.accelerator.current_stream(
            torch.device(name, index(device))
        ),
        "default_stream": lambda device=None: torch.accelerator.current_stream(
            torch.device(name, index(device))
        ),
        "stream": stream,
        "set_stream": torch.accelerator.set_stream,
    }
