"""Muon's optimizer step against AdamW's on one Llama 3 8B block, in one process and FSDP2-sharded.

The block's seven matrices (dim 4096, ffn 14336, 32 heads of 128, 8 kv heads: q/o 4096x4096, k/v
1024x4096, gate/up 14336x4096, down 4096x14336; ``--scale N`` divides every size by N for a CPU) get
random gradients; the step of ``torch.optim.AdamW`` (foreach) and of ``portatrain.optim.muon.Muon``
(every matrix a Muon matrix) is timed, median of ``--steps``, and printed side by side.

``--nproc 2`` also runs them on that many processes (gloo on CPU, nccl on CUDA), each matrix a
DTensor sharded on dim 0 as FSDP2 holds it, Muon both ways (``portatrain.optim.muon.SHARDED``): the
gather (every rank all-gathers every matrix and orthogonalizes it) and round robin (each matrix to one
owner rank and back, two all-to-alls). The bytes each rank receives, in the Newton-Schulz dtype, are
summed over the ranks and compared with the analytic amounts for a matrix of ``n`` elements split
evenly: the gather brings ``(world - 1) / world * n`` to each of the ``world`` ranks; round robin
brings ``(world - 1) / world * n`` to the owner and sends ``(world - 1) / world * n`` back out. The two
results' largest difference is printed too (0: the same to the bit).

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
from portatrain.optim.muon import SHARDED, Muon


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


def _optimizers(params: list[torch.Tensor], ns_dtype: str, sharded: tuple[str, ...] = ()) -> dict:
    """AdamW and Muon over ``params``; with ``sharded``, one Muon per way of orthogonalizing a sharded
    matrix."""
    muon = {
        f"muon {way}" if sharded else "muon": Muon(
            [{"params": params, "algorithm": "muon"}], lr=1e-4, ns_dtype=ns_dtype, sharded=way
        )
        for way in sharded or ("round_robin",)
    }
    return {"adamw": torch.optim.AdamW(params, lr=1e-4), **muon}


def one_process(
    shapes: dict[str, tuple[int, int]], device: torch.device, steps: int, ns_dtype: str
) -> dict[str, float]:
    params = _params(shapes, device)
    return {name: time_step(opt.step, steps, device) for name, opt in _optimizers(params, ns_dtype).items()}


def _sharded_params(shapes, mesh, device: torch.device) -> list[torch.Tensor]:  # noqa: ANN001
    """The same matrices on every rank, each keeping its dim-0 shard (FSDP2's layout)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    params = []
    for full in _params(shapes, device):
        p = torch.nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(0)]))
        p.grad = distribute_tensor(full.grad, mesh, [Shard(0)])
        params.append(p)
    return params


def _largest_difference(shapes, mesh, device: torch.device, ns_dtype: str) -> float:  # noqa: ANN001
    """The largest difference, over every rank's shards, of one Muon step taken each way."""
    stepped = []
    for way in SHARDED:
        params = _sharded_params(shapes, mesh, device)
        Muon([{"params": params, "algorithm": "muon"}], lr=1e-2, ns_dtype=ns_dtype, sharded=way).step()
        stepped.append(params)
    local = [(a.to_local() - b.to_local()).detach().abs().max() for a, b in zip(*stepped)]
    largest = torch.stack(local).max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest)


def _worker(
    rank: int, world: int, port: int, shapes, device_type: str, steps: int, ns_dtype: str, out
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    optimizers = _optimizers(_sharded_params(shapes, mesh, device), ns_dtype, SHARDED)
    times, received = {}, {}
    for name, opt in optimizers.items():
        counts: list[int] = []
        opt.on_receive = counts.append
        times[name] = time_step(opt.step, steps, device)
        # Summed over the ranks; the warm-up step received too.
        total = torch.tensor([sum(counts) // (steps + 1)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        received[name] = float(total)
    difference = _largest_difference(shapes, mesh, device, ns_dtype)
    if rank == 0:
        out.put({**times, "received": received, "difference": difference})
    dist.destroy_process_group()


def distributed(
    shapes: dict[str, tuple[int, int]], nproc: int, device_type: str, steps: int, ns_dtype: str
) -> dict:
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
    print(f"{'layout':<16}{'muon':<13}{'adamw step':>12}{'muon step':>12}{'muon/adamw':>12}")
    print(
        f"{'one process':<16}{'':<13}{single['adamw'] * 1e3:>10.1f}ms{single['muon'] * 1e3:>10.1f}ms"
        f"{single['muon'] / single['adamw']:>11.1f}x"
    )
    if args.nproc > 1:
        result = distributed(shapes, args.nproc, args.device, args.steps, args.ns_dtype)
        name, world = f"fsdp2 x{args.nproc}", args.nproc
        size = torch.empty((), dtype=dtype_from_name(args.ns_dtype)).element_size()
        # Each shard of a matrix of n elements is n / world of them (dim 0 divides evenly here).
        moved = sum((world - 1) * (r * c) // world for r, c in shapes.values()) * size
        analytic = {"gather": world * moved, "round_robin": 2 * moved}
        for way in SHARDED:
            step = result[f"muon {way}"]
            print(
                f"{name:<16}{way:<13}{result['adamw'] * 1e3:>10.1f}ms{step * 1e3:>10.1f}ms"
                f"{step / result['adamw']:>11.1f}x"
            )
        for way in SHARDED:
            got, want = result["received"][f"muon {way}"], analytic[way]
            print(
                f"{way} received per step, all ranks: {got / 2**20:.2f} MiB measured, "
                f"{want / 2**20:.2f} MiB analytic (ratio {got / want:.3f})"
            )
        print(f"round robin against the gather: largest difference {result['difference']:.3g}")


if __name__ == "__main__":
    main()
