"""Nothing lost: saves that always write, non-finite training, Ctrl-C, the run-directory lock,
atomic rotation, damaged checkpoints, filesystem faults, secrets (issue 11).

Each test drives the tiny debug run in-process (or a fresh process where a signal or a second
process is the point) and checks what is on disk afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    inspect_checkpoint,
    model_args_dict,
    read_trainer_state,
)
from portatrain.rundir import LOCK_FILE, RunDirLockedError, RunDirNotWritableError, lock_run_dir
from portatrain.trainer import NonFiniteError, Trainer
from tests.helpers import ROOT, TINY, fit, make_trainer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _names(run_dir: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(run_dir / "checkpoints")]


def _save_id(path: Path) -> str:
    _, metadata = inspect_checkpoint(path)
    return metadata.storage_meta.save_id


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint, read with DCP (single process)."""
    import torch.distributed.checkpoint as dcp

    from portatrain.checkpoint import safe_reader

    _, metadata = inspect_checkpoint(path)
    tensors = {
        k.removeprefix("model."): torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    dcp.load({"model": tensors}, storage_reader=safe_reader(str(path)))
    return tensors


# -- 1. a save writes what it is given ---------------------------------------------------------
def test_rolled_back_run_replaces_stale_checkpoints_and_supersedes_later_ones(tmp_path: Path) -> None:
    fit(["trainer.steps=6", "checkpoint.every=2", "checkpoint.keep=0"], tmp_path)
    ckpts = tmp_path / "checkpoints"
    assert _names(tmp_path) == ["step_0000002", "step_0000004", "step_0000006"]
    old_id = _save_id(ckpts / "step_0000004")
    # Roll back to step 2 and train again to step 4 with another learning rate: another step 4.
    fit(
        [
            "trainer.steps=4",
            "checkpoint.every=2",
            "checkpoint.keep=0",
            f"checkpoint.resume={ckpts / 'step_0000002'}",
            "optim.lr=1e-4",
        ],
        tmp_path,
    )
    assert _save_id(ckpts / "step_0000004") != old_id  # written, not skipped as "already exists"
    assert read_trainer_state(ckpts / "step_0000004")["step"] == 4
    # The abandoned timeline's step 6 is set aside, so resume=auto continues the new run.
    assert _names(tmp_path) == ["step_0000002", "step_0000004"]
    assert (ckpts / "step_0000006.superseded").is_dir()
    assert not [p for p in ckpts.iterdir() if p.name.endswith((".tmp", ".old", ".deleting"))]


def test_broken_checkpoint_of_the_same_step_is_replaced(tmp_path: Path) -> None:
    fit(["trainer.steps=2", "checkpoint.every=1", "checkpoint.keep=0"], tmp_path)
    broken = tmp_path / "checkpoints" / "step_0000002"
    for file in broken.glob("*.distcp"):
        file.write_bytes(b"")  # truncated: inspect_checkpoint now refuses it
    with pytest.raises(CheckpointError):
        inspect_checkpoint(broken)
    fit(
        [
            "trainer.steps=2",
            "checkpoint.every=1",
            "checkpoint.keep=0",
            f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_0000001'}",
        ],
        tmp_path,
    )
    inspect_checkpoint(broken)  # complete again
    assert all(torch.isfinite(t).all() for t in _weights(broken).values())


# -- 2. non-finite training -------------------------------------------------------------------
class NaNAtStep3(Trainer):
    """The loss of step 3 is NaN (so are its gradients); every other step is normal."""

    def compute_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        loss = super().compute_loss(logits, batch)
        return loss * float("nan") if self.step + 1 == 3 else loss


def test_nonfinite_step_stops_naming_it_and_keeps_the_last_finite_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match="non-finite at step 3") as info:
        fit(["trainer.steps=6", "checkpoint.every=1", "checkpoint.keep=1"], tmp_path, NaNAtStep3)
    assert "trainer.on_nonfinite=skip_step" in str(info.value)
    assert _names(tmp_path) == ["step_0000002"]  # never step 3, and step 2 was not rotated away
    assert all(torch.isfinite(t).all() for t in _weights(tmp_path / "checkpoints" / "step_0000002").values())


def test_nonfinite_is_found_at_the_logging_sync_not_every_step(tmp_path: Path) -> None:
    # log_every=4: the NaN of step 3 is reported at step 4's sync (no per-step host read).
    with pytest.raises(NonFiniteError, match="non-finite at step 3"):
        fit(["trainer.steps=8", "trainer.log_every=4", "checkpoint.enabled=false"], tmp_path, NaNAtStep3)


def test_skip_step_leaves_weights_and_moments_unchanged_and_counts(tmp_path: Path) -> None:
    snapshots: dict[int, list[torch.Tensor]] = {}

    class Watch(NaNAtStep3):
        def on_step_end(self, step: int, metrics: dict) -> None:
            state = [s for p in self.model.parameters() for s in self.optimizer.state[p].values()]
            snapshots[step] = [t.detach().clone() for t in [*self.model.parameters(), *state]]

    trainer = fit(["trainer.steps=5", "trainer.on_nonfinite=skip_step"], tmp_path, Watch)
    assert trainer.nonfinite_skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4], strict=True))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("nonfinite_skipped") for r in records if r.get("step") in (2, 3, 5) and "loss" in r] == [
        None,
        1,
        1,
    ]
    assert all(
        torch.isfinite(t).all() for t in _weights(complete_checkpoints(tmp_path / "checkpoints")[-1]).values()
    )


