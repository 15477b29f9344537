"""Cold start of a first run and of a restart that finds the compile cache (``compile.cache``).

Each run is ``portatrain bench`` in a fresh process, compiled (``compile.enabled=true``), so
nothing compiled survives in memory: what the restart saves comes from disk alone.

- **first**: a new run directory; its compile cache (``<run_dir>/compile_cache``) starts empty,
  so every graph is compiled (inductor's global cache in /tmp is not used: the run's cache
  directory replaces it);
- **restart**: another run directory with ``compile.cache_dir`` pointing at the first run's cache,
  the same shapes -- what a job restarted after preemption sees in its own run directory (a bench
  refuses to reuse a run directory, so the cache is shared explicitly here).

Pairs run one after the other (``--pairs`` times) so a burst of load hits both; each pair gets a
fresh cache. Reported: ``cold_start_s`` from the bench (command start -> end of step 1, compilation
included), its ``setup_s`` and ``first_step_s``, the whole process's wall time, and the ratio
restart / first.

    OMP_NUM_THREADS=1 python scripts/bench_cold_start.py
    OMP_NUM_THREADS=1 python scripts/bench_cold_start.py --pairs 1 recipe=debug data.seq_len=128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = [
    "recipe=debug",
    "device=cpu",
    "compile.enabled=true",
    "bench.steps=2",
    "bench.warmup_steps=0",
    "trainer.progress=false",
]


def bench(run_dir: Path, overrides: list[str]) -> dict:
    """One ``portatrain bench`` in a fresh process; its bench.json plus the process's wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "portatrain", "bench", f"run_dir={run_dir}", *overrides],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads((run_dir / "bench.json").read_text())
    result["process_wall_s"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="first/restart pairs, each with a fresh cache")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (both runs)")
    args = parser.parse_args()
    overrides = BASE + args.overrides
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; overrides: {' '.join(overrides)}")
    print(f"{'run':<10}{'cold start':>12}{'setup':>9}{'step 1':>9}{'process':>10}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            first_dir = Path(tmp) / f"first{pair}"
            first = bench(first_dir, overrides)
            cache = first_dir / "compile_cache"
            restart = bench(Path(tmp) / f"restart{pair}", [*overrides, f"compile.cache_dir={cache}"])
            for name, r in (("first", first), ("restart", restart)):
                print(
                    f"{name:<10}{r['cold_start_s']:>10.2f} s{r['setup_s']:>7.2f} s{r['first_step_s']:>7.2f} s"
                    f"{r['process_wall_s']:>8.1f} s"
                )
            ratios.append(restart["cold_start_s"] / first["cold_start_s"])
            print(f"  pair {pair}: restart / first cold start = {ratios[-1]:.3f}")
    print(
        f"\nrestart / first (time to the end of step 1): {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"load average now {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )


if __name__ == "__main__":
    main()
