"""Where documents come from: local files, directories, globs and Hugging Face datasets, mixed by weight.

What this file does:
- ``expand_source(spec)``: one ``data.dataset`` string -> the files it names (a file, a directory
  searched recursively, or a glob), or a Hugging Face ``datasets`` source (``hf:NAME?split=...``);
- ``iter_source(spec, ...)``: that source's records, one at a time, streamed (never the whole
  file in memory except ``.json``, which is one JSON value), each with its location (``file:line``);
- ``iter_mixed(sources, weights, seed, ...)``: several sources interleaved by a seeded weighted draw
  (every source is read to its end at least once; one that ends early restarts, so the weights hold);
  ``mix_sum_problem`` refuses weights whose sum the draw cannot take;
- ``record_payload``: a record -> what the tokenizer stage needs for ``data.format``:
  ``text`` (a string from ``data.text_field``), ``prompt_response`` (``prompt`` and ``response``
  strings; the loss is taken on the response only) or ``chat`` (a ``messages`` list).

Formats by suffix: ``.jsonl`` (one JSON object a line), ``.json`` (a list of objects, or an object
holding one such list), ``.parquet`` and ``.arrow`` (columns; need ``pyarrow``), ``.txt`` (documents
separated by blank lines). Text must be UTF-8: undecodable bytes are an error naming the file and
line, never silently replaced. Every bad record is a :class:`DataError` naming the file, the line
or row, and the fix.
"""

from __future__ import annotations

import glob
import json
import math
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from portatrain.data.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".txt")
FORMATS = ("text", "prompt_response", "chat")
"""``data.format``: what a record holds (see the module docstring)."""

Record = tuple[str, Any]
"""``(location, record)``: ``location`` names the file and line/row for error messages."""


def is_hf_source(spec: str) -> bool:
    return spec.startswith("hf:")


def expand_source(spec: str) -> list[Path]:
    """The files a local ``data.dataset`` names, sorted; a :class:`DataError` if it names none."""
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        files = [f for f in files if f.suffix in SUFFIXES]
        if not files:
            raise DataError(
                f"data.dataset={spec!r}: the glob matches no {'/'.join(SUFFIXES)} file; check the pattern"
            )
        return files
    if path.is_dir() and (path / "manifest.json").is_file() and (path / "prepare.json").is_file():
        raise DataError(
            f"{spec!r} is a prepared corpus (portatrain prepare): train on it alone with data.dataset={spec}; "
            "to mix it with other data, mix the raw sources with data.mix and prepare them together"
        )
    if path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        # A ``datasets.save_to_disk`` directory: its Arrow files, in the order state.json lists them.
        try:
            state = json.loads((path / "state.json").read_text())
            return [path / f["filename"] for f in state["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path / 'state.json'}: not a datasets save_to_disk state ({exc})") from None
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix in SUFFIXES and not any(part.startswith(".") for part in p.parts)
        )
        if not files:
            raise DataError(
                f"data.dataset={spec!r} is a directory without any {'/'.join(SUFFIXES)} file; "
                "point it at a directory of data files or a prepared corpus (portatrain prepare)"
            )
        return files
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise DataError(
                f"data.dataset={spec!r}: unknown file type {path.suffix!r}; use one of "
                f"{', '.join(SUFFIXES)} (plain text: rename it to .txt)"
            )
        return [path]
    raise DataError(
        f"data.dataset={spec!r} is not a file, directory or glob here; use data.dataset=builtin, a local "
        f"{'/'.join(SUFFIXES)} file, directory or glob, a prepared corpus, or hf:NAME for a Hugging Face dataset"
    )


def iter_source(spec: str, *, text_field: str = "text", format: str = "text") -> Iterator[Record]:
    """Every record of one ``data.dataset`` source, in order, with its location."""
    if is_hf_source(spec):
        yield from _iter_hf(spec)
        return
    for file in expand_source(spec):
        n = 0
        for record in _READERS[file.suffix](file):
            n += 1
            yield record
        if n == 0:
            raise DataError(f"{file} holds no documents (it is empty); remove it or give it some records")