def test_export_refuses_nonfinite_weights(tmp_path: Path) -> None:
    from portatrain.export import export_hf

    trainer = make_trainer(["trainer.steps=1"], tmp_path)
    try:
        with torch.no_grad():
            next(trainer.model.parameters()).view(-1)[0] = float("nan")
        # Bypass the trainer's own refusal to save non-finite weights: an old or foreign checkpoint.
        path = _save_unchecked(trainer)
    finally:
        trainer.close()
    with pytest.raises(CheckpointError, match="non-finite") as info:
        export_hf(path, tmp_path / "hf", max_shard_size=10**9)
    assert "embed_tokens" in str(info.value) or "model." in str(info.value)
    assert not (tmp_path / "hf").exists()


def _save_unchecked(trainer: Trainer) -> Path:
    """Save through the Checkpointer directly, without the trainer's finite-state check."""
    from omegaconf import OmegaConf

    return trainer.checkpointer.save(
        trainer.step,
        model=trainer.model,
        optimizer=trainer.optimizer,
        state={
            "step": 0,
            "tokens_seen": 0,
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
            "recipe": trainer.cfg.recipe,
            "model_name": trainer.cfg.model.name,
            "model_args": model_args_dict(trainer.model),
            "tokenizer": trainer.tokenizer.name,
        },
        dataloader_state=trainer.train_loader.state_dict(),
        rng_state=trainer.accelerator.get_rng_state(),
        config_yaml=OmegaConf.to_yaml(trainer.cfg),
    )


# -- 3. Ctrl-C ----------------------------------------------------------------------------------
def test_sigint_saves_at_the_step_boundary_and_stops(tmp_path: Path) -> None:
    class CtrlC(Trainer):
        def on_step_end(self, step: int, metrics: dict) -> None:
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    previous = signal.getsignal(signal.SIGINT)
    trainer = fit(["trainer.steps=6"], tmp_path, CtrlC)
    assert trainer.preempted and trainer.step == 2
    assert _names(tmp_path) == ["step_0000002"]
    assert signal.getsignal(signal.SIGINT) == previous


def test_second_sigint_exits_at_once_without_traceback(tmp_path: Path) -> None:
    script = tmp_path / "ctrl_c_twice.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal
            from portatrain.cli import main
            from portatrain.trainer import Trainer

            class CtrlCTwice(Trainer):
                def on_step_end(self, step, metrics):
                    if step == 2:
                        os.kill(os.getpid(), signal.SIGINT)
                        os.kill(os.getpid(), signal.SIGINT)

            main(trainer_cls=CtrlCTwice)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script), *TINY, "trainer.steps=6", f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 130, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "exiting now" in out.stderr
    assert _names(tmp_path / "run") == []  # nothing half-saved either


# -- 4. the run-directory lock ------------------------------------------------------------------
def test_second_run_in_a_locked_directory_names_the_holder(tmp_path: Path) -> None:
    first = make_trainer([], tmp_path)
    try:
        with pytest.raises(RunDirLockedError) as info:
            make_trainer(["checkpoint.resume=auto"], tmp_path)
        assert f"PID {os.getpid()}" in str(info.value) and "host " in str(info.value)
    finally:
        first.close()
    make_trainer(["checkpoint.resume=auto"], tmp_path).close()  # released on close


def test_lock_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from portatrain.rundir import lock_run_dir; "
            "lock = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLockedError, match=f"PID {holder.pid}"):
            lock_run_dir(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock_run_dir(tmp_path).release()  # a crashed holder leaves nothing to clean up


# -- 5. a new run over a used directory --------------------------------------------------------
def test_new_run_over_config_and_metrics_without_checkpoint_is_refused(tmp_path: Path) -> None:
    fit(["checkpoint.enabled=false"], tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match="config.yaml and metrics.jsonl"):
        make_trainer([], tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before


# -- 6. atomic rotation ---------------------------------------------------------------------------
def test_rotation_renames_before_deleting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_rmtree = shutil.rmtree
    seen = []

    def dying_rmtree(path, *args, **kwargs):  # deletes one file, then "the process dies"
        path = Path(path)
        if path.name.endswith(".deleting") and not seen:
            seen.append(path.name)
            next(path.glob("*.distcp")).unlink()
            raise KeyboardInterrupt("killed mid-deletion (simulated)")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        fit(["trainer.steps=3", "checkpoint.every=1", "checkpoint.keep=2"], tmp_path)
    monkeypatch.undo()
    assert seen == ["step_0000001.deleting"]
    assert _names(tmp_path) == ["step_0000002", "step_0000003"]
    for path in complete_checkpoints(tmp_path / "checkpoints"):
        inspect_checkpoint(path)  # every step_N that exists is whole
    fit(["trainer.steps=4", "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.resume=auto"], tmp_path)
    assert not (tmp_path / "checkpoints" / "step_0000001.deleting").exists()  # swept by the next save
    assert _names(tmp_path) == ["step_0000003", "step_0000004"]


# -- 9. filesystem -------------------------------------------------------------------------------
def test_read_only_run_dir_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests run as root, for whom chmod does not make a directory read-only: fail the write instead.
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(RunDirNotWritableError, match="Read-only file system"):
        make_trainer([], tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []


def test_disk_full_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    original, calls = FileSystemWriter.write_data, []

    def full(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointError) as info:
        fit(["trainer.steps=4", "checkpoint.every=2"], tmp_path)
    message = str(info.value)
    assert "no space left on device" in message and "step_0000002 is intact" in message, message
    assert _names(tmp_path) == ["step_0000002"]
    assert not (tmp_path / "checkpoints" / "step_0000004.tmp").exists()


def test_lock_file_is_the_only_trace_of_the_lock(tmp_path: Path) -> None:
    lock = lock_run_dir(tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_FILE]
    lock.release()
    lock.release()  # idempotent
