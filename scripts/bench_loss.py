"""The memory-lean loss (``trainer.loss=chunked``) against the plain loss: peak memory and step time.

Two Trainers of the same custom-size Llama (a 128,256-token vocabulary, Llama 3's, on a small
body, so the output head and the loss dominate as they do at long sequences on real models) are
built in one process, one with ``trainer.loss=plain`` and one with ``trainer.loss=chunked``, and
train on the same batches, one step each in turn (order alternating), so load from other
processes hits both alike. Reported:

- **step time**: median of ``--steps`` measured ``train_step`` calls each (after ``--warmup``);
- **peak memory of a step**: torch's CPU allocator, through the profiler's memory events
  (``portatrain.profiling.measured_peak_bytes``), for one step after the optimizer state
  exists: the persistent state held before the step (parameters and AdamW moments, counted from
  the tensors) plus the step's peak above it (activations, logits, gradients).

    OMP_NUM_THREADS=1 python scripts/bench_loss.py                   # 128,256 x 2,048 positions
    OMP_NUM_THREADS=1 python scripts/bench_loss.py --steps 3 model.dim=128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import compose  # noqa: E402  (a sibling script, not a package)

from portatrain.profiling import measured_peak_bytes  # noqa: E402
from portatrain.trainer import Trainer  # noqa: E402

OVERRIDES = [
    "recipe=debug",
    "device=cpu",
    "model.vocab_size=128256",
    "model.dim=256",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.max_seq_len=2048",
    "data.seq_len=2048",
    "data.batch_size=1",
    "trainer.steps=1000",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "checkpoint.enabled=false",
    "optim.grad_clip=1.0",
]
MIB = 1024**2


def state_bytes(trainer: Trainer) -> int:
    """Parameters and optimizer state held between steps (gradients are freed by zero_grad)."""
    tensors = {id(p): p for p in trainer.model.parameters()}
    for state in trainer.optimizer.state.values():
        tensors.update({id(t): t for t in state.values() if isinstance(t, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per loss")
    parser.add_argument("--warmup", type=int, default=1, help="steps dropped first")
    parser.add_argument("--chunk", type=int, default=1024, help="trainer.loss_chunk_size")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (both runners)")
    args = parser.parse_args()
    overrides = OVERRIDES + args.overrides
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; overrides: {' '.join(overrides)}"
    )
    variants = {
        "plain": ["trainer.loss=plain"],
        "chunked": ["trainer.loss=chunked", f"trainer.loss_chunk_size={args.chunk}"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {k: Trainer(compose(overrides + v, Path(tmp) / k)) for k, v in variants.items()}
        loader = iter(trainers["plain"].train_loader)
        names = list(trainers)
        times: dict[str, list[float]] = {k: [] for k in names}
        losses: dict[str, list[float]] = {k: [] for k in names}
        peaks: dict[str, int] = {}
        for step in range(args.warmup + args.steps + 1):
            batch = next(loader)
            order = names if step % 2 == 0 else names[::-1]
            for name in order:
                trainer = trainers[name]
                if step == args.warmup + args.steps:  # the last step: memory, under the profiler
                    before = state_bytes(trainer)
                    peaks[name] = before + measured_peak_bytes(lambda t=trainer, b=batch: t.train_step([b]))
                    continue
                start = time.perf_counter()
                metrics = trainer.train_step([batch])
                elapsed = time.perf_counter() - start
                losses[name].append(float(metrics["loss"]))
                if step >= args.warmup:
                    times[name].append(elapsed)
        for t in trainers.values():
            t.close()
    tokens = int(trainers["plain"].cfg.data.batch_size) * int(trainers["plain"].cfg.data.seq_len)
    print(f"\nper step: {tokens} positions x vocabulary {trainers['plain'].model.args.vocab_size}")
    print(f"{'loss':<10}{'median step':>13}{'peak memory':>14}   losses (same batches)")
    for name in names:
        print(
            f"{name:<10}{statistics.median(times[name]) * 1e3:>10.0f} ms{peaks[name] / MIB:>10.0f} MiB   "
            + ", ".join(f"{x:.5f}" for x in losses[name])
        )
    p, c = (statistics.median(times[k]) for k in names)
    print(
        f"\nchunked / plain: step time {c / p:.3f}, peak memory {peaks['chunked'] / peaks['plain']:.3f} "
        f"({1 - peaks['chunked'] / peaks['plain']:.0%} lower); per-step ratios "
        + ", ".join(f"{b / a:.2f}" for a, b in zip(times["plain"], times["chunked"]))
    )


if __name__ == "__main__":
    main()
