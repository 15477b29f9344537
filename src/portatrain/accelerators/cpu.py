"""Host CPU: always available; fp32 by default because bf16 matmuls are slow without AMX.

Compute threads: unless ``OMP_NUM_THREADS`` is set (torchrun sets it to 1 for several processes),
each process takes ``(cores available - 1) // local processes`` threads, at least one
(:func:`default_threads`). OpenMP workers busy-wait at every barrier, so a team that claims every
core stalls whenever another thread -- the data loader's prefetch, Python, another job -- takes one
of them: on a shared 2-core machine the debug recipe ran at 4,855-5,185 tokens/s with one thread
against 275-860 with torch's default of two, side by side under the same load.

Peak FLOP/s (for MFU): measured, not looked up (:func:`measured_peak`), once per machine, thread
count, dtype, CPU kernels and torch version, and cached with its provenance in
``$PORTATRAIN_PEAK_CACHE`` (default ``~/.cache/portatrain/peak_flops.json``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from portatrain.accelerators.base import Accelerator

logger = logging.getLogger(__name__)


def default_threads(cores: int | None = None, local_processes: int | None = None) -> int:
    """Compute threads per process when ``OMP_NUM_THREADS`` is unset: one core is left to the host
    work beside the matmuls, the rest shared by this host's processes."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (cores - 1) // max(1, local_processes))


def measured_matmul_flops(dtype: torch.dtype, threads: int, size: int = 1024, budget_s: float = 0.3) -> float:
    """Best FLOP/s of a square ``size`` matmul in ``dtype`` on ``threads`` threads, timed for ~``budget_s``.

    CPUs have no datasheet peak we could look up (cores, clocks, SIMD width and turbo all vary), so
    MFU on CPU is measured against what a large GEMM actually reaches here: the attainable peak,
    not the theoretical one. The best repetition is kept because a peak is the least-disturbed run
    (other processes only ever slow it down).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)  # leaves the global RNG stream untouched
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        torch.mm(a, b)  # warm-up: first-call dispatch and packing buffers
        best, spent, reps = float("inf"), 0.0, 0
        while reps < 2 or (spent < budget_s and reps < 20):
            start = time.perf_counter()
            torch.mm(a, b)
            elapsed = time.perf_counter() - start
            best, spent, reps = min(best, elapsed), spent + elapsed, reps + 1
        return 2 * size**3 / best
    finally:
        torch.set_num_threads(previous)


PEAK_CACHE_ENV = "PORTATRAIN_PEAK_CACHE"
"""A JSON file of measured CPU peaks; default ``$XDG_CACHE_HOME/portatrain/peak_flops.json``
(``~/.cache/...``). The test suite points it at a temporary file."""


def peak_cache_path() -> Path:
    explicit = os.environ.get(PEAK_CACHE_ENV)
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "portatrain" / "peak_flops.json"


@dataclass(frozen=True)
class PeakMeasurement:
    """A measured matmul peak and where it came from."""

    flops: float
    cpu: str
    threads: int
    dtype: str
    kernels: str
    """``torch.backends.cpu.get_cpu_capability()``: the SIMD kernels torch picked (``AVX2``,
    ``AVX512``, ``DEFAULT`` under ``ATEN_CPU_CAPABILITY=default``)."""
    torch: str
    measured_at: str
    """ISO 8601, UTC."""
    load: float | None
    """The 1-minute load average just before measuring (None where the OS has none)."""
    quiet: bool
    """Nothing else wanted the cores this measurement used (:func:`_quiet`); a busy measurement is
    taken again at the next start-up, and the higher figure kept."""
    cached_in: str = ""
    """The cache file, or why the measurement could not be written there."""

    def describe(self) -> str:
        busy = "" if self.quiet else f", busy (load {self.load:.1f})"
        return (
            f"measured matmul (MFU on CPU is indicative only), {self.measured_at[:16]}Z{busy}, "
            f"cached in {self.cached_in}"
        )


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _quiet(load: float | None, threads: int) -> bool:
    """The 1-minute load average leaves our ``threads`` their cores: at most the cores they leave
    free, plus half a core for this process's own start-up (imports are CPU-bound)."""
    return load is None or load <= max(0, _cores() - threads) + 0.5


