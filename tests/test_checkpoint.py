"""Checkpoints on disk: layout, keep-last-K, atomicity, and clear errors for bad input."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from portatrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    PreemptionWatcher,
    complete_checkpoints,
    read_trainer_state,
    resolve_resume,
)
from portatrain.trainer import Trainer
from tests.conftest import TINY, compose_config
from tests.helpers import fit, make_trainer

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and mtime: proof that nothing was rewritten (the
    run-directory lock file names whoever holds it last, so it is left out)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and p.name != ".portatrain.lock"
    }


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-step run saving every step and keeping 2: shared, read-only, by the tests below."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    fit(["checkpoint.every=1", "checkpoint.keep=2"], run_dir)
    return run_dir


def test_layout_keep_last_k_and_only_tensors_in_dcp(saved_run: Path) -> None:
    ckpts = complete_checkpoints(saved_run / "checkpoints")
    assert [p.name for p in ckpts] == ["step_0000003", "step_0000004"]
    assert not list((saved_run / "checkpoints").glob("*.tmp"))
    newest = ckpts[-1]
    names = {p.name for p in newest.iterdir()}
    assert {".metadata", "trainer_state.json", "dataloader_rank0.json", "config.yaml"} <= names
    state = read_trainer_state(newest)
    assert state["step"] == 4 and state["tokens_seen"] > 0 and state["recipe"] == "debug"
    assert state["lr_scheduler"]["last_epoch"] == 4 and state["world_size"] == 1
    assert state["model_args"]["dim"] == 128
    assert (
        json.loads((newest / "dataloader_rank0.json").read_text())["_index_sampler_state"]["batches_yielded"]
        == 4
    )
    assert "flavor: debug" in (newest / "config.yaml").read_text()
    # Only tensors go through DCP: loading never unpickles a value with torch.load(weights_only=False).
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(newest)).read_metadata()
    kinds = {type(v).__name__ for v in metadata.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata.__name__}
    keys = set(metadata.state_dict_metadata)
    assert "model.embed_tokens.weight" in keys and "rng.rank0.cpu" in keys
    assert "optim.layers.0.self_attn.q_proj.weight.exp_avg_sq" in keys


def test_new_run_in_a_used_run_dir_fails_before_touching_it(saved_run: Path) -> None:
    before = _snapshot(saved_run)
    with pytest.raises(CheckpointError) as info:
        make_trainer([], saved_run)
    message = str(info.value)
    assert str(saved_run) in message and "checkpoint.resume=auto" in message and "run_dir=" in message
    assert _snapshot(saved_run) == before


@pytest.mark.parametrize(
    "damage",
    [
        "missing",
        "unfinished_tmp",
        "truncated_data",
        "truncated_index",
        "no_trainer_state",
        "wrong_shape",
        "wrong_recipe",
    ],
)
def test_bad_checkpoint_is_one_clear_error_and_nothing_is_overwritten(
    saved_run: Path, tmp_path: Path, damage: str
) -> None:
    ckpt = tmp_path / "checkpoints" / "step_0000004"
    shutil.copytree(complete_checkpoints(saved_run / "checkpoints")[-1], ckpt)
    overrides: list[str] = []
    expected: str
    if damage == "missing":
        ckpt = tmp_path / "nowhere" / "step_0000009"
        expected = f"checkpoint {ckpt} does not exist"
    elif damage == "unfinished_tmp":
        ckpt = ckpt.rename(ckpt.with_name("step_0000004.tmp"))
        expected = "is an unfinished save"
    elif damage == "truncated_data":
        data = ckpt / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        expected = f"{data} is truncated"
    elif damage == "truncated_index":
        index = ckpt / ".metadata"
        index.write_bytes(index.read_bytes()[:100])
        expected = f"{index} is unreadable"
    elif damage == "no_trainer_state":
        (ckpt / "trainer_state.json").unlink()
        expected = f"{ckpt / 'trainer_state.json'} is missing"
    elif damage == "wrong_shape":
        overrides = ["model.vocab_size=300"]
        expected = "embed_tokens.weight: checkpoint [258, 128], model [300, 128]"
    else:  # a checkpoint of another recipe: refused before the model is built
        overrides = ["recipe=llama8b"]
        expected = "was saved by recipe 'debug', not 'llama8b'"
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        make_trainer(overrides + [f"checkpoint.resume={ckpt}"], run_dir)
    assert expected in str(info.value)
    assert _snapshot(tmp_path) == before  # nothing written: no config.yaml, no metrics line


@pytest.mark.parametrize("async_mode", ["none", "thread"])
def test_crash_during_save_leaves_previous_checkpoint_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_mode: str
) -> None:
    """The writer dies after the data files of the step-4 save are written, before its index (for an
    asynchronous save: in the background, reported when the loop next waits for it -- here the end)."""
    calls = {"n": 0}
    original = FileSystemWriter.finish

    def finish(self, metadata, results):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return original(self, metadata, results)

    monkeypatch.setattr(FileSystemWriter, "finish", finish)
    with pytest.raises(CheckpointError) as info:  # one message, DCP's exception unwrapped
        fit(["checkpoint.every=2", f"checkpoint.async_mode={async_mode}"], tmp_path)
    message = str(info.value)
    assert "disk full (simulated)" in message and "step_0000002 is intact" in message, message
    monkeypatch.undo()
    folder = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(folder)] == ["step_0000002"]
    assert not (folder / "step_0000004.tmp").exists()  # the failed save removed its partial files
    assert resolve_resume("auto", folder) == folder / "step_0000002"

    resumed = fit(["checkpoint.every=2", "checkpoint.resume=auto"], tmp_path)
    assert resumed.step == 4
    assert [p.name for p in complete_checkpoints(folder)] == ["step_0000002", "step_0000004"]


@pytest.mark.parametrize("async_mode", ["none", "thread"])
def test_sigterm_in_process_saves_at_the_step_boundary(tmp_path: Path, async_mode: str) -> None:
    class Preempted(Trainer):
        def on_step_end(self, step: int, metrics: dict) -> None:
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    overrides = TINY + ["trainer.steps=6", f"checkpoint.async_mode={async_mode}"]
    trainer = Preempted(compose_config(overrides, run_dir=tmp_path))
    trainer.fit()
    trainer.close()
    assert trainer.preempted and trainer.step == 2
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_0000002"]
    assert signal.getsignal(signal.SIGTERM) == previous  # handler given back


def test_async_save_blocks_for_staging_only_and_commits_the_staged_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save`` returns while DCP's writer is held; the checkpoint is not ``step_N`` (nor reported
    saved) before ``wait`` commits it; what is written is the state at ``save``, not later updates."""
    import torch.distributed.checkpoint as dcp

    release = threading.Event()
    original = FileSystemWriter.write_data

    def held(self, plan, planner):
        assert release.wait(60)
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    saved_weight = model.weight.detach().clone()
    checkpointer = Checkpointer(tmp_path, keep=2, is_main=True, async_mode="thread")
    state = {"step": 1, "tokens_seen": 0, "lr_scheduler": {}}
    args = dict(model=model, optimizer=optimizer, dataloader_state=None, rng_state={}, config_yaml="")
    path = checkpointer.save(1, state=state, **args)
    assert not path.exists() and path.with_name(path.name + ".tmp").is_dir()
    assert checkpointer.last_step is None and complete_checkpoints(tmp_path) == []
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step changes the weights while the save is in flight
    release.set()
    checkpointer.wait()
    assert complete_checkpoints(tmp_path) == [path] and checkpointer.last_step == 1
    loaded = {"model": {"weight": torch.zeros(4, 4)}}
    dcp.load(loaded, checkpoint_id=str(path))
    assert torch.equal(loaded["model"]["weight"], saved_weight)
    checkpointer.close()


