"""A checkpoint never runs code: an index that declares a pickled (non-tensor) entry is refused by name
before a byte of it is read, in every command that loads DCP checkpoints, and fault tolerance's
live recovery unpickles only tensors and plain values.

The crafted checkpoints are made the way an attacker would: a real checkpoint re-saved by DCP with one
optimizer moment (or one weight) replaced by an object whose ``__reduce__`` writes a marker file. DCP
stores it as a *bytes* entry, and its stock reader unpickles that with ``torch.load(weights_only=False)``
(``DefaultLoadPlanner.load_bytes``). Every test checks the marker is never written.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import CheckpointError, UnsafeCheckpointError, inspect_checkpoint
from tests.helpers import TINY, compose_config, make_trainer
from tests.test_command_errors import one_line_error, run


class Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_pickled_entry(step_dir: Path, marker: Path, *, part: str = "optim") -> None:
    """Re-save checkpoint ``step_dir`` with DCP, one tensor of ``part`` replaced by a :class:`Payload`
    (``trainer_state.json`` and the loader state stay: only the tensors' index and files change)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = step_dir.parent / "flat.pt"
    dcp_to_torch_save(step_dir, flat)  # this checkpoint is still ours: its tensors only
    state = torch.load(flat, weights_only=True)
    flat.unlink()
    first = next(iter(state[part]))
    if part == "optim":
        state["optim"][first]["exp_avg"] = Payload(marker)
    else:
        state[part][first] = Payload(marker)
    for file in [*step_dir.glob("*.distcp"), step_dir / ".metadata"]:
        file.unlink()
    dcp.save(state, checkpoint_id=str(step_dir))


def _step(run_dir: Path, n: int) -> Path:
    return run_dir / "checkpoints" / f"step_{n:07d}"


def _resume(run_dir: Path, *overrides: str):
    trainer = make_trainer(["trainer.steps=4", *overrides], run_dir)
    trainer.close()
    return trainer


def test_the_planted_payload_runs_under_dcps_own_reader(run_copy: Path, tmp_path: Path) -> None:
    """The threat is real: DCP's stock reader runs the planted payload (so the refusals below matter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    marker = tmp_path / "ran"
    plant_pickled_entry(_step(run_copy, 3), marker)
    dcp_to_torch_save(_step(run_copy, 3), tmp_path / "all.pt")
    assert marker.exists()


def test_train_refuses_an_explicit_resume_and_auto_skips_it_as_unsafe(
    run_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "ran"
    plant_pickled_entry(_step(run_copy, 3), marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        inspect_checkpoint(_step(run_copy, 3))
    message = str(info.value)
    assert "optim.embed_tokens.weight.exp_avg" in message and "unsafe" in message and "\n" not in message
    with pytest.raises(CheckpointError, match="is unsafe and was not loaded"):
        _resume(run_copy, f"checkpoint.resume={_step(run_copy, 3)}")
    with caplog.at_level(logging.WARNING):
        trainer = _resume(run_copy, "checkpoint.resume=auto")
    assert trainer.resume_from.name == "step_0000002"  # the one before, which is safe
    assert "skipping UNSAFE checkpoint" in caplog.text and "step_0000003" in caplog.text
    assert not marker.exists()


def test_train_cli_is_one_line_exit_2(
    run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran"
    plant_pickled_entry(_step(run_copy, 3), marker)
    monkeypatch.chdir(tmp_path)
    status, err = run(
        [*TINY, "trainer.steps=4", f"run_dir={run_copy}", f"checkpoint.resume={_step(run_copy, 3)}"], capsys
    )
    line = one_line_error(err, "train")
    assert status == 2 and "is unsafe and was not loaded" in line and "exp_avg" in line, err
    assert not marker.exists()


def test_export_refuses_a_pickled_model_entry(run_copy: Path, tmp_path: Path) -> None:
    """A bytes *model* entry used to end in ``AttributeError: 'BytesStorageMetadata' ... 'size'``."""
    from portatrain.export import export_hf

    marker = tmp_path / "ran"
    plant_pickled_entry(_step(run_copy, 3), marker, part="model")
    with pytest.raises(UnsafeCheckpointError, match="model.embed_tokens.weight"):
        export_hf(_step(run_copy, 3), tmp_path / "hf", max_shard_size=10**9)
    assert not (tmp_path / "hf").exists() and not marker.exists()


def test_eval_refuses_it(run_copy: Path, tmp_path: Path) -> None:
    from portatrain.evaluation.model import load_checkpoint_model

    marker = tmp_path / "ran"
    plant_pickled_entry(_step(run_copy, 3), marker, part="model")
    with pytest.raises(UnsafeCheckpointError):
        load_checkpoint_model(compose_config(TINY, run_dir=tmp_path / "eval"), _step(run_copy, 3))
    assert not marker.exists()


def test_read_data_refuses_byte_reads_even_if_a_planner_asks(run_copy: Path, tmp_path: Path) -> None:
    """Belt and braces: a load plan that asks for a pickled entry is refused by the reader itself."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from portatrain.checkpoint.safe_metadata import UnsafeMetadataError, safe_reader

    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("optim.x"),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("optim.x"),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    with pytest.raises(UnsafeMetadataError, match="optim.x"):
        safe_reader(str(_step(run_copy, 3))).read_data(LoadPlan([item]), planner=None)


def test_dpo_resume_refuses_it(tmp_path: Path) -> None:
    from tests.test_dpo import dpo_overrides, fit_dpo, write_pairs

    pairs = write_pairs(tmp_path / "pairs.jsonl", n=8)
    run_dir = tmp_path / "dpo"
    fit_dpo(dpo_overrides(pairs, "trainer.steps=1", "data.batch_size=2", "checkpoint.every=1"), run_dir)
    marker = tmp_path / "ran"
    plant_pickled_entry(_step(run_dir, 1), marker)
    with pytest.raises(CheckpointError, match="unsafe"):
        fit_dpo(
            dpo_overrides(
                pairs, "trainer.steps=2", "data.batch_size=2", f"checkpoint.resume={_step(run_dir, 1)}"
            ),
            run_dir,
        )
    assert not marker.exists()


def test_fault_tolerance_recovery_unpickles_only_plain_values(tmp_path: Path) -> None:
    """A recovering replica group reads a healthy group's state over torchft's HTTP transport, which
    torchft itself loads with ``weights_only=False``; portatrain's transport refuses a payload."""
    torchft = pytest.importorskip("torchft")
    from torchft.checkpointing.http_transport import HTTPTransport

    from portatrain.fault_tolerance import tensor_only_transport

    timeout = timedelta(seconds=10)
    plain = {"model": {"w": torch.ones(2)}, "step": 3, "data": {"pos": [1, 2]}, "name": "x"}
    marker = tmp_path / "ran"
    for transport_class, payload_runs in ((None, False), (HTTPTransport, True)):
        transport = (
            tensor_only_transport(torchft, timeout)
            if transport_class is None
            else transport_class(timeout=timeout, num_chunks=0)
        )
        try:
            transport.send_checkpoint([1], step=1, state_dict=plain, timeout=timeout)
            got = transport.recv_checkpoint(0, transport.metadata(), step=1, timeout=timeout)
            assert torch.equal(got["model"]["w"], torch.ones(2)) and got["data"] == {"pos": [1, 2]}
            transport.send_checkpoint([1], step=2, state_dict={"evil": Payload(marker)}, timeout=timeout)
            if payload_runs:  # torchft's own transport: the test's premise
                transport.recv_checkpoint(0, transport.metadata(), step=2, timeout=timeout)
            else:
                with pytest.raises(Exception, match="Unsupported global|weights_only|unsupported GLOBAL"):
                    transport.recv_checkpoint(0, transport.metadata(), step=2, timeout=timeout)
            assert marker.exists() == payload_runs
        finally:
            transport.shutdown(wait=True)
        marker.unlink(missing_ok=True)


def test_parity_command_loads_no_checkpoint(tmp_path: Path) -> None:
    """``portatrain parity`` trains both sides from the same seed with checkpoints off and resume=none,
    whatever the config says: it reads no checkpoint, so there is nothing to refuse."""
    from portatrain.parity.run import _derived

    cfg = compose_config([*TINY, "checkpoint.resume=auto"], run_dir=tmp_path / "run")
    for reference in (True, False):
        side = _derived(cfg, "cpu", tmp_path / "side", reference)
        assert side.checkpoint.enabled is False and side.checkpoint.resume == "none"


@pytest.mark.parametrize("name", ["trainer_state.json", "dataloader_rank0.json"])
def test_an_edited_json_file_is_refused_by_its_digest(
    run_copy: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The JSON beside the tensors (step, schedule, data position) is checked like the tensors: a
    well-formed edit (one number changed) is found by the SHA-256 written with it."""
    import json

    file = _step(run_copy, 3) / name
    state = json.loads(file.read_text())
    assert len(state["sha256"]) == 64
    if name == "trainer_state.json":
        state["tokens_seen"] += 1
    else:
        state["_index_sampler_state"]["batches_yielded"] -= 1
    file.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="changed after it was saved") as info:
        _resume(run_copy, f"checkpoint.resume={_step(run_copy, 3)}")
    assert str(file) in str(info.value) and "\n" not in str(info.value)
    if name == "trainer_state.json":  # found without reading tensors: auto takes the one before
        with caplog.at_level(logging.WARNING):
            trainer = _resume(run_copy, "checkpoint.resume=auto")
        assert trainer.resume_from.name == "step_0000002"
