"""Checkpoints verified on load (issue 28): content checksums written with every save and compared at
every load, weights and optimizer moments checked finite, ``checkpoint.resume=auto`` skipping a
damaged checkpoint for the newest whole one -- on one process and on two FSDP2 ranks. Then the
checkpoint/trainer failure rows: a full disk that torch reports as "unexpected pos", a
``model.init_from`` whose config.json is not JSON, SIGTERM while the Trainer is being built, and a
fresh ``run_dir`` on a read-only filesystem.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import (
    CheckpointError,
    DamagedCheckpointError,
    complete_checkpoints,
    inspect_checkpoint,
    read_trainer_state,
)
from portatrain.checkpoint.verify import checksums, nonfinite_keys
from portatrain.trainer import NonFiniteError, Trainer
from tests.helpers import ROOT, TINY, fit, make_trainer, python, torchrun

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:07d}"


def _resume(run_dir: Path, *overrides: str) -> Trainer:
    trainer = make_trainer(["trainer.steps=4", *overrides], run_dir)
    trainer.close()
    return trainer


def _write_random_bytes_into_tensor_data(path: Path, size: int = 4096) -> str:
    """Overwrite ``size`` random bytes in the middle of the largest tensor of ``path``'s .distcp files
    (in its data, not in the zip records around it: the damage only a content check finds)."""
    _, metadata = inspect_checkpoint(path)
    key, info = max(metadata.storage_data.items(), key=lambda item: item[1].length)
    assert info.length > 4 * size, "the tensor is too small to damage its middle"
    with open(path / info.relative_path, "r+b") as file:
        file.seek(info.offset + info.length // 2 - size // 2)
        file.write(random.Random(0).randbytes(size))
    return key.fqn


def _rewrite_with_nan(path: Path) -> str:
    """Write a NaN into one weight of checkpoint ``path`` the way a user would: read every tensor
    back with DCP, change one element of a weight matrix, save them over the old files
    (trainer_state.json stays); returns the weight's key."""
    import torch.distributed.checkpoint as dcp

    _, metadata = inspect_checkpoint(path)
    tensors = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if hasattr(v, "properties")
    }
    key = next(k for k in sorted(tensors) if k.startswith("model.") and tensors[k].dim() == 2)
    dcp.load(tensors, checkpoint_id=str(path))
    tensors[key].view(-1)[7] = float("nan")
    for old in path.glob("*.distcp"):
        old.unlink()
    dcp.save(tensors, checkpoint_id=str(path))
    return key


# -- the checksum itself --------------------------------------------------------------------------
def test_checksum_is_the_same_for_any_sharding_and_changes_with_one_element() -> None:
    full = torch.randn(10, 6)
    whole = checksums({"t": full})["t"]
    for parts in (2, 3, 7):  # uneven row shards, as FSDP2 makes them: the sums add up modulo 2**32
        shards = torch.tensor_split(full, parts)
        assert sum(checksums({"t": s})["t"] for s in shards) % 2**32 == whole
    damaged = full.clone()
    damaged[3, 2] = float("nan")
    assert checksums({"t": damaged})["t"] != whole
    half = full.to(torch.bfloat16)
    assert 0 <= checksums({"t": half})["t"] < 2**16  # each dtype in its own width
    steps = torch.tensor(3.0)  # a 0-dim optimizer step count
    assert checksums({"s": steps})["s"] == steps.view(torch.int32).item()


def test_nonfinite_keys_is_exact_when_a_sum_overflows() -> None:
    big = torch.full((4,), 3e38)  # finite, but its float32 sum is inf
    tensors = {
        "big": big,
        "nan": torch.tensor([1.0, float("nan")]),
        "ok": torch.ones(3),
        "i": torch.ones(2, dtype=torch.int64),
    }
    assert nonfinite_keys(tensors) == ["nan"]


