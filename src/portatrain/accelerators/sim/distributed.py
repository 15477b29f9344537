"""The sim device's process-group backend, ``simccl``: gloo over CPU aliases of device memory.

Use it as ``init_process_group("cpu:gloo,sim:simccl")`` (the adapter's ``dist_backend``): CPU
tensors go to plain gloo, device tensors to :class:`SimBackend` (``csrc/dist.cpp``), which runs
each collective synchronously on its own ProcessGroupGloo and emulates what gloo lacks (AVG,
PREMUL_SUM). Registered for the device's current name, so an impersonated ``tpu`` gets it too.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

BACKEND_NAME = "simccl"

_registered: set[str] = set()


def register(ext: Any, name: str, backend: str = BACKEND_NAME) -> None:
    """Register the backend as ``backend`` (default ``simccl``) for device type ``name`` (once per name)."""
    import torch.distributed as dist

    if backend in _registered or not dist.is_available():
        return

    def create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        # Its own store prefix: the group's cpu:gloo backend rendezvouses on the same store.
        inner = dist.ProcessGroupGloo(dist.PrefixStore(f"{backend}/", store), rank, size, timeout)
        return ext.SimBackend(inner, rank, size)

    dist.Backend.register_backend(backend, create, devices=[name])
    _registered.add(backend)
