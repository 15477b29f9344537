"""Run many tiny training runs to the end and count how each process exited.

A finished run must exit 0: a scheduler marks anything else failed and may requeue it. This loop
trains the debug model on a prepared corpus (the streaming loader, whose prefetch thread outlived
the run before it was joined on close), saves the final checkpoint, and records every exit status,
alone and under ``torchrun`` (2 ranks, gloo)::

    OMP_NUM_THREADS=1 python scripts/exit_loop.py --runs 50 --torchrun-runs 50

It prints one line per run and the counts at the end; exit status 1 when any run did not exit 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = [
    "device=cpu",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.steps=6",
    "trainer.log_every=2",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "optim.warmup_steps=2",
    "checkpoint.every=3",
]


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -999, "timed out"
    tail = (out.stdout + out.stderr).strip().splitlines()[-1:] if out.returncode else []
    return out.returncode, tail[0] if tail else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="single-process runs")
    parser.add_argument("--torchrun-runs", type=int, default=50, help="2-rank torchrun runs")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="portatrain-exit-loop-") as tmp:
        root = Path(tmp)
        rc, tail = _run(
            [python, "-m", "portatrain", "prepare", "out=corpus", "data.num_documents=300", "workers=1"],
            root,
            args.timeout,
        )
        if rc != 0:
            print(f"prepare failed ({rc}): {tail}", file=sys.stderr)
            return 1
        data = [*TINY, f"data.dataset={root / 'corpus'}"]
        plans = [("single", [python, "-m", "portatrain"], []) for _ in range(args.runs)]
        launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        plans += [("torchrun", [*launcher, "-m", "portatrain"], ["parallel.dp_shard=2"])] * args.torchrun_runs
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for i, (kind, cmd, extra) in enumerate(plans):
            start = time.perf_counter()
            rc, tail = _run([*cmd, *data, *extra, f"run_dir={root / f'run{i}'}"], root, args.timeout)
            counts[kind][rc] += 1
            print(f"{kind} run {i}: exit {rc} in {time.perf_counter() - start:.1f} s {tail}", flush=True)
    for kind, counter in counts.items():
        print(f"{kind}: {sum(counter.values())} runs, exit statuses {dict(sorted(counter.items()))}")
    return int(any(rc != 0 for counter in counts.values() for rc in counter))


if __name__ == "__main__":
    sys.exit(main())