def iter_mixed(
    sources: Sequence[str],
    weights: Sequence[float] | None = None,
    *,
    seed: int = 0,
    open_source: Callable[[str], Iterator[Record]] | None = None,
) -> Iterator[Record]:
    """Interleave ``sources`` by a seeded weighted draw until each has been read to its end once.

    One source is just itself. With several, each next record comes from source ``i`` with
    probability ``weights[i] / sum(weights)``; a source that runs out before the others restarts
    from its beginning (it is oversampled), and the mix ends when every source has ended at least
    once -- so the weights are the mix's proportions, and no document is left out.
    """
    open_source = open_source or iter_source
    if len(sources) == 1:
        yield from open_source(sources[0])
        return
    weights = list(weights) if weights is not None else [1.0] * len(sources)
    if len(weights) != len(sources) or any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise DataError(f"data.mix weights {weights} must be one positive, finite number per dataset")
    problem = mix_sum_problem(weights)
    if problem:
        raise DataError(problem)
    rng = random.Random(f"portatrain-mix:{seed}")
    iterators = [open_source(s) for s in sources]
    ended = [False] * len(sources)
    while not all(ended):
        (i,) = rng.choices(range(len(sources)), weights=weights)
        try:
            yield next(iterators[i])
        except StopIteration:
            ended[i] = True
            if all(ended):
                return
            iterators[i] = open_source(sources[i])
            yield next(iterators[i])


def mix_sum_problem(weights: Sequence[float]) -> str | None:
    """Why positive, finite ``weights`` cannot be drawn by, or None: the draw (``random.choices``)
    sums them, and a sum past the float range (``1e308`` twice) is ``inf``, which it refuses."""
    if math.isfinite(sum(weights)):
        return None
    largest = max(weights)
    scaled = ", ".join(f"{w / largest:.3g}" for w in weights)
    return (
        f"data.mix weights {list(weights)} sum past the float range ({sys.float_info.max:.3g}); only their "
        f"ratios matter: scale them down, e.g. weights [{scaled}]"
    )


def record_payload(location: str, record: Any, *, format: str = "text", text_field: str = "text") -> Any:
    """Check one record and return what ``format`` needs from it (a str, a (prompt, response) pair,
    or a messages list). A missing or mistyped field is a :class:`DataError` naming the location."""
    if format not in FORMATS:
        raise DataError(f"data.format={format!r} is not one of {', '.join(FORMATS)}")
    if isinstance(record, str):  # a .txt document
        if format != "text":
            raise DataError(
                f"{location}: a .txt file holds plain text; data.format={format} needs JSON records"
            )
        return record
    if not isinstance(record, dict):
        raise DataError(
            f"{location}: the record is a JSON {type(record).__name__}, not an object; "
            f'each record must look like {{"{text_field}": "..."}}'
        )
    if format == "text":
        return _field(location, record, text_field, str, "set data.text_field to the field holding the text")
    if format == "prompt_response":
        fix = 'fine-tuning records look like {"prompt": "...", "response": "..."}'
        return (_field(location, record, "prompt", str, fix), _field(location, record, "response", str, fix))
    messages = _field(
        location,
        record,
        "messages",
        list,
        'chat records look like {"messages": [{"role": ..., "content": ...}]}',
    )
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{location}: every message needs a string 'role' and 'content'; got {m!r:.120}")
    return messages


def _field(location: str, record: dict, name: str, kind: type, fix: str) -> Any:
    if name not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise DataError(f"{location}: the record has no {name!r} field (its fields: {keys}); {fix}")
    value = record[name]
    if not isinstance(value, kind):
        raise DataError(
            f"{location}: field {name!r} is a {type(value).__name__}, not a {kind.__name__} ({value!r:.80}); {fix}"
        )
    return value


