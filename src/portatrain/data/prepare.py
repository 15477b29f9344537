"""``portatrain prepare``: tokenize a corpus once into memory-mapped token shards.

What this file does:
- ``prepare(...)``: reads the (mixed) sources in order, cuts the stream into chunks of about
  ``shard_chars`` characters, and tokenizes the chunks in a pool of worker processes (every core by
  default), each writing one shard; a progress bar counts documents and tokens;
- ``main``: the command line (``python -m portatrain.data.prepare --help``).

Layout of the output directory::

    prepare.json            the settings; a re-run with other settings is refused
    shard_00000.bin         token ids, little-endian uint16 (vocabulary <= 65,536) else uint32
    shard_00000.idx         int64 offsets of each document in .bin (documents + 1 values)
    shard_00000.mask        uint8 target mask per token (fine-tuning formats only)
    shard_00000.json        the shard's counts and sha256 checksums: written last, it marks it done
    manifest.json           tokenizer, dtype, shards, counts and checksums: the corpus is complete

Same input, same settings -> the same bytes, whatever the number of workers: a chunk's content and
its shard number depend only on the input, and nothing time- or host-dependent is recorded.
An interrupted prepare resumes: shards whose ``.json`` marker is present are not tokenized again.
A prepare that fails or is interrupted (a full disk, Ctrl-C) removes its half-written ``*.tmp`` files,
and the directory itself when it made it and completed no shard; completed shards stay for the resume.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from portatrain.data.documents import encode_payloads, iter_payloads
from portatrain.data.errors import DataError
from portatrain.data.sources import FORMATS
from portatrain.data.store import FORMAT_VERSION, MANIFEST, PreparedCorpus
from portatrain.data.tokenizer import build_tokenizer
from portatrain.errors import FileSystemError, UserError, file_system_error

logger = logging.getLogger(__name__)

SETTINGS = "prepare.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def prepare(
    sources: Sequence[str],
    out: str | Path,
    *,
    tokenizer: str = "byte",
    weights: Sequence[float] | None = None,
    seed: int = 0,
    text_field: str = "text",
    format: str = "text",
    num_documents: int = 4000,
    workers: int = 0,
    shard_chars: int = 64_000_000,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``sources`` into ``out``; return the manifest. ``workers=0`` uses every core."""
    if format not in FORMATS:
        raise DataError(f"format={format!r} is not one of {', '.join(FORMATS)}")
    if shard_chars <= 0 or workers < 0:
        raise DataError(f"shard_chars={shard_chars} must be positive and workers={workers} >= 0")
    out = Path(out)
    tok = build_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    settings = {
        "format_version": FORMAT_VERSION,
        "sources": list(sources),
        "weights": None if weights is None else [float(w) for w in weights],
        "seed": seed,
        "text_field": text_field,
        "format": format,
        "num_documents": num_documents if "builtin" in sources else None,
        "shard_chars": shard_chars,
        "tokenizer": tok.fingerprint(),
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "dtype": dtype.name,
    }
    if (out / MANIFEST).is_file():
        manifest = json.loads((out / MANIFEST).read_text())
        if {k: manifest.get(k) for k in settings} != settings:
            raise DataError(
                f"{out} already holds a corpus prepared with other settings; prepare into a new directory"
            )
        logger.info(
            "%s is already prepared (%d documents, %d tokens)", out, manifest["documents"], manifest["tokens"]
        )
        return manifest
    if out.exists() and not out.is_dir():
        raise DataError(
            f"prepare out={out} is an existing file; prepare writes a directory there: choose a new path"
        )
    created = not out.exists()
    try:
        return _prepare_into(
            out,
            sources,
            settings,
            tokenizer,
            dtype,
            weights,
            seed,
            text_field,
            format,
            num_documents,
            workers,
            shard_chars,
            progress,
        )
    except BaseException as exc:
        complete = _discard_partial(out, created=created)
        error = file_system_error(exc) if isinstance(exc, Exception) else None
        if error is None:
            raise
        kept = f"; {complete} complete shard(s) stay there and the same command resumes" if complete else ""
        raise FileSystemError(f"prepare out={out}: {error}{kept}") from None


