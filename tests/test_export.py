"""``portatrain export``: a checkpoint becomes a Hugging Face directory that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import CheckpointError, complete_checkpoints
from portatrain.export import export_command, export_hf, parse_size
from portatrain.trainer import Trainer
from tests.conftest import TINY, compose_config, run_cli

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trainer]:
    """A 4-step debug run: its directory and its trainer (whose model holds the saved weights)."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    trainer = Trainer(compose_config(TINY, run_dir=run_dir))
    trainer.fit()
    trainer.close()
    return run_dir, trainer


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (2, 48), generator=gen)
    positions = torch.stack([torch.arange(48), torch.arange(48) + 100])  # beyond the trained rows too
    return ids, positions


@pytest.mark.slow
def test_cli_export_loads_in_transformers_with_matching_logits(trained, tmp_path: Path) -> None:
    run_dir, trainer = trained
    out = tmp_path / "hf"
    result = run_cli(
        ["export", "checkpoint=auto", f"run_dir={run_dir}", f"out={out}", "export.max_shard_size=300KB"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert all((out / s).stat().st_size <= 300_000 for s in shards)  # no tensor here exceeds the limit
    assert len(index["weight_map"]) == len(trainer.model.state_dict())

    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, positions = tokens()
    model = trainer.model.eval()
    with torch.no_grad():
        for pos in (None, positions):
            ours = model(ids, positions=pos)
            theirs = hf(input_ids=ids, position_ids=pos).logits
            assert (ours - theirs).abs().max().item() <= ATOL
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == 257 and config["vocab_size"] == 258


def test_export_in_process_auto_bf16_and_no_overwrite(trained, tmp_path: Path) -> None:
    run_dir, trainer = trained
    cfg = compose_config(TINY + [f"export.out={tmp_path / 'bf16'}", "export.dtype=bfloat16"], run_dir=run_dir)
    out = export_command(cfg.export, cfg.run_dir)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 (safe_open is not iterable)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    with pytest.raises(CheckpointError, match="already exists"):
        export_command(cfg.export, cfg.run_dir)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before

    empty = compose_config(TINY + [f"export.out={tmp_path / 'x'}"], run_dir=tmp_path / "no_run")
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        export_command(empty.export, empty.run_dir)


def test_export_one_shard_and_a_tensor_larger_than_the_limit(trained, tmp_path: Path) -> None:
    run_dir, _ = trained
    ckpt = complete_checkpoints(run_dir / "checkpoints")[-1]
    one = export_hf(ckpt, tmp_path / "one", max_shard_size=parse_size("5GB"))
    assert [p.name for p in one.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    tiny = export_hf(ckpt, tmp_path / "tiny", max_shard_size=1)  # every tensor alone in its shard
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(index["weight_map"])


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("300KB") == 300_000
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
