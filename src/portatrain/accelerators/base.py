"""The accelerator adapter contract, and its generic implementation on ``torch.accelerator``.

One subclass per backend holds everything backend-specific: the torch device type, the
distributed backend, the compile backend, which device index this process drives, synchronize,
memory statistics and RNG. Vendor modules (``torch_tpu``, ``torch_neuronx``) are imported only
inside the adapter's :meth:`Accelerator.load`, which runs when that backend is selected or
probed, never at ``import portatrain`` (where a vendor stack is installed, torch's backend
autoload has already imported it at ``import torch``; portatrain adds no import of its own).

The base class talks to devices through the generic ``torch.accelerator`` API only, never
through the per-device ``torch.<device_type>`` modules: out-of-tree backends are entitled to
close those. TorchTPU does so from torch 2.11 on: ``torch.tpu.device_count()``,
``synchronize()``, ``set_device()``, ``current_device()``, ``is_available()`` and (torch >= 2.13)
``get_rng_state()`` raise ``RuntimeError`` for callers outside torch/torch_tpu unless
``TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS=1`` (torch_tpu 0.2.0 wheel:
``torch_tpu/_internal/device/_device_module.py``, decorator ``internal_or_experimental`` in
``torch_tpu/_internal/utils/annotations.py``). TorchNeuron documents that code written against
``torch.accelerator`` runs unchanged (aws-neuron-sdk ``frameworks/torch/pytorch-native-overview.rst``).
In-tree backends with other habits (CUDA, MPS, CPU) override what they need.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from portatrain.errors import UserError

logger = logging.getLogger(__name__)


class DeviceUnavailableError(UserError, RuntimeError):
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
    """``torch.distributed`` backend string, always named explicitly per device type
    (``cpu:gloo,<type>:<backend>``) so CPU tensors (object collectives, checkpoint metadata) have one too."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend name."""
    static_shapes: bool = False
    """Whether the compiler wants ``dynamic=False`` (one graph per shape, shapes kept bounded)."""
    default_dtype: torch.dtype = torch.bfloat16
    """Training precision when ``trainer.dtype=auto``."""
    fused_adamw: bool = False
    """Whether ``torch.optim.AdamW(fused=True)`` is supported here."""
    pinned_staging: bool = False
    """Whether host copies of device state (asynchronous checkpoints' staging buffers) should be
    pinned, so the device-to-host copy runs asynchronously and the loop waits for one sync."""
    deterministic_kernels: bool = False
    """Whether ``torch.use_deterministic_algorithms(True)`` makes this device's eager kernels repeat
    bitwise (``trainer.deterministic``). False unless the adapter knows: a vendor runtime that
    compiles every op (XLA-style) decides for itself, and says nothing either way."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        """The device index this process drives. Starts as the requested index (``device.index``,
        else ``LOCAL_RANK``); :meth:`unavailable_reason` replaces it with the one the process can
        actually use (:meth:`select_index`)."""

    # -- discovery -------------------------------------------------------------------------
    def vendor_installed(self) -> bool:
        """True when the vendor module is importable, checked without importing it."""
        return self.vendor_module is None or importlib.util.find_spec(self.vendor_module) is not None

    def load(self) -> None:
        """Import the vendor module so torch knows the device type. Raise ImportError if absent."""
        if self.vendor_module is not None:
            importlib.import_module(self.vendor_module)

    def _is_current_accelerator(self) -> bool:
        """Whether torch's accelerator (what ``torch.accelerator.*`` talks to) is this device type."""
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == self.device_type

    def device_count(self) -> int:
        """Devices of this type visible to this process (0 when torch has no such accelerator)."""
        return int(torch.accelerator.device_count()) if self._is_current_accelerator() else 0

    def select_index(self, requested: int, visible: int) -> int:
        """The device index this process should drive, decided from what the process sees.

        A launcher that gives each worker one device (TorchTPU; Neuron with one visible logical
        core per process) leaves ``visible == 1``: that device is index 0 whatever ``LOCAL_RANK``
        says. A process that sees all the host's devices drives ``requested`` (``LOCAL_RANK``).
        """
        if visible == 1:
            if requested != 0:
                logger.info(
                    "%s: this process sees one %s device; using index 0, not the requested %d",
                    self.name,
                    self.device_type,
                    requested,
                )
            return 0
        if 0 <= requested < visible:
            return requested
        raise DeviceUnavailableError(
            f"{visible} {self.device_type} device(s) visible to this process, need index {requested}; "
            f"launch at most {visible} processes per host or set device.index below {visible}"
        )

    def unavailable_reason(self) -> str | None:
        """None when usable (and :attr:`index` is then this process's device); otherwise a one-line
        reason. Imports the vendor module if installed; never raises, so discovery cannot crash."""
        if not self.vendor_installed():
            return f"the Python package {self.vendor_module!r} is not installed"
        try:
            self.load()
        except Exception as exc:  # vendor import failures come in every exception type
            return f"importing {self.vendor_module} failed: {type(exc).__name__}: {exc}"
        try:
            count = self.device_count()
            if count == 0:
                current = torch.accelerator.current_accelerator()
                return (
                    f"0 {self.device_type} devices visible "
                    f"(torch.accelerator.current_accelerator() is {current})"
                )
            self.index = self.select_index(self.index, count)
        except DeviceUnavailableError as exc:
            return str(exc)
        except Exception as exc:  # e.g. a vendor's RuntimeError from a closed legacy API
            return f"querying {self.device_type} devices failed: {type(exc).__name__}: {exc}"
        return None

    def probe(self) -> None:
        """Allocate and compute on the device, then synchronize: proves the runtime works."""
        self.set_device()
        x = torch.ones(8, device=self.device)
        if float((x * 2).sum().item()) != 16.0:
            raise RuntimeError(f"probe allocation on {self.device} returned a wrong result")
        self.synchronize()

    # -- runtime ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.index)

    def set_device(self) -> None:
        if self._is_current_accelerator():
            torch.accelerator.set_device_index(self.index)

    def synchronize(self) -> None:
        if self._is_current_accelerator():
            torch.accelerator.synchronize(self.index)

    def memory_stats(self) -> dict[str, int]:
        """Allocator statistics in bytes: ``allocated``, ``reserved``, ``peak_allocated`` where known.

        Read through ``torch.accelerator.memory``, which reaches the backend's ``DeviceAllocator``
        (TorchTPU's ``TpuAllocator`` implements ``getDeviceStats``/``resetPeakStats``; its
        ``torch.tpu`` module exports no ``memory_*`` functions). Empty when the backend keeps none.
        """
        if not self._is_current_accelerator():
            return {}
        memory = torch.accelerator.memory
        try:
            return {
                "allocated": int(memory.memory_allocated(self.index)),
                "reserved": int(memory.memory_reserved(self.index)),
                "peak_allocated": int(memory.max_memory_allocated(self.index)),
            }
        except RuntimeError as exc:  # an allocator without device statistics
            logger.debug("%s keeps no allocator statistics: %s", self.device_type, exc)
            return {}

    def reset_peak_memory(self) -> None:
        if self._is_current_accelerator():
            try:
                torch.accelerator.memory.reset_peak_memory_stats(self.index)
            except RuntimeError as exc:
                logger.debug("%s cannot reset peak memory: %s", self.device_type, exc)

    def manual_seed(self, seed: int) -> None:
        """Seed the host and every device generator: ``torch.manual_seed`` also seeds the
        PrivateUse1 backend through its device module's ``manual_seed_all`` (torch/random.py
        ``_seed_custom_device``), a call from inside torch that vendors allow."""
        torch.manual_seed(seed)

    def _device_generator(self) -> torch.Generator | None:
        """This device's default generator (what ``torch.manual_seed`` seeds and random ops on the
        device draw from), or None where the backend does not expose one.

        torch 2.13 offers no generic accessor: ``torch.accelerator`` has no RNG functions. The
        device module's ``default_generators`` tuple is the one part of the per-device RNG API
        TorchTPU keeps open (experimental, it warns once; ``get_rng_state`` is internal from
        torch 2.13 on and raises), and it is what torch itself reads (DeviceInterface ``_get_generator``).
        """
        module = getattr(torch, self.device_type, None)
        generators = getattr(module, "default_generators", None)
        if generators is None or len(generators) <= self.index:
            return None
        return generators[self.index]

    def get_rng_state(self) -> dict[str, Any]:
        """The host RNG state and this device's: from its default generator, else from the device
        module's ``get_rng_state(index)`` (the ``torch.cuda``-shaped function). A backend with
        neither is warned about once, at the first save: a resume then draws device random numbers
        (dropout, random ops on the device) from a fresh stream, not where the run left off."""
        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if not self._is_current_accelerator():
            return state
        generator = self._device_generator()
        if generator is not None:
            state[self.device_type] = generator.get_state()
            return state
        module_state = self._device_module_rng("get_rng_state", self.index)
        if module_state is not False:
            state[self.device_type] = module_state
        elif not self._warned_rng:
            self._warned_rng = True
            logger.warning(
                "%s exposes no device RNG state (neither torch.%s.default_generators nor "
                "torch.%s.get_rng_state): checkpoints hold the host RNG only, and a resume draws random "
                "numbers on the device (dropout, random ops) from a fresh stream",
                self.device_type,
                self.device_type,
                self.device_type,
            )
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if self.device_type != "cpu" and self.device_type in state:
            generator = self._device_generator()
            if generator is not None:
                generator.set_state(state[self.device_type])
            elif self._device_module_rng("set_rng_state", state[self.device_type], self.index) is False:
                raise RuntimeError(
                    f"the checkpoint holds a {self.device_type} RNG state but this {self.device_type} "
                    "backend exposes no default generator or set_rng_state to restore it into"
                )

    _warned_rng = False

    def _device_module_rng(self, function: str, *args: Any) -> Any:
        """Call ``torch.<device_type>.<function>(*args)``; False where the backend has no such
        function or closes it to callers outside itself (TorchTPU raises ``RuntimeError``)."""
        fn = getattr(getattr(torch, self.device_type, None), function, None)
        if fn is None:
            return False
        try:
            return fn(*args)
        except RuntimeError as exc:
            logger.debug("torch.%s.%s is closed: %s", self.device_type, function, exc)
            return False

    def make_deterministic(self, compile_backend: str | None) -> str | None:
        """Ask for deterministic kernels (``trainer.deterministic=true``); returns None when two runs
        of one config on this device give bitwise-identical losses, else one line saying why not.
        ``compile_backend``: the backend of a compiled run, None for an eager one."""
        torch.use_deterministic_algorithms(True)
        if not self.deterministic_kernels:
            return f"{self.name}: its adapter knows of no bitwise-determinism guarantee for this device's kernels"
        if compile_backend not in (None, "eager", "aot_eager"):  # those two run the eager kernels
            # The deterministic-algorithms flag covers eager kernels; the kernels a compiler
            # generates (and, on GPUs, picks by benchmarking them) are the compiler's choice.
            return f"compile backend {compile_backend!r} generates its own kernels, which the flag does not cover"
        return None

    def describe(self) -> str:
        return f"{self.name}:{self.index}"

    def compile_cache_env(self, cache_dir: Path) -> dict[str, str]:
        """Environment variables that point the vendor compiler's own on-disk cache into
        ``cache_dir`` (``compile.cache``), set by ``portatrain.compile.CompileCache`` before the first
        compilation. Empty here: inductor's caches (cpu/cuda) are set there directly, and TorchTPU's
        ``tpu`` backend stores its compiled graphs through PyTorch's own AOTAutograd cache, which
        lives under the same ``TORCHINDUCTOR_CACHE_DIR`` (torch_tpu 0.2.0
        ``_internal/compile/_backend.py``: ``_CacheSavesManager`` wraps ``AOTAutogradCache.save``)."""
        return {}

    def take_fallback_report(self) -> dict[str, int] | None:
        """Operations the backend ran on the host CPU since the previous call (op -> count), then
        reset; None where the backend reports none (the runtime audit then writes "not available").

        Override where the vendor stack exposes its CPU-fallback accounting (TorchTPU logs fallbacks
        under ``TPU_LOG_OP_FALLBACK=1``). The sim device's counters are read by the audit directly.
        """
        return None

    def low_precision_matmuls(self) -> dict[str, str]:
        """The low-precision matmul formats of ``quantize.linear`` this device runs: ``{format: how}``
        with format ``float8`` (FP8 e4m3, a scale per tensor or per row) or ``mxfp8`` (OCP
        microscaling: FP8 e4m3 with an e8m0 scale per 32 elements), how ``native`` (matmul units for
        it) or ``emulated`` (correct numerics, no speed-up: tests only). A format left out is not
        declared, and ``portatrain.converters.quantize`` refuses it here. Nothing by default: an
        adapter declares what its vendor documents."""
        return {}

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

    def peak_flops_source(self, dtype: torch.dtype) -> str:
        """Where :meth:`peak_flops` comes from, for logs and bench reports (the CPU's is a
        measurement, cached with its provenance)."""
        return "datasheet"

    # -- kernels ---------------------------------------------------------------------------
    def supports_grouped_mm(self, dtype: torch.dtype) -> bool:
        """Whether ``torch._grouped_mm`` runs on this device in ``dtype`` (mixture-of-experts layers
        then run their dropless experts as one grouped matmul, else as a loop over the experts).
        False unless the adapter knows: a device whose torch build lacks the kernel would fail."""
        return False

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
