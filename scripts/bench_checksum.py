"""What content checksums cost a checkpoint save: ``Checkpointer.save`` with and without them.

Every save writes, with the tensors, a checksum of each model and optimizer tensor (a wrapping
integer sum of its elements' bit patterns, see ``portatrain.checkpoint.verify``) that every load
compares. This script measures that cost where it is paid: the whole save (state dict, DCP's write
with its fsync, the JSON, the rename and rotation), with checksums on and off, alternating on/off so
a burst of load from another process hits both alike. It prints the median and the lower quartile
of each kind's save time (bursts of load from other processes lengthen some saves: the quartile is
the steadier figure on a busy machine), their ratios, and the checksum pass alone (timed by itself)
as a share of the save without it.

The state is a stack of ``--layers`` square linear layers of width ``--dim`` with AdamW's two moments
(after one step): 3 x 4 bytes per parameter on disk, as a model in fp32 with AdamW saves.

    OMP_NUM_THREADS=1 python scripts/bench_checksum.py                  # ~25M parameters, ~300 MB a save
    OMP_NUM_THREADS=1 python scripts/bench_checksum.py --dim 2048 --layers 12 --repeats 5 --dir /scratch
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from portatrain.checkpoint import Checkpointer
from portatrain.checkpoint.verify import checksums, flat_tensors


def build_state(dim: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).sum().backward()
    optimizer.step()  # creates the moments
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=15, help="saves of each kind")
    parser.add_argument("--dir", type=Path, default=None, help="where to save (default: a temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose

    model, optimizer = build_state(args.dim, args.layers)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        savers = {
            on: Checkpointer(Path(root) / ("with" if on else "without"), keep=1, is_main=True, checksums=on)
            for on in (True, False)
        }
        times: dict[bool, list[float]] = {True: [], False: []}
        size = 0
        for i in range(args.repeats + 1):  # the first round warms up (allocations, page cache)
            for on in (True, False) if i % 2 == 0 else (False, True):
                start = time.perf_counter()
                path = savers[on].save(
                    i,
                    model=model,
                    optimizer=optimizer,
                    state={"step": i, "tokens_seen": 0, "lr_scheduler": {}},
                    dataloader_state=None,
                    rng_state={},
                    config_yaml="",
                )
                if i:
                    times[on].append(time.perf_counter() - start)
                size = sum(f.stat().st_size for f in path.iterdir())

        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        flat = flat_tensors({"model": model_sd, "optim": optim_sd["state"]})
        alone = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            checksums(flat)
            alone.append(time.perf_counter() - start)

    def quartile(values: list[float]) -> float:
        return statistics.quantiles(values, n=4)[0]

    with_s, without_s, sums_s = (statistics.median(t) for t in (times[True], times[False], alone))
    with_q, without_q = quartile(times[True]), quartile(times[False])
    print(f"state: {params / 1e6:.1f}M parameters + AdamW moments, {size / 2**20:.0f} MiB a checkpoint")
    print(f"threads: {torch.get_num_threads()}, saves of each kind: {args.repeats}")
    print("                          median   lower quartile")
    print(f"  save with checksums     {with_s * 1e3:6.1f} ms   {with_q * 1e3:6.1f} ms")
    print(f"  save without checksums  {without_s * 1e3:6.1f} ms   {without_q * 1e3:6.1f} ms")
    print(f"  ratio with / without    {with_s / without_s:6.3f}      {with_q / without_q:6.3f}")
    print(
        f"  checksum pass alone     {sums_s * 1e3:8.1f} ms = {sums_s / without_s:.1%} of a save "
        f"({size / 2**30 / sums_s:.1f} GiB/s)"
    )


if __name__ == "__main__":
    main()
