"""Goodput under faults: torchft's replica groups against restart-from-checkpoint, side by side.

The same run (the debug model, ``--steps`` optimizer steps over 2 processes, a checkpoint every
``--every`` steps) meets the same fault schedule (a process SIGKILLed when the run reaches each step of
``--kill-at``) two ways:

* **torchft** (``fault_tolerance.enabled=true``): two replica groups of one process each under one
  lighthouse; group 1 dies and is started again at once (as a scheduler would), heals from group 0
  (live recovery) and rejoins, while group 0 trains on;
* **restart**: one ``torchrun --max-restarts`` job of 2 processes (FSDP over both); rank 1 dies,
  torchrun restarts both workers and they resume from the newest checkpoint (``checkpoint.resume=auto``),
  redoing the steps since.

Reported: wall seconds from launch to the end, and steps completed per wall-second (``--steps`` /
wall), with and without the faults, and the ratios. Each step sleeps ``--step-seconds`` after its
real compute: the debug model's step takes ~0.1 s here and a process start ~10 s, so without it a
replacement would come back after the run ended; with a step of a second, restarts are shorter than
the gap between faults, as in a real run. Run::

    OMP_NUM_THREADS=1 python scripts/bench_fault_tolerance.py             # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import os, signal, time
from pathlib import Path
from portatrain.cli import main
from portatrain.trainer import Trainer

KILL_AT = [int(s) for s in os.environ.get("KILL_AT", "").split(",") if s]

class Faulty(Trainer):
    def on_step_end(self, step, metrics):
        time.sleep(float(os.environ["STEP_SECONDS"]))  # the rest of a real step's compute
        if step in KILL_AT and self.dist.rank == int(os.environ.get("KILL_RANK", "0")):
            marker = Path(f"killed_at_{step}")
            if not marker.exists():  # each fault once: a resumed run passes the step again
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)

main(trainer_cls=Faulty)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}
    for key in ("WORLD_SIZE", "RANK", "PORTATRAIN_RUN_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _run_args(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        "device=cpu",
        "data.num_documents=400",
        "data.seq_len=64",
        "data.batch_size=4",
        f"trainer.steps={args.steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.progress=false",
        "optim.warmup_steps=2",
        f"checkpoint.every={args.every}",
        "checkpoint.resume=auto",
        f"run_dir={run_dir}",
    ]


def run_torchft(args: argparse.Namespace, work: Path, kill_at: str) -> tuple[float, int]:
    """Wall seconds for both replica groups to finish; the number of replacements started."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum at INFO
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000
    )
    script = work / "worker.py"
    run = [
        *_run_args(args, work / "run"),
        "fault_tolerance.enabled=true",
        "fault_tolerance.group_size=2",
        f"fault_tolerance.lighthouse={lighthouse.address()}",
    ]

    def start(group: int) -> subprocess.Popen:
        env = _env(STEP_SECONDS=str(args.step_seconds), KILL_AT=kill_at if group == 1 else "")
        return subprocess.Popen(
            [sys.executable, str(script), *run, f"fault_tolerance.replica_id={group}"],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    started = time.perf_counter()
    groups, replacements = [start(0), start(1)], 0
    try:
        while any(p.poll() is None for p in groups):
            if groups[1].poll() == -9:  # killed: a scheduler starts a replacement at once
                groups[1], replacements = start(1), replacements + 1
            time.sleep(0.05)
        wall = time.perf_counter() - started
        codes = [p.returncode for p in groups]
        if codes != [0, 0]:
            raise RuntimeError(f"torchft run failed: exit statuses {codes} (logs under {work})")
    finally:
        for p in groups:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    return wall, replacements


def run_restart(args: argparse.Namespace, work: Path, kill_at: str) -> tuple[float, int]:
    """Wall seconds for ``torchrun --max-restarts`` to finish; the restarts it made."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    started = time.perf_counter()
    out = subprocess.run(
        [
            *torchrun,
            "--max-restarts=5",
            str(work / "worker.py"),
            *_run_args(args, work / "run"),
            "parallel.dp_shard=2",
        ],
        cwd=work,
        env=_env(STEP_SECONDS=str(args.step_seconds), KILL_AT=kill_at, KILL_RANK="1"),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"torchrun exited {out.returncode}: {out.stderr[-2000:]}")
    return wall, len(list(work.glob("killed_at_*")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", default="10,25", help="steps at which a process is SIGKILLed [10,25]")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps [5]")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="sleep added to each step [1.0]")
    parser.add_argument("--no-clean", action="store_true", help="skip the runs without faults")
    args = parser.parse_args()
    results: dict[tuple[str, str], tuple[float, int]] = {}
    schedules = [("faults", args.kill_at)] + ([] if args.no_clean else [("clean", "")])
    for label, kill_at in schedules:
        for name, run in (("torchft", run_torchft), ("restart", run_restart)):
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                (work / "worker.py").write_text(textwrap.dedent(WORKER))
                results[name, label] = run(args, work, kill_at)
            wall, events = results[name, label]
            print(
                f"{name:8s} {label:6s} {wall:6.1f} s  {args.steps / wall:.3f} steps/s  "
                f"({events} {'replacement(s)' if name == 'torchft' else 'fault(s) injected'})",
                flush=True,
            )
    print(
        f"\n{args.steps} steps, faults at steps {args.kill_at}, checkpoint every {args.every}, "
        f"+{args.step_seconds} s per step:"
    )
    for label, _ in schedules:
        ft, restart = results["torchft", label][0], results["restart", label][0]
        print(f"  {label:6s} steps/s torchft / restart-from-checkpoint = {restart / ft:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
