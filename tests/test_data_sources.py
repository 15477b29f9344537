"""Data sources: every local format, directories, globs, HF datasets, mixing, and bad data as clear errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from portatrain.data.config import config_problems
from portatrain.data.documents import encode_payloads, iter_payloads
from portatrain.data.errors import DataError
from portatrain.data.sources import expand_source, iter_mixed
from portatrain.data.tokenizer import ByteTokenizer

TEXTS = ["first document", "second one\nwith two lines", "third"]


def _write_all_formats(d: Path) -> dict[str, Path]:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    files = {
        "jsonl": d / "a.jsonl",
        "json": d / "b.json",
        "txt": d / "c.txt",
        "parquet": d / "d.parquet",
        "arrow": d / "e.arrow",
    }
    files["jsonl"].write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    files["json"].write_text(json.dumps({"rows": [{"text": t} for t in TEXTS]}))
    files["txt"].write_text("\n\n".join(TEXTS) + "\n")
    table = pa.table({"text": TEXTS, "n": list(range(len(TEXTS)))})
    pq.write_table(table, files["parquet"])
    with pa.ipc.new_stream(str(files["arrow"]), table.schema) as writer:  # datasets' save_to_disk format
        writer.write_table(table)
    return files


def _texts(spec: str, **kw) -> list[str]:
    return [payload for _, payload in iter_payloads([spec], **kw)]


@pytest.mark.parametrize("kind", ["jsonl", "json", "txt", "parquet", "arrow"])
def test_each_local_format_reads_its_documents(tmp_path, kind):
    files = _write_all_formats(tmp_path)
    assert _texts(str(files[kind])) == TEXTS


def test_directories_and_globs_read_files_in_sorted_order(tmp_path):
    _write_all_formats(tmp_path / "data")
    assert _texts(str(tmp_path / "data")) == TEXTS * 5
    assert _texts(str(tmp_path / "data" / "*.json*")) == TEXTS * 2  # b.json, a.jsonl -> sorted a, b
    assert [p.name for p in expand_source(str(tmp_path / "data"))] == [
        "a.jsonl",
        "b.json",
        "c.txt",
        "d.parquet",
        "e.arrow",
    ]


def test_text_field_selects_the_column(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"content": "hello"}\n{"content": "world"}\n')
    assert _texts(str(f), text_field="content") == ["hello", "world"]


def test_hf_datasets_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(saved))
    assert _texts(str(saved)) == TEXTS  # a save_to_disk directory is read through its .arrow files
    only_parquet = tmp_path / "pq"
    _write_all_formats(tmp_path / "all")
    only_parquet.mkdir()
    (tmp_path / "all" / "d.parquet").rename(only_parquet / "train.parquet")
    assert _texts(f"hf:{only_parquet}?split=train") == TEXTS  # streamed by datasets
    assert _texts(f"hf:{only_parquet}?split=train&streaming=false") == TEXTS
    with pytest.raises(DataError, match="load_dataset failed"):
        _texts(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(DataError, match=r"unknown option\(s\) \['revison'\]"):
        _texts(f"hf:{only_parquet}?revison=main")


def test_mix_is_deterministic_and_follows_the_weights():
    big = [(f"a:{i}", "a") for i in range(3000)]
    small = [(f"b:{i}", "b") for i in range(500)]
    sources = {"A": big, "B": small}

    def mixed(seed):
        return list(iter_mixed(["A", "B"], [3.0, 1.0], seed=seed, open_source=lambda s: iter(sources[s])))

    first, again, other = mixed(1), mixed(1), mixed(2)
    assert first == again and first != other
    counts = Counter(p for _, p in first)
    assert 2.6 < counts["a"] / counts["b"] < 3.4  # the weights are the proportions
    assert {loc for loc, p in first if p == "a"} == {loc for loc, _ in big}  # every document at least once
    assert {loc for loc, p in first if p == "b"} == {loc for loc, _ in small}  # the small one repeats


def test_mix_of_files(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.txt"
    a.write_text("".join(json.dumps({"text": f"a{i}"}) + "\n" for i in range(50)))
    b.write_text("\n\n".join(f"b{i}" for i in range(50)))
    got = [p for _, p in iter_payloads([str(a), str(b)], weights=[1, 1], seed=0)]
    assert set(got) >= {f"a{i}" for i in range(50)} | {f"b{i}" for i in range(50)}


def test_prompt_response_masks_only_the_response():
    tok = ByteTokenizer()
    [(tokens, mask)] = encode_payloads(tok, [("Q?", "A!")], "prompt_response")
    assert tokens.tolist() == [256, ord("Q"), ord("?"), ord("A"), ord("!"), 257]
    assert mask.tolist() == [0, 0, 0, 1, 1, 1]


# -- bad data: one clear error naming the file and line ---------------------------------------------
def test_empty_file(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    with pytest.raises(DataError, match=rf"{f} holds no documents"):
        _texts(str(f))


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=rf"{f}:3: not valid JSON"):
        _texts(str(f))


def test_record_without_text_names_the_fields_and_the_fix(tmp_path):
    f = tmp_path / "notext.jsonl"
    f.write_text('{"text": "ok"}\n{"body": "no text here"}\n')
    with pytest.raises(
        DataError, match=rf"{f}:2: the record has no 'text' field \(its fields: 'body'\).*text_field"
    ):
        _texts(str(f))
    f.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=rf"{f}:1: field 'text' is a int, not a str"):
        _texts(str(f))
    f.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=rf"{f}:1: the record is a JSON list, not an object"):
        _texts(str(f))


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_undecodable_bytes_name_the_file(tmp_path, suffix):
    f = tmp_path / f"binary{suffix}"
    f.write_bytes(b'{"text": "fine"}\n' + bytes(range(128, 256)) + b"\n")
    with pytest.raises(DataError, match=rf"{f}:2: bytes .* are not UTF-8.*re-encode"):
        _texts(str(f))


def test_unknown_suffix_missing_path_and_empty_glob(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0\1")
    with pytest.raises(DataError, match=r"unknown file type '.bin'"):
        _texts(str(tmp_path / "model.bin"))
    with pytest.raises(DataError, match="is not a file, directory or glob"):
        _texts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="the glob matches no"):
        _texts(str(tmp_path / "*.parquet"))
    with pytest.raises(DataError, match="without any"):
        _texts(str(tmp_path))


def test_json_that_is_not_a_list(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('"just a string"')
    with pytest.raises(DataError, match="must be a list of records"):
        _texts(str(f))


def test_config_problems_reports_every_bad_data_setting():
    from portatrain.config import DataConfig

    cfg = DataConfig(
        buckets=[],
        num_workers=-1,
        group_size_multiplier=0,
        seq_len=1,
        tokenizer="no-such-tokenizer",
        collator="bukket",
        dataset="/no/such/file.jsonl",
    )
    problems = "\n".join(config_problems(cfg))
    for needle in (
        "data.buckets=[]",
        "data.num_workers=-1 must be >= 0",
        "data.group_size_multiplier=0 must be >= 1",
        "data.seq_len=1 must be >= 2",
        "data.tokenizer='no-such-tokenizer' is unknown",
        "data.collator='bukket' is not one of packing, bucket, pad_to_max",
        "data.dataset='/no/such/file.jsonl' does not exist",
    ):
        assert needle in problems, needle
    assert config_problems(DataConfig()) == []


def test_a_prepared_corpus_cannot_be_mixed_or_prepared_again(tmp_path):
    from portatrain.data.prepare import prepare

    prepare(["builtin"], tmp_path / "c", num_documents=10, workers=1, progress=False)
    with pytest.raises(DataError, match="is a prepared corpus"):
        _texts(str(tmp_path / "c"))
