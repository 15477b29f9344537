"""Host CPU: always available; fp32 by default because bf16 matmuls are slow without AMX."""

from __future__ import annotations

import torch

from portatrain.accelerators.base import Accelerator


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
