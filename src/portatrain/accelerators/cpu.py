"""Host CPU: always available; fp32 by default because bf16 matmuls are slow without AMX.

Compute threads: unless ``OMP_NUM_THREADS`` is set (torchrun sets it to 1 for several processes),
each process takes ``(cores available - 1) // local processes`` threads, at least one
(:func:`default_threads`). OpenMP workers busy-wait at every barrier, so a team that claims every
core stalls whenever another thread -- the data loader's prefetch, Python, another job -- takes one
of them: on a shared 2-core machine the debug recipe ran at 4,855-5,185 tokens/s with one thread
against 275-860 with torch's default of two, side by side under the same load.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time

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


@functools.cache
def measured_matmul_flops(dtype: torch.dtype, threads: int, size: int = 1024, budget_s: float = 0.3) -> float:
    """Best FLOP/s of a square ``size`` matmul in ``dtype`` on ``threads`` threads, timed for ~``budget_s``.

    CPUs have no datasheet peak we could look up (cores, clocks, SIMD width and turbo all vary), so
    MFU on CPU is measured against what a large GEMM actually reaches here: the attainable peak,
    not the theoretical one. Cached per process; the best repetition is kept because a peak is the
    least-disturbed run (other processes only ever slow it down).
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


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    compile_backend = "inductor"
    default_dtype = torch.float32
    fused_adamw = True

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

    def device_name(self) -> str:
        model = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                model = next(
                    (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model
                )
        except OSError:
            pass
        return f"{model} ({torch.get_num_threads()} threads)"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """The measured matmul peak at this process's thread count (see :func:`measured_matmul_flops`)."""
        return measured_matmul_flops(dtype, torch.get_num_threads())

    def remeasure_peak_flops(self, dtype: torch.dtype) -> float | None:
        """A fresh measurement, over a longer budget than the first (which a busy machine can
        have slowed: the training loop then runs above it)."""
        return measured_matmul_flops.__wrapped__(dtype, torch.get_num_threads(), budget_s=1.0)

    def supports_grouped_mm(self, dtype: torch.dtype) -> bool:
        # torch's CPU kernel is a loop of mm/bmm over the groups (pytorch/pytorch
        # aten/src/ATen/native/GroupedMMUtils.h, _grouped_mm_fallback); fp32 and bf16 tested here.
        return dtype in (torch.float32, torch.bfloat16)