def test_preemption_watcher_single_process() -> None:
    watcher = PreemptionWatcher()
    previous = signal.getsignal(signal.SIGTERM)
    watcher.install()
    try:
        assert not watcher.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.should_stop()
    finally:
        watcher.uninstall()
    assert signal.getsignal(signal.SIGTERM) == previous


def test_no_torch_load_without_weights_only_in_src() -> None:
    """``torch.load`` unpickles arbitrary objects unless ``weights_only=True``: never in portatrain.

    Calls are found in the syntax tree (multi-line calls included, docstrings and comments not),
    under any spelling that names the function ``load`` on ``torch`` or imports it from there.
    """
    offenders = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {"load"} if _imports_torch_load(tree) else set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            is_torch_load = (
                isinstance(func, ast.Attribute) and func.attr == "load" and ast.unparse(func.value) == "torch"
            ) or (isinstance(func, ast.Name) and func.id in aliases)
            safe = any(
                kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
                for kw in node.keywords
            )
            if is_torch_load and not safe:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders, "torch.load without weights_only=True:\n" + "\n".join(offenders)


def _imports_torch_load(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == "torch"
        and any(a.name == "load" for a in node.names)
        for node in ast.walk(tree)
    )


def test_rng_state_round_trips(saved_run: Path, tmp_path: Path) -> None:
    """The generator continues where the saved run left it, so random ops after a resume match too."""
    from torch.distributed.checkpoint import load

    ckpt = complete_checkpoints(saved_run / "checkpoints")[-1]
    saved = {"rng": {"rank0": {"cpu": torch.get_rng_state()}}}
    load(saved, checkpoint_id=str(ckpt))
    torch.manual_seed(0)
    trainer = make_trainer([f"checkpoint.resume={ckpt}"], tmp_path)
    assert torch.equal(torch.get_rng_state(), saved["rng"]["rank0"]["cpu"])
    assert trainer.step == 4
    trainer.close()


