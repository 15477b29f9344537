"""Resume: an interrupted run continues exactly where it stopped, whatever stopped it.

Each test interrupts a run differently (an exception, SIGTERM, SIGKILL in the middle of a save,
SIGKILL under ``torchrun --max-restarts``), resumes it with ``checkpoint.resume=auto``, and compares
every step's loss with an uninterrupted run's. On CPU in fp32 they are bitwise equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from portatrain.checkpoint import complete_checkpoints, read_trainer_state
from portatrain.trainer import Trainer
from tests.conftest import ROOT, TINY, compose_config
from tests.helpers import fit as fit_tiny
from tests.helpers import python, step_losses, torchrun_command

STEPS = 8
RUN = TINY + [f"trainer.steps={STEPS}"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def fit(overrides: list[str], run_dir: Path, trainer_cls: type[Trainer] = Trainer) -> Trainer:
    """Fit ``STEPS`` steps of the tiny config."""
    return fit_tiny([f"trainer.steps={STEPS}", *overrides], run_dir, trainer_cls)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Per-step losses of the uninterrupted 8-step run (checkpointing never changes them)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    fit(["checkpoint.enabled=false"], run_dir)
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


class CrashAtStep5(Trainer):
    def on_step_end(self, step: int, metrics: dict) -> None:
        if step == 5:
            raise RuntimeError("crash (simulated)")


def test_resume_after_a_crash_matches_the_uninterrupted_run(tmp_path: Path, reference: dict) -> None:
    with pytest.raises(RuntimeError, match="simulated"):
        fit(["checkpoint.every=3"], tmp_path, CrashAtStep5)
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_0000003"]
    resumed = fit(["checkpoint.every=3", "checkpoint.resume=auto"], tmp_path)
    assert step_losses(tmp_path) == reference  # bitwise: model, optimizer, schedule and data order restored
    state = read_trainer_state(complete_checkpoints(tmp_path / "checkpoints")[-1])
    assert state["step"] == STEPS and state["tokens_seen"] == resumed.tokens_seen
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["tokens_seen"] == resumed.tokens_seen > 0


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_exits_zero(tmp_path: Path) -> None:
    long_run = TINY + ["trainer.steps=200"]  # long enough that the signal lands mid-run
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        python("-m", "portatrain", *long_run, f"run_dir={run_dir}"),
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(lambda: len(step_losses(run_dir)) >= 2 if (run_dir / "metrics.jsonl").exists() else False)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "resume with checkpoint.resume=auto" in output
    (ckpt,) = complete_checkpoints(run_dir / "checkpoints")
    stopped_at = read_trainer_state(ckpt)["step"]
    assert 2 <= stopped_at < 200 and max(step_losses(run_dir)) == stopped_at

    # The resumed run continues the uninterrupted one (compared over 3 more steps; a step-boundary
    # stop request ends both runs there, as SIGTERM would).
    class StopAt(Trainer):
        def on_step_end(self, step: int, metrics: dict) -> None:
            if step == stopped_at + 3:
                self.preemption.requested = True

    resumed = StopAt(compose_config(long_run + ["checkpoint.resume=auto"], run_dir=run_dir))
    resumed.fit()
    resumed.close()
    clean = StopAt(compose_config(long_run, run_dir=tmp_path / "clean"))
    clean.fit()
    clean.close()
    assert step_losses(run_dir) == step_losses(tmp_path / "clean")


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path, reference: dict) -> None:
    # The second save (step 4) dies by SIGKILL after its data files are written, before DCP's index.
    script = tmp_path / "die_in_save.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal
            from torch.distributed.checkpoint import FileSystemWriter
            from portatrain.cli import main

            original, calls = FileSystemWriter.finish, []

            def finish(self, metadata, results):
                calls.append(1)
                if len(calls) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(self, metadata, results)

            FileSystemWriter.finish = finish
            main()
            """
        )
    )
    run_dir = tmp_path / "run"
    out = subprocess.run(
        python(str(script), *RUN, "checkpoint.every=2", f"run_dir={run_dir}"),
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    folder = run_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(folder)] == ["step_0000002"]
    partial = folder / "step_0000004.tmp"
    assert list(partial.glob("*.distcp")) and not (partial / ".metadata").exists()

    fit(["checkpoint.every=2", "checkpoint.resume=auto"], run_dir)
    assert step_losses(run_dir) == reference
    assert not partial.exists()


@pytest.mark.slow
def test_torchrun_restarts_a_sigkilled_worker_which_resumes(tmp_path: Path, reference: dict) -> None:
    """A worker SIGKILLed after step 5 is restarted by torchrun and resumes from step 4.

    The run directory comes from TORCHELASTIC_RUN_ID (``runs/<recipe>/<id>``), the same for both
    attempts, so ``checkpoint.resume=auto`` finds the first attempt's checkpoint.
    """
    script = tmp_path / "kill_once.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal
            from pathlib import Path
            from portatrain.cli import main
            from portatrain.trainer import Trainer

            class KillOnce(Trainer):
                def on_step_end(self, step, metrics):
                    marker = Path("killed.marker")
                    if step == 5 and not marker.exists():
                        marker.touch()
                        os.kill(os.getpid(), signal.SIGKILL)

            main(trainer_cls=KillOnce)
            """
        )
    )
    env = {k: v for k, v in ENV.items() if k not in ("PORTATRAIN_RUN_ID", "TORCHELASTIC_RUN_ID")}
    out = subprocess.run(
        [*torchrun_command(1, "--max-restarts=1"), str(script), *RUN, "checkpoint.every=2"]
        + ["checkpoint.resume=auto"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "killed.marker").exists()
    (run_dir,) = (tmp_path / "runs" / "debug").iterdir()  # one directory for both attempts
    assert read_trainer_state(complete_checkpoints(run_dir / "checkpoints")[-1])["step"] == STEPS
    losses = step_losses(run_dir)
    assert losses == reference
    assert losses[STEPS] == reference[STEPS]


def _wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)
