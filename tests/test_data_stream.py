"""The streaming loader over prepared shards: shapes, every token once, exact resume (also on another
number of ranks), per-rank reads, prefetch order, fine-tuning labels, packing attention, clear errors."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from portatrain.config import DataConfig
from portatrain.data.collate import IGNORE_INDEX, OverlongError, with_attention_mask
from portatrain.data.errors import DataError
from portatrain.data.pipeline import build_data
from portatrain.data.prepare import prepare
from portatrain.data.store import MemoryCorpus, PreparedCorpus
from portatrain.data.stream import StreamingLoader, _prefetched
from tests.helpers import make_trainer

PAD = 257
COLLATORS = ("packing", "bucket", "pad_to_max")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stream") / "corpus"
    prepare(["builtin"], out, num_documents=600, shard_chars=15_000, workers=1, progress=False)
    return out


def _loader(corpus, collator="packing", **kw) -> StreamingLoader:
    kw = {
        "batch_size": 4,
        "seq_len": 128,
        "buckets": [32, 64, 128],
        "pad_id": PAD,
        "seed": 7,
        "group_size_multiplier": 4,
        **kw,
    }
    return StreamingLoader(corpus, collator=collator, **kw)


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("collator", COLLATORS)
def test_every_batch_has_a_listed_shape(corpus_dir, collator):
    corpus = PreparedCorpus(corpus_dir)
    allowed = {(4, 32), (4, 64), (4, 128)} if collator == "bucket" else {(4, 128)}
    seen = set()
    for batch in itertools.islice(_loader(corpus, collator, dp_rank=1, dp_world_size=2), 150):  # > 1 epoch
        shape = tuple(batch["input_ids"].shape)
        assert shape in allowed
        seen.add(shape)
        assert batch["labels"].shape == batch["positions"].shape == batch["input_ids"].shape
        assert all(batch[k].dtype == torch.long for k in ("input_ids", "labels", "positions"))
        assert "attn_mask" not in batch, "the mask is built on the device, from document_ids"
        if collator == "packing":
            ids = batch["document_ids"]
            assert ids.shape == (4, 128) and ids.dtype == torch.int32
            assert (ids.diff(dim=1) >= 0).all() and (ids[:, 0] == 0).all(), "numbered from each row's start"
            assert with_attention_mask(batch)["attn_mask"].any(-1).all(), "every query attends to itself"
        else:
            assert "document_ids" not in batch
    assert seen == allowed


@pytest.mark.parametrize("collator", COLLATORS)
@pytest.mark.parametrize("sampler", ["sequential", "length_grouped"])
def test_an_epoch_predicts_every_token_exactly_once(corpus_dir, collator, sampler):
    corpus = PreparedCorpus(corpus_dir)
    loader = _loader(corpus, collator, sampler=sampler, last_batch="pad", infinite=False, prefetch=0)
    labels = [b["labels"] for b in loader]
    assert sum(int((lab != IGNORE_INDEX).sum()) for lab in labels) == corpus.num_tokens - corpus.num_documents
    # Label multiset equals the corpus's tokens minus each document's first (BOS).
    got = torch.cat([lab[lab != IGNORE_INDEX] for lab in labels]).bincount(minlength=258)
    want = np.zeros(258, dtype=np.int64)
    for doc in range(corpus.num_documents):
        tokens, _ = corpus.read(doc, 0, int(corpus.lengths(np.array([doc]))[0]))
        want += np.bincount(np.asarray(tokens[1:], dtype=np.int64), minlength=258)
    assert got.tolist() == want.tolist()


def test_packing_rows_are_dense_and_documents_stay_apart(corpus_dir):
    corpus = PreparedCorpus(corpus_dir)
    batches = list(itertools.islice(_loader(corpus, "packing"), 40))
    real = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    assert real / (40 * 4 * 128) > 0.9, "online best-fit packing wastes under 10%"
    b = batches[0]
    mask, pos, ids = with_attention_mask(b)["attn_mask"][0, 0], b["positions"][0], b["document_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist()
    assert len(starts) >= 2
    s = starts[1]
    assert not mask[s, s - 1] and mask[s, s] and mask[s - 1, 0]  # no attention across the boundary
    # A new document id exactly where positions restart (the pad tail included).
    assert (ids.diff() != 0).nonzero().flatten().add(1).tolist() == starts[1:]


@pytest.mark.parametrize("collator", COLLATORS)
def test_resume_is_exact_mid_epoch_and_across_epochs(corpus_dir, collator):
    corpus = PreparedCorpus(corpus_dir)
    reference = list(itertools.islice(_loader(corpus, collator), 120))
    for stop in (1, 17, 60):  # 60 crosses an epoch boundary for this corpus
        first = _loader(corpus, collator)
        it = iter(first)
        for _ in range(stop):
            next(it)
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
        resumed = _loader(corpus, collator, prefetch=0)
        resumed.load_state_dict(state)
        for ref, got in zip(reference[stop : stop + 30], resumed):
            assert _same(ref, got)


@pytest.mark.parametrize("collator", ["packing", "pad_to_max"])
def test_two_ranks_see_the_rows_one_rank_sees_and_resume_across_world_sizes(corpus_dir, collator):
    corpus = PreparedCorpus(corpus_dir)
    one = _loader(corpus, collator, batch_size=4)
    it = iter(one)
    single = [next(it) for _ in range(30)]
    state = one.state_dict()
    after = [next(it) for _ in range(10)]
    ranks = [_loader(corpus, collator, batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    for r, loader in enumerate(ranks):
        for ref, got in zip(single, loader):
            assert _same({k: v[2 * r : 2 * r + 2] for k, v in ref.items()}, got)
    for r in range(2):  # a 1-rank checkpoint continues on 2 ranks
        loader = _loader(corpus, collator, batch_size=2, dp_rank=r, dp_world_size=2)
        loader.load_state_dict(state)
        for ref, got in zip(after, loader):
            assert _same({k: v[2 * r : 2 * r + 2] for k, v in ref.items()}, got)


def test_a_changed_data_order_is_refused(corpus_dir):
    corpus = PreparedCorpus(corpus_dir)
    loader = _loader(corpus)
    next(iter(loader))
    with pytest.raises(ValueError, match=r"global_batch_size: saved 4, now 8"):
        _loader(corpus, batch_size=8).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="not a streaming loader's"):
        _loader(corpus).load_state_dict({"_index_sampler_state": {}})


def test_each_rank_reads_only_its_rows(corpus_dir):
    corpus = PreparedCorpus(corpus_dir)
    reads: dict[int, set[tuple[int, int, int]]] = {0: set(), 1: set()}
    for r in range(2):
        loader = _loader(corpus, "pad_to_max", batch_size=2, dp_rank=r, dp_world_size=2, prefetch=0)
        real_read = loader.corpus.read

        def spy(doc, s, e, r=r, real_read=real_read):
            reads[r].add((doc, s, e))
            return real_read(doc, s, e)

        loader.corpus = type("Spy", (), {"read": staticmethod(spy), "lengths": corpus.lengths, "name": "x"})()
        for _ in itertools.islice(loader, 20):
            pass
    assert len(reads[0]) == len(reads[1]) == 20 * 2 and not reads[0] & reads[1]


def test_prefetch_does_not_change_the_order(corpus_dir):
    corpus = PreparedCorpus(corpus_dir)
    a = list(itertools.islice(_loader(corpus, prefetch=0), 50))
    b = list(itertools.islice(_loader(corpus, prefetch=4), 50))
    assert all(_same(x, y) for x, y in zip(a, b))


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "portatrain-prefetch" and t.is_alive()]


def test_closing_the_stream_joins_its_prefetch_thread_mid_batch():
    """A prefetch thread left running at interpreter exit inside a torch op aborts the process
    ("terminate called without an active exception") after a run that finished: closing the
    iterator must wait for the batch being built and end the thread."""
    building = threading.Event()

    def slow_batches():
        while True:
            building.set()
            time.sleep(0.2)  # the batch being built when the consumer leaves
            yield torch.zeros(2)

    it = _prefetched(slow_batches(), 1)
    next(it)
    building.clear()
    assert building.wait(5)  # the producer is inside the next batch
    it.close()
    assert not _prefetch_threads()


def test_fit_ends_the_prefetch_thread(corpus_dir, tmp_path):
    trainer = make_trainer([f"data.dataset={corpus_dir}", "checkpoint.enabled=false"], tmp_path / "run")
    try:
        trainer.fit()
        assert not _prefetch_threads()
    finally:
        trainer.close()


def test_first_batch_reads_one_window_not_the_corpus(corpus_dir):
    corpus = PreparedCorpus(corpus_dir)
    asked: list[int] = []
    real = corpus.lengths
    corpus.lengths = lambda ids: asked.append(len(ids)) or real(ids)
    next(iter(_loader(corpus, prefetch=0)))
    assert sum(asked) <= 4 * 4 < corpus.num_documents  # batch * group_size_multiplier documents


def test_causal_packing_has_no_mask_and_running_positions(corpus_dir):
    corpus = PreparedCorpus(corpus_dir)
    doc = next(iter(_loader(corpus, packing_attention="document", prefetch=0)))
    causal = next(iter(_loader(corpus, packing_attention="causal", prefetch=0)))
    assert "attn_mask" not in causal and "document_ids" not in causal
    assert causal["positions"][0].tolist() == list(range(128))
    assert torch.equal(doc["input_ids"], causal["input_ids"]) and torch.equal(doc["labels"], causal["labels"])


def test_fine_tuning_labels_only_the_response(tmp_path):
    records = tmp_path / "sft.jsonl"
    records.write_text(
        "".join(json.dumps({"prompt": "Q" * 5, "response": "A" * 3}) + "\n" for _ in range(20))
    )
    prepare([str(records)], tmp_path / "c", format="prompt_response", workers=1, progress=False)
    for collator in ("packing", "bucket"):
        batch = next(
            iter(_loader(PreparedCorpus(tmp_path / "c"), collator, batch_size=2, seq_len=32, buckets=[16]))
        )
        labelled = batch["labels"][batch["labels"] != IGNORE_INDEX]
        assert set(labelled.tolist()) == {ord("A"), 257}  # response tokens and EOS only
        assert len(labelled) == 4 * int((labelled == 257).sum()) > 0  # 3 response tokens + EOS each


def test_overlong_error_names_the_document(corpus_dir):
    with pytest.raises(OverlongError, match=r"document \d+ of .* more than data.seq_len \(16\)"):
        next(iter(_loader(PreparedCorpus(corpus_dir), seq_len=16, overlong="error", prefetch=0)))


def test_fewer_documents_than_a_batch_is_a_clear_error():
    tiny = MemoryCorpus([(np.array([256, 1, 2, 257]), None)], name="tiny.jsonl")
    with pytest.raises(
        DataError, match=r"tiny.jsonl: 1 document\(s\) make 1 packed rows, fewer than one global batch"
    ):
        next(iter(_loader(tiny)))
    # With last_batch=pad a single tiny document still trains: one real row, the rest masked.
    batch = next(iter(_loader(tiny, last_batch="pad")))
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == 3


def test_bad_settings_are_reported_together():
    tiny = MemoryCorpus([(np.array([256, 1, 257]), None)])
    with pytest.raises(DataError) as err:
        _loader(tiny, "bucket", buckets=[], group_size_multiplier=0, seq_len=1, last_batch="keep")
    for needle in ("data.buckets=[]", "group_size_multiplier=0", "data.seq_len=1", "data.last_batch='keep'"):
        assert needle in str(err.value)


def test_pipeline_streams_a_prepared_corpus_and_holds_out_its_tail(corpus_dir, tmp_path):
    from tests.test_tokenizer import make_bpe_tokenizer

    cfg = DataConfig(dataset=str(corpus_dir), batch_size=4, seq_len=128, eval_fraction=0.1)
    data = build_data(cfg, seed=1)
    assert data.streaming and data.train_range == (0, 540) and data.eval_range == (540, 600)
    assert next(iter(data.train_loader()))["input_ids"].shape == (4, 128)
    evals = list(data.eval_loader())
    assert sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in evals) > 0
    with pytest.raises(DataError, match="was prepared with tokenizer 'byte'"):
        build_data(
            DataConfig(dataset=str(corpus_dir), tokenizer=str(make_bpe_tokenizer(tmp_path / "t"))), seed=1
        )
