"""Process-group setup from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from portatrain.accelerators import Accelerator


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info_from_env() -> DistInfo:
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(accelerator: Accelerator, info: DistInfo) -> None:
    """Create the default process group with the adapter's backend when launched with >1 process."""
    if info.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=accelerator.dist_backend)


def destroy_distributed() -> None:
    """Tear the process group down in step: a rank that leaves while a peer's gloo threads still
    talk to it can abort the peer ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
