"""Collators: token-id examples -> one fixed-shape batch, so a graph compiler sees a bounded set of shapes.

XLA and the Neuron compiler build one graph per input shape; a loader that feeds lengths 128, 129,
135... recompiles at every step. Every batch this module builds has a shape from a short list fixed
by the config (see ``portatrain.data.loader.batch_shapes``).

What this file does:
- ``fit_documents``: the overlong policy (``truncate`` / ``split`` / ``error``), applied once, up
  front, to the document list.
- ``PadCollator``: right-pads a batch to the smallest configured bucket that fits its longest
  example (``collator=bucket``); with a single bucket of ``seq_len`` it is ``collator=pad_to_max``.
- ``PackingCollator``: turns packed rows (several documents per row, see ``packing.py``) into a
  batch with restarting positions and per-position document ids.
- ``document_causal_mask`` / ``with_attention_mask``: the block-diagonal causal SDPA mask, built
  from the document ids where the batch is used (on the device, after the batch has moved).
- ``padding_stats`` / ``loss_token_count``: how many positions of a batch are real.

The batch contract (every tensor ``[B, S]`` unless noted, ``B = data.batch_size`` always):
- ``input_ids`` long: token ids; padding holds ``pad_id``.
- ``labels`` long: the next token of each position, ``IGNORE_INDEX`` (-100) on padding.
- ``positions`` long: 0, 1, ... from the start of each document (they restart inside packed rows).
- ``document_ids`` int32, ``packing_attention=document`` only: which document of its row each
  position belongs to (0, 1, ... from the row's start; the padded tail is one more). The loader
  never builds the ``[B, 1, S, S]`` mask itself: at ``S=2048`` it is 33 MB of host memory traffic
  per batch of 8 (about 2 KB per token; it held the loader under 1M tokens/s), the ids 64 KB.
  The Trainer moves the batch, then adds ``attn_mask`` = ``document_causal_mask(document_ids)``
  (bool ``[B, 1, S, S]``, True = may attend: causal within a document, never across one) on the
  device; code that moves batches itself calls :func:`with_attention_mask` after moving them.
  Bucket/pad batches, and ``packing_attention=causal``, carry neither: with right padding and
  causal attention a real token never sees a later pad, so the model keeps the fast ``is_causal``
  path.

What "length" means. A document of L tokens (``[BOS, ..., EOS]``) occupies L - 1 positions: the
inputs are ``tokens[:-1]`` and the labels ``tokens[1:]``, so a row of S positions holds S + 1 tokens.
Every real position therefore carries a label, BOS is never a target, EOS never an input, and no
label ever points into another document -- in packed rows the boundary needs no extra -100, and
``(labels != -100)`` counts exactly the real (non-pad) positions. Every length, bucket and limit in
this package is in positions, never tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portatrain.errors import UserError

IGNORE_INDEX = -100
"""Label of a position that takes no part in the loss (``F.cross_entropy``'s default ``ignore_index``)."""

OVERLONG_POLICIES = ("truncate", "split", "error")


class OverlongError(UserError, ValueError):
    """A document does not fit the largest row and ``data.overlong=error``."""


def num_positions(tokens: Sequence[int]) -> int:
    """Positions a document occupies in a row: inputs are ``tokens[:-1]``, labels ``tokens[1:]``."""
    return len(tokens) - 1


def fit_documents(
    documents: Sequence[Sequence[int]],
    max_positions: int,
    overlong: str,
    *,
    limit_name: str = "the largest bucket",
    limit_fix: str = "add a bucket >= {need} to data.buckets",
) -> list[list[int]]:
    """Apply the overlong policy; return examples of 2..``max_positions + 1`` tokens each.

    ``truncate`` keeps the first ``max_positions + 1`` tokens. ``split`` cuts a document into
    pieces of ``max_positions + 1`` tokens that overlap by one token, so every token after the first
    is still a label exactly once. ``error`` raises :class:`OverlongError` naming the first overlong
    document, its length, the limit and the fix. ``limit_name``/``limit_fix`` word that message
    for the caller's config (``{need}`` is the longest document's positions).

    Documents of fewer than 2 tokens have nothing to predict and are dropped.
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"data.overlong={overlong!r} is not one of {', '.join(OVERLONG_POLICIES)}")
    if max_positions <= 0:
        raise ValueError(f"max_positions={max_positions} must be positive")
    if overlong == "error":
        too_long = [i for i, doc in enumerate(documents) if num_positions(doc) > max_positions]
        if too_long:
            first = too_long[0]
            need = max(num_positions(documents[i]) for i in too_long)
            raise OverlongError(
                f"document {first} has {len(documents[first])} tokens = {num_positions(documents[first])} "
                f"positions (inputs are tokens[:-1], labels tokens[1:]), more than {limit_name} "
                f"({max_positions}); {len(too_long)} of {len(documents)} documents are overlong, the longest "
                f"needs {need} positions. Fix: {limit_fix.format(need=need)}, or set data.overlong=split "
                f"(cut them into pieces) or data.overlong=truncate"
            )
    span = max_positions + 1
    examples: list[list[int]] = []
    for doc in documents:
        doc = list(doc)
        if len(doc) < 2:
            continue
        if len(doc) <= span:
            examples.append(doc)
        elif overlong == "truncate":
            examples.append(doc[:span])
        else:  # split: each piece's last token is the next piece's first input
            for start in range(0, len(doc) - 1, max_positions):
                examples.append(doc[start : start + span])
    return examples


def select_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``length`` (positions)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise OverlongError(
        f"an example needs {length} positions but the largest bucket is {buckets[-1]}; "
        f"add a bucket >= {length} to data.buckets or set data.overlong=split"
    )


class PadCollator:
    """Right-pad each batch to the smallest bucket that fits its longest example.

    ``collator=bucket`` passes ``data.buckets``; ``collator=pad_to_max`` passes ``[seq_len]``.
    A batch with fewer than ``batch_size`` examples (the last one, under ``last_batch=pad``, or a
    rank's empty share of it) is filled with fully-masked rows: ``pad_id`` inputs, all labels -100.
    """

    def __init__(self, buckets: Sequence[int], batch_size: int, pad_id: int) -> None:
        buckets = list(buckets)
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] <= 0:
            raise ValueError(
                f"buckets={buckets} must be a non-empty, strictly ascending list of positive lengths"
            )
        self.buckets = buckets
        self.batch_size = batch_size
        self.pad_id = pad_id

    def __call__(self, examples: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        _check_batch_size(len(examples), self.batch_size)
        longest = max((num_positions(ex) for ex in examples), default=1)
        seq = select_bucket(longest, self.buckets)
        input_ids, labels = [], []
        for ex in examples:
            ex = list(ex)
            pad = seq - num_positions(ex)
            input_ids.append(ex[:-1] + [self.pad_id] * pad)
            labels.append(ex[1:] + [IGNORE_INDEX] * pad)
        for _ in range(self.batch_size - len(examples)):
            input_ids.append([self.pad_id] * seq)
            labels.append([IGNORE_INDEX] * seq)
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            # Pads keep counting past their document; harmless, since no real token attends to them.
            "positions": torch.arange(seq, dtype=torch.long).repeat(self.batch_size, 1),
        }


class PackingCollator:
    """Batch packed rows (each a list of examples whose positions sum to <= ``seq_len``).

    ``packing_attention=document`` (default): positions restart at 0 for every document;
    ``document_ids`` number the documents of each row, from which :func:`document_causal_mask`
    lets a token attend only to earlier tokens of its own document. The padded tail of a row (and
    each fully-masked filler row) is one more document of its own, so every query attends to at
    least itself: an all-False mask row would make SDPA return NaN there, and NaN leaks into
    gradients even where the label is -100.

    ``causal=True`` (``packing_attention=causal``): no mask and positions 0..S-1 across the row;
    documents are separated only by EOS, and attention takes SDPA's fused ``is_causal`` path.
    """

    def __init__(self, seq_len: int, batch_size: int, pad_id: int, *, causal: bool = False) -> None:
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.causal = causal

    def __call__(self, rows: Sequence[Sequence[Sequence[int]]]) -> dict[str, torch.Tensor]:
        _check_batch_size(len(rows), self.batch_size)
        seq = self.seq_len
        input_ids, labels, positions, segments = [], [], [], []
        for row in list(rows) + [[]] * (self.batch_size - len(rows)):
            ids: list[int] = []
            lab: list[int] = []
            pos: list[int] = []
            seg: list[int] = []
            for k, ex in enumerate(row):
                n = num_positions(ex)
                ids += ex[:-1]
                lab += ex[1:]
                pos += range(n)
                seg += [k] * n
            used = len(ids)
            if used > seq:
                raise ValueError(f"a packed row holds {used} positions, more than data.seq_len={seq}")
            pad = seq - used
            input_ids.append(ids + [self.pad_id] * pad)
            labels.append(lab + [IGNORE_INDEX] * pad)
            positions.append(pos + list(range(pad)))
            seg += [len(row)] * pad
            segments.append(seg)
        batch = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
        }
        if self.causal:
            batch["positions"] = torch.arange(seq, dtype=torch.long).repeat(self.batch_size, 1)
            return batch
        batch["positions"] = torch.tensor(positions, dtype=torch.long)
        batch["document_ids"] = torch.tensor(segments, dtype=torch.int32)
        return batch


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The SDPA boolean mask of packed rows: ``[B, S]`` document ids -> ``[B, 1, S, S]``.

    True where query ``i`` may attend to key ``j``: ``j <= i`` and both in the same document. Built on
    ``document_ids``' device with static shapes and no host sync, so calling it on the device batch
    costs one small kernel instead of shipping ``B * S * S`` bytes from the host.
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
    index = torch.arange(document_ids.shape[1], device=document_ids.device)
    causal = index[:, None] >= index[None, :]
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    # In place: one [B, S, S] pass fewer (a quarter less time for the CPU device at 8 x 2048).
    return same_document.logical_and_(causal).unsqueeze(1)


def with_attention_mask(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` plus ``attn_mask`` built from its ``document_ids`` (packed ``document`` batches);
    other batches are returned as they are. Call it after moving the batch to its device."""
    if "document_ids" in batch and "attn_mask" not in batch:
        batch = {**batch, "attn_mask": document_causal_mask(batch["document_ids"])}
    return batch


def _check_batch_size(n: int, batch_size: int) -> None:
    if n > batch_size:
        raise ValueError(f"got {n} examples for a batch of data.batch_size={batch_size}")


def loss_token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Positions that carry a label: the loss denominator and the real (non-pad) token count.

    Returns a 0-dim tensor on the batch's device so that a caller on an accelerator can accumulate it
    without a host sync; call ``int()`` on it only when logging.
    """
    return (batch["labels"] != IGNORE_INDEX).sum()


def padding_stats(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """``real_tokens`` (labelled positions), ``total_tokens`` (B*S) and ``pad_fraction`` of a host batch."""
    real = int(loss_token_count(batch))
    total = batch["labels"].numel()
    return {"real_tokens": real, "total_tokens": total, "pad_fraction": 1.0 - real / total}
