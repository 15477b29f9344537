"""build_dataloader end to end: static shapes, last batch, token accounting, rank slicing, resume."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

from portatrain.config import DataConfig
from portatrain.data.collate import IGNORE_INDEX, OverlongError, loss_token_count
from portatrain.data.loader import batch_shapes, build_dataloader

BOS, EOS, PAD = 256, 257, 257
COLLATORS = ("bucket", "packing", "pad_to_max")


def _documents(n: int = 300, seed: int = 0) -> list[list[int]]:
    """Long-tailed document lengths, some beyond the largest bucket (to exercise overlong=split)."""
    rng = random.Random(seed)
    lengths = [min(int(rng.lognormvariate(3.5, 0.9)) + 2, 400) for _ in range(n)]
    return [[BOS] + [rng.randrange(256) for _ in range(k - 2)] + [EOS] for k in lengths]


def _cfg(collator: str = "bucket", **kw) -> DataConfig:
    kw = {"seq_len": 128, "buckets": [32, 64, 128], "batch_size": 4, "group_size_multiplier": 4, **kw}
    return DataConfig(collator=collator, **kw)


def _loader(cfg: DataConfig, docs=None, **kw):
    return build_dataloader(
        cfg, _documents() if docs is None else docs, pad_id=PAD, seed=kw.pop("seed", 7), **kw
    )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_batch_shapes_lists_one_shape_per_bucket_or_one():
    assert batch_shapes(_cfg("bucket")) == [(4, 32), (4, 64), (4, 128)]
    assert batch_shapes(_cfg("packing")) == [(4, 128)]
    assert batch_shapes(_cfg("pad_to_max")) == [(4, 128)]


@pytest.mark.parametrize("collator", COLLATORS)
@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_every_batch_has_a_listed_shape(collator, last_batch):
    cfg = _cfg(collator, last_batch=last_batch)
    allowed = set(batch_shapes(cfg))
    seen = set()
    for batch in itertools.islice(_loader(cfg, dp_rank=1, dp_world_size=2), 200):  # > 2 epochs
        shape = tuple(batch["input_ids"].shape)
        assert shape in allowed
        seen.add(shape)
        assert batch["labels"].shape == batch["positions"].shape == batch["input_ids"].shape
        assert batch["input_ids"].dtype == batch["labels"].dtype == batch["positions"].dtype == torch.long
        assert "attn_mask" not in batch, "the mask is built on the device, from document_ids"
        if collator == "packing":
            assert batch["document_ids"].shape == shape and batch["document_ids"].dtype == torch.int32
        else:
            assert "document_ids" not in batch
    assert seen == allowed, "this data uses every bucket"


@pytest.mark.parametrize("collator", COLLATORS)
def test_an_epoch_predicts_every_token_exactly_once(collator):
    """With overlong=split and last_batch=pad, no label is lost, duplicated or invented."""
    docs = _documents()
    loader = _loader(_cfg(collator, last_batch="pad", sampler="sequential"), docs, infinite=False)
    labels = [batch["labels"] for batch in loader]
    assert sum(int((lab != IGNORE_INDEX).sum()) for lab in labels) == sum(len(d) - 1 for d in docs)
    assert sum(int(loss_token_count({"labels": lab})) for lab in labels) == sum(len(d) - 1 for d in docs)
    if collator != "packing":  # unpacked sequential order: the first row is document 0
        assert labels[0][0, : len(docs[0]) - 1].tolist() == docs[0][1:]


def test_last_batch_drop_versus_pad():
    docs = _documents(30)  # 30 short documents, batch 4: 7 full batches and 2 left over
    docs = [d[:20] for d in docs]
    dropped = list(_loader(_cfg("pad_to_max", last_batch="drop"), docs, infinite=False))
    padded = list(_loader(_cfg("pad_to_max", last_batch="pad"), docs, infinite=False))
    assert len(dropped) == 7 and len(padded) == 8
    assert all(b["input_ids"].shape == (4, 128) for b in dropped + padded)
    last = padded[-1]
    real_rows = (last["labels"] != IGNORE_INDEX).any(dim=1)
    assert real_rows.tolist() == [True, True, False, False]
    assert (last["input_ids"][2:] == PAD).all(), "filler rows are fully masked pad rows"


@pytest.mark.parametrize("collator", ["pad_to_max", "packing"])
def test_two_ranks_of_b_equal_one_rank_of_2b(collator):
    cfg = _cfg(collator, last_batch="pad")
    single = list(itertools.islice(_loader(replace(cfg, batch_size=8)), 60))
    ranks = [list(itertools.islice(_loader(cfg, dp_rank=r, dp_world_size=2), 60)) for r in range(2)]
    for step, (whole, a, b) in enumerate(zip(single, *ranks)):
        joined = {k: torch.cat([a[k], b[k]]) for k in a}
        assert _same(joined, whole), f"step {step}"


def test_ranks_of_a_bucketed_loader_share_the_global_batch_rows():
    # Each rank pads its slice to its own bucket, so compare the real tokens row by row.
    cfg = _cfg("bucket")
    single = list(itertools.islice(_loader(replace(cfg, batch_size=8)), 30))
    ranks = [list(itertools.islice(_loader(cfg, dp_rank=r, dp_world_size=2), 30)) for r in range(2)]

    def rows(batch):
        return [row[lab != IGNORE_INDEX].tolist() for row, lab in zip(batch["input_ids"], batch["labels"])]

    for whole, a, b in zip(single, *ranks):
        assert rows(a) + rows(b) == rows(whole)


@pytest.mark.parametrize(
    "collator,num_workers,k",
    [("bucket", 0, 5), ("bucket", 0, 80), ("packing", 0, 7), ("pad_to_max", 2, 9)],
)
def test_stateful_loader_resumes_the_exact_remaining_batches(collator, num_workers, k):
    cfg = _cfg(collator, num_workers=num_workers, last_batch="pad")
    total = k + 12
    reference = list(itertools.islice(_loader(cfg), total))  # crosses an epoch when k=80

    loader = _loader(cfg)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    state = loader.state_dict()
    del it, loader

    fresh = _loader(cfg)
    fresh.load_state_dict(state)
    tail = list(itertools.islice(fresh, total - k))
    assert all(_same(a, b) for a, b in zip(head + tail, reference, strict=True))


def test_resuming_with_different_documents_is_refused():
    loader = _loader(_cfg())
    next(iter(loader))
    state = loader.state_dict()
    other = _loader(_cfg(), _documents(250))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="num_examples"):
        next(iter(other))


def test_overlong_error_names_the_limit_of_the_collator():
    docs = _documents()
    with pytest.raises(OverlongError, match=r"more than data.seq_len \(128\).*raise data.seq_len to >= "):
        _loader(_cfg("packing", overlong="error"), docs)
    with pytest.raises(OverlongError, match=r"more than the largest bucket \(128\).*add a bucket >= "):
        _loader(_cfg("bucket", overlong="error"), docs)
    batch = next(iter(_loader(_cfg("bucket", overlong="truncate"), docs)))
    assert batch["input_ids"].shape[1] in (32, 64, 128)
