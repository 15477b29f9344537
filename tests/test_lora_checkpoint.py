"""What a LoRA run saves is what trains: its step checkpoints hold the adapters and their optimizer
state, and reference the frozen base (``portatrain.checkpoint.base``) -- a base checkpoint the run
wrote once, or the Hugging Face directory of ``model.init_from`` -- which every load checks by its
SHA-256 before reading it. Resume, ``eval`` and ``export`` read the base through the reference, and
checkpoints written before bases existed (every tensor in the step) keep loading.

Multi-process: ``tests/test_lora.py``'s 4-process run saves with a base and resumes in one process.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from portatrain.checkpoint import BASE_DIR, complete_checkpoints, load_model_weights, safe_reader
from portatrain.export import export_hf
from portatrain.finetune.lora import is_adapter_key
from tests.helpers import fit, make_trainer, train_records
from tests.test_command_errors import one_line_error, run

LORA = [
    "finetune.method=lora",
    "model.n_layers=2",
    "data.num_documents=60",
    "optim.lr=0.02",
    "optim.warmup_steps=0",
    "optim.decay=constant",
    "checkpoint.every=2",
]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """A 4-step LoRA run that saved steps 2 and 4, and the names of its frozen parameters."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    trainer = fit(LORA, run_dir)
    frozen = {n for n, p in trainer.model.named_parameters() if not p.requires_grad}
    return run_dir, frozen


@pytest.fixture
def _cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``portatrain.cli.main`` in this process: argv, threads and the root logger as they were."""
    monkeypatch.setattr(sys, "argv", ["portatrain"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:], root.level = handlers, level


def model_keys(path: Path) -> set[str]:
    """The ``model.*`` tensors of the DCP directory ``path``, without the prefix (its index only)."""
    metadata = safe_reader(str(path)).read_metadata()
    return {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}


def copy_at_step_2(run_dir: Path, copy: Path) -> Path:
    """A copy of the run stopped after step 2 (step 4 and the metrics gone)."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_0000004")
    (copy / "metrics.jsonl").write_text("")
    return copy


def test_step_checkpoints_hold_the_adapters_and_resume_through_the_base(lora_run, tmp_path: Path) -> None:
    run_dir, frozen = lora_run
    steps = complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in steps] == ["step_0000002", "step_0000004"]
    base = run_dir / "checkpoints" / BASE_DIR
    assert frozen and model_keys(base) == frozen  # the base: the frozen parameters, written once
    for step in steps:
        saved = model_keys(step)
        assert saved and all(is_adapter_key(k) for k in saved) and not saved & frozen
        reference = json.loads((step / "trainer_state.json").read_text())["base"]
        assert reference["kind"] == "checkpoint" and reference["path"] == str(base.resolve())
    assert sum(f.stat().st_size for f in steps[0].iterdir()) < sum(f.stat().st_size for f in base.iterdir())

    copy = copy_at_step_2(run_dir, tmp_path / "copy")
    fit([*LORA, "checkpoint.resume=auto"], copy)
    resumed, want = train_records(copy), train_records(run_dir)[2:]
    assert [r["step"] for r in resumed] == [3, 4]
    for got, expected in zip(resumed, want, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    # The copy's own base (beside its steps) was the one loaded: kept, not written again.
    state = json.loads((copy / "checkpoints" / "step_0000004" / "trainer_state.json").read_text())
    assert state["base"]["path"] == str((copy / "checkpoints" / BASE_DIR).resolve())


@pytest.mark.usefixtures("_cli")
def test_a_changed_or_missing_base_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    fit([*LORA, "trainer.steps=2"], run_dir)
    base = run_dir / "checkpoints" / BASE_DIR
    data = next(base.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-4] + b"\x00\x01\x02\x03")  # the same size, another content
    argv = ["train", "device=cpu", *LORA, "trainer.steps=4", "checkpoint.resume=auto", f"run_dir={run_dir}"]
    status, err = run(argv, capsys)
    line = one_line_error(err, "train")
    assert status == 2 and "the base model changed since the checkpoint was written" in line, line
    assert str(base.resolve()) in line

    shutil.rmtree(base)
    status, err = run(argv, capsys)
    line = one_line_error(err, "train")
    assert status == 2 and f"is missing: {base.resolve()}" in line, line
    status, err = run(["export", f"checkpoint={run_dir}", f"out={tmp_path / 'hf'}"], capsys)
    assert status == 2 and f"is missing: {base.resolve()}" in one_line_error(err, "export")
    assert not (tmp_path / "hf").exists()