# -- readers ---------------------------------------------------------------------------------------
def _decode(raw: bytes, location: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 8]
        raise DataError(
            f"{location}: bytes {bad!r} at byte {exc.start} of the line are not UTF-8 (a binary file, or "
            "another encoding?); portatrain reads UTF-8 only: re-encode the file "
            "(iconv -f LATIN1 -t UTF-8) or remove it from data.dataset"
        ) from None


def _read_jsonl(path: Path) -> Iterator[Record]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            location = f"{path}:{lineno}"
            line = _decode(raw, location)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{location}: not valid JSON ({exc.msg} at column {exc.colno}); each line of a .jsonl "
                    "file must be one JSON object: fix or delete that line"
                ) from None
            yield location, record


def _read_json(path: Path) -> Iterator[Record]:
    text = _decode(path.read_bytes(), str(path))
    if not text.strip():
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); fix the file "
            "(a file of one JSON object per line must be named .jsonl)"
        ) from None
    if isinstance(value, dict):
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(
                f"{path}: a .json file must hold a list of records, or an object with exactly one list "
                f"of records (this one has {len(lists)} lists)"
            )
        value = lists[0]
    if not isinstance(value, list):
        raise DataError(f"{path}: holds a JSON {type(value).__name__}; it must be a list of records")
    for i, record in enumerate(value):
        yield f"{path}: record {i}", record


def _read_txt(path: Path) -> Iterator[Record]:
    """Documents separated by blank lines; location is the document's first line."""
    lines: list[str] = []
    start = 1
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, f"{path}:{lineno}")
            if line.strip():
                if not lines:
                    start = lineno
                lines.append(line)
            elif lines:
                yield f"{path}:{start}", "".join(lines).strip()
                lines = []
    if lines:
        yield f"{path}:{start}", "".join(lines).strip()


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError(
            f"{path}: reading {path.suffix} files needs pyarrow: pip install 'portatrain[datasets]'"
        ) from None
    import pyarrow as pa

    return pa


def _iter_table_batches(batches: Iterator[Any], path: Path) -> Iterator[Record]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{path}: row {row}", record
            row += 1


def _read_parquet(path: Path) -> Iterator[Record]:
    _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError variants
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    yield from _iter_table_batches(reader.iter_batches(batch_size=1024), path)


def _read_arrow(path: Path) -> Iterator[Record]:
    """Arrow IPC, stream format (what ``datasets.save_to_disk`` writes) or file format."""
    pa = _pyarrow(path)
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path}: not an Arrow IPC file ({exc})") from None
        yield from _iter_table_batches((reader.get_batch(i) for i in range(reader.num_record_batches)), path)
        return
    yield from _iter_table_batches(iter(reader), path)


_READERS: dict[str, Callable[[Path], Iterator[Record]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".txt": _read_txt,
    ".parquet": _read_parquet,
    ".arrow": _read_arrow,
}


def _iter_hf(spec: str) -> Iterator[Record]:
    """``hf:NAME_OR_PATH?name=CONFIG&split=train&streaming=true`` through ``datasets.load_dataset``."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.dataset={spec!r} needs the Hugging Face datasets library: pip install 'portatrain[datasets]'"
        ) from None
    name, _, query = spec[3:].partition("?")
    options = dict(parse_qsl(query))
    split = options.pop("split", "train")
    streaming = options.pop("streaming", "true").lower() != "false"
    config = options.pop("name", None)
    if options:
        raise DataError(
            f"data.dataset={spec!r}: unknown option(s) {sorted(options)}; allowed: name, split, streaming"
        )
    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as exc:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        raise DataError(
            f"data.dataset={spec!r}: datasets.load_dataset failed: {type(exc).__name__}: {exc}"
        ) from None
    for i, record in enumerate(dataset):
        yield f"{spec}: row {i}", record
