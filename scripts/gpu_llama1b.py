"""The ``llama1b`` recipe on the visible CUDA GPUs: bf16, compiled, FSDP2; prints tokens/s, MFU, peak memory.

One command for the first GPU machine. It launches ``portatrain bench`` under ``torchrun`` with one
process per visible GPU (``parallel.dp_shard`` = the GPU count: FSDP2 over all of them; one GPU runs
without sharding), then reads the bench's ``bench.json`` and prints the three figures. Cold start
(compilation included) and steady state are measured apart by the bench (``portatrain.bench``).

    python scripts/gpu_llama1b.py                          # all visible GPUs, 30 measured steps
    CUDA_VISIBLE_DEVICES=0 python scripts/gpu_llama1b.py --steps 50
    python scripts/gpu_llama1b.py --loss plain data.batch_size=4

``--loss chunked`` (the default) takes the loss chunk by chunk (``trainer.loss=chunked``): Llama 3's
128,256-token vocabulary at 8 x 2,048 positions would otherwise hold ~20 GB of logits and their
gradients per GPU. Extra arguments are Hydra overrides passed to the bench.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps (bench.steps)")
    parser.add_argument("--warmup", type=int, default=5, help="steps after the first, not measured")
    parser.add_argument("--loss", default="chunked", choices=["plain", "chunked"])
    parser.add_argument("--run-dir", default=None, help="where bench.json goes (default: a temporary dir)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA GPU visible (torch.cuda.is_available() is False): run this on a CUDA machine "
            "with a CUDA build of torch"
        )
    gpus = torch.cuda.device_count()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="gpu_llama1b_"))
    overrides = [
        "recipe=llama1b",
        "device=cuda",
        "trainer.dtype=bfloat16",
        "compile.enabled=true",
        f"parallel.dp_shard={gpus}",
        f"trainer.loss={args.loss}",
        f"bench.steps={args.steps}",
        f"bench.warmup_steps={args.warmup}",
        f"run_dir={run_dir}",
        *args.overrides,
    ]
    torchrun = shutil.which("torchrun") or "torchrun"
    command = [torchrun, "--standalone", f"--nproc_per_node={gpus}", "-m", "portatrain", "bench", *overrides]
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; running: {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)

    r = json.loads((run_dir / "bench.json").read_text())
    mfu = (
        f"{100 * r['mfu']:.1f}% of {r['peak_tflops_per_device']:.0f} TFLOP/s"
        if r["mfu"] is not None
        else "n/a"
    )
    peak = r["memory_peak_bytes"]
    peak_text = f"{peak / GIB:.2f} GiB on rank 0" if peak is not None else "not reported"
    print(
        f"\nllama1b, bf16, compiled, FSDP2 over {r['world_size']} GPU(s), batch {r['batch_size']} x "
        f"{r['seq_len']} per GPU, loss {args.loss}\n"
        f"  tokens/s      {r['tokens_per_s']:,.0f} ({r['tokens_per_s_per_device']:,.0f} per GPU)\n"
        f"  MFU           {mfu}\n"
        f"  peak memory   {peak_text}\n"
        f"  cold start    {r['cold_start_s']:.1f} s to the end of step 1\n"
        f"  bench.json    {run_dir / 'bench.json'}"
    )


if __name__ == "__main__":
    sys.exit(main())