def _discard_partial(out: Path, *, created: bool) -> int:
    """After a failed or interrupted prepare: remove half-written files (``*.tmp``), and ``out`` itself
    when this call created it and no shard was completed; return the number of complete shards (kept:
    a re-run resumes after them)."""
    if not out.is_dir():
        return 0
    for tmp in out.glob("*.tmp"):
        tmp.unlink(missing_ok=True)
    complete = len(list(out.glob("shard_*.json")))
    if created and not complete:
        shutil.rmtree(out, ignore_errors=True)
    return complete


def _prepare_into(
    out: Path,
    sources: Sequence[str],
    settings: dict[str, Any],
    tokenizer: str,
    dtype: np.dtype,
    weights: Sequence[float] | None,
    seed: int,
    text_field: str,
    format: str,
    num_documents: int,
    workers: int,
    shard_chars: int,
    progress: bool,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    settings_file = out / SETTINGS
    if settings_file.is_file():
        if json.loads(settings_file.read_text()) != settings:
            raise DataError(
                f"{out} holds an interrupted prepare with other settings ({settings_file}); prepare into a "
                "new directory, or delete it to start over"
            )
    elif any(out.iterdir()):
        raise DataError(f"prepare out={out} exists and is not empty; choose a new directory")
    else:
        _write_atomic(settings_file, _json_bytes(settings))

    workers = workers or os.cpu_count() or 1
    # A live bar on a terminal; in a log file (SLURM output, CI, `> file`) one plain line per shard
    # instead of a carriage-return frame per update.
    interactive = sys.stderr.isatty()
    bar = tqdm(
        desc=f"prepare {out.name}", unit="doc", disable=not (progress and interactive), dynamic_ncols=True
    )
    shards: list[dict[str, Any]] = []

    def finished(meta: dict[str, Any]) -> None:
        shards.append(meta)
        bar.update(meta["documents"])
        tokens = sum(s["tokens"] for s in shards)
        bar.set_postfix(tokens=f"{tokens:,}")
        if progress and not interactive:
            documents = sum(s["documents"] for s in shards)
            print(
                f"prepare {out.name}: shard {len(shards)}, {documents:,} documents, {tokens:,} tokens",
                file=sys.stderr,
            )

    payloads = iter_payloads(
        sources, weights=weights, seed=seed, text_field=text_field, format=format, num_documents=num_documents
    )
    try:
        resumed = _run(
            _chunks(payloads, shard_chars), (str(out), tokenizer, format, dtype.str), workers, finished
        )
    finally:
        bar.close()
    if not shards or sum(s["documents"] for s in shards) == 0:
        raise DataError(f"{', '.join(sources)}: no documents to prepare (the input is empty)")
    manifest = {
        **settings,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "has_mask": format != "text",
        "shards": shards,
    }
    _write_atomic(out / MANIFEST, _json_bytes(manifest))
    if resumed:
        logger.info("resumed: %d of %d shard(s) were already written", resumed, len(shards))
    return manifest


def _run(chunks: Any, job: tuple[str, str, str, str], workers: int, finished: Any) -> int:
    """Tokenize and write every chunk not already done, in order; return how many were done before."""
    out = Path(job[0])
    resumed = 0
    if workers == 1:
        _init_worker()  # one core means one core: no tokenizer thread pool either
        for index, chunk in enumerate(chunks):
            meta = _done_shard(out, index)
            resumed += meta is not None
            finished(meta or _write_shard(job, index, chunk))
    else:
        # At most 2 chunks per worker in flight: reading never runs ahead of tokenizing by more.
        # forkserver, not fork: the parent may already run threads (JAX, tokenizer pools) whose locks
        # a forked child would inherit held; the server is a clean process that forks the workers.
        context = multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")
        with context.Pool(workers, initializer=_init_worker) as pool:
            pending: deque[Any] = deque()
            for index, chunk in enumerate(chunks):
                meta = _done_shard(out, index)
                if meta is not None:
                    resumed += 1
                    pending.append(meta)
                else:
                    pending.append(pool.apply_async(_write_shard, (job, index, chunk)))
                while pending and (len(pending) > 2 * workers or isinstance(pending[0], dict)):
                    head = pending.popleft()
                    finished(head if isinstance(head, dict) else head.get())
            while pending:
                head = pending.popleft()
                finished(head if isinstance(head, dict) else head.get())
    return resumed


def _chunks(payloads: Any, shard_chars: int) -> Any:
    """Cut the payload stream into lists of about ``shard_chars`` characters (never empty)."""
    chunk: list[Any] = []
    size = 0
    for location, payload in payloads:
        chunk.append((location, payload))
        size += _chars(payload)
        if size >= shard_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _chars(payload: Any) -> int:
    if isinstance(payload, str):
        return len(payload)
    if isinstance(payload, tuple):
        return len(payload[0]) + len(payload[1])
    return sum(len(m["content"]) for m in payload)


def _init_worker() -> None:
    # One process per core already: the tokenizers library's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


_TOKENIZERS: dict[str, Any] = {}


def _write_shard(job: tuple[str, str, str, str], index: int, chunk: list[tuple[str, Any]]) -> dict[str, Any]:
    """Tokenize one chunk and write shard ``index``; return its marker (counts and checksums)."""
    out, tokenizer, format, dtype_str = job
    dtype = np.dtype(dtype_str)
    tok = _TOKENIZERS.get(tokenizer) or _TOKENIZERS.setdefault(tokenizer, build_tokenizer(tokenizer))
    docs = []
    for start in range(0, len(chunk), 1024):  # batched calls into the tokenizer
        docs += encode_payloads(tok, [p for _, p in chunk[start : start + 1024]], format)
    name = f"shard_{index:05d}"
    lengths = np.fromiter((len(t) for t, _ in docs), dtype=np.int64, count=len(docs))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
    tokens = np.concatenate([t for t, _ in docs]).astype(dtype)
    files = {"bin": tokens.tobytes(), "idx": offsets.tobytes()}
    if format != "text":
        files["mask"] = np.concatenate([m for _, m in docs]).astype(np.uint8).tobytes()
    for suffix, data in files.items():
        _write_atomic(Path(out) / f"{name}.{suffix}", data)
    meta = {
        "name": name,
        "documents": len(docs),
        "tokens": int(offsets[-1]),
        "first": chunk[0][0],
        "sha256": {suffix: hashlib.sha256(data).hexdigest() for suffix, data in files.items()},
    }
    _write_atomic(Path(out) / f"{name}.json", _json_bytes(meta))  # last: the shard is complete
    return meta


def _done_shard(out: Path, index: int) -> dict[str, Any] | None:
    """The marker of a shard an earlier (interrupted) run completed, else None."""
    marker = out / f"shard_{index:05d}.json"
    if not marker.is_file():
        return None
    try:
        meta = json.loads(marker.read_text())
    except ValueError:
        return None
    for suffix in meta["sha256"]:
        if not (out / f"{meta['name']}.{suffix}").is_file():
            return None
    return meta


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def verify(path: str | Path) -> None:
    """Check every shard's sha256 against the manifest; a :class:`DataError` names the first mismatch."""
    corpus = PreparedCorpus(path)
    for shard in corpus.shards:
        for suffix, digest in shard["sha256"].items():
            file = corpus.path / f"{shard['name']}.{suffix}"
            if hashlib.sha256(file.read_bytes()).hexdigest() != digest:
                raise DataError(f"{file}: checksum mismatch; the corpus is damaged: prepare it again")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m portatrain.data.prepare", description="Tokenize a corpus into memory-mapped shards."
    )
    parser.add_argument("sources", nargs="+", help="files, directories, globs, hf:NAME or builtin")
    parser.add_argument("--out", required=True, help="output directory (new, or an interrupted prepare)")
    parser.add_argument("--tokenizer", default="byte", help="byte or a Hugging Face tokenizer directory")
    parser.add_argument("--weights", type=float, nargs="*", help="mixing weight per source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--format", default="text", choices=FORMATS)
    parser.add_argument("--num-documents", type=int, default=4000, help="size of the builtin corpus")
    parser.add_argument("--workers", type=int, default=0, help="processes (0: every core)")
    parser.add_argument("--shard-chars", type=int, default=64_000_000)
    parser.add_argument("--verify", action="store_true", help="check the checksums afterwards")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        manifest = prepare(
            args.sources,
            args.out,
            tokenizer=args.tokenizer,
            weights=args.weights,
            seed=args.seed,
            text_field=args.text_field,
            format=args.format,
            num_documents=args.num_documents,
            workers=args.workers,
            shard_chars=args.shard_chars,
        )
        if args.verify:
            verify(args.out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"prepared {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"({manifest['dtype']}, {len(manifest['shards'])} shard(s)) in {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
