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
import textwrap
from pathlib import Path

import pytest
import torch

from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    inspect_checkpoint,
    model_args_dict,
    read_trainer_state,
)
from portatrain.rundir import LOCK_FILE, RunDirLockedError, RunDirNotWritableError, lock_run_dir
from portatrain.trainer import NonFiniteError, Trainer
from tests.helpers import ROOT, TINY, fit, make_trainer, python, torchrun_command

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


class UnfusedCPU(CPUAccelerator):
    fused_adamw = False  # the generic skip (copy, step, put back with torch.where), as under FSDP2


@pytest.mark.parametrize("accelerator", [None, UnfusedCPU], ids=["fused-found_inf", "generic"])
def test_skip_step_leaves_weights_and_moments_unchanged_and_counts(tmp_path: Path, accelerator) -> None:
    snapshots: dict[int, list[torch.Tensor]] = {}

    class Watch(NaNAtStep3):
        def on_step_end(self, step: int, metrics: dict) -> None:
            state = [s for p in self.model.parameters() for s in self.optimizer.state[p].values()]
            snapshots[step] = [t.detach().clone() for t in [*self.model.parameters(), *state]]

    kwargs = {} if accelerator is None else {"accelerator": accelerator()}
    trainer = fit(["trainer.steps=5", "trainer.on_nonfinite=skip_step"], tmp_path, Watch, **kwargs)
    assert all(g.get("fused") for g in trainer.optimizer.param_groups) == (accelerator is None)
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
        python(str(script), *TINY, "trainer.steps=6", f"run_dir={tmp_path / 'run'}"),
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
        python(
            "-c",
            "import os, sys, time; from portatrain.rundir import lock_run_dir; "
            "lock = lock_run_dir(sys.argv[1]); print('locked', os.getpid(), flush=True); time.sleep(600)",
            str(tmp_path),
        ),
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = None
    try:
        said, pid = holder.stdout.readline().split()
        assert said == "locked"
        with pytest.raises(RunDirLockedError, match=f"PID {pid}"):
            lock_run_dir(tmp_path)
    finally:
        # The holder's own pid, which a fork's client does not have: the client ends once it has died.
        if pid is None:
            holder.kill()
        else:
            os.kill(int(pid), signal.SIGKILL)
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


# -- 8. damaged checkpoints -------------------------------------------------------------------------
def _step3(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step_0000003"


def _resume(run_dir: Path, *overrides: str) -> Trainer:
    trainer = make_trainer(["trainer.steps=4", *overrides], run_dir)
    trainer.close()
    return trainer


def test_zero_filled_distcp_is_one_clear_error_and_auto_falls_back(run_copy: Path, caplog) -> None:
    for file in _step3(run_copy).glob("*.distcp"):
        file.write_bytes(bytes(file.stat().st_size))  # same size: only reading the tensors finds it
    with pytest.raises(CheckpointError) as info:
        _resume(run_copy, f"checkpoint.resume={_step3(run_copy)}")
    message = str(info.value)
    assert "step_0000003 is corrupt" in message and "earlier step_*" in message, message
    assert "weights_only" not in message and "Traceback" not in message and "\n" not in message
    with caplog.at_level("WARNING"):
        trainer = _resume(run_copy, "checkpoint.resume=auto")
    assert trainer.step == 2 and trainer.resume_from.name == "step_0000002"
    assert "skipping" in caplog.text and "step_0000003" in caplog.text


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda s: {k: v for k, v in s.items() if k != "lr_scheduler"}, "lr_scheduler (missing)"),
        (lambda s: [s], "holds a JSON list"),
        (lambda s: {**s, "step": "three"}, "step (str, not int)"),
    ],
    ids=["missing-key", "json-list", "wrong-type"],
)
def test_damaged_trainer_state_is_one_clear_error(run_copy: Path, damage, expected: str) -> None:
    file = _step3(run_copy) / "trainer_state.json"
    file.write_text(json.dumps(damage(json.loads(file.read_text()))))
    with pytest.raises(CheckpointError, match=re_escape(expected)) as info:
        _resume(run_copy, f"checkpoint.resume={_step3(run_copy)}")
    assert str(file) in str(info.value)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("content", ["garbage{", '{"unexpected": 1}', "[1, 2]"])
def test_garbage_loader_state_is_one_clear_error(run_copy: Path, content: str) -> None:
    (_step3(run_copy) / "dataloader_rank0.json").write_text(content)
    with pytest.raises(CheckpointError, match="restore_data=false"):
        _resume(run_copy, f"checkpoint.resume={_step3(run_copy)}")


