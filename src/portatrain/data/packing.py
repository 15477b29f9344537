"""Sequence packing: group whole documents into rows of ``seq_len`` positions, once, up front.

Packing is done over the document list before any sampling, by a deterministic best-fit-decreasing
pass: the result depends only on the documents and ``seq_len`` (not on seed, epoch or rank), so the
packed rows form a fixed map-style dataset the sampler can shuffle, shard and resume like any other.
A document is never cut across rows here; overlong documents were already truncated or split by
``collate.fit_documents``. What keeps documents apart in a row (document ids, from which
``collate.document_causal_mask`` builds the attention mask) is written by the collators.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence


def pack_documents(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: return rows as ascending lists of document indices.

    Documents are placed longest first, each into the open row whose free space fits it most
    tightly (a new row if none does). Rows are ordered by their first document index, so a
    ``sequential`` sampler walks them roughly in document order. Lengths are in positions.
    """
    if capacity <= 0:
        raise ValueError(f"capacity={capacity} must be positive")
    for i, n in enumerate(lengths):
        if not 0 < n <= capacity:
            raise ValueError(f"document {i} has length {n}; packing needs 0 < length <= seq_len={capacity}")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free positions, row id), ascending; full rows are left out
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[i]
        slot = bisect_left(free, (need, -1))
        if slot == len(free):
            rows.append([i])
            left, row = capacity - need, len(rows) - 1
        else:
            left, row = free.pop(slot)
            rows[row].append(i)
            left -= need
        if left > 0:
            insort(free, (left, row))
    for row in rows:
        row.sort()
    rows.sort(key=lambda row: row[0])
    return rows


def packing_efficiency(lengths: Sequence[int], rows: Sequence[Sequence[int]], capacity: int) -> float:
    """Fraction of the rows' positions that hold document tokens (1.0 = no padding)."""
    return sum(lengths) / (len(rows) * capacity) if rows else 1.0