# -- damaged checkpoints are found at load ------------------------------------------------------------
def test_random_bytes_in_a_distcp_are_found_at_load_and_auto_takes_the_older_one(
    run_copy: Path, caplog
) -> None:
    damaged = _write_random_bytes_into_tensor_data(_step(run_copy, 3))
    with pytest.raises(DamagedCheckpointError) as info:
        _resume(run_copy, f"checkpoint.resume={_step(run_copy, 3)}")
    message = str(info.value)
    assert "step_0000003 is damaged" in message and damaged in message and "earlier step_*" in message, (
        message
    )
    assert "\n" not in message
    with caplog.at_level("WARNING"):
        trainer = _resume(run_copy, "checkpoint.resume=auto")
    assert trainer.step == 2 and trainer.resume_from.name == "step_0000002"
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert skipped and "step_0000003" in skipped[0] and damaged in skipped[0], skipped


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")  # the rewrite, on purpose
@pytest.mark.parametrize("checksummed", [True, False], ids=["checksums", "no-checksums"])
def test_nan_written_into_a_weight_is_refused_at_load(run_copy: Path, caplog, checksummed: bool) -> None:
    step3 = _step(run_copy, 3)
    if not checksummed:  # as a checkpoint written before checksums existed: finiteness alone finds it
        state = read_trainer_state(step3)
        del state["checksums"]
        (step3 / "trainer_state.json").write_text(__import__("json").dumps(state))
    key = _rewrite_with_nan(step3)
    expected = (
        "is damaged: the content checksum of " if checksummed else "holds non-finite (NaN/inf) values in "
    )
    with pytest.raises(DamagedCheckpointError) as info:
        _resume(run_copy, f"checkpoint.resume={step3}")
    assert expected + key in str(info.value), str(info.value)
    with caplog.at_level("WARNING"):
        trainer = _resume(run_copy, "checkpoint.resume=auto")
    assert trainer.step == 2
    assert "skipping" in caplog.text and "step_0000003" in caplog.text


def test_every_checkpoint_of_auto_damaged_is_the_error(run_copy: Path) -> None:
    for step in (1, 2, 3):
        _write_random_bytes_into_tensor_data(_step(run_copy, step))
    with pytest.raises(DamagedCheckpointError, match="step_0000001 is damaged"):
        _resume(run_copy, "checkpoint.resume=auto")


class NaNAtStep4(Trainer):
    def compute_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        loss = super().compute_loss(logits, batch)
        return loss * float("nan") if self.step + 1 == 4 else loss


def test_nonfinite_stop_names_how_the_newest_checkpoint_was_checked(run_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError) as info:
        fit(["trainer.steps=5", "checkpoint.resume=auto", "checkpoint.every=10"], run_copy, NaNAtStep4)
    assert "the newest checkpoint (step 3) was checked finite when it was loaded" in str(info.value)
    with pytest.raises(NonFiniteError) as info:
        fit(["trainer.steps=5", "checkpoint.every=2"], tmp_path / "fresh", NaNAtStep4)
    assert "the newest checkpoint (step 2) was checked finite when it was saved" in str(info.value)