def test_deleted_loader_state_never_restarts_the_data_silently(run_copy: Path) -> None:
    (_step3(run_copy) / "dataloader_rank0.json").unlink()
    with pytest.raises(CheckpointError, match="dataloader_rank0.json is missing") as info:
        _resume(run_copy, f"checkpoint.resume={_step3(run_copy)}")
    assert "checkpoint.restore_data=false" in str(info.value)
    trainer = _resume(run_copy, f"checkpoint.resume={_step3(run_copy)}", "checkpoint.restore_data=false")
    assert trainer.step == 3  # the explicit choice to restart the data order works


def test_incomplete_newest_checkpoint_is_skipped_with_a_warning(run_copy: Path, caplog) -> None:
    (_step3(run_copy) / ".metadata").unlink()
    with caplog.at_level("WARNING"):
        trainer = _resume(run_copy, "checkpoint.resume=auto")
    assert trainer.step == 2
    assert "skipping broken checkpoint" in caplog.text and "step_0000003" in caplog.text


def test_trainer_steps_below_the_checkpoint_is_an_error(run_copy: Path) -> None:
    with pytest.raises(CheckpointError, match=r"at step 3, past trainer.steps=2"):
        trainer = make_trainer(["trainer.steps=2", "checkpoint.resume=auto"], run_copy)
        trainer.close()


def test_changed_optimizer_settings_are_applied_and_logged(run_copy: Path, caplog) -> None:
    saved = read_trainer_state(_step3(run_copy))["optimizer_param_groups"]
    assert {g["initial_lr"] for g in saved} == {3e-3}
    with caplog.at_level("WARNING"):
        trainer = _resume(run_copy, "checkpoint.resume=auto", "optim.lr=1e-3", "optim.weight_decay=0.05")
    assert trainer.lr_scheduler.base_lrs == [1e-3] * len(trainer.optimizer.param_groups)
    assert {g["initial_lr"] for g in trainer.optimizer.param_groups} == {1e-3}
    # The moments were restored (a fresh optimizer would have none) and the schedule is at step 3.
    assert trainer.optimizer.state and trainer.lr_scheduler.last_epoch == 3
    assert "optim.lr 0.003 -> 0.001" in caplog.text


