"""Collators, overlong policies and packing: shapes, contents, masks, and loss parity with a model."""

from __future__ import annotations

import random

import pytest
import torch

from portatrain.data.collate import (
    IGNORE_INDEX,
    OverlongError,
    PackingCollator,
    PadCollator,
    document_causal_mask,
    fit_documents,
    loss_token_count,
    padding_stats,
    select_bucket,
    with_attention_mask,
)
from portatrain.data.packing import pack_documents, packing_efficiency

BOS, EOS, PAD = 256, 257, 257


def _doc(n_tokens: int, rng: random.Random) -> list[int]:
    """A document of ``n_tokens`` tokens (occupying ``n_tokens - 1`` positions)."""
    return [BOS] + [rng.randrange(256) for _ in range(n_tokens - 2)] + [EOS]


def _docs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [_doc(n, rng) for n in lengths]


def test_select_bucket_picks_the_smallest_that_fits():
    buckets = [64, 128, 256]
    assert [select_bucket(n, buckets) for n in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]
    with pytest.raises(OverlongError, match="257 positions.*largest bucket is 256"):
        select_bucket(257, buckets)


def test_pad_collator_pads_to_the_bucket_of_the_longest_example():
    docs = _docs([5, 65])  # 4 and 64 positions: a 65-token document fits bucket 64 exactly
    batch = PadCollator([64, 128], batch_size=2, pad_id=PAD)(docs)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (2, 64),
        "labels": (2, 64),
        "positions": (2, 64),
    }
    assert batch["input_ids"][0, :4].tolist() == docs[0][:-1]
    assert batch["labels"][0, :4].tolist() == docs[0][1:]
    assert (batch["input_ids"][0, 4:] == PAD).all() and (batch["labels"][0, 4:] == IGNORE_INDEX).all()
    assert batch["input_ids"][1].tolist() == docs[1][:-1] and batch["labels"][1].tolist() == docs[1][1:]
    assert batch["positions"][1].tolist() == list(range(64))
    assert int(loss_token_count(batch)) == 4 + 64
    one_more = PadCollator([64, 128], batch_size=2, pad_id=PAD)(_docs([5, 66]))
    assert one_more["input_ids"].shape == (2, 128)


def test_pad_collator_fills_a_short_batch_with_fully_masked_rows():
    batch = PadCollator([16], batch_size=4, pad_id=PAD)(_docs([10]))
    assert batch["input_ids"].shape == (4, 16)
    assert (batch["labels"][1:] == IGNORE_INDEX).all() and (batch["input_ids"][1:] == PAD).all()
    assert padding_stats(batch) == {"real_tokens": 9, "total_tokens": 64, "pad_fraction": 1 - 9 / 64}
    empty = PadCollator([16, 32], batch_size=4, pad_id=PAD)([])  # a rank's empty share of the last batch
    assert empty["input_ids"].shape == (4, 16) and int(loss_token_count(empty)) == 0


def test_overlong_truncate_keeps_the_first_max_positions_plus_one_tokens():
    doc = _docs([300])[0]
    assert fit_documents([doc], 256, "truncate") == [doc[:257]]


def test_overlong_split_predicts_every_token_exactly_once():
    doc = _docs([600])[0]  # 599 positions -> 256 + 256 + 87
    pieces = fit_documents([doc], 256, "split")
    assert [len(p) - 1 for p in pieces] == [256, 256, 87]
    assert sum((p[1:] for p in pieces), []) == doc[1:], "labels of the pieces must be the document's, once"
    assert sum((p[:-1] for p in pieces), []) == doc[:-1]
    exact = _docs([257])[0]  # 256 positions: fits, not split
    assert fit_documents([exact], 256, "split") == [exact]


def test_overlong_error_names_the_document_its_length_the_limit_and_the_fix():
    docs = _docs([10, 20, 300, 900])
    with pytest.raises(OverlongError) as info:
        fit_documents(docs, 256, "error")
    message = str(info.value)
    for part in (
        "document 2 has 300 tokens = 299 positions",
        "the largest bucket (256)",
        "2 of 4 documents are overlong",
        "the longest needs 899 positions",
        "add a bucket >= 899 to data.buckets",
        "data.overlong=split",
    ):
        assert part in message, f"{part!r} missing from: {message}"
    assert fit_documents(docs[:2], 256, "error") == docs[:2]


