"""LoRA against full fine-tuning: peak memory and step time of the same model, data and batch.

Each run is a fresh ``python -m portatrain`` process (so each peak is its own: on CPU the peak is the
process's resident set, ``memory_peak_bytes``), the two kinds alternating ``--repeats`` times so that
load from other processes hits both alike. Step time is the logging window after the first
(cold) steps. Printed: each kind's median peak and step time, and LoRA's ratios to full.

    OMP_NUM_THREADS=2 python scripts/bench_lora.py                      # an 88M-parameter Llama, CPU
    python scripts/bench_lora.py --dim 2048 --layers 16 --device cuda   # where there is a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(kind: str, args: argparse.Namespace, root: Path, i: int) -> dict[str, float]:
    run_dir = root / f"{kind}{i}"
    steps = 2 * args.steps  # the first half warms up; the second half is the measured window
    command = [
        sys.executable,
        "-m",
        "portatrain",
        f"device={args.device}",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        f"model.n_heads={args.dim // 64}",
        f"model.n_kv_heads={max(1, args.dim // 256)}",
        f"model.ffn_dim={args.dim * 8 // 3 // 64 * 64}",
        f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch_size}",
        "data.num_documents=400",
        f"trainer.steps={steps}",
        f"trainer.log_every={args.steps}",
        "trainer.eval_every=0",
        "trainer.progress=false",
        "checkpoint.enabled=false",
        f"finetune.method={kind}",
        f"run_dir={run_dir}",
    ]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    return {"peak": last["memory_peak_bytes"], "step_s": last["step_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="steps measured (after as many warm-up steps)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternating")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    results: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.repeats):
            for kind in results:
                results[kind].append(run(kind, args, Path(root), i))
    median = {
        kind: {key: statistics.median(r[key] for r in runs) for key in ("peak", "step_s")}
        for kind, runs in results.items()
    }
    print(
        f"model: dim {args.dim}, {args.layers} layers, rows {args.batch_size} x {args.seq_len}, "
        f"device {args.device}; median of {args.repeats} runs each"
    )
    for kind, m in median.items():
        print(f"{kind:>5}: peak memory {m['peak'] / 2**20:8.1f} MiB   step time {m['step_s']:.3f} s")
    print(
        f"LoRA / full: peak memory {median['lora']['peak'] / median['full']['peak']:.2f}, "
        f"step time {median['lora']['step_s'] / median['full']['step_s']:.2f}"
    )


if __name__ == "__main__":
    main()