# -- 11. the restricted unpickler ----------------------------------------------------------------
class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_metadata_payload_is_refused_without_running(run_copy: Path, tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "payload-ran"
    (_step3(run_copy) / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="os.system|posix.system") as info:
        inspect_checkpoint(_step3(run_copy))
    assert "is unsafe and was not loaded" in str(info.value)
    with pytest.raises(CheckpointError):
        _resume(run_copy, f"checkpoint.resume={_step3(run_copy)}")
    from portatrain.export import export_hf

    with pytest.raises(CheckpointError):
        export_hf(_step3(run_copy), tmp_path / "hf", max_shard_size=10**9)
    assert not marker.exists()


# -- 12. secrets and shared exports --------------------------------------------------------------
def test_secrets_are_redacted_in_every_config_written(tmp_path: Path) -> None:
    fit(
        [
            "+parallel.launch.env.HF_TOKEN=hf_topsecret",
            "+parallel.launch.env.WANDB_API_KEY=wandb_topsecret",
            "+parallel.launch.env.NCCL_DEBUG=INFO",
        ],
        tmp_path,
    )
    files = [tmp_path / "config.yaml", *(tmp_path / "checkpoints").glob("step_*/config.yaml")]
    assert len(files) == 2
    for file in files:
        text = file.read_text()
        assert "topsecret" not in text and "HF_TOKEN: '***'" in text and "NCCL_DEBUG: INFO" in text, text


def test_secret_key_names() -> None:
    from portatrain.redact import is_secret_key, redact

    for key in ("HF_TOKEN", "hf_token", "WANDB_API_KEY", "apiKey", "password", "AWS_SECRET_ACCESS_KEY"):
        assert is_secret_key(key), key
    for key in ("keep", "key", "max_tokens", "tokenizer", "NCCL_DEBUG", "every", "monkey"):
        assert not is_secret_key(key), key
    assert redact({"a": [{"token": "x", "n": 1}], "max_tokens": 5}) == {
        "a": [{"token": "***", "n": 1}],
        "max_tokens": 5,
    }


def test_export_is_shared_by_umask_and_refuses_an_existing_file(three_steps: Path, tmp_path: Path) -> None:
    from portatrain.export import export_hf

    out = export_hf(_step3(three_steps), tmp_path / "hf", max_shard_size=10**9)
    umask = os.umask(0)
    os.umask(umask)
    modes = {oct(p.stat().st_mode & 0o777) for p in out.glob("*.safetensors")}
    assert modes == {oct(0o666 & ~umask)}
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    existing = tmp_path / "existing.bin"
    existing.write_text("keep me")
    with pytest.raises(CheckpointError, match="is an existing file"):
        export_hf(_step3(three_steps), existing, max_shard_size=10**9)
    assert existing.read_text() == "keep me"


# -- 10. a stop request during compile warm-up --------------------------------------------------------
def test_sigterm_during_compile_warmup_stops_before_the_next_shape(tmp_path: Path) -> None:
    torch._dynamo.reset()
    shapes = []

    class TermInWarmup(Trainer):
        def forward_backward(self, batch, num_tokens):
            if self.step == 0 and not shapes:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first shape compiles
            shapes.append(tuple(batch["input_ids"].shape))
            return super().forward_backward(batch, num_tokens)

    overrides = [
        "trainer.steps=4",
        "data.collator=bucket",
        "data.buckets=[16,32,64]",
        "compile.enabled=true",
        "compile.warmup=true",
        "compile.dynamic=false",
        "compile.backend=eager",
    ]
    try:
        trainer = fit(overrides, tmp_path, TermInWarmup)
    finally:
        torch._dynamo.reset()
    assert shapes == [(4, 16)]  # the second and third shapes were never compiled
    assert trainer.preempted and trainer.step == 0
    assert _names(tmp_path) == []  # nothing trained, nothing to save


# -- 14-16. what the command line shows and leaves behind ------------------------------------------
def _cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        python("-m", "portatrain", *args),
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _leaf_dirs(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_dir() and not any(p.iterdir())] if root.exists() else []


def test_errors_dry_runs_and_render_leave_no_empty_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_command_errors import run

    monkeypatch.chdir(tmp_path)  # in this process (the CLI's main): the default run_dir is under cwd
    for args, status in [
        (["trainer.steps=-1"], 2),  # a configuration error
        (["device=neuron"], 2),  # a missing device
        (["dry_run=true"], 0),
        (["render", "parallel.launch.nodes=2", "parallel.launch.procs_per_node=2"], 0),
    ]:
        code, err = run([*TINY, *args] if args[0] != "render" else [args[0], *TINY[1:], *args[1:]], capsys)
        assert code == status, (args, err[-2000:])
        assert _leaf_dirs(tmp_path / "runs") == [], args


@pytest.mark.slow
def test_non_interactive_log_has_one_line_per_log_every_and_no_bar_frames(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = _cli(
        [*TINY, "trainer.steps=6", "trainer.log_every=2", "trainer.progress=true", f"run_dir={run_dir}"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "\r" not in text  # no progress-bar frames in a log file
    lines = [line for line in text.splitlines() if " step " in f" {line}" and "/6" in line]
    assert [line.split("step ")[1].split()[0] for line in lines] == ["2/6", "4/6", "6/6"], text[-2000:]


@pytest.mark.slow
def test_torchrun_prints_a_configuration_error_once(tmp_path: Path) -> None:
    out = subprocess.run(
        [*torchrun_command(2), "-m", "portatrain", *TINY, "trainer.steps=-1"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert text.count("portatrain train: error: invalid config") == 1, text[-3000:]
    assert "trainer.steps=-1 must be positive" in text
    # Every worker exits 2 (torchrun's summary says so); torchrun itself reports a failed child
    # with status 1 -- that part is torchrun's, not ours (see docs/configuration.md).
    assert "exitcode  : 2" in text or "exitcode: 2" in text, text[-3000:]
    assert out.returncode != 0
    assert _leaf_dirs(tmp_path / "runs") == []


# -- 7. meaningless values are rejected up front ---------------------------------------------------
def test_meaningless_checkpoint_and_trainer_values_are_rejected_together() -> None:
    from portatrain.errors import ConfigError
    from portatrain.validate import validate
    from tests.helpers import compose_config

    bad = [
        "checkpoint.every=-1",
        "checkpoint.keep=-2",
        "trainer.eval_every=-5",
        "trainer.on_nonfinite=ignore",
    ]
    with pytest.raises(ConfigError) as info:
        validate(compose_config(TINY + bad))
    message = str(info.value)
    for expected in (
        "checkpoint.every=-1 must be >= 0",
        "checkpoint.keep=-2 must be >= 0",
        "trainer.eval_every=-5 must be >= 0",
        "trainer.on_nonfinite='ignore' is not one of stop, skip_step",
    ):
        assert expected in message, message
    with pytest.raises(
        ConfigError, match="trainer.eval_batches=0 must be positive when trainer.eval_every=10"
    ):
        validate(compose_config(TINY + ["trainer.eval_every=10", "trainer.eval_batches=0"]))
    validate(
        compose_config(TINY + ["trainer.eval_every=0", "trainer.eval_batches=0"])
    )  # evaluation off: fine
