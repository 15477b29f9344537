"""Token stores: where the loader reads documents' tokens from, by document id.

What this file does:
- ``PreparedCorpus``: a directory written by ``portatrain prepare`` (see ``prepare.py`` for the
  layout), read through memory maps. Opening it reads the manifest and nothing else, so the time to
  the first batch and the resident memory do not grow with the corpus: the operating system pages
  in only the tokens a rank actually reads. Damage is caught as cheaply: file sizes at opening, a
  shard's document offsets when it is first mapped, and every token id read against the tokenizer's
  vocabulary (the full sha256 check is ``prepare.verify=true``: it reads the whole corpus);
- ``MemoryCorpus``: the same interface over documents held in memory (the bundled corpus, or a small
  source read whole), so both go through one loader.

Both answer ``lengths(ids)`` (tokens per document, vectorized: the loader plans batches from lengths
alone) and ``read(doc, start, end)`` (tokens and, for fine-tuning data, the target mask).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from portatrain.data.errors import DataError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a corpus written by ``portatrain prepare``."""
    return (Path(str(path)).expanduser() / MANIFEST).is_file()


class MemoryCorpus:
    """Documents in memory: one concatenated token array plus offsets (and an optional mask)."""

    def __init__(
        self, documents: Sequence[tuple[np.ndarray, np.ndarray | None]], *, name: str = "memory"
    ) -> None:
        if not documents:
            raise DataError(f"{name}: no documents")
        lengths = np.fromiter((len(t) for t, _ in documents), dtype=np.int64, count=len(documents))
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in documents])
        has_mask = any(m is not None for _, m in documents)
        self.mask = (
            np.concatenate([np.ones(len(t), np.uint8) if m is None else m for t, m in documents])
            if has_mask
            else None
        )
        self.num_documents = len(documents)
        self.num_tokens = int(self.offsets[-1])
        self.name = name
        digest = hashlib.sha256(self.offsets.tobytes())
        digest.update(self.tokens[: 1 << 16].tobytes())
        self.fingerprint = {
            "corpus": name,
            "documents": self.num_documents,
            "sha256": digest.hexdigest()[:16],
        }

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        return self.offsets[ids + 1] - self.offsets[ids]

    def read(self, doc: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        base = int(self.offsets[doc])
        mask = None if self.mask is None else self.mask[base + start : base + end]
        return self.tokens[base + start : base + end], mask


class PreparedCorpus:
    """A prepared corpus directory, memory-mapped shard by shard as the loader reaches it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(str(path)).expanduser()
        manifest_file = self.path / MANIFEST
        try:
            raw = manifest_file.read_bytes()
            manifest = json.loads(raw)
        except FileNotFoundError:
            raise DataError(
                f"{self.path} has no {MANIFEST}: it is not a prepared corpus, or its prepare did not "
                "finish; run `portatrain prepare` again with the same settings (it resumes)"
            ) from None
        except ValueError as exc:
            raise DataError(f"{manifest_file} is not valid JSON ({exc}); re-run portatrain prepare") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{manifest_file}: format_version {manifest.get('format_version')!r}, this portatrain "
                f"reads {FORMAT_VERSION}; re-run portatrain prepare"
            )
        self.manifest: dict[str, Any] = manifest
        self.dtype = np.dtype(manifest["dtype"])
        self.has_mask = bool(manifest["has_mask"])
        self.shards = manifest["shards"]
        docs = np.array([s["documents"] for s in self.shards], dtype=np.int64)
        self.first_doc = np.concatenate([[0], np.cumsum(docs)]).astype(np.int64)
        self.num_documents = int(self.first_doc[-1])
        self.num_tokens = int(manifest["tokens"])
        # Every id the tokenizer can produce is below this; a larger one is damage (an overwritten
        # shard), caught at read time instead of as an index error inside the embedding.
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self.name = str(self.path)
        self.fingerprint = {
            "corpus": "prepared",
            "documents": self.num_documents,
            "manifest_sha256": hashlib.sha256(raw).hexdigest()[:16],
        }
        if self.num_documents == 0:
            raise DataError(f"{self.path}: the prepared corpus holds no documents")
        for shard in self.shards:  # sizes only: cheap, and catches a truncated copy
            for suffix, itemsize, count in self._files(shard):
                file = self.path / f"{shard['name']}.{suffix}"
                if not file.is_file() or file.stat().st_size != itemsize * count:
                    raise DataError(
                        f"{file}: missing or of the wrong size (expected {itemsize * count} bytes); the "
                        "prepared corpus is incomplete or damaged: re-run portatrain prepare into a new directory"
                    )
        self._maps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}

    def _files(self, shard: dict[str, Any]) -> list[tuple[str, int, int]]:
        files = [("bin", self.dtype.itemsize, shard["tokens"]), ("idx", 8, shard["documents"] + 1)]
        if self.has_mask:
            files.append(("mask", 1, shard["tokens"]))
        return files

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    def _shard(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        maps = self._maps.get(s)
        if maps is None:
            name = self.path / self.shards[s]["name"]
            tokens = np.memmap(f"{name}.bin", dtype=self.dtype, mode="r")
            index = np.memmap(f"{name}.idx", dtype="<i8", mode="r")
            mask = np.memmap(f"{name}.mask", dtype=np.uint8, mode="r") if self.has_mask else None
            # The index once per shard (8 bytes a document): it must rise from 0 to the token count.
            if index[0] != 0 or index[-1] != len(tokens) or bool((np.diff(index) < 0).any()):
                self._damaged(
                    f"{name}.idx", "its document offsets are not ascending from 0 to the token count"
                )
            maps = self._maps[s] = (tokens, index, mask)
        return maps

    def _damaged(self, file: str, what: str) -> None:
        raise DataError(
            f"{file}: {what}; the prepared corpus is damaged (overwritten since it was prepared): prepare "
            f"it again into a new directory (prepare.verify=true checks every shard against {MANIFEST})"
        )

    def __getstate__(self) -> dict[str, Any]:  # memory maps are reopened in another process
        return {**self.__dict__, "_maps": {}}

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        shard = np.searchsorted(self.first_doc, ids, side="right") - 1
        out = np.empty(len(ids), dtype=np.int64)
        for s in np.unique(shard):
            sel = shard == s
            local = ids[sel] - self.first_doc[s]
            index = self._shard(int(s))[1]
            out[sel] = index[local + 1] - index[local]
        return out

    def read(self, doc: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        s = int(np.searchsorted(self.first_doc, doc, side="right") - 1)
        tokens, index, mask = self._shard(s)
        base = int(index[doc - self.first_doc[s]])
        m = None if mask is None else mask[base + start : base + end]
        piece = tokens[base + start : base + end]
        if len(piece) and int(piece.max()) >= self.vocab_size:  # a pass over tokens read anyway
            self._damaged(
                f"{self.path / self.shards[s]['name']}.bin",
                f"document {doc} holds token id {int(piece.max())}, not below the tokenizer's vocabulary "
                f"({self.vocab_size})",
            )
        return piece, m


Corpus = MemoryCorpus | PreparedCorpus
