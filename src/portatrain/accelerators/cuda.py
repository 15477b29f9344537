"""NVIDIA GPUs through torch's built-in CUDA support."""

from __future__ import annotations

import torch

from portatrain.accelerators.base import Accelerator


class CUDAAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    install_hint = (
        "install a CUDA build of torch on a machine with an NVIDIA GPU and driver, or pick device=cpu"
    )
    # gloo stays registered for CPU tensors (object collectives, DCP metadata).
    dist_backend = "cpu:gloo,cuda:nccl"
    compile_backend = "inductor"
    fused_adamw = True

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            built = torch.version.cuda
            return f"torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA {built})"
        if torch.cuda.device_count() <= self.index:
            return f"{torch.cuda.device_count()} CUDA device(s) visible, need index {self.index}"
        return None