def test_documents_with_nothing_to_predict_are_dropped():
    assert fit_documents([[EOS], [], [BOS, EOS]], 8, "split") == [[BOS, EOS]]


def test_pack_documents_best_fit_is_complete_bounded_and_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(1, 200) for _ in range(500)]
    rows = pack_documents(lengths, 256)
    assert sorted(sum(rows, [])) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 256 for row in rows)
    assert rows == pack_documents(lengths, 256)
    efficiency = packing_efficiency(lengths, rows, 256)
    assert efficiency > 0.97, efficiency  # measured 0.99; next-fit in document order gets ~0.7
    with pytest.raises(ValueError, match="document 1 has length 300"):
        pack_documents([10, 300], 256)


def _packed_batch():
    docs = _docs([4, 6, 3, 9])  # positions 3, 5, 2, 8
    rows = [[docs[0], docs[1]], [docs[2], docs[3]]]  # 8 and 10 positions in rows of 12
    return docs, PackingCollator(seq_len=12, batch_size=3, pad_id=PAD)(rows)


def test_packing_restarts_positions_and_never_labels_across_documents():
    docs, batch = _packed_batch()
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (3, 12),
        "labels": (3, 12),
        "positions": (3, 12),
        "document_ids": (3, 12),  # the loader never builds the [B, 1, S, S] mask
    }
    assert batch["document_ids"].dtype == torch.int32
    assert batch["document_ids"][0].tolist() == [0] * 3 + [1] * 5 + [2] * 4  # the pad tail is one more
    assert batch["document_ids"][2].tolist() == [0] * 12  # a filler row: one all-pad document
    assert batch["positions"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]  # pad tail restarts too
    assert batch["input_ids"][0, :8].tolist() == docs[0][:-1] + docs[1][:-1]
    assert batch["labels"][0].tolist() == docs[0][1:] + docs[1][1:] + [IGNORE_INDEX] * 4
    assert (batch["labels"][2] == IGNORE_INDEX).all(), "the filler row is fully masked"
    assert int(loss_token_count(batch)) == 3 + 5 + 2 + 8


