"""Custom sizes: ``model.dim=... model.n_layers=...`` on top of a flavour, validated, and followed by
the dry run, training, export and ``model.init_from``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import CheckpointError, complete_checkpoints
from portatrain.config import ModelConfig
from portatrain.errors import ConfigError
from portatrain.export import export_hf
from portatrain.models import get_spec, model_args, model_problems, model_schema
from portatrain.plan import describe_plan
from portatrain.validate import validate
from tests.helpers import compose_config, fit, make_trainer, run_cli

CUSTOM = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=2", "model.ffn_dim=1536"]
# Small enough to train in a second: 64 wide, 2 blocks, 4 query heads sharing 1 kv head.
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=1", "model.ffn_dim=96"]


def _llama_params(vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int) -> int:
    head_dim = dim // heads
    block = 2 * dim * dim + 2 * dim * kv_heads * head_dim + 3 * dim * ffn + 2 * dim
    return 2 * vocab * dim + layers * block + dim  # untied embedding and head, final norm


def test_dry_run_follows_the_custom_sizes(tmp_path: Path) -> None:
    expected = _llama_params(258, 512, 8, 8, 2, 1536)
    plan = describe_plan(compose_config(CUSTOM + ["dry_run=true", "device=cpu"]))
    assert f"parameters: {expected:,}" in plan
    assert "dim=512" in plan and "dim 512, 8 layers, 8 heads (2 kv, head_dim 64), ffn 1536" in plan
    out = run_cli([*CUSTOM, "dry_run=true", "device=cpu"], cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{expected:,}" in out.stdout and "activations" in out.stdout


def test_inconsistent_sizes_are_one_error_listing_each_problem() -> None:
    cfg = compose_config(["model.dim=500", "model.n_heads=8", "model.n_kv_heads=3", "model.head_dim=64"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert "model.head_dim=64: not an option of the llama3 family" in message  # Llama derives it
    assert "dim(500) must be divisible by n_heads(8)" in message
    assert "model.n_kv_heads=3 must divide model.n_heads=8" in message and "[1, 2, 4, 8]" in message
    with pytest.raises(ConfigError, match=r"n_layers=0 must be positive"):
        validate(compose_config(["model.n_layers=0"]))


def test_tensor_parallel_checks_the_custom_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"parallel.tp=2 must divide n_heads\(4\) and n_kv_heads\(1\)"):
        validate(compose_config([*SMALL, "parallel.tp=2"]))


def test_custom_size_trains_exports_and_initializes_back(tmp_path: Path) -> None:
    source = fit(SMALL, tmp_path / "source")
    assert source.model.args.dim == 64 and len(source.model.layers) == 2
    state = json.loads(
        (complete_checkpoints(tmp_path / "source" / "checkpoints")[-1] / "trainer_state.json").read_text()
    )
    assert state["model_name"] == "llama3" and state["model_args"]["ffn_hidden_dim"] == 96
    out = export_hf(
        complete_checkpoints(tmp_path / "source" / "checkpoints")[-1], tmp_path / "hf", max_shard_size=10**9
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (64, 2, 96)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 1)

    started = make_trainer([*SMALL, f"model.init_from={out}"], tmp_path / "started")
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(started.model.eval()(tokens), source.model.eval()(tokens))
    with pytest.raises(CheckpointError, match="hidden_size: config.json has 64, the model 128"):
        make_trainer([f"model.init_from={out}"], tmp_path / "flavour_only")  # without the custom sizes


def test_a_family_option_lives_in_its_folder_and_composes_under_model() -> None:
    """DeepSeek-V3's own keys are its spec's ``options`` (not the shared ``ModelConfig``), yet compose
    as ``model.<key>``, set its arguments, and are refused by name for another family as before."""
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    options = {f.name for f in dataclasses.fields(get_spec("deepseek_v3").options)}
    assert {"n_group", "topk_group", "bias_update_rate", "q_lora_rank", "kv_lora_rank"} <= options
    assert not options & shared
    cfg = compose_config(["model=deepseek_v3_debug", "model.q_lora_rank=16", "model.n_group=2"])
    assert (model_args(cfg.model).q_lora_rank, model_args(cfg.model).n_group) == (16, 2)
    problems = model_problems(compose_config(["model.kv_lora_rank=8"]).model)
    assert len(problems) == 1 and problems[0].startswith(
        "model.kv_lora_rank=8: not an option of the llama3 family; unset it, or use one of model.dim,"
    )


def test_a_family_option_that_clashes_is_refused_when_the_registry_is_built() -> None:
    @dataclasses.dataclass
    class Shared:  # repeats a shared key
        dim: int | None = None

    @dataclasses.dataclass
    class Defaulted:  # a default would override every flavour's value
        q_lora_rank: int | None = 8

    @dataclasses.dataclass
    class Retyped:  # DeepSeek-V3's q_lora_rank with another type
        q_lora_rank: float | None = None

    for bad, message in [(Shared, "option dim"), (Defaulted, "option q_lora_rank"), (Retyped, "float")]:
        with pytest.raises(TypeError, match=message):
            model_schema([get_spec("deepseek_v3"), dataclasses.replace(get_spec("qwen3"), options=bad)])
