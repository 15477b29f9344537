"""The streaming loader: documents by id -> online packing/bucketing -> this rank's batches, resumable.

What this file does:
- ``StreamingLoader``: iterates fixed-shape batches (the contract of ``collate.py``) over a token
  store (``store.PreparedCorpus`` memory maps, or ``store.MemoryCorpus``), with no pass over the
  corpus before the first batch, reading only this rank's tokens, prefetching on a background
  thread, and ``state_dict()``/``load_state_dict()`` that resume the exact batch order -- also on a
  different number of ranks with the same global batch;
- ``stream_config_problems``: the data-config checks this loader adds.

How the order is made (every rank computes the same GLOBAL plan from document lengths alone, which
it reads from the corpus index, and then reads the tokens of its own rows only):

1. Epoch order. The documents are cut into blocks of ``SHUFFLE_BLOCK`` consecutive ids; each epoch
   visits the blocks in a seeded random order (``sampler=random|length_grouped``; in id order for
   ``sequential``). Blocks keep reads local in the memory-mapped shards.
2. Windows. The epoch's documents are taken ``global batch * data.group_size_multiplier`` at a time;
   a window's documents are shuffled among themselves (not for ``sequential``). Only the current
   window's lengths are in memory.
3. Units. Each document goes through the overlong policy (``truncate``/``split``/``error``) into
   pieces. ``collator=packing``: the window's pieces are packed into rows of ``seq_len`` positions by
   best-fit decreasing (``packing.pack_documents``); a row is a unit. ``bucket``/``pad_to_max``: a
   piece is a unit; with ``sampler=length_grouped`` the window's units are sorted by length, cut into
   global batches and those batches shuffled.
4. Batches. Units are taken ``data.batch_size * dp ranks`` at a time; rank r takes the r-th slice of
   ``data.batch_size``. Units left over at a window's end (fewer than a global batch: the "partly
   filled" tail) are carried into the next window; at an epoch's end they are dropped or padded with
   fully-masked rows (``data.last_batch``).

The saved position is ``(epoch, window, global batches taken from the window, carried units)``: a
handful of integers, equal on every rank, from which the rest of the order is recomputed.
Randomness comes from private generators seeded by a hash of ``(seed, epoch, window)``: no global
RNG is touched and the order does not depend on the number of ranks, workers or prefetching.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from portatrain.data.collate import IGNORE_INDEX, OverlongError
from portatrain.data.config import COLLATORS, LAST_BATCH, OVERLONG, PACKING_ATTENTION, SAMPLERS
from portatrain.data.errors import DataError
from portatrain.data.packing import pack_documents
from portatrain.data.store import Corpus

SHUFFLE_BLOCK = 64
"""Documents per block of the epoch-level shuffle (consecutive ids, read together)."""

Piece = tuple[int, int, int]
"""``(document id, first token, end token)``: a slice of one document, at least 2 tokens."""


def _rng(*key: Any) -> np.random.Generator:
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))


class StreamingLoader:
    """This rank's batches over documents ``[first_doc, end_doc)`` of ``corpus``.

    Iterating yields batches forever (``infinite``) or until the current epoch ends. ``prefetch``
    batches are built ahead on a background thread (0: built on demand); the order is the same.
    """

    def __init__(
        self,
        corpus: Corpus,
        *,
        collator: str,
        batch_size: int,
        seq_len: int,
        buckets: Sequence[int] = (),
        overlong: str = "split",
        sampler: str = "length_grouped",
        last_batch: str = "drop",
        group_size_multiplier: int = 50,
        packing_attention: str = "document",
        pad_id: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        prefetch: int = 2,
        doc_range: tuple[int, int] | None = None,
    ) -> None:
        problems = stream_problems(
            collator=collator,
            batch_size=batch_size,
            seq_len=seq_len,
            buckets=buckets,
            overlong=overlong,
            sampler=sampler,
            last_batch=last_batch,
            group_size_multiplier=group_size_multiplier,
            packing_attention=packing_attention,
        )
        if not 0 <= dp_rank < dp_world_size:
            problems.append(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
        if problems:
            raise DataError("; ".join(problems))
        self.corpus = corpus
        self.first_doc, self.end_doc = doc_range if doc_range is not None else (0, corpus.num_documents)
        self.num_docs = self.end_doc - self.first_doc
        if self.num_docs <= 0:
            raise DataError(
                f"{corpus.name}: no documents to load (range {self.first_doc}..{self.end_doc}); "
                "add documents or lower data.eval_fraction"
            )
        self.collator = collator
        self.batch_size = batch_size
        self.global_batch_size = batch_size * dp_world_size
        self.seq_len = seq_len
        self.buckets = [int(b) for b in buckets] if collator == "bucket" else [int(seq_len)]
        self.max_positions = self.buckets[-1]
        self.overlong = overlong
        self.sampler = sampler
        self.drop_last = last_batch == "drop"
        self.window_docs = self.global_batch_size * group_size_multiplier
        self.causal = packing_attention == "causal"
        self.pad_id = pad_id
        self.seed = seed
        self.dp_rank = dp_rank
        self.infinite = infinite
        self.prefetch = prefetch
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._state: dict[str, Any] = {"epoch": 0, "window": 0, "batch": 0, "carry": []}
        self._fingerprint = {
            **corpus.fingerprint,
            "doc_range": [self.first_doc, self.end_doc],
            "global_batch_size": self.global_batch_size,
            "collator": collator,
            "max_positions": self.max_positions,
            "overlong": overlong,
            "sampler": sampler,
            "seed": seed,
            "group_size_multiplier": group_size_multiplier,
            "drop_last": self.drop_last,
        }

    # -- the global plan (a pure function of lengths, config and seed) -------------------------
    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Block start ids in this epoch's visiting order, and the cumulative document counts."""
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1], self._epoch_cache[2]
        starts = np.arange(self.first_doc, self.end_doc, SHUFFLE_BLOCK, dtype=np.int64)
        if self.sampler != "sequential":
            starts = starts[_rng("blocks", self.seed, epoch).permutation(len(starts))]
        sizes = np.minimum(starts + SHUFFLE_BLOCK, self.end_doc) - starts
        cum = np.concatenate([[0], np.cumsum(sizes)])
        self._epoch_cache = (epoch, starts, cum)
        return starts, cum

    def num_windows(self) -> int:
        return -(-self.num_docs // self.window_docs)

    def window_documents(self, epoch: int, window: int) -> np.ndarray:
        """The document ids of one window, in order."""
        starts, cum = self._epoch(epoch)
        lo, hi = window * self.window_docs, min((window + 1) * self.window_docs, self.num_docs)
        first, last = np.searchsorted(cum, lo, side="right") - 1, np.searchsorted(cum, hi, side="left")
        ids = np.concatenate(
            [np.arange(s, s + cum[b + 1] - cum[b]) for b, s in zip(range(first, last), starts[first:last])]
        )
        ids = ids[lo - cum[first] : lo - cum[first] + hi - lo]
        if self.sampler != "sequential":
            ids = ids[_rng("docs", self.seed, epoch, window).permutation(len(ids))]
        return ids

    def _pieces(self, ids: np.ndarray) -> list[Piece]:
        """The overlong policy over a window's documents (documents of < 2 tokens are dropped)."""
        limit = self.max_positions
        span = limit + 1
        pieces: list[Piece] = []
        for doc, length in zip(ids.tolist(), self.corpus.lengths(ids).tolist()):
            if length < 2:
                continue
            if length <= span:
                pieces.append((doc, 0, length))
            elif self.overlong == "truncate":
                pieces.append((doc, 0, span))
            elif self.overlong == "split":  # pieces overlap by one token: every label kept once
                pieces.extend((doc, s, min(s + span, length)) for s in range(0, length - 1, limit))
            else:
                where = "the largest bucket" if self.collator == "bucket" else "data.seq_len"
                fix = (
                    "add a bucket >= {n} to data.buckets"
                    if self.collator == "bucket"
                    else "raise data.seq_len to >= {n}"
                )
                raise OverlongError(
                    f"document {doc} of {self.corpus.name} has {length} tokens = {length - 1} positions, more "
                    f"than {where} ({limit}). Fix: {fix.format(n=length - 1)}, or set data.overlong=split "
                    "(cut it into pieces) or data.overlong=truncate"
                )
        return pieces

    def window_units(self, epoch: int, window: int, carry: list[Any]) -> list[Any]:
        """Carried units, then this window's: packed rows (lists of pieces) or single pieces."""
        pieces = self._pieces(self.window_documents(epoch, window))
        if self.collator == "packing":
            lengths = [e - s - 1 for _, s, e in pieces]
            rows = pack_documents(lengths, self.seq_len) if pieces else []
            return list(carry) + [[pieces[i] for i in row] for row in rows]
        units = [tuple(u) for u in carry] + pieces
        if self.sampler == "length_grouped":
            g = self.global_batch_size
            units.sort(key=lambda p: p[1] - p[2])  # longest first; stable
            batches = [units[i : i + g] for i in range(0, len(units), g)]
            tail = batches.pop() if batches and len(batches[-1]) < g else []
            order = _rng("batches", self.seed, epoch, window).permutation(len(batches))
            units = [u for i in order for u in batches[i]] + tail
        return units

    def _plan(self, state: dict[str, Any]) -> Iterator[tuple[list[Any], dict[str, Any]]]:
        """Global batches of units from ``state`` on, each with the state after it."""
        epoch, window, batch, carry = state["epoch"], state["window"], state["batch"], state["carry"]
        g = self.global_batch_size
        while True:
            while window < self.num_windows():
                units = self.window_units(epoch, window, carry)
                full = len(units) // g
                for b in range(batch, full):
                    yield (
                        units[b * g : (b + 1) * g],
                        {"epoch": epoch, "window": window, "batch": b + 1, "carry": carry},
                    )
                carry = [_jsonable(u) for u in units[full * g :]]
                window, batch = window + 1, 0
            if carry and not self.drop_last:
                yield [_unjson(u) for u in carry], {"epoch": epoch + 1, "window": 0, "batch": 0, "carry": []}
            epoch, window, batch, carry = epoch + 1, 0, 0, []
            if not self.infinite:
                return

    # -- this rank's batches ----------------------------------------------------------------
    def _batches(self, state: dict[str, Any]) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        lo, hi = self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size
        collate = self._collate_packed if self.collator == "packing" else self._collate_padded
        for units, after in self._plan(state):
            yield collate(units[lo:hi]), after

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start = dict(self._state)
        if self.infinite:
            self._check_one_batch()
        source = (
            self._batches(start) if self.prefetch <= 0 else _prefetched(self._batches(start), self.prefetch)
        )
        try:
            for batch, after in source:
                self._state = after
                yield batch
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _check_one_batch(self) -> None:
        """An endless loader over fewer units than one global batch would never yield: say so now."""
        if self.num_windows() > 1 or not self.drop_last:
            return
        units = self.window_units(self._state["epoch"], 0, [])
        if len(units) < self.global_batch_size:
            what = "packed rows" if self.collator == "packing" else "examples"
            raise DataError(
                f"{self.corpus.name}: {self.num_docs} document(s) make {len(units)} {what}, fewer than one "
                f"global batch of data.batch_size({self.batch_size}) * data-parallel ranks "
                f"({self.global_batch_size // self.batch_size}) = {self.global_batch_size}; add documents, "
                f"lower data.batch_size{' or data.seq_len' if self.collator == 'packing' else ''}, "
                "or set data.last_batch=pad (pad the short batch with fully-masked rows)"
            )

    def _read(self, piece: Piece) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and labels of one piece (labels -100 where the mask says "not a target")."""
        doc, s, e = piece
        tokens, mask = self.corpus.read(doc, s, e)
        tokens = np.asarray(tokens, dtype=np.int64)
        labels = tokens[1:]
        if mask is not None:
            labels = np.where(np.asarray(mask[1:], dtype=bool), labels, IGNORE_INDEX)
        return tokens[:-1], labels

    def _collate_padded(self, units: list[Piece]) -> dict[str, torch.Tensor]:
        longest = max((e - s - 1 for _, s, e in units), default=1)
        seq = next(b for b in self.buckets if longest <= b)
        input_ids = np.full((self.batch_size, seq), self.pad_id, dtype=np.int64)
        labels = np.full((self.batch_size, seq), IGNORE_INDEX, dtype=np.int64)
        for r, piece in enumerate(units):
            x, y = self._read(tuple(piece))
            input_ids[r, : len(x)] = x
            labels[r, : len(y)] = y
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "positions": torch.arange(seq, dtype=torch.long).repeat(self.batch_size, 1),
        }

    def _collate_packed(self, rows: list[list[Piece]]) -> dict[str, torch.Tensor]:
        b, seq = self.batch_size, self.seq_len
        input_ids = np.full((b, seq), self.pad_id, dtype=np.int64)
        labels = np.full((b, seq), IGNORE_INDEX, dtype=np.int64)
        if self.causal:
            for r, row in enumerate(rows):
                at = 0
                for piece in row:
                    x, y = self._read(tuple(piece))
                    input_ids[r, at : at + len(x)] = x
                    labels[r, at : at + len(y)] = y
                    at += len(x)
            return {
                "input_ids": torch.from_numpy(input_ids),
                "labels": torch.from_numpy(labels),
                "positions": torch.arange(seq, dtype=torch.long).repeat(b, 1),
            }
        positions = np.tile(np.arange(seq, dtype=np.int64), (b, 1))
        # Document ids, not the [B, 1, S, S] mask: the mask is built on the device at the point of
        # use (collate.document_causal_mask), from 4 bytes per position instead of S.
        document_ids = np.zeros((b, seq), dtype=np.int32)
        for r in range(b):
            row = rows[r] if r < len(rows) else []
            at = 0
            for k, piece in enumerate(row):
                x, y = self._read(tuple(piece))
                n = len(x)
                input_ids[r, at : at + n] = x
                labels[r, at : at + n] = y
                positions[r, at : at + n] = np.arange(n)
                document_ids[r, at : at + n] = k
                at += n
            # The padded tail is one more document (every query attends to at least itself).
            positions[r, at:] = np.arange(seq - at)
            document_ids[r, at:] = len(row)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "positions": torch.from_numpy(positions),
            "document_ids": torch.from_numpy(document_ids),
        }

    # -- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out, plus what it is valid for. Equal on all ranks."""
        return {"stream": {k: v for k, v in self._state.items()}, "fingerprint": dict(self._fingerprint)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; a ``ValueError`` if it was saved for another data order."""
        if not isinstance(state, dict) or "stream" not in state or "fingerprint" not in state:
            raise ValueError(
                "the loader state is not a streaming loader's (it has keys "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}); the checkpoint was "
                "written with another data pipeline"
            )
        saved = state["fingerprint"]
        mismatched = [
            f"{key}: saved {saved.get(key)!r}, now {value!r}"
            for key, value in self._fingerprint.items()
            if saved.get(key) != value
        ]
        if mismatched:
            raise ValueError(
                "the loader state was saved for a different data order (" + "; ".join(mismatched) + ")"
            )
        position = state["stream"]
        try:
            self._state = {
                "epoch": int(position["epoch"]),
                "window": int(position["window"]),
                "batch": int(position["batch"]),
                "carry": [_jsonable(u) for u in position["carry"]],
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the loader position {position!r} is malformed ({exc})") from None


def _jsonable(unit: Any) -> list:
    """A unit as JSON-safe nested lists (a piece, or a row of pieces)."""
    if unit and isinstance(unit[0], list | tuple):
        return [[int(v) for v in p] for p in unit]
    return [int(v) for v in unit]


def _unjson(unit: list) -> Any:
    if unit and isinstance(unit[0], list | tuple):
        return [tuple(p) for p in unit]
    return tuple(unit)


_DONE = object()


def _prefetched(source: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run ``source`` on a daemon thread, ``depth`` items ahead; same items, same order.

    Closing the generator (or dropping it) stops the thread and joins it, so it never outlives its
    consumer. A daemon thread still inside a torch op when the interpreter exits is ended by
    ``pthread_exit`` as it takes the GIL back; the forced unwind through PyTorch's C++ frames then
    aborts the process ("terminate called without an active exception", status -6) after a run that
    finished and saved (see https://github.com/python/cpython/issues/87135).
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        """Hand ``item`` over; False once the consumer has gone (never blocks past a stop)."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            put(exc)

    thread = threading.Thread(target=produce, name="portatrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()  # at most the batch being built: the producer checks ``stop`` between batches


def stream_problems(
    *,
    collator: str,
    batch_size: int,
    seq_len: int,
    buckets: Sequence[int],
    overlong: str,
    sampler: str,
    last_batch: str,
    group_size_multiplier: int,
    packing_attention: str,
) -> list[str]:
    """Every problem with these data settings (empty when they can run)."""
    problems = []
    for key, value, allowed in (
        ("collator", collator, COLLATORS),
        ("overlong", overlong, OVERLONG),
        ("sampler", sampler, SAMPLERS),
        ("last_batch", last_batch, LAST_BATCH),
        ("packing_attention", packing_attention, PACKING_ATTENTION),
    ):
        if value not in allowed:
            problems.append(f"data.{key}={value!r} is not one of {', '.join(allowed)}")
    for key, value, least in (
        ("batch_size", batch_size, 1),
        ("seq_len", seq_len, 2),
        ("group_size_multiplier", group_size_multiplier, 1),
    ):
        if value < least:
            problems.append(f"data.{key}={value} must be >= {least}")
    buckets = list(buckets)
    if collator == "bucket" and (not buckets or buckets != sorted(set(buckets)) or buckets[0] <= 0):
        problems.append(
            f"data.buckets={buckets} must be a non-empty, strictly ascending list of positive lengths, e.g. [64,128,256]"
        )
    return problems
