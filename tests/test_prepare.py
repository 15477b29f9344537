"""portatrain prepare: memory-mapped shards, determinism across worker counts, resume, dtype, checksums."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from portatrain.data import prepare as prepare_mod
from portatrain.data.corpus import generate_corpus
from portatrain.data.errors import DataError
from portatrain.data.prepare import main, prepare, token_dtype, verify
from portatrain.data.store import PreparedCorpus
from portatrain.data.tokenizer import build_tokenizer
from tests.test_tokenizer import make_bpe_tokenizer


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_prepared_shards_hold_the_tokenized_documents(tmp_path):
    manifest = prepare(
        ["builtin"], tmp_path / "c", num_documents=300, shard_chars=5000, workers=1, progress=False
    )
    corpus = PreparedCorpus(tmp_path / "c")
    texts = generate_corpus(300)
    tok = build_tokenizer("byte")
    assert corpus.num_documents == manifest["documents"] == 300 and len(manifest["shards"]) > 3
    assert manifest["dtype"] == "uint16" and manifest["tokens"] == sum(len(tok.encode(t)) for t in texts)
    for doc in (0, 137, 299):
        tokens, mask = corpus.read(doc, 0, len(tok.encode(texts[doc])))
        assert tokens.tolist() == tok.encode(texts[doc]) and mask is None
    assert corpus.lengths(np.array([299, 0])).tolist() == [len(tok.encode(texts[i])) for i in (299, 0)]
    verify(tmp_path / "c")


def test_same_input_same_bytes_whatever_the_workers(tmp_path):
    one = prepare(
        ["builtin"], tmp_path / "one", num_documents=400, shard_chars=8000, workers=1, progress=False
    )
    two = prepare(
        ["builtin"], tmp_path / "two", num_documents=400, shard_chars=8000, workers=2, progress=False
    )
    assert one == two
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_interrupted_prepare_resumes_without_redoing_shards(tmp_path, monkeypatch):
    out = tmp_path / "c"
    prepare(["builtin"], out, num_documents=300, shard_chars=5000, workers=1, progress=False)
    reference = _files(out)
    # Simulate a crash after shard 2: the manifest, later shards and a half-written file are missing.
    (out / "manifest.json").unlink()
    for p in out.glob("shard_*"):
        if int(p.name[6:11]) > 2:
            p.unlink()
    (out / "shard_00003.bin.tmp").write_bytes(b"partial")
    written = []
    real = prepare_mod._write_shard
    monkeypatch.setattr(prepare_mod, "_write_shard", lambda *a: written.append(a[1]) or real(*a))
    prepare(["builtin"], out, num_documents=300, shard_chars=5000, workers=1, progress=False)
    assert 0 not in written and 2 not in written and 3 in written
    assert {k: v for k, v in _files(out).items() if not k.endswith(".tmp")} == reference
    # Other settings over an interrupted or finished prepare are refused.
    with pytest.raises(DataError, match="prepared with other settings"):
        prepare(["builtin"], out, num_documents=301, shard_chars=5000, workers=1, progress=False)
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match="interrupted prepare with other settings"):
        prepare(["builtin"], out, num_documents=301, shard_chars=5000, workers=1, progress=False)


def test_not_empty_out_dir_is_refused(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="exists and is not empty"):
        prepare(["builtin"], tmp_path / "c", num_documents=10, progress=False)


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(258) == np.uint16 and token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32 and token_dtype(128_256) == np.uint32


def test_bpe_tokenizer_and_fine_tuning_mask(tmp_path):
    tok_dir = make_bpe_tokenizer(tmp_path / "tok")
    records = tmp_path / "sft.jsonl"
    records.write_text(
        "".join(
            json.dumps({"prompt": f"Q{i}: what is {i}+{i}?", "response": f" {2 * i}."}) + "\n"
            for i in range(40)
        )
    )
    manifest = prepare(
        [str(records)],
        tmp_path / "c",
        tokenizer=str(tok_dir),
        format="prompt_response",
        workers=1,
        progress=False,
    )
    corpus = PreparedCorpus(tmp_path / "c")
    assert manifest["has_mask"] and manifest["tokenizer"]["vocab_size"] == 400
    tok = build_tokenizer(str(tok_dir))
    tokens, mask = corpus.read(3, 0, int(corpus.lengths(np.array([3]))[0]))
    response = tok.encode(" 6.", bos=False, eos=True)
    assert tokens.tolist()[-len(response) :] == response
    assert mask.tolist() == [0] * (len(tokens) - len(response)) + [1] * len(response)


def test_damaged_corpus_is_detected(tmp_path):
    prepare(["builtin"], tmp_path / "c", num_documents=50, workers=1, progress=False)
    shard = tmp_path / "c" / "shard_00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum mismatch"):
        verify(tmp_path / "c")
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="wrong size"):
        PreparedCorpus(tmp_path / "c")


def test_empty_input_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([str(empty), "--out", str(tmp_path / "c"), "--workers", "1"]) == 2
    assert "holds no documents" in capsys.readouterr().err


def test_cli_prints_the_counts(tmp_path, capsys):
    assert (
        main(["builtin", "--num-documents", "20", "--out", str(tmp_path / "c"), "--workers", "1", "--verify"])
        == 0
    )
    assert "prepared 20 documents" in capsys.readouterr().out


def test_progress_in_a_log_is_plain_lines_not_bar_frames(tmp_path, capsys):
    # pytest's captured stderr is not a terminal: what a SLURM log or `> file` gets.
    prepare(["builtin"], tmp_path / "c", num_documents=300, shard_chars=5000, workers=1, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("prepare c: shard ")]
    assert len(lines) >= 2 and lines[-1].endswith(" tokens")
