"""Per-block compile, bucket warm-up and the recompile guard (``portatrain.compile``).

Dynamo's guards and graph counting do not depend on the code generator, so the warm-up and guard
tests use ``compile.backend=eager`` (dynamo only, seconds). One slow test runs inductor, the CPU
default, to check that compiled blocks train exactly like eager ones.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.accelerators.tpu import TPUAccelerator
from portatrain.compile import (
    RecompileError,
    compile_blocks,
    compile_granularity,
    compile_options,
    warmup_batches,
)
from portatrain.data.loader import batch_shapes, build_collator
from portatrain.errors import UserError
from portatrain.models import build_model
from portatrain.trainer import Trainer
from tests.conftest import TINY, compose_config
from tests.helpers import fit, make_trainer, read_metrics

BUCKETS = [
    "data.collator=bucket",
    "data.buckets=[16,32,64]",
    "checkpoint.enabled=false",
]
WARMUP = ["compile.enabled=true", "compile.warmup=true", "compile.dynamic=false"]
DYNAMO_ONLY = [*WARMUP, "compile.backend=eager"]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Dynamo caches graphs per code object for the whole process: start and end each test clean."""
    torch._dynamo.reset()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def _fit(overrides: list[str], run_dir: Path, trainer_cls: type[Trainer] = Trainer) -> list[dict]:
    """Fit, then every metrics record."""
    fit(overrides, run_dir, trainer_cls)
    return read_metrics(run_dir)


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


