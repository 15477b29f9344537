"""Qwen 3 through the generic stages, as Llama is tested: training, activation checkpointing, compiled
blocks, the dry run and its memory plan, ``portatrain export`` (loads in transformers) and
``model.init_from`` (bit-identical round trip), and FSDP2 / TP / FSDP2 x TP under a real torchrun
against one process. Nothing here names a Qwen module outside the spec: the trainer, exporter and
importer reach the family through ``model.name=qwen3``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from portatrain.models import build_model, get_spec
from portatrain.models.memory import estimate_memory as estimate_dense_memory
from portatrain.models.qwen3.model import QWEN3_FLAVORS
from portatrain.parallel.activation_checkpoint import apply_activation_checkpointing
from portatrain.plan import describe_plan
from portatrain.trainer import Trainer
from tests.conftest import ROOT, TINY, compose_config, run_cli

QWEN = [*TINY, "model=qwen3_debug"]
ATOL = 1e-4


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _fit(overrides: list[str], run_dir: Path) -> Trainer:
    trainer = Trainer(compose_config(overrides, run_dir=run_dir))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (2, 48), generator=gen)
    positions = torch.stack([torch.arange(48), torch.arange(48) + 100])
    return ids, positions


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(_tokens()[0])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trainer]:
    """A 4-step Qwen 3 debug run (tied, head_dim 64 != dim/n_heads): its directory and trainer."""
    run_dir = tmp_path_factory.mktemp("qwen3") / "run"
    return run_dir, _fit(QWEN, run_dir)


def test_trains_through_the_generic_trainer(trained) -> None:
    run_dir, trainer = trained
    assert type(trainer.model).__name__ == "Qwen3" and trainer.model.lm_head is None
    losses = [r["loss"] for r in _records(run_dir)]
    assert len(losses) == 4 and all(loss == loss for loss in losses)  # no NaN
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_gradients_and_names(mode: str) -> None:
    cfg = compose_config(QWEN)
    tokens = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))

    def grads(ac: str):
        model = build_model(cfg.model)
        torch.manual_seed(1)
        model.init_weights()
        apply_activation_checkpointing(model.layers, ac)
        model(tokens).float().logsumexp(-1).sum().backward()
        return {k: p.grad for k, p in model.named_parameters()}, list(model.state_dict())

    ref, ref_keys = grads("none")
    got, keys = grads(mode)
    assert keys == ref_keys
    assert any("q_norm" in k for k in got)
    for (name, g), r in zip(got.items(), ref.values()):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_blocks_train_like_eager(tmp_path: Path) -> None:
    """Dynamo only (``compile.backend=eager``): the compile stage's block compiler reaches Qwen 3's
    blocks through the spec's parallelizer, and training matches eager."""
    torch._dynamo.reset()
    try:
        trainer = _fit([*QWEN, "compile.enabled=true", "compile.backend=eager"], tmp_path / "compiled")
    finally:
        torch._dynamo.reset()
    assert all(block._compiled_call_impl is not None for block in trainer.model.layers.values())
    _fit(QWEN, tmp_path / "eager")
    compiled, eager = _records(tmp_path / "compiled"), _records(tmp_path / "eager")
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], abs=1e-5)


def test_dry_run_plans_qwen3_8b_with_its_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["recipe=qwen3_8b", "device=cuda", "dry_run=true", "parallel.dp_shard=8"]
    plan = describe_plan(compose_config(base))
    assert "8,190,735,360" in plan and "head_dim 128" in plan
    total = float(next(line for line in plan.splitlines() if line.startswith("total")).split()[1])
    with_tp = describe_plan(compose_config([*base, "parallel.tp=2"]))
    total_tp = float(next(line for line in with_tp.splitlines() if line.startswith("total")).split()[1])
    assert 0 < total_tp < total
    # A tied flavour plans under TP too (one vocabulary-sharded matrix for both ends).
    tied = describe_plan(compose_config([*base, "model=qwen3_0_6b", "parallel.tp=2"]))
    assert "596,049,920" in tied