def test_init_from_is_the_base_for_resume_eval_and_export(lora_run, tmp_path: Path) -> None:
    """A LoRA run from ``model.init_from`` references that directory and writes no base; its
    checkpoint resumes, evaluates and exports through it, and a changed file there is refused."""
    hf = export_hf(
        complete_checkpoints(lora_run[0] / "checkpoints")[-1], tmp_path / "hf", max_shard_size=10**9
    )
    run_dir = tmp_path / "run"
    trainer = fit([*LORA, f"model.init_from={hf}", "trainer.steps=2", "checkpoint.every=1"], run_dir)
    assert not (run_dir / "checkpoints" / BASE_DIR).exists()
    step_1, step_2 = complete_checkpoints(run_dir / "checkpoints")
    reference = json.loads((step_2 / "trainer_state.json").read_text())["base"]
    assert reference["kind"] == "init_from" and reference["path"] == str(hf.resolve())

    resumed = make_trainer([*LORA, f"model.init_from={hf}", f"checkpoint.resume={step_2}"], run_dir / "again")
    want = trainer.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in resumed.model.state_dict().items())
    resumed.close()
    evaluated = make_trainer([*LORA, "checkpoint.enabled=false"], tmp_path / "eval")
    load_model_weights(step_2, evaluated.model)
    assert all(torch.equal(v, want[k]) for k, v in evaluated.model.state_dict().items())
    evaluated.close()

    out = export_hf(step_2, tmp_path / "out", max_shard_size=10**9)
    theirs, ours = load_file(next(hf.glob("*.safetensors"))), load_file(next(out.glob("*.safetensors")))
    assert theirs.keys() == ours.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)

    shard = next(hf.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes() + b" ")
    with pytest.raises(Exception, match="the base model changed since the checkpoint was written") as caught:
        export_hf(step_1, tmp_path / "changed", max_shard_size=10**9)
    assert str(hf.resolve()) in str(caught.value) and "\n" not in str(caught.value)


def test_a_checkpoint_without_a_base_still_loads(tmp_path: Path) -> None:
    """A LoRA checkpoint written before bases existed holds every tensor: resume and eval read it
    as before, and the resumed run's first save writes its base."""
    legacy = make_trainer(LORA, tmp_path / "legacy")
    frozen = [p for p in legacy.model.parameters() if not p.requires_grad]
    for param in frozen:  # what every save did before: the whole model in the step
        param.requires_grad_(True)
    step_0 = legacy.save_checkpoint()
    for param in frozen:
        param.requires_grad_(False)
    legacy.close()
    state = json.loads((step_0 / "trainer_state.json").read_text())
    assert "base" not in state and model_keys(step_0) == set(legacy.model.state_dict())

    run_dir = tmp_path / "run"
    trainer = fit([*LORA, "trainer.steps=2", f"checkpoint.resume={step_0}"], run_dir)
    evaluated = make_trainer([*LORA, "checkpoint.enabled=false"], tmp_path / "eval")
    load_model_weights(step_0, evaluated.model)
    want = legacy.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in evaluated.model.state_dict().items())
    evaluated.close()
    base = run_dir / "checkpoints" / BASE_DIR
    assert model_keys(base) == {n for n, p in trainer.model.named_parameters() if not p.requires_grad}