@pytest.fixture(scope="module")
def eager_bucket_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Eager losses over buckets 32 and 64: what every compiled variant below must reproduce."""
    return _losses(_fit([*BUCKETS, "data.buckets=[32,64]"], tmp_path_factory.mktemp("eager")))


def test_compile_options_follow_the_adapter_unless_overridden() -> None:
    cfg = OmegaConf.create({"backend": None, "dynamic": None})
    assert compile_options(cfg, CPUAccelerator()) == ("inductor", None)
    assert compile_options(cfg, TPUAccelerator()) == (TPUAccelerator.compile_backend, False)
    cfg = OmegaConf.create({"backend": "aot_eager", "dynamic": True})
    assert compile_options(cfg, TPUAccelerator()) == ("aot_eager", True)


def test_compile_blocks_in_place_keeps_parameter_names() -> None:
    model_cfg = compose_config(TINY).model
    with torch.device("meta"):
        model = build_model(model_cfg)
    names = list(model.state_dict())
    compile_blocks(model, CPUAccelerator(), OmegaConf.create({"backend": "eager", "dynamic": False}))
    assert list(model.state_dict()) == names  # no `_orig_mod.`: checkpoints and HF maps still apply
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
    assert model.embed_tokens._compiled_call_impl is None  # embedding, head and loss stay eager
    with pytest.raises(ValueError, match="model.layers"):
        compile_blocks(torch.nn.Linear(2, 2), CPUAccelerator(), OmegaConf.create({"backend": None}))


@pytest.mark.parametrize("collator", ["bucket", "packing"])
def test_warmup_batches_cover_every_shape_with_valid_labels(collator: str) -> None:
    data_cfg = compose_config(TINY + [f"data.collator={collator}", "data.buckets=[16,32,64]"]).data
    rng = torch.get_rng_state()
    collate = build_collator(data_cfg, pad_id=257)
    batches = warmup_batches(collate, batch_shapes(data_cfg), packed=collator == "packing", vocab_size=258)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [tuple(b["input_ids"].shape) for b in batches] == batch_shapes(data_cfg)
    for batch in batches:
        assert (batch["labels"] != -100).all()
        assert ("document_ids" in batch) == (collator == "packing")  # same inputs, same dynamo guards


def test_warmup_compiles_one_graph_per_bucket_and_training_then_never_recompiles(tmp_path: Path) -> None:
    records = _fit(BUCKETS + DYNAMO_ONLY, tmp_path / "compiled")
    warmup = records[0]["compile_warmup"]
    assert [r["shape"] for r in warmup] == [[4, 16], [4, 32], [4, 64]]
    assert [r["graphs"] for r in warmup] == [1, 1, 1]
    assert all(r["train_s"] > 0 and "eval_s" not in r for r in warmup)  # trainer.eval_every=0 in TINY
    last = records[-1]
    assert (last["compile_graphs"], last["compile_recompiles"]) == (3, 0)
    # Warm-up neither stepped the optimizer nor moved the RNG or the data order.
    eager = _fit(BUCKETS, tmp_path / "eager")
    assert _losses(records) == pytest.approx(_losses(eager), abs=1e-6)
    assert "compile_graphs" not in eager[-1]


def test_warmup_leaves_weights_optimizer_and_rng_untouched(tmp_path: Path) -> None:
    trainer = Trainer(compose_config(TINY + BUCKETS + DYNAMO_ONLY, run_dir=tmp_path))
    try:
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        torch.manual_seed(0)  # the restored state must be the pre-warm-up one, whatever it is
        rng = trainer.accelerator.get_rng_state()
        trainer.warmup()
        assert torch.equal(trainer.accelerator.get_rng_state()["cpu"], rng["cpu"])
        assert all(p.grad is None for p in trainer.model.parameters())
        assert not trainer.optimizer.state
        assert all(torch.equal(v, weights[k]) for k, v in trainer.model.state_dict().items())
    finally:
        trainer.close()


def test_warmup_also_compiles_evaluation(tmp_path: Path) -> None:
    records = _fit(BUCKETS + DYNAMO_ONLY + ["trainer.eval_every=2"], tmp_path)
    # Grad mode is part of dynamo's guards: evaluation is a second graph per bucket, compiled up front.
    assert [r["graphs"] for r in records[0]["compile_warmup"]] == [2, 2, 2]
    assert any("eval_loss" in r for r in records)
    assert records[-2]["compile_recompiles"] == 0


class _UnseenShapeTrainer(Trainer):
    """Feeds a sequence length (40) that no bucket has, at the second step."""

    def build_dataloader(self, documents, *, train):
        loader = super().build_dataloader(documents, train=train)
        return _CutSecondBatch(loader) if train else loader


class _CutSecondBatch:
    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            yield {k: v[:, :40] for k, v in batch.items()} if i == 1 else batch


def test_unseen_shape_after_warmup_stops_naming_shape_and_guard(tmp_path: Path) -> None:
    overrides = BUCKETS + DYNAMO_ONLY + ["data.buckets=[64]", "compile.on_recompile=error"]
    with pytest.raises(RecompileError) as err:
        _fit(overrides, tmp_path, _UnseenShapeTrainer)
    message = str(err.value)
    assert "batch shape (4, 40)" in message and "warm-up did not compile" in message
    assert "size mismatch" in message and "expected 64, actual 40" in message  # dynamo's failed guard
    assert "compile.on_recompile=warn" in message  # the fix
    assert issubclass(RecompileError, UserError)  # the CLI prints it without a traceback


def test_unseen_shape_after_warmup_warns_and_continues(tmp_path: Path, caplog) -> None:
    overrides = BUCKETS + DYNAMO_ONLY + ["data.buckets=[64]", "compile.on_recompile=warn"]
    with caplog.at_level(logging.WARNING, logger="portatrain.compile"):
        records = _fit(overrides, tmp_path, _UnseenShapeTrainer)
    assert "batch shape (4, 40)" in caplog.text and "expected 64, actual 40" in caplog.text
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4
    assert [r["compile_recompiles"] for r in steps] == [0, 1, 1, 1]
    assert steps[-1]["compile_graphs"] == 2


def test_warmup_needs_compile_enabled() -> None:
    from portatrain.errors import ConfigError
    from portatrain.validate import validate

    with pytest.raises(ConfigError, match="compile.warmup=true needs compile.enabled=true"):
        validate(compose_config(TINY + ["compile.warmup=true"]))


@pytest.mark.slow
def test_inductor_blocks_train_like_eager(tmp_path: Path, eager_bucket_losses: list[float]) -> None:
    """The CPU default backend: same losses as eager over a few steps, one graph per bucket."""
    compiled = _fit([*BUCKETS, "data.buckets=[32,64]", *WARMUP], tmp_path / "inductor")
    assert [r["graphs"] for r in compiled[0]["compile_warmup"]] == [1, 1]
    assert compiled[-1]["compile_recompiles"] == 0
    assert _losses(compiled) == pytest.approx(eager_bucket_losses, abs=1e-5)


@pytest.mark.parametrize("granularity", ["model", "nested"])
def test_whole_model_granularities_compile_the_model_not_its_blocks(tmp_path: Path, granularity: str) -> None:
    from portatrain.models.llama.model import TransformerBlock

    trainer = make_trainer(["compile.enabled=true", f"compile.granularity={granularity}"], tmp_path)
    try:
        assert trainer.model._compiled_call_impl is not None
        blocks = list(trainer.model.layers.values())
        assert all(block._compiled_call_impl is None for block in blocks)
        names = {name for name, _ in trainer.model.named_parameters()}
        assert "layers.0.self_attn.q_proj.weight" in names  # in place: no _orig_mod. prefix
        assert all(isinstance(block, TransformerBlock) for block in blocks)
        # nested: every block shares one marked subclass (one region to reuse); model: plain blocks.
        assert {type(block) for block in blocks} == (
            {TransformerBlock} if granularity == "model" else {type(blocks[0])}
        )
        assert (type(blocks[0]) is TransformerBlock) == (granularity == "model")
    finally:
        trainer.close()


def test_whole_model_granularities_are_refused_for_a_sharded_model_and_unknown_values_are_named() -> None:
    from portatrain.errors import ConfigError
    from portatrain.validate import validate

    for granularity in ("model", "nested"):
        cfg = OmegaConf.create({"enabled": True, "granularity": granularity})
        assert compile_granularity(cfg, sharded=False) == granularity
        with pytest.raises(ConfigError, match=f"granularity={granularity} .* use compile.granularity=block"):
            compile_granularity(cfg, sharded=True)
        # With compilation off the setting is moot: a sharded run is not refused for it.
        cfg.enabled = False
        assert compile_granularity(cfg, sharded=True) == granularity
    with pytest.raises(ConfigError, match="compile.granularity='layer' is not one of block, model, nested"):
        validate(compose_config(TINY + ["compile.granularity=layer"]))


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["model", "nested"])
def test_whole_model_compile_trains_like_eager_with_one_graph_per_bucket(
    tmp_path: Path, granularity: str, eager_bucket_losses: list[float]
) -> None:
    """``compile.granularity=model|nested`` (the model one graph): the losses of eager, one graph per
    bucket at warm-up, no recompilation after it. For ``nested`` this is also the check on torch's
    reused regions: their wrong gradients under inductor (``scripts/check_nested_compile.py``) would
    show here. ``model`` runs ``aot_eager`` (dynamo and AOT autograd, without inductor's C++ code
    generation: its one graph per bucket is the point, and inductor on blocks is
    ``test_inductor_blocks_train_like_eager``), which saves minutes on 2 cores."""
    backend = ["compile.backend=aot_eager"] if granularity == "model" else []
    overrides = [*BUCKETS, "data.buckets=[32,64]", *WARMUP, *backend, f"compile.granularity={granularity}"]
    compiled = _fit(overrides, tmp_path / granularity)
    assert [r["graphs"] for r in compiled[0]["compile_warmup"]] == [1, 1]
    assert compiled[-1]["compile_recompiles"] == 0
    assert _losses(compiled) == pytest.approx(eager_bucket_losses, abs=1e-5)