def test_dry_run_cli_with_custom_head_dim(tmp_path: Path) -> None:
    out = run_cli(
        ["recipe=qwen3_8b", "device=cpu", "dry_run=true", "model.head_dim=64", "model.n_layers=4"],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    args = replace(QWEN3_FLAVORS["8b"], head_dim=64, n_layers=4)
    assert f"{args.num_params():,}" in out.stdout and "head_dim 64" in out.stdout


def test_memory_estimate_counts_the_query_width_and_the_q_k_norms() -> None:
    spec = get_spec("qwen3")
    args = QWEN3_FLAVORS["0.6b"]  # q width 2048 = 2 x dim
    kwargs = {"batch_size": 2, "seq_len": 1024, "tp_degree": 2}
    ours, dense = spec.estimate_memory(args, **kwargs), estimate_dense_memory(args, **kwargs)
    norms = 2 * 1024 * 28 * ((2048 + 1024) * 4 + (16 + 8) * 4) // 2  # q, k norm inputs + fp32 stats
    assert ours["activations"] - dense["activations"] == norms
    assert ours["total"] - dense["total"] == norms
    for key in ("params", "grads", "optimizer", "fsdp_buffers"):
        assert ours[key] == dense[key]
    # The decoupled width reaches the generic table: a Llama-shaped model (q width = dim) saves less.
    narrow = replace(args, head_dim=64)  # 16 x 64 = dim
    assert estimate_dense_memory(narrow, **kwargs)["activations"] < dense["activations"]
    # Checkpointing keeps the norms' inputs of one block only (the one being recomputed).
    selective = spec.estimate_memory(args, **kwargs, activation_checkpointing="selective")
    dense_selective = estimate_dense_memory(args, **kwargs, activation_checkpointing="selective")
    assert selective["activations"] - dense_selective["activations"] == norms // 28
    assert selective["activations"] < ours["activations"]


# ---------------------------------------------------------------------------------------------
# Hugging Face export and import through the spec
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_export_loads_in_transformers_and_init_from_round_trips(trained, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    run_dir, trainer = trained
    out = tmp_path / "hf"
    result = run_cli(
        ["export", "checkpoint=auto", f"run_dir={run_dir}", f"out={out}", "export.max_shard_size=300KB"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True

    hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, positions = _tokens()
    with torch.no_grad():
        for pos in (None, positions):
            ours = trainer.model.eval()(ids, positions=pos)
            theirs = hf(input_ids=ids, position_ids=pos).logits
            assert (ours - theirs).abs().max().item() <= ATOL

    started = Trainer(compose_config([*QWEN, f"model.init_from={out}"], run_dir=tmp_path / "started"))
    try:
        assert torch.equal(_logits(started.model), _logits(trainer.model))  # fp32 export: bit-exact
        source = trainer.model.state_dict()
        assert all(torch.equal(v, source[k]) for k, v in started.model.state_dict().items())
    finally:
        started.close()


def test_transformers_save_pretrained_then_init_from(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from portatrain.models.qwen3.hf import hf_config

    config = transformers.Qwen3Config(**hf_config(QWEN3_FLAVORS["debug"], torch_dtype="float32"))
    torch.manual_seed(3)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    copy.deepcopy(hf).save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    trainer = Trainer(compose_config([*QWEN, f"model.init_from={tmp_path / 'hf'}"], run_dir=tmp_path / "run"))
    try:
        with torch.no_grad():
            expected = hf(input_ids=_tokens()[0]).logits
        assert (_logits(trainer.model) - expected).abs().max().item() <= ATOL
    finally:
        trainer.close()


def test_init_from_a_llama_directory_names_the_family(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from portatrain.models.llama.hf import hf_config as llama_config
    from portatrain.models.llama.model import LLAMA3_FLAVORS

    config = transformers.LlamaConfig(**llama_config(LLAMA3_FLAVORS["debug"], torch_dtype="float32"))
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    with pytest.raises(Exception, match="LlamaForCausalLM") as info:
        Trainer(compose_config([*QWEN, f"model.init_from={tmp_path / 'llama'}"], run_dir=tmp_path / "run"))
    assert "qwen3" in str(info.value)


# ---------------------------------------------------------------------------------------------
# FSDP2, TP and FSDP2 x TP under torchrun, against one process
# ---------------------------------------------------------------------------------------------

STEPS = 4
GLOBAL_BATCH = 8


def _torchrun(nproc: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*cmd, "-m", "portatrain", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "layout", "batch_size"),
    [
        (2, ["parallel.dp_shard=2"], GLOBAL_BATCH // 2),
        (4, ["parallel.dp_shard=2", "parallel.tp=2"], GLOBAL_BATCH // 2),
    ],
    ids=["fsdp2", "fsdp2xtp2-tied"],
)
def test_distributed_layouts_match_one_process(
    tmp_path: Path, nproc: int, layout: list[str], batch_size: int
) -> None:
    common = [*QWEN, f"trainer.steps={STEPS}", "checkpoint.enabled=false"]
    _fit([*common, f"data.batch_size={GLOBAL_BATCH}"], tmp_path / "single")
    reference = _records(tmp_path / "single")
    out = _torchrun(
        nproc, [*common, *layout, f"data.batch_size={batch_size}", f"run_dir={tmp_path / 'run'}"], tmp_path
    )
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, reference):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got, want)


def test_qwen3_8b_recipe_differs_from_llama8b_only_in_the_model() -> None:
    from omegaconf import OmegaConf

    def flat(overrides: list[str]) -> dict:
        cfg = OmegaConf.to_container(compose_config(overrides), resolve=False)

        def walk(node, prefix=""):
            if isinstance(node, dict):
                for key, value in node.items():
                    yield from walk(value, f"{prefix}{key}.")
            else:
                yield prefix.rstrip("."), node

        return dict(walk(cfg))

    qwen, llama = flat(["recipe=qwen3_8b"]), flat(["recipe=llama8b"])
    assert {k for k in qwen.keys() | llama.keys() if qwen.get(k) != llama.get(k)} == {"recipe", "model.name"}
    assert (qwen["model.name"], qwen["model.flavor"]) == ("qwen3", "8b")
