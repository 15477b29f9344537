"""torchrun restarts and stop signals (``portatrain.distributed``, ``portatrain.launch.elastic``).

A restarted attempt meets in a store of its own (the agent's store keeps the previous attempt's gloo
addresses); a worker SIGKILLed under ``--max-restarts`` with two workers on the node is restarted
and resumes with the clean run's losses; SIGTERM to ``portatrain torchrun`` saves and exits 0.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers import TINY, fit, launch_env, sigterm_portatrain_torchrun, step_losses, torchrun_command

pytestmark = pytest.mark.slow


def _script(path: Path, code: str) -> Path:
    path.write_text(textwrap.dedent(code))
    return path


def test_a_restarted_attempt_never_reads_the_previous_attempts_gloo_addresses(tmp_path: Path) -> None:
    """Rank 1 dies in three attempts after their process group is up; in each restart rank 0 reaches
    the process group first. Through the agent's store it would read rank 1's dead address and,
    where gloo has rank 0 connect to rank 1 (one pair in two), fail with Connection refused; the
    attempt's own store has no stale address."""
    worker = _script(
        tmp_path / "worker.py",
        """
        import os, time
        from pathlib import Path
        from portatrain.accelerators.cpu import CPUAccelerator
        from portatrain.distributed import destroy_distributed, dist_info_from_env, init_distributed

        attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), os.environ["RANK"]
        joining = Path(f"rank0_joining_{attempt}")
        if rank == "0":
            joining.touch()
        elif attempt > 0:  # rank 0 looks for rank 1's address first
            while not joining.exists():
                time.sleep(0.05)
            time.sleep(3)
        init_distributed(CPUAccelerator(), dist_info_from_env())
        import torch.distributed as dist
        dist.barrier()
        if attempt < 3 and rank == "1":
            os._exit(1)
        print(f"attempt {attempt} rank {rank} connected", flush=True)
        destroy_distributed()
        """,
    )
    out = subprocess.run(
        [*torchrun_command(2, "--max-restarts=3"), str(worker)],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "attempt 3 rank 0 connected" in out.stdout and "attempt 3 rank 1 connected" in out.stdout
    assert "Connection refused" not in out.stderr


def test_two_workers_restart_after_a_sigkill_and_resume_with_the_clean_losses(tmp_path: Path) -> None:
    """The README's elastic example, one worker of two killed after step 5: torchrun restarts both,
    they resume from step 4 and every step's loss is the one-process run's on the same global batch."""
    reference = step_losses(fit(["trainer.steps=8", "checkpoint.enabled=false"], tmp_path / "ref").run_dir)
    run = [o for o in TINY if not o.startswith("data.batch_size=")] + ["trainer.steps=8", "data.batch_size=2"]
    kill_once = _script(
        tmp_path / "kill_once.py",
        """
        import os, signal
        from pathlib import Path
        from portatrain.cli import main
        from portatrain.trainer import Trainer

        class KillOnce(Trainer):
            def on_step_end(self, step, metrics):
                if step == 5 and self.dist.rank == 0 and not Path("killed.marker").exists():
                    Path("killed.marker").touch()
                    os.kill(os.getpid(), signal.SIGKILL)

        main(trainer_cls=KillOnce)
        """,
    )
    args = [*run, "parallel.dp_shard=2", "checkpoint.every=2", "checkpoint.resume=auto", "run_dir=run"]
    out = subprocess.run(
        [*torchrun_command(2, "--max-restarts=3"), str(kill_once), *args],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert (tmp_path / "killed.marker").exists() and "step_0000004 at step 4" in out.stdout + out.stderr
    losses = step_losses(tmp_path / "run")
    assert sorted(losses) == sorted(reference)
    assert all(losses[s] == pytest.approx(reference[s], abs=1e-5) for s in reference), (losses, reference)


def test_sigterm_to_portatrain_torchrun_saves_and_exits_0(tmp_path: Path) -> None:
    args = [*TINY, "trainer.steps=100000", "parallel.dp_shard=2", "run_dir=run", "trainer.progress=true"]
    status, output = sigterm_portatrain_torchrun(args, tmp_path)
    assert status == 0, output[-4000:]
    assert "every worker saved and ended cleanly" in output
    assert list((tmp_path / "run" / "checkpoints").glob("step_*"))
