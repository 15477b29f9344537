"""The dry run's memory estimate against the measured peak of a training step, on CPU.

For each case, a Trainer (fp32, eager) is built exactly as ``portatrain`` builds it, takes one step
(so AdamW's moments exist), and then one more step runs under torch's CPU-allocator accounting
(``portatrain.profiling.measured_peak_bytes``: the profiler's allocation and free events in
time order). Measured peak = bytes held before the step (parameters, optimizer state, counted from
the tensors) + the step's peak above that. The estimate is the model family's
``spec.estimate_memory`` with the arguments ``dry_run=true`` passes (``portatrain.plan``). FSDP2
cases run the same on 2 gloo processes (``torch.multiprocessing``) and report rank 0.

Each case runs in a fresh process, so the process's peak resident set (``ru_maxrss``, what the
Trainer logs as ``peak_rss`` on CPU) is the case's own: it is printed beside the allocator's peak
(RSS adds the interpreter, torch's libraries and the allocator's cached pages).

The published shapes (``REAL``: Qwen3-0.6B and Llama-3.2-1B, full fine-tune and LoRA, batch 1 x 256)
are not in the default set: they need ~12 and ~20 GiB of memory and minutes each.

    OMP_NUM_THREADS=1 python scripts/bench_memory.py                 # the small cases
    OMP_NUM_THREADS=1 python scripts/bench_memory.py --cases small-none small-full
    OMP_NUM_THREADS=1 python scripts/bench_memory.py --cases qwen3-0.6b-full qwen3-0.6b-lora
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import compose  # noqa: E402  (a sibling script, not a package)

from portatrain.plan import estimate_for_config  # noqa: E402
from portatrain.profiling import measured_peak_bytes  # noqa: E402

MIB = 1024**2
COMMON = [
    "recipe=debug",
    "device=cpu",
    "trainer.dtype=float32",
    "trainer.steps=100",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "checkpoint.enabled=false",
    "data.collator=pad_to_max",
]
SMALL = [
    "model.dim=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=8192",
]
WIDE = [
    "model.dim=512",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.vocab_size=32000",
]
CASES: dict[str, list[str]] = {
    "small-none": [*SMALL, "data.batch_size=4", "data.seq_len=256"],
    "small-selective": [
        *SMALL,
        "data.batch_size=4",
        "data.seq_len=256",
        "parallel.activation_checkpointing=selective",
    ],
    "small-full": [*SMALL, "data.batch_size=4", "data.seq_len=256", "parallel.activation_checkpointing=full"],
    "small-none-seq512": [*SMALL, "data.batch_size=2", "data.seq_len=512", "model.max_seq_len=512"],
    "wide-none": [*WIDE, "data.batch_size=2", "data.seq_len=256"],
    "wide-full": [*WIDE, "data.batch_size=2", "data.seq_len=256", "parallel.activation_checkpointing=full"],
    "wide-chunked": [
        *WIDE,
        "data.batch_size=2",
        "data.seq_len=256",
        "trainer.loss=chunked",
        "trainer.loss_chunk_size=128",
    ],
    "small-fsdp2": [*SMALL, "data.batch_size=4", "data.seq_len=256"],
}
DISTRIBUTED = {"small-fsdp2": 2}
# The published shapes, embedding included: with the byte tokenizer a run builds the tokenizer's 258
# rows unless model.vocab_size names the checkpoint's (Qwen3: 151,936; Llama 3.2: 128,256).
QWEN3_0_6B = ["model=qwen3_0_6b", "model.vocab_size=151936", "data.batch_size=1", "data.seq_len=256"]
LLAMA3_1B = ["model=llama3_1b", "model.vocab_size=128256", "data.batch_size=1", "data.seq_len=256"]
REAL: dict[str, list[str]] = {
    "qwen3-0.6b-full": QWEN3_0_6B,
    "qwen3-0.6b-lora": [*QWEN3_0_6B, "finetune.method=lora"],
    "llama3-1b-full": LLAMA3_1B,
    "llama3-1b-lora": [*LLAMA3_1B, "finetune.method=lora"],
}


def state_bytes(trainer) -> int:
    """Parameters (local shards under FSDP2) and optimizer state held between steps."""
    tensors = {}
    for p in trainer.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        tensors[id(local)] = local
    for state in trainer.optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                local = t.to_local() if hasattr(t, "to_local") else t
                tensors[id(local)] = local
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.numel() > 1)


def measure(overrides: list[str], run_dir: Path) -> dict:
    from portatrain.trainer import Trainer

    cfg = compose(COMMON + overrides, run_dir)
    trainer = Trainer(cfg)
    try:
        loader = iter(trainer.train_loader)
        trainer.train_step([next(loader)])  # creates AdamW's moments
        batch = next(loader)
        before = state_bytes(trainer)
        delta = measured_peak_bytes(lambda: trainer.train_step([batch]))
        estimate = estimate_for_config(cfg, world_size=trainer.dist.world_size)
        return {
            "measured": before + delta,
            "state": before,
            "estimate": estimate,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        }
    finally:
        trainer.close()


def _worker(rank: int, world: int, port: int, overrides: list[str], run_dir: str, out: str) -> None:
    if world == 1:  # one process, no process group: as ``portatrain`` runs without torchrun
        torch.save(measure(overrides, Path(run_dir)), out)
        return
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    result = measure(overrides, Path(run_dir))
    if rank == 0:
        torch.save(result, out)


def run_case(name: str, tmp: Path) -> dict:
    world = DISTRIBUTED.get(name, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"{name}.pt"
    mp.start_processes(
        _worker,
        args=(world, port, (CASES | REAL)[name], str(tmp / name), str(out)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return torch.load(out, weights_only=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=[*CASES, *REAL])
    args = parser.parse_args()
    print(
        f"{'case':<20}{'estimate':>10}{'measured':>10}{'est/meas':>9}{'peak RSS':>10}{'est/RSS':>8}"
        "   estimate components (MiB)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            r = run_case(name, Path(tmp))
            est = r["estimate"]
            parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in est.items() if k != "total")
            print(
                f"{name:<20}{est['total'] / MIB:>8.1f} M{r['measured'] / MIB:>8.1f} M"
                f"{est['total'] / r['measured']:>9.3f}{r['peak_rss'] / MIB:>8.1f} M"
                f"{est['total'] / r['peak_rss']:>8.3f}   {parts}; measured state {r['state'] / MIB:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
