"""The runtime stage: this process's device, process group, parallel layout and compute precision.

Built once per process by :func:`build_runtime`, the same way for every command that runs a model
(train, DPO, bench, parity, eval): the layout is checked against the world size before the process
group starts (a ``ConfigError`` names the fix), then the mesh is built on the adapter's device type.
:func:`seed_run` then seeds every random stream the run draws from and, with ``trainer.deterministic``,
asks the adapter for deterministic kernels.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from portatrain.accelerators import Accelerator, resolve_accelerator
from portatrain.config import Config
from portatrain.data.collate import with_attention_mask
from portatrain.distributed import DistInfo, destroy_distributed, dist_info_from_env, init_distributed
from portatrain.dtypes import dtype_from_name
from portatrain.fault_tolerance import data_slice
from portatrain.parallel import ParallelDims, dp_all_reduce
from portatrain.parallel.context import ContextParallel

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    """Where and how this process computes."""

    dist: DistInfo
    accelerator: Accelerator
    parallel_dims: ParallelDims
    dtype: torch.dtype
    """The compute dtype (``trainer.dtype``; ``auto`` is the adapter's default): autocast's, FSDP2's."""
    dp_rank: int
    dp_world_size: int
    """This rank's slice among the ranks that read different rows (with fault tolerance, every
    replica group's ranks)."""
    context_parallel: ContextParallel | None
    """``parallel.cp > 1``: cuts full-length rows into this rank's shard on the device."""

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype (nothing in float32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device_type, dtype=self.dtype)

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A loader's batch on the device. Packed rows come with document ids; their ``[B, 1, S, S]``
        mask is built here, on the device. With context parallel: this rank's shard of the rows, and
        the attention that sees the whole row."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if self.context_parallel is not None:
            return self.context_parallel.shard_batch(batch)
        return with_attention_mask(batch)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (tp ranks of one dp group hold the same value)."""
        return dp_all_reduce(value.to(self.device), self.parallel_dims, "sum")


def build_runtime(cfg: Config, accelerator: Accelerator | None = None) -> Runtime:
    """The device (``device.*``), the process group and the mesh (``parallel.*``) of this process."""
    info = dist_info_from_env()
    index = cfg.device.index if cfg.device.index is not None else info.local_rank
    accelerator = accelerator or resolve_accelerator(cfg.device.type, index)
    accelerator.set_device()
    dims = ParallelDims.from_config(cfg.parallel, world_size=info.world_size)
    started = not torch.distributed.is_initialized()
    init_distributed(accelerator, info)
    if started and torch.distributed.is_initialized():
        # The command that runs this process tears the group down (portatrain.cli); a script that
        # builds a Trainer itself gets the same in-step teardown at exit.
        atexit.register(destroy_distributed)
    dtype = accelerator.default_dtype if cfg.trainer.dtype == "auto" else dtype_from_name(cfg.trainer.dtype)
    dims.build_mesh(accelerator.device_type)
    dp_rank, dp_world_size = data_slice(cfg.fault_tolerance, dims.dp_rank, dims.dp)
    return Runtime(
        dist=info,
        accelerator=accelerator,
        parallel_dims=dims,
        dtype=dtype,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        context_parallel=ContextParallel.from_mesh(dims.cp_mesh) if dims.cp_enabled else None,
    )


def seed_run(cfg: Config, runtime: Runtime) -> None:
    """Seed Python's, NumPy's and torch's host and device generators with ``trainer.seed`` (the data
    order draws from streams of its own, derived from the same seed: ``portatrain.data``). With
    ``trainer.deterministic=true``, ask the adapter for deterministic kernels: two runs of one config on
    one device then give bitwise-identical losses, or one warning line says why this run cannot."""
    seed, accelerator = int(cfg.trainer.seed), runtime.accelerator
    random.seed(seed)  # research hooks (augmentation, sampling) draw from these too
    np.random.seed(seed % 2**32)
    accelerator.manual_seed(seed)
    if not cfg.trainer.deterministic:
        return
    backend = (cfg.compile.backend or accelerator.compile_backend) if cfg.compile.enabled else None
    caveat = accelerator.make_deterministic(backend)
    if caveat is not None and runtime.dist.is_main:
        logger.warning("trainer.deterministic=true cannot promise bitwise-identical losses: %s", caveat)


def describe(runtime: Runtime) -> dict[str, Any]:
    """The runtime in a few JSON-able fields (the start banner and ``summary.json``)."""
    dims = runtime.parallel_dims
    return {
        "device": str(runtime.device),
        "world_size": runtime.dist.world_size,
        "dtype": str(runtime.dtype).removeprefix("torch."),
        "layout": {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")},
    }
