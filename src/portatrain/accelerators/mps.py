"""Apple silicon GPUs (Metal). Not part of auto-discovery: useful for laptops, not for training at scale."""

from __future__ import annotations

from typing import Any

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

    def set_device(self) -> None:
        """Nothing to select: a Mac has one GPU."""

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def get_rng_state(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state(), "mps": torch.mps.get_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "mps" in state:
            torch.mps.set_rng_state(state["mps"])

    def memory_stats(self) -> dict[str, int]:
        return {
            "allocated": int(torch.mps.current_allocated_memory()),
            "reserved": int(torch.mps.driver_allocated_memory()),
        }
