"""Qwen 3 through the generic stages, where it differs from Llama: activation checkpointing with the
q/k norms, the dry run and its memory plan (query width, q/k norms), and ``model.init_from`` of another
family's directory. Nothing here names a Qwen module outside the spec: the trainer and importer reach
the family through ``model.name=qwen3``.

Training eager and compiled, export -> transformers, the ``init_from`` round trip and FSDP2 on two
processes are checked for every family in ``tests/test_conformance.py``; FSDP2 x TP of the tied
debug model against one process in ``tests/test_distributed.py`` (in the four-process launch there).
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from portatrain.models import build_model, get_spec
from portatrain.models.memory import estimate_memory as estimate_dense_memory
from portatrain.models.qwen3.model import QWEN3_FLAVORS, Qwen3Args
from portatrain.parallel.activation_checkpoint import apply_activation_checkpointing
from portatrain.plan import describe_plan
from portatrain.trainer import Trainer
from tests.conftest import TINY, compose_config, run_cli

QWEN = [*TINY, "model=qwen3_debug"]


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


def _without_qk_norm(args: Qwen3Args) -> Qwen3Args:
    """The same shape with the q/k norms switched off (the shared estimate reads ``args.qk_norm``)."""

    class NoQKNorm(Qwen3Args):
        qk_norm = "none"

    return NoQKNorm(**{f.name: getattr(args, f.name) for f in fields(args)})


def test_memory_estimate_counts_the_query_width_and_the_q_k_norms() -> None:
    spec = get_spec("qwen3")
    args = QWEN3_FLAVORS["0.6b"]  # q width 2048 = 2 x dim
    kwargs = {"batch_size": 2, "seq_len": 1024, "tp_degree": 2}
    ours, dense = (
        spec.estimate_memory(args, **kwargs),
        estimate_dense_memory(_without_qk_norm(args), **kwargs),
    )
    norms = 2 * 1024 * 28 * ((2048 + 1024) * 4 + (16 + 8) * 4) // 2  # q, k norm inputs + fp32 stats
    assert ours["activations"] - dense["activations"] == norms
    gains = 28 * 2 * 128 * 4 // 2  # the q/k norms' gains (fp32, over tp 2) are the only other difference
    assert ours["params"] - dense["params"] == ours["grads"] - dense["grads"] == gains
    # The decoupled width reaches the generic table: a Llama-shaped model (q width = dim) saves less.
    narrow = _without_qk_norm(replace(args, head_dim=64))  # 16 x 64 = dim
    assert estimate_dense_memory(narrow, **kwargs)["activations"] < dense["activations"]
    # Checkpointing keeps the norms' inputs of one block only, the one being recomputed, which is
    # alive after the output head's buffers are freed: visible where the recomputation is the
    # larger of the two (a small vocabulary), absorbed by the head's buffers where it is not.
    small = replace(args, vocab_size=1024)
    selective = spec.estimate_memory(small, **kwargs, activation_checkpointing="selective")
    plain = estimate_dense_memory(_without_qk_norm(small), **kwargs, activation_checkpointing="selective")
    assert selective["activations"] - plain["activations"] == norms // 28
    assert selective["activations"] < spec.estimate_memory(small, **kwargs)["activations"]
    large = spec.estimate_memory(args, **kwargs, activation_checkpointing="selective")
    plain = estimate_dense_memory(_without_qk_norm(args), **kwargs, activation_checkpointing="selective")
    assert large["activations"] == plain["activations"]


# ---------------------------------------------------------------------------------------------
# Hugging Face import through the spec
# ---------------------------------------------------------------------------------------------


def test_init_from_a_llama_directory_names_the_family(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from portatrain.models.llama.hf import hf_config as llama_config
    from portatrain.models.llama.model import LLAMA3_FLAVORS

    config = transformers.LlamaConfig(**llama_config(LLAMA3_FLAVORS["debug"], torch_dtype="float32"))
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    with pytest.raises(Exception, match="LlamaForCausalLM") as info:
        Trainer(compose_config([*QWEN, f"model.init_from={tmp_path / 'llama'}"], run_dir=tmp_path / "run"))
    assert "qwen3" in str(info.value)


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