# -- a full disk --------------------------------------------------------------------------------------
def _fail_second_write(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """The second save fails the way torch.save inside DCP reports a short write on a full tmpfs."""
    from torch.distributed.checkpoint import FileSystemWriter

    original, calls = FileSystemWriter.write_data, []

    def short_write(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return original(self, plan, planner)

    real = shutil.disk_usage
    monkeypatch.setattr(FileSystemWriter, "write_data", short_write)
    monkeypatch.setattr(
        "portatrain.checkpoint.common.shutil.disk_usage",
        lambda path: real(path)._replace(free=free) if len(calls) == 2 else real(path),
    )


def test_disk_full_reported_as_unexpected_pos_says_no_space_and_how_much(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_second_write(monkeypatch, free=4096)
    with pytest.raises(CheckpointError) as info:
        fit(["trainer.steps=4", "checkpoint.every=2"], tmp_path)
    message = str(info.value)
    assert "no space left on device" in message and "step_0000002 is intact" in message, message
    assert "needs about" in message and "MiB" in message and "inline_container" not in message
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_0000002"]
    assert not (tmp_path / "checkpoints" / "step_0000004.tmp").exists()


def test_other_write_errors_keep_their_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_second_write(monkeypatch, free=10 * 2**30)
    with pytest.raises(CheckpointError, match=r"failed \(RuntimeError: .*unexpected pos") as info:
        fit(["trainer.steps=4", "checkpoint.every=2"], tmp_path)
    assert "no space" not in str(info.value)


# -- model.init_from with a config.json that is not JSON ----------------------------------------------
@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff\xfe"], ids=["garbage", "list", "binary"])
def test_init_from_with_a_broken_config_json_is_one_clear_error(tmp_path: Path, content: str) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_bytes(content.encode("latin-1"))
    (hf_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="config.json") as info:
        make_trainer([f"model.init_from={hf_dir}"], tmp_path / "run").close()
    assert "\n" not in str(info.value)


# -- SIGTERM while the Trainer is being built; a read-only run_dir ------------------------------------
def _script(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        python(str(script), *TINY, *args),
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_sigterm_right_after_compiling_blocks_stops_like_ctrl_c(tmp_path: Path) -> None:
    out = _script(
        tmp_path,
        """
        import os, signal
        from portatrain.cli import main
        from portatrain.trainer import Trainer

        class TermAfterCompile(Trainer):
            def parallelize(self, model):
                model = super().parallelize(model)  # logs "compiling transformer blocks"
                os.kill(os.getpid(), signal.SIGTERM)
                return model

        main(trainer_cls=TermAfterCompile)
        """,
        "compile.enabled=true",
        "compile.backend=eager",
        f"run_dir={tmp_path / 'run'}",
    )
    assert out.returncode == 130, out.stderr[-3000:]
    assert "portatrain train: interrupted" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # nothing was trained: no run directory is left behind


def test_fresh_run_dir_on_a_read_only_filesystem_is_one_line(tmp_path: Path) -> None:
    # Tests run as root (chmod does not stop root): fail the directory's creation as a read-only
    # filesystem does.
    out = _script(
        tmp_path,
        f"""
        import errno, os
        from portatrain.cli import main

        real_mkdir = os.mkdir

        def read_only(path, *args, **kwargs):
            if str(path).startswith({str(tmp_path / "ro")!r}):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_mkdir(path, *args, **kwargs)

        os.mkdir = read_only
        main()
        """,
        f"run_dir={tmp_path / 'ro' / 'run'}",
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) == 1 and "Read-only file system" in lines[0] and "Traceback" not in out.stderr, lines
    assert lines[0].startswith("portatrain train: error: ")


# -- two FSDP2 ranks agree ----------------------------------------------------------------------------
def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return torchrun(2, [*TINY, "parallel.dp_shard=2", *args], cwd=cwd)


@pytest.mark.slow
def test_two_ranks_skip_a_damaged_checkpoint_together(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = _torchrun(
        ["trainer.steps=3", "checkpoint.every=1", "checkpoint.keep=0", f"run_dir={run_dir}"], tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(list(_step(run_dir, 3).glob("*.distcp"))) == 2  # one file per rank
    _write_random_bytes_into_tensor_data(_step(run_dir, 3))

    out = _torchrun(
        ["trainer.steps=3", f"checkpoint.resume={_step(run_dir, 3)}", f"run_dir={run_dir}"], tmp_path
    )
    assert out.returncode != 0, out.stderr[-3000:]  # the ranks exit 2, torchrun then 1
    errors = [line for line in out.stderr.splitlines() if "portatrain train: error" in line]
    assert len(errors) == 1 and "step_0000003 is damaged" in errors[0], (
        errors
    )  # every rank agreed; printed once

    out = _torchrun(["trainer.steps=4", "checkpoint.resume=auto", f"run_dir={run_dir}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "skipping" in log and "step_0000003" in log and "resumed from" in log, log[-3000:]
    state = read_trainer_state(_step(run_dir, 4))
    assert state["step"] == 4 and state["world_size"] == 2
