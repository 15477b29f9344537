"""Expert parallel's all-to-all traffic in one training step, measured against the analytic amount.

Run under torchrun (``parallel.ep`` ranks or more); the trainer is built as ``portatrain`` builds it,
takes one step to warm up, then one step with every all-to-all counted (forward and backward, the
bytes each rank hands to ``_c10d_functional.all_to_all_single``). Summed over the ranks, per step:

* ``capacity``: ``(4 * n_experts * slots * dim + 2 * n_experts * slots) * bytes`` per rank and MoE
  layer (rows and routing weights out, rows back, and the gradients of all three), ``slots`` the
  layer's capacity for the rank's tokens; ``(ep - 1) / ep`` of it crosses to other ranks.
* ``dropless``: ``n_experts`` int32 counts per rank and layer, plus
  ``2 * (2 * dim + 1) * top_k * tokens * bytes`` over the ranks: every assignment leaves its rank
  once and comes back once (rows and weights out, rows back, and the gradients), however unevenly
  routing spreads them.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 scripts/bench_ep_bytes.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 scripts/bench_ep_bytes.py model.moe_dispatch=dropless
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=4 scripts/bench_ep_bytes.py parallel.ep=4
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from torch.utils._python_dispatch import TorchDispatchMode

from portatrain.cli import config_dir
from portatrain.config import register_configs
from portatrain.models import ModelSchema
from portatrain.models.common.moe import MoE
from portatrain.trainer import Trainer

DEFAULTS = [
    "device=cpu",
    "model=qwen3_moe_debug",
    "model.moe_dispatch=capacity",
    "parallel.ep=2",
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=2",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "checkpoint.enabled=false",
]


class AllToAllBytes(TorchDispatchMode):
    """Bytes this rank sends through all-to-all while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def analytic_bytes(layer: MoE, tokens: int, dim: int, itemsize: int, ep: int) -> int:
    """All-to-all bytes of one MoE layer in one step, summed over the ``ep`` ranks (see the module docstring)."""
    if layer.dispatch == "capacity":
        slots = layer.capacity(tokens)
        return ep * (4 * layer.n_experts * slots * dim + 2 * layer.n_experts * slots) * itemsize
    counts = ep * layer.n_experts * 4  # int32
    return counts + 2 * (2 * dim + 1) * ep * layer.top_k * tokens * itemsize


def main(argv: list[str]) -> None:
    register_configs(ModelSchema)
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = compose("config", overrides=[*DEFAULTS, *argv])
    with open_dict(cfg):
        # One directory for all ranks (torchrun gives them one run id), fresh for each launch.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        cfg.run_dir = os.path.join(tempfile.gettempdir(), f"bench_ep_bytes_{run_id}")
    trainer = Trainer(cfg)
    try:
        loader = iter(trainer.train_loader)
        trainer.train_step([next(loader)])  # warm-up: lazy initialization, first-call costs
        batch = next(loader)
        with AllToAllBytes() as counted:
            trainer.train_step([batch])
        layers = [m for m in trainer.model.modules() if isinstance(m, MoE)]
        tokens, ep = batch["input_ids"].numel(), trainer.parallel_dims.ep
        dim = layers[0].gate.weight.shape[1]
        itemsize = torch.empty((), dtype=trainer.dtype).element_size()
        analytic = sum(analytic_bytes(m, tokens, dim, itemsize, ep) for m in layers)
        total = torch.tensor([counted.bytes], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(total)
        if trainer.dist.is_main:
            dispatch = layers[0].dispatch
            measured = int(total.item())
            print(
                f"{dispatch}: ep={ep}, {trainer.dist.world_size} ranks, {len(layers)} MoE layers, {tokens} tokens per rank, "
                f"dim {dim}, {layers[0].n_experts} experts, top-{layers[0].top_k}, {itemsize}-byte activations"
            )
            print(
                f"  all-to-all bytes per step, all ranks: measured {measured:,}  analytic {analytic:,}  ratio {measured / analytic:.4f}"
            )
            if dispatch == "capacity":
                print(f"  of which to other ranks: {measured * (ep - 1) // ep:,} ((ep-1)/ep, equal splits)")
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