def _peak_key(dtype: torch.dtype, threads: int) -> dict[str, Any]:
    return {
        "cpu": CPUAccelerator.model_name(),
        "threads": threads,
        "dtype": str(dtype).removeprefix("torch."),
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def _cached(entry: Any, path: Path) -> PeakMeasurement | None:
    """A cache file's entry as a measurement; None when absent or written by another version."""
    try:
        return PeakMeasurement(**{**entry, "cached_in": str(path)})
    except TypeError:
        return None


@functools.cache
def measured_peak(dtype: torch.dtype, threads: int) -> PeakMeasurement:
    """The matmul peak of this machine at ``threads`` threads in ``dtype``: from the cache file
    (:func:`peak_cache_path`) when a quiet measurement is there, else measured now, once per
    process, at start-up (never mid-run) and written back with its provenance. A peak is the best
    figure ever measured: a busy measurement only ever raises an earlier one."""
    path = peak_cache_path()
    key = _peak_key(dtype, threads)
    name = "|".join(str(v) for v in key.values())
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries = entries if isinstance(entries, dict) else {}
    known = _cached(entries.get(name), path)
    if known is not None and known.quiet:
        return known
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    when = datetime.now(timezone.utc).isoformat(timespec="seconds").removesuffix("+00:00")
    measured = PeakMeasurement(
        measured_matmul_flops(dtype, threads), **key, measured_at=when, load=load, quiet=_quiet(load, threads)
    )
    if known is not None and known.flops > measured.flops:
        # An earlier (busy) figure is higher: it stays, and stops being re-measured once this one was quiet.
        measured = replace(known, quiet=measured.quiet)
    entries[name] = {k: v for k, v in asdict(measured).items() if k != "cached_in"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        partial.replace(path)  # atomic: processes starting together never read half a file
    except OSError as exc:
        logger.debug("could not cache the measured peak in %s: %s", path, exc)
        return PeakMeasurement(**{**asdict(measured), "cached_in": f"nowhere ({path}: {exc.strerror})"})
    return PeakMeasurement(**{**asdict(measured), "cached_in": str(path)})


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    compile_backend = "inductor"
    default_dtype = torch.float32
    fused_adamw = True
    # Same machine, same thread count: a kernel splits its reductions the same way in every run.
    deterministic_kernels = True

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def unavailable_reason(self) -> str | None:
        return None

    def set_device(self) -> None:
        """Choose the compute thread count (module docstring); ``OMP_NUM_THREADS`` wins when set."""
        if "OMP_NUM_THREADS" in os.environ:
            return
        threads = default_threads()
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            logger.debug("cpu: %d compute thread(s); set OMP_NUM_THREADS to choose", threads)

    def device_count(self) -> int:
        return 1

    def memory_stats(self) -> dict[str, int]:
        """CPU has no device allocator: report the process's resident set and its high-water mark."""
        import resource

        stats = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        try:
            with open("/proc/self/statm") as f:
                stats["rss"] = int(f.read().split()[1]) * resource.getpagesize()
        except OSError:
            return stats
        # ru_maxrss is sampled by the kernel and can trail the live RSS by a few pages.
        stats["peak_rss"] = max(stats["peak_rss"], stats["rss"])
        return stats

    @staticmethod
    def model_name() -> str:
        """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
        model = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                model = next(
                    (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model
                )
        except OSError:
            pass
        return model

    def device_name(self) -> str:
        return f"{self.model_name()} ({torch.get_num_threads()} threads)"

    def low_precision_matmuls(self) -> dict[str, str]:
        """Both formats, emulated: no CPU has FP8 matmul units, but torch's CPU ``_scaled_mm`` and
        torchao's emulated MXFP8 cast to the real 8-bit formats and multiply the results, so a CPU
        run has a GPU run's rounding (what the tests check), at no gain in speed."""
        return {"float8": "emulated", "mxfp8": "emulated"}

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """The matmul peak measured on this machine at this process's thread count (:func:`measured_peak`)."""
        return measured_peak(dtype, torch.get_num_threads()).flops

    def peak_flops_source(self, dtype: torch.dtype) -> str:
        return measured_peak(dtype, torch.get_num_threads()).describe()

    def supports_grouped_mm(self, dtype: torch.dtype) -> bool:
        # torch's CPU kernel is a loop of mm/bmm over the groups (pytorch/pytorch
        # aten/src/ATen/native/GroupedMMUtils.h, _grouped_mm_fallback); fp32 and bf16 tested here.
        return dtype in (torch.float32, torch.bfloat16)
