"""The packed-document mask is built on the device by the Trainer, from the loader's document ids:
every hook sees ``attn_mask``, a hand-written forward that passes it trains the same, and the
compile warm-up's batches match the real ones (no recompilation)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from portatrain.data.collate import document_causal_mask
from portatrain.trainer import Trainer
from tests.helpers import fit, losses, read_metrics

STEPS = ["trainer.steps=3", "checkpoint.enabled=false", "data.collator=packing"]


class _Recording(Trainer):
    """Keeps every micro-batch ``forward_loss`` receives."""

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.seen.append(batch)
        return super().forward_loss(batch)

    seen: list[dict[str, torch.Tensor]] = []


class _ByHand(Trainer):
    """A research subclass written against the documented call: the model with the batch's mask."""

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(
            batch["input_ids"], positions=batch.get("positions"), attn_mask=batch.get("attn_mask")
        )
        return self.compute_loss(logits, batch)


class _NoMask(Trainer):
    """The same forward without the mask: documents of a row see each other."""

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(batch["input_ids"], positions=batch.get("positions"))
        return self.compute_loss(logits, batch)


def test_every_hook_sees_the_document_mask_built_on_the_device(tmp_path: Path) -> None:
    _Recording.seen = []
    trainer = fit([*STEPS, "data.packing_attention=document"], tmp_path, _Recording)
    assert len(_Recording.seen) == 3
    several = 0
    for batch in _Recording.seen:
        ids, mask = batch["document_ids"], batch["attn_mask"]
        assert mask.shape == (4, 1, 64, 64) and mask.dtype == torch.bool
        assert mask.device == ids.device == trainer.device
        assert torch.equal(mask, document_causal_mask(ids))
        real = [row[labels != -100] for row, labels in zip(ids, batch["labels"])]
        several += sum(len(row.unique()) > 1 for row in real)  # rows holding two documents or more
    assert several > 0, "the data packs several documents into a row, so the mask is not plain causal"


def test_causal_packing_sends_no_mask(tmp_path: Path) -> None:
    _Recording.seen = []
    fit([*STEPS, "data.packing_attention=causal"], tmp_path, _Recording)
    assert _Recording.seen and all("attn_mask" not in b and "document_ids" not in b for b in _Recording.seen)


def test_a_subclass_passing_batch_attn_mask_trains_as_before(tmp_path: Path) -> None:
    fit(STEPS, tmp_path / "base")
    fit(STEPS, tmp_path / "by_hand", _ByHand)
    fit(STEPS, tmp_path / "no_mask", _NoMask)
    base, by_hand, no_mask = (losses(tmp_path / name) for name in ("base", "by_hand", "no_mask"))
    assert by_hand == pytest.approx(base, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(no_mask, base)) > 1e-4, (
        "sensitive: without the mask the loss moves (at step 2: batch 1 has no row with two documents)"
    )


@pytest.fixture()
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_warmup_batches_match_real_packed_batches(tmp_path: Path, fresh_dynamo: None) -> None:
    """One graph per shape from warm-up's one-document rows; real rows (several documents, the mask
    built the same way on the device) never recompile."""
    fit(
        [
            *STEPS,
            "compile.enabled=true",
            "compile.warmup=true",
            "compile.dynamic=false",
            "compile.backend=eager",
            "compile.on_recompile=error",
        ],
        tmp_path,
    )
    records = read_metrics(tmp_path)
    assert [r["graphs"] for r in records[0]["compile_warmup"]] == [1]
    assert records[-1]["compile_recompiles"] == 0
