"""How long an asynchronous checkpoint blocks the training loop, against a synchronous save of the
same state (``checkpoint.async_mode``).

For each kind of save the script times what the loop waits for -- the call to ``Checkpointer.save``
(for ``thread``/``process``: state dict, checksums, JSON and the staging copy; the write goes on in
the background and is waited for outside the timed region, as when training outlasts a save) -- in
rounds that alternate the kinds, so a burst of load from another process hits all alike. The
reference kinds:

- ``none``: the synchronous save (the loop waits for the whole write, fsync and rename);
- ``dcp default``: ``dcp.async_save`` with DCP's default stager (fresh host buffers at every save),
  what a plain ``async_save`` call blocks for, and no checksums, JSON or commit.

It prints the median blocked time of each kind and its ratio to the synchronous save, side by side.
The state is a stack of ``--layers`` square linear layers of width ``--dim`` with AdamW's two moments
(12 bytes per parameter on disk).

    OMP_NUM_THREADS=1 python scripts/bench_async_checkpoint.py            # 101M parameters, 1.2 GB a save
    OMP_NUM_THREADS=1 python scripts/bench_async_checkpoint.py --dim 512 --layers 4 --repeats 2  # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from bench_checksum import build_state  # the same model and AdamW state (scripts/ is on sys.path)

from portatrain.checkpoint import Checkpointer

KINDS = ("none", "thread", "process", "dcp default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind, after one warm-up")
    parser.add_argument("--dir", type=Path, default=None, help="where to save (default: a temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = build_state(args.dim, args.layers)
    params = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        savers = {
            kind: Checkpointer(Path(root) / kind, keep=1, is_main=True, async_mode=kind)
            for kind in KINDS
            if kind != "dcp default"
        }
        size = 0
        for i in range(args.repeats + 1):  # round 0 warms up (buffers, page cache, DCP's process)
            for kind in KINDS if i % 2 == 0 else reversed(KINDS):
                start = time.perf_counter()
                if kind == "dcp default":
                    model_sd, optim_sd = get_state_dict(model, optimizer)
                    tensors = {"model": model_sd, "optim": optim_sd["state"]}
                    pending = dcp.async_save(tensors, checkpoint_id=str(Path(root) / f"dcp_{i}"))
                    blocked = time.perf_counter() - start
                    pending.result()
                else:
                    path = savers[kind].save(
                        i,
                        model=model,
                        optimizer=optimizer,
                        state={"step": i, "tokens_seen": 0, "lr_scheduler": {}},
                        dataloader_state=None,
                        rng_state={},
                        config_yaml="",
                    )
                    blocked = time.perf_counter() - start
                    savers[kind].wait()
                    size = sum(f.stat().st_size for f in path.iterdir())
                if i:
                    times[kind].append(blocked)
        for saver in savers.values():
            saver.close()

    sync = statistics.median(times["none"])
    print(f"state: {params / 1e6:.1f}M parameters + AdamW moments, {size / 1e9:.2f} GB a checkpoint")
    print(f"threads: {torch.get_num_threads()}, saves of each kind: {args.repeats} (after one warm-up)")
    print("  async_mode      loop blocked per save (median)   / synchronous save")
    for kind in KINDS:
        median = statistics.median(times[kind])
        print(f"  {kind:<14}  {median:8.3f} s                      {median / sync:6.1%}")


if __name__ == "__main__":
    main()
