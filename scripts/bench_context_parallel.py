"""Context parallelism on CPU: activation memory per rank, step time and bytes exchanged, cp=1, 2, 4.

One long sequence (one row of ``--seq`` positions, one document) through a grouped-query Llama
(dim 256, 8 query heads over 2 kv heads, SwiGLU 768, 2 layers) with the chunked loss, so the
logits do not swamp the blocks' activations. For each ``cp`` the script spawns ``cp`` gloo processes;
rank 0 reports

* ``activations``: the peak bytes torch's CPU allocator holds during the forward (everything saved
  for backward, plus the forward's transients; ``portatrain.profiling.measured_peak_bytes``),
  against the cp=1 run;
* ``step``: the best of ``--repeats`` forward+backward wall times, and the device-seconds per token
  against cp=1 (``cp * step / step(cp=1)``; 1.0 would be a perfect split, the excess is the
  overhead: the collectives, the masked SDPA path, the smaller matmuls);
* ``exchanged``: bytes this rank received through the all-gathers of k/v (forward) and sent through
  the reduce-scatters of their gradients (backward) in one step, against
  ``portatrain.parallel.context.exchanged_bytes``.

    OMP_NUM_THREADS=1 python scripts/bench_context_parallel.py            # 8192 positions
    OMP_NUM_THREADS=1 python scripts/bench_context_parallel.py --seq 2048 --cp 1 2

Step times on a shared 2-core machine are noisy, and cp=4 runs 4 processes on 2 cores: read its
time as a check that it runs, its memory and bytes as the figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from portatrain.losses import chunked_loss_fn
from portatrain.models.llama import LLAMA3
from portatrain.parallel.context import ContextParallel, exchanged_bytes
from portatrain.parallel.parallel_dims import ParallelDims
from portatrain.profiling import measured_peak_bytes

ARGS = replace(LLAMA3.flavors["debug"], dim=256, n_layers=2, n_heads=8, n_kv_heads=2, multiple_of=256)


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank exchanges through the k/v all-gathers and gradient reduce-scatters."""

    def __init__(self, cp: int) -> None:
        super().__init__()
        self.cp, self.bytes = cp, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = str(func)
        if "all_gather_into_tensor" in name or "reduce_scatter_tensor" in name:
            # All-gather: the others' (cp - 1) shards arrive; reduce-scatter: (cp - 1) of cp parts leave.
            full = args[0].numel() * args[0].element_size() * (self.cp if "all_gather" in name else 1)
            self.bytes += full * (self.cp - 1) // self.cp
        return func(*args, **(kwargs or {}))


def _worker(rank: int, cp: int, port: int, seq: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    context = None
    if cp > 1:
        dist.init_process_group("gloo", rank=rank, world_size=cp)
        dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=cp, cp=cp)
        dims.build_mesh("cpu")
        context = ContextParallel.from_mesh(dims.cp_mesh)
    args = replace(ARGS, max_seq_len=seq)
    torch.manual_seed(0)
    model = LLAMA3.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "positions": torch.arange(seq)[None]}
    if context is not None:
        batch = context.shard_batch(batch)

    def forward() -> torch.Tensor:
        loss_fn = chunked_loss_fn(batch["labels"], 1024)
        return model(
            batch["input_ids"],
            positions=batch["positions"],
            attn_mask=batch.get("attn_mask"),
            output_fn=loss_fn,
        )

    def step() -> None:
        forward().backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    counter = CollectiveBytes(cp)
    with counter:
        step()
    times = []
    for _ in range(repeats):
        if context is not None:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if context is not None:
        worst = torch.tensor(min(times))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        times = [worst.item()]
    holder: list[torch.Tensor] = []
    activations = measured_peak_bytes(lambda: holder.append(forward()))
    holder.clear()
    if rank == 0:
        torch.save({"activations": activations, "step": min(times), "bytes": counter.bytes}, out)
    if context is not None:
        dist.barrier()
        dist.destroy_process_group()


def run(cp: int, seq: int, repeats: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.start_processes(
            _worker, args=(cp, port, seq, repeats, out), nprocs=cp, join=True, start_method="spawn"
        )
        return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="positions in the one row")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    opts = parser.parse_args()
    kv_dim = ARGS.n_kv_heads * ARGS.head_dim
    print(
        f"one row of {opts.seq} positions; llama dim {ARGS.dim}, {ARGS.n_layers} layers, "
        f"{ARGS.n_heads} heads / {ARGS.n_kv_heads} kv heads, ffn {ARGS.ffn_dim}; fp32, CPU, 1 thread per rank"
    )
    print(
        f"{'cp':>3} {'activations MB':>15} {'vs cp=1':>8} {'step s':>8} {'dev-s/token vs cp=1':>20} "
        f"{'exchanged MB':>13} {'analytic MB':>12}"
    )
    base = None
    for cp in opts.cp:
        result = run(cp, opts.seq, opts.repeats)
        base = base or result
        analytic = exchanged_bytes(
            batch=1, seq_len=opts.seq, n_layers=ARGS.n_layers, kv_dim=kv_dim, cp=cp, act_bytes=4
        )
        print(
            f"{cp:>3} {result['activations'] / 1e6:>15.1f} {result['activations'] / base['activations']:>8.3f} "
            f"{result['step']:>8.2f} {cp * result['step'] / base['step']:>20.2f} "
            f"{result['bytes'] / 1e6:>13.2f} {analytic / 1e6:>12.2f}"
        )


if __name__ == "__main__":
    main()