def test_packing_mask_is_block_diagonal_causal():
    _, batch = _packed_batch()
    full = with_attention_mask(batch)["attn_mask"]
    assert full.shape == (3, 1, 12, 12) and full.dtype == torch.bool
    mask = full[0, 0]
    # Written out by hand, block by block (3, 5 and 4 positions), not by the function under test.
    expected = torch.zeros(12, 12, dtype=torch.bool)
    for start, n in ((0, 3), (3, 5), (8, 4)):
        expected[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    assert not mask[3, 2] and mask[4, 3] and not mask[3, 4], "no attention across a document or to the future"
    assert full.any(dim=-1).all(), "every query attends to something (no NaN rows in SDPA)"
    assert torch.equal(full[2, 0], torch.ones(12, 12, dtype=torch.bool).tril()), "a filler row is causal"


def test_with_attention_mask_leaves_other_batches_alone_and_checks_the_shape():
    docs, packed = _packed_batch()
    padded = PadCollator([16], batch_size=2, pad_id=PAD)(docs[:2])
    assert with_attention_mask(padded) is padded  # bucket/pad batches keep SDPA's is_causal path
    assert "attn_mask" not in packed, "the mask is added to a new dict; the loader's batch is not changed"
    given = torch.zeros(3, 1, 12, 12, dtype=torch.bool)
    assert with_attention_mask({**packed, "attn_mask": given})["attn_mask"] is given
    with pytest.raises(ValueError, match=r"\[batch, seq\], got shape \(12,\)"):
        document_causal_mask(packed["document_ids"][0])


# --- Loss parity with a real model -------------------------------------------------------------
# Padding and packing must not change what the model computes for the real tokens.


@pytest.fixture(scope="module")
def llama():
    from dataclasses import replace

    from portatrain.models.llama.model import LLAMA3_FLAVORS, Llama

    torch.manual_seed(0)
    model = Llama(replace(LLAMA3_FLAVORS["debug"], n_layers=2))
    # A wider init than training's 0.02 gives attention sharp, position-dependent weights, so a token
    # that saw a pad or another document moves the logits by ~5, far beyond the tolerance (measured
    # fp32 noise: <= 3.5e-6 on the logits, whose magnitude is up to ~6).
    model.init_weights(std=0.1)
    return model.eval()


def _summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Per-token losses in fp32 (as training computes them), summed in fp64: a loss near 5.5 has an
    # fp32 ulp of 4.8e-7, so an fp32 sum in a different order alone could use up the 1e-6 budget.
    per_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return per_token.double().sum()


def _one_by_one(model, docs):
    """Each document alone, unpadded, default positions and plain causal attention."""
    logits = [model(torch.tensor([doc[:-1]]))[0] for doc in docs]
    loss = sum(_summed_loss(lg[None], torch.tensor([doc[1:]])) for lg, doc in zip(logits, docs))
    return logits, loss / sum(len(doc) - 1 for doc in docs)


def test_padded_batch_loss_equals_the_unpadded_loss(llama):
    docs = _docs([11, 38, 65, 6, 50])
    batch = PadCollator([32, 64], batch_size=6, pad_id=PAD)(docs)  # bucket 64, plus one filler row
    assert batch["input_ids"].shape == (6, 64)
    logits = llama(batch["input_ids"], positions=batch["positions"])
    loss = _summed_loss(logits, batch["labels"]) / loss_token_count(batch)
    ref_logits, ref_loss = _one_by_one(llama, docs)
    assert torch.isfinite(logits).all()
    assert abs(loss.item() - ref_loss.item()) <= 1e-6, (loss.item(), ref_loss.item())
    for i, ref in enumerate(ref_logits):
        torch.testing.assert_close(logits[i, : len(ref)], ref, atol=1e-5, rtol=0)


def test_packed_rows_match_the_documents_run_one_by_one(llama):
    docs = _docs([40, 30, 25, 60, 12, 70, 33])
    lengths = [len(d) - 1 for d in docs]
    rows = [[docs[i] for i in row] for row in pack_documents(lengths, 128)]
    assert [len(row) for row in rows] == [4, 2, 1], "rows 0 and 1 hold several documents"
    batch = with_attention_mask(PackingCollator(seq_len=128, batch_size=4, pad_id=PAD)(rows))  # + filler row
    logits = llama(batch["input_ids"], positions=batch["positions"], attn_mask=batch["attn_mask"])
    loss = _summed_loss(logits, batch["labels"]) / loss_token_count(batch)
    ref_logits, ref_loss = _one_by_one(llama, docs)
    assert torch.isfinite(logits).all(), "a fully-masked query row would give NaN"
    assert abs(loss.item() - ref_loss.item()) <= 1e-5, (loss.item(), ref_loss.item())
    where = {id(doc): i for i, doc in enumerate(docs)}
    for r, row in enumerate(rows):
        offset = 0
        for doc in row:
            n = len(doc) - 1
            torch.testing.assert_close(
                logits[r, offset : offset + n], ref_logits[where[id(doc)]], atol=1e-5, rtol=0
            )
            offset += n
    # The test is sensitive: without the document mask (plain causal) the logits move by far more.
    leaky = llama(batch["input_ids"], positions=batch["positions"])
    assert (leaky[:3] - logits[:3]).abs().max() > 1e-2


def test_packed_gradients_are_finite_and_match_one_by_one(llama):
    docs = _docs([20, 9, 31, 14])
    rows = [[docs[0], docs[1]], [docs[2], docs[3]]]
    batch = with_attention_mask(PackingCollator(seq_len=64, batch_size=3, pad_id=PAD)(rows))  # + filler row
    params = [p for p in llama.parameters()]
    loss = _summed_loss(
        llama(batch["input_ids"], positions=batch["positions"], attn_mask=batch["attn_mask"]), batch["labels"]
    ) / loss_token_count(batch)
    grads = torch.autograd.grad(loss, params)
    ref_grads = torch.autograd.grad(_one_by_one(llama, docs)[1], params)
    for g, ref in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-4)


def test_causal_packing_has_no_mask_and_running_positions():
    """``packing_attention=causal``: same tokens and labels, no mask, positions 0..S-1 (fused SDPA path)."""
    docs, document = _packed_batch()
    rows = [[docs[0], docs[1]], [docs[2], docs[3]]]
    causal = PackingCollator(12, 3, PAD, causal=True)(rows)
    assert "attn_mask" not in causal and "document_ids" not in causal
    assert with_attention_mask(causal) is causal
    assert torch.equal(causal["input_ids"], document["input_ids"])
    assert torch.equal(causal["labels"], document["labels"])
    assert causal["positions"].tolist() == [list(range(12))] * 3
