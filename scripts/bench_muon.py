"""Muon's optimizer step against AdamW's on one Llama 3 8B block, in one process and FSDP2-sharded.

The block's seven matrices (dim 4096, ffn 14336, 32 heads of 128, 8 kv heads: q/o 4096x4096, k/v
1024x4096, gate/up 14336x4096, down 4096x14336; ``--scale N`` divides every size by N for a CPU) get
random gradients; the step of ``torch.optim.AdamW`` (foreach) and of ``portatrain.optim.muon.Muon``
(every matrix a Muon matrix) is timed, median of ``--steps``, and printed side by side.

``--nproc 2`` also runs both on that many processes (gloo on CPU, nccl on CUDA), each matrix a
DTensor sharded on dim 0 as FSDP2 holds it: Muon gathers every matrix in its Newton-Schulz dtype
before orthogonalizing it, and the bytes each rank receives are counted and compared with the analytic
amount, ``(world - 1) / world * elements * element size`` per matrix (an all-gather's).

    OMP_NUM_THREADS=1 python scripts/bench_muon.py --scale 16 --nproc 2
    python scripts/bench_muon.py --device cuda --nproc 2    # the full sizes, on GPUs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from portatrain.dtypes import dtype_from_name
from portatrain.optim.muon import Muon


def block_shapes(dim: int, ffn: int, heads: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    head_dim = dim // heads
    kv = kv_heads * head_dim
    return {
        "q_proj": (dim, dim),
        "k_proj": (kv, dim),
        "v_proj": (kv, dim),
        "o_proj": (dim, dim),
        "gate_proj": (ffn, dim),
        "up_proj": (ffn, dim),
        "down_proj": (dim, ffn),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Median seconds of ``step`` over ``steps`` runs, after one warm-up (state allocation)."""
    step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _params(shapes: dict[str, tuple[int, int]], device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes.values():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return params


def _optimizers(params: list[torch.Tensor], ns_dtype: str) -> dict[str, torch.optim.Optimizer]:
    return {
        "adamw": torch.optim.AdamW(params, lr=1e-4),
        "muon": Muon([{"params": params, "algorithm": "muon"}], lr=1e-4, ns_dtype=ns_dtype),
    }


def one_process(
    shapes: dict[str, tuple[int, int]], device: torch.device, steps: int, ns_dtype: str
) -> dict[str, float]:
    params = _params(shapes, device)
    return {name: time_step(opt.step, steps, device) for name, opt in _optimizers(params, ns_dtype).items()}


def _worker(
    rank: int, world: int, port: int, shapes, device_type: str, steps: int, ns_dtype: str, out
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    params = []
    for full in _params(shapes, device):  # the same matrices on every rank, each keeps its dim-0 shard
        p = torch.nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(0)]))
        p.grad = distribute_tensor(full.grad, mesh, [Shard(0)])
        params.append(p)
    optimizers = _optimizers(params, ns_dtype)
    received: list[int] = []
    optimizers["muon"].on_gather = received.append
    times = {name: time_step(opt.step, steps, device) for name, opt in optimizers.items()}
    per_step = sum(received) // (steps + 1)  # the warm-up step gathered too
    if rank == 0:
        out.put({**times, "gathered": per_step})
    dist.destroy_process_group()


def distributed(
    shapes: dict[str, tuple[int, int]], nproc: int, device_type: str, steps: int, ns_dtype: str
) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    mp.start_processes(
        _worker,
        args=(nproc, port, shapes, device_type, steps, ns_dtype, out),
        nprocs=nproc,
        start_method="spawn",
    )
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--scale", type=int, default=1, help="divide every size by this (CPU: 16)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument(
        "--nproc", type=int, default=0, help="also time FSDP2-sharded matrices on N processes"
    )
    parser.add_argument("--ns-dtype", default="bfloat16", help="Newton-Schulz dtype (optim.muon.ns_dtype)")
    args = parser.parse_args()
    dtype_from_name(args.ns_dtype)  # a typo fails here, not in a worker
    shapes = block_shapes(4096 // args.scale, 14336 // args.scale, 32, 8)
    if args.scale > 1:
        shapes = {name: tuple(max(1, s) for s in shape) for name, shape in shapes.items()}
    device = torch.device(args.device)
    elements = sum(r * c for r, c in shapes.values())
    print(
        f"Llama 3 8B block / {args.scale}: {len(shapes)} matrices, {elements / 1e6:.1f}M parameters, "
        f"{args.device}, Newton-Schulz in {args.ns_dtype}"
    )
    single = one_process(shapes, device, args.steps, args.ns_dtype)
    print(f"{'layout':<16}{'adamw step':>12}{'muon step':>12}{'muon/adamw':>12}")
    print(
        f"{'one process':<16}{single['adamw'] * 1e3:>10.1f}ms{single['muon'] * 1e3:>10.1f}ms{single['muon'] / single['adamw']:>11.1f}x"
    )
    if args.nproc > 1:
        result = distributed(shapes, args.nproc, args.device, args.steps, args.ns_dtype)
        name = f"fsdp2 x{args.nproc}"
        print(
            f"{name:<16}{result['adamw'] * 1e3:>10.1f}ms{result['muon'] * 1e3:>10.1f}ms{result['muon'] / result['adamw']:>11.1f}x"
        )
        size = torch.empty((), dtype=dtype_from_name(args.ns_dtype)).element_size()
        world = args.nproc
        # Each shard of a matrix of n elements is n / world of them (dim 0 divides evenly here).
        analytic = sum((world - 1) * (r * c) // world for r, c in shapes.values()) * size
        gathered = result["gathered"]
        print(
            f"gathered per rank and step: {gathered / 2**20:.2f} MiB measured, {analytic / 2**20:.2f} MiB analytic "
            f"(ratio {gathered / analytic:.3f}); in fp32 it would be {analytic / size * 4 / 2**20:.2f} MiB"
        )


if __name__ == "__main__":
    main()
