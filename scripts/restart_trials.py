"""Kill a worker under ``torchrun --max-restarts`` and check the job recovers, trial after trial.

Each trial trains the debug model on 2 ranks (FSDP, ``parallel.dp_shard=2``), SIGKILLs one worker
(rank 0 or rank 1, alternately) after step 5, and lets torchrun restart the workers, which resume
with ``checkpoint.resume=auto``. Two layouts alternate: one agent with 2 workers
(``--standalone --nproc-per-node=2``), and two agents with 1 worker each on a c10d rendezvous, as two
hosts would run. A trial passes when every agent exits 0, the restarted workers resumed from the
newest complete checkpoint (step 4), the run reached its last step, and every step's loss equals a
clean run's (fp32, within 1e-6)::

    OMP_NUM_THREADS=1 python scripts/restart_trials.py --trials 20

Exit status 1 when any trial failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

STEPS, EVERY, KILL_AFTER = 8, 2, 5
RUN = [
    "device=cpu",
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "optim.warmup_steps=2",
    "parallel.dp_shard=2",
    f"checkpoint.every={EVERY}",
    "checkpoint.resume=auto",
]
KILL_ONCE = f"""
import os, signal
from pathlib import Path
from portatrain.cli import main
from portatrain.trainer import Trainer

class KillOnce(Trainer):
    def on_step_end(self, step, metrics):
        marker = Path("killed.marker")
        kill_rank = int(os.environ.get("KILL_RANK", "-1"))
        if step == {KILL_AFTER} and self.dist.rank == kill_rank and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

main(trainer_cls=KillOnce)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(layout: str, cwd: Path, run_dir: Path, kill_rank: int, timeout: float) -> tuple[list[int], str]:
    """Run one job in ``layout``; return every agent's exit status and their output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_RANK": str(kill_rank)}
    for key in ("WORLD_SIZE", "PORTATRAIN_RUN_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    run = [sys.executable, "-m", "torch.distributed.run"]
    job = ["--max-restarts=3", str(cwd / "kill_once.py"), *RUN, f"run_dir={run_dir}"]
    if layout == "1 agent x 2 workers":
        commands = [[*run, "--standalone", "--nproc-per-node=2", *job]]
    else:
        rdzv = [f"--rdzv-endpoint=localhost:{_free_port()}", "--rdzv-backend=c10d", f"--rdzv-id={cwd.name}"]
        commands = [[*run, "--nnodes=2", "--nproc-per-node=1", *rdzv, *job] for _ in range(2)]
    logs = [open(cwd / f"agent{i}.log", "w") for i in range(len(commands))]  # noqa: SIM115
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        for cmd, log in zip(commands, logs)
    ]
    statuses = []
    for proc in procs:
        try:
            statuses.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            statuses.append(-999)
    for log in logs:
        log.close()
    return statuses, "".join((cwd / f"agent{i}.log").read_text() for i in range(len(commands)))


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    layouts = ["1 agent x 2 workers", "2 agents x 1 worker"]
    passed = 0
    with tempfile.TemporaryDirectory(prefix="portatrain-restarts-") as tmp:
        root = Path(tmp)
        reference: dict[str, dict[int, float]] = {}
        for layout in layouts:  # the clean run of each layout: nobody is killed
            cwd = root / f"clean{len(reference)}"
            cwd.mkdir()
            (cwd / "kill_once.py").write_text(textwrap.dedent(KILL_ONCE))
            statuses, output = _launch(layout, cwd, cwd / "run", -1, args.timeout)
            if statuses != [0] * len(statuses):
                print(f"clean run ({layout}) failed {statuses}:\n{output[-3000:]}", file=sys.stderr)
                return 1
            reference[layout] = _losses(cwd / "run")
        for trial in range(args.trials):
            layout, kill_rank = layouts[trial % 2], (trial // 2) % 2
            cwd = root / f"trial{trial}"
            cwd.mkdir()
            (cwd / "kill_once.py").write_text(textwrap.dedent(KILL_ONCE))
            start = time.perf_counter()
            statuses, output = _launch(layout, cwd, cwd / "run", kill_rank, args.timeout)
            losses = _losses(cwd / "run")
            expected = reference[layout]
            problems = []
            if statuses != [0] * len(statuses):
                problems.append(f"exit statuses {statuses}")
            if not (cwd / "killed.marker").exists():
                problems.append("no worker was killed")
            if f"step_{KILL_AFTER - 1:07d} at step {KILL_AFTER - 1}" not in output:
                problems.append(f"did not resume from step {KILL_AFTER - 1}")
            if "connectFullMesh" in output:
                problems.append("gloo connectFullMesh failed in a restart")
            if sorted(losses) != sorted(expected) or any(
                not math.isclose(losses[s], expected[s], rel_tol=1e-6) for s in expected
            ):
                problems.append(f"losses {losses} != clean {expected}")
            passed += not problems
            verdict = "ok" if not problems else "FAILED: " + "; ".join(problems)
            print(
                f"trial {trial} ({layout}, rank {kill_rank} killed after step {KILL_AFTER}): "
                f"{verdict} in {time.perf_counter() - start:.0f} s",
                flush=True,
            )
            if problems:
                print(output[-4000:], flush=True)
    print(f"{passed}/{args.trials} restarts recovered")
    return int(passed != args.trials)


if __name__ == "__main__":
    sys.exit(main())
