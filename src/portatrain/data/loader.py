"""The data loader: tokenized documents -> (packing) -> sampler -> collator -> a resumable loader.

What this file does:
- ``prepare_examples``: applies the overlong policy and, for ``collator=packing``, packs documents
  into rows; returns the map-style examples and their lengths (in positions);
- ``build_dataloader``: wires those examples, :class:`~portatrain.data.sampler.StatefulBatchSampler`
  and the configured collator into a ``torchdata`` ``StatefulDataLoader`` whose
  ``state_dict()``/``load_state_dict()`` restore the exact remaining batch order;
- ``batch_shapes``: every ``(batch, seq)`` shape the loader can emit, for compile warm-up.

The batch contract is documented in ``portatrain.data.collate``; count real tokens with
``collate.loss_token_count(batch)`` (``(labels != -100).sum()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from portatrain.data.collate import PackingCollator, PadCollator, fit_documents, num_positions
from portatrain.data.config import COLLATORS
from portatrain.data.packing import pack_documents
from portatrain.data.sampler import StatefulBatchSampler


class ExampleDataset(Dataset):
    """A map-style dataset over prepared examples (token lists, or packed rows of token lists)."""

    def __init__(self, examples: Sequence[Any]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Any:
        return self.examples[index]


def max_positions(data_cfg: Any) -> int:
    """The longest example a batch can hold: the largest bucket, or ``seq_len``."""
    if data_cfg.collator == "bucket":
        return int(data_cfg.buckets[-1])
    return int(data_cfg.seq_len)


def batch_shapes(data_cfg: Any) -> list[tuple[int, int]]:
    """Every ``(batch_size, seq_len)`` the loader can emit: one per bucket, else one."""
    _check_collator(data_cfg.collator)
    batch = int(data_cfg.batch_size)
    if data_cfg.collator == "bucket":
        return [(batch, int(bucket)) for bucket in data_cfg.buckets]
    return [(batch, int(data_cfg.seq_len))]


def prepare_examples(data_cfg: Any, documents: Sequence[Sequence[int]]) -> tuple[list[Any], list[int]]:
    """Overlong policy, then packing if configured. Returns ``(examples, lengths in positions)``.

    Deterministic: depends on the documents and the config only, never on seed or rank.
    """
    _check_collator(data_cfg.collator)
    limit = max_positions(data_cfg)
    if data_cfg.collator == "bucket":
        names = ("the largest bucket", "add a bucket >= {need} to data.buckets")
    else:
        names = ("data.seq_len", "raise data.seq_len to >= {need}")
    docs = fit_documents(documents, limit, data_cfg.overlong, limit_name=names[0], limit_fix=names[1])
    lengths = [num_positions(doc) for doc in docs]
    if data_cfg.collator != "packing":
        return docs, lengths
    rows = pack_documents(lengths, limit)
    return [[docs[i] for i in row] for row in rows], [sum(lengths[i] for i in row) for row in rows]


def has_attention_mask(data_cfg: Any) -> bool:
    """Whether batches carry document ids, hence a block-diagonal attention mask: packed rows with
    ``data.packing_attention=document``. Every other batch is plain causal attention."""
    return data_cfg.collator == "packing" and getattr(data_cfg, "packing_attention", "document") == "document"


def build_collator(data_cfg: Any, *, pad_id: int) -> PadCollator | PackingCollator:
    _check_collator(data_cfg.collator)
    batch = int(data_cfg.batch_size)
    if data_cfg.collator == "packing":
        return PackingCollator(int(data_cfg.seq_len), batch, pad_id, causal=not has_attention_mask(data_cfg))
    buckets = list(data_cfg.buckets) if data_cfg.collator == "bucket" else [int(data_cfg.seq_len)]
    return PadCollator(buckets, batch, pad_id)


def build_dataloader(
    data_cfg: Any,
    documents: list[list[int]],
    *,
    pad_id: int,
    seed: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
) -> StatefulDataLoader:
    """Build this rank's loader over ``documents`` (token ids, each ending with EOS).

    Every rank must pass the same documents and seed: each builds the same global batches and takes
    its own slice. With ``infinite`` the loader never ends (a new order each epoch); a trainer
    runs it for a fixed number of steps. Without, one ``iter()`` is one epoch, and the next
    ``iter()`` the next epoch.
    """
    if data_cfg.last_batch not in ("drop", "pad"):
        raise ValueError(f"data.last_batch={data_cfg.last_batch!r} is not one of drop, pad")
    examples, lengths = prepare_examples(data_cfg, documents)
    sampler = StatefulBatchSampler(
        lengths,
        int(data_cfg.batch_size),
        order=data_cfg.sampler,
        seed=seed,
        group_size_multiplier=int(data_cfg.group_size_multiplier),
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        drop_last=data_cfg.last_batch == "drop",
        infinite=infinite,
    )
    workers = int(data_cfg.num_workers)
    return StatefulDataLoader(
        ExampleDataset(examples),
        batch_sampler=sampler,
        collate_fn=build_collator(data_cfg, pad_id=pad_id),
        num_workers=workers,
        # Keep workers across epochs of a finite loader; the collator is stateless and seedless.
        persistent_workers=workers > 0,
    )


def _check_collator(collator: str) -> None:
    if collator not in COLLATORS:
        raise ValueError(f"data.collator={collator!r} is not one of {', '.join(COLLATORS)}")
