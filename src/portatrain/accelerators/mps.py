"""Apple silicon GPUs (Metal). Not part of auto-discovery: useful for laptops, not for training at scale."""

from __future__ import annotations

import torch

from portatrain.accelerators.base import Accelerator


class MPSAccelerator(Accelerator):
    name = "mps"
    device_type = "mps"
    install_hint = "MPS needs macOS on Apple silicon with an arm64 build of torch; pick device=cpu elsewhere"
    dist_backend = "gloo"
    default_dtype = torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("mps")

    def unavailable_reason(self) -> str | None:
        if not torch.backends.mps.is_available():
            return "torch.backends.mps.is_available() is False"
        return None

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def memory_stats(self) -> dict[str, int]:
        return {
            "allocated": int(torch.mps.current_allocated_memory()),
            "reserved": int(torch.mps.driver_allocated_memory()),
        }