@pytest.mark.slow  # DCP spawns its checkpoint process (a fresh interpreter importing torch): ~8 s
@pytest.mark.skipif(
    not Path("/dev/full").exists(), reason="needs /dev/full (Linux), where writes fail with ENOSPC"
)
def test_a_full_disk_in_process_mode_is_one_line_without_the_checkpoint_process_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """DCP's checkpoint process shares the training process's stderr (capfd reads the descriptor): it
    printed its own 25-line traceback of the failed save before the training process's one line."""
    from portatrain.checkpoint.staging import AsyncSaves

    real_start = AsyncSaves.start

    def start_onto_a_full_disk(self: AsyncSaves, tensors: dict, tmp: Path, commit) -> None:
        (tmp / "__0_0.distcp").symlink_to("/dev/full")  # the file the checkpoint process writes next
        real_start(self, tensors, tmp, commit)

    monkeypatch.setattr(AsyncSaves, "start", start_onto_a_full_disk)
    with pytest.raises(CheckpointError, match="no space left on device while saving checkpoint step 1"):
        fit(["trainer.steps=1", "model.n_layers=1", "checkpoint.async_mode=process"], tmp_path)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Checkpoint save failed" not in err, err
    assert not (tmp_path / "checkpoints" / "step_0000001").exists()


def test_process_mode_refuses_an_entry_script_without_a_main_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's checkpoint process is spawned and imports the entry script: unguarded, it would train."""
    import types

    script = tmp_path / "train.py"
    script.write_text("from portatrain.cli import main\nmain()\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(CheckpointError, match=r"train\.py calls training without an `if __name__"):
        Checkpointer(tmp_path, keep=1, is_main=True, async_mode="process")
    script.write_text('from portatrain.cli import main\n\nif __name__ == "__main__":\n    main()\n')
    Checkpointer(tmp_path, keep=1, is_main=True, async_mode="process").close()
