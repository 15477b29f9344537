"""The batch sampler: which examples go into each step's batch, on every rank, across epochs.

What this file does:
- orders the examples of an epoch: ``sequential``, ``random`` (a seeded permutation) or
  ``length_grouped`` (a seeded permutation, sorted by length inside windows of
  ``group_size_multiplier`` global batches, then the batches shuffled -- like Hugging Face's
  ``LengthGroupedSampler`` and Megatron's bucketing: examples of similar length share a batch, which
  cuts padding, while the epoch stays random);
- cuts that order into GLOBAL batches of ``batch_size * dp_world_size`` examples and gives rank r the
  contiguous slice ``[r * batch_size, (r + 1) * batch_size)``: N ranks with batch B see exactly the
  rows one rank with batch N * B sees, so parity tests can compare them;
- runs forever (a new permutation each epoch) unless ``infinite=False``;
- resumes: ``state_dict()`` is ``{epoch, global batches consumed}`` plus a fingerprint, identical on
  every rank. ``torchdata``'s ``StatefulDataLoader`` saves it with each step (including prefetching
  workers: it snapshots the sampler when it hands out a batch) and restores the exact remaining order.

Permutations come from a private ``torch.Generator`` seeded by a hash of ``(seed, epoch)``: equal on
every rank without communication, no global RNG touched, and unlike ``seed + epoch`` (torch's
``DistributedSampler``) seed 1 epoch 0 is not seed 0 epoch 1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from portatrain.data.errors import DataError

ORDERS = ("length_grouped", "random", "sequential")


class StatefulBatchSampler(Sampler[list[int]]):
    """Yield this rank's slice of each global batch of example indices.

    ``lengths`` are the examples' lengths in positions (used only by ``length_grouped``).
    With ``drop_last`` an epoch's last partial global batch is dropped; without it, it comes last
    and a rank's slice may be short or empty -- the collator fills it with fully-masked rows, so
    every rank still takes the same number of steps.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        order: str = "length_grouped",
        seed: int = 0,
        group_size_multiplier: int = 50,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        drop_last: bool = True,
        infinite: bool = True,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"data.sampler={order!r} is not one of {', '.join(ORDERS)}")
        if batch_size <= 0 or group_size_multiplier <= 0:
            raise ValueError(
                f"data.batch_size={batch_size} and data.group_size_multiplier={group_size_multiplier} "
                "must be positive"
            )
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        self.batch_size = batch_size
        self.global_batch_size = batch_size * dp_world_size
        n = len(self.lengths)
        if n == 0 or (drop_last and n < self.global_batch_size):
            raise DataError(
                f"{n} examples cannot fill one global batch of data.batch_size({batch_size}) * "
                f"dp_world_size({dp_world_size}) = {self.global_batch_size} with data.last_batch=drop; "
                "lower data.batch_size, add documents or set data.last_batch=pad"
            )
        self.order = order
        self.seed = seed
        self.group_size_multiplier = group_size_multiplier
        self.dp_rank = dp_rank
        self.drop_last = drop_last
        self.infinite = infinite
        self.epoch = 0
        self.batches_yielded = 0
        """Global batches of ``epoch`` already handed out (on every rank alike)."""
        self._cache: tuple[int, list[torch.Tensor]] | None = None

    def global_batches(self, epoch: int) -> list[torch.Tensor]:
        """Every global batch of ``epoch``, in order (a pure function of seed, epoch and config)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n, g = len(self.lengths), self.global_batch_size
        rng = torch.Generator().manual_seed(_mix(self.seed, epoch))
        order = torch.arange(n) if self.order == "sequential" else torch.randperm(n, generator=rng)
        if self.order == "length_grouped":
            # Windows are whole global batches, so the grouping (and thus every rank's rows) does not
            # depend on how the global batch is split across ranks.
            window = g * self.group_size_multiplier
            order = torch.cat(
                [
                    chunk[torch.sort(self.lengths[chunk], descending=True, stable=True).indices]
                    for chunk in order.split(window)
                ]
            )
        batches = list(order.split(g))
        partial = batches.pop() if len(batches[-1]) < g else None
        if self.order == "length_grouped":
            # Sorted windows yield batches from longest to shortest; shuffle them so steps do not
            # sweep through lengths in a saw-tooth.
            batches = [batches[i] for i in torch.randperm(len(batches), generator=rng).tolist()]
        if partial is not None and not self.drop_last:
            batches.append(partial)
        self._cache = (epoch, batches)
        return batches

    def __len__(self) -> int:
        """Batches per epoch (iteration itself is endless when ``infinite``)."""
        return len(self.global_batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        # The position lives on the sampler, not in this generator: StatefulDataLoader serializes
        # the sampler object, and the generator's body runs only at the first next(), after any
        # load_state_dict.
        lo, hi = self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size
        while True:
            batches = self.global_batches(self.epoch)
            if self.batches_yielded >= len(batches):  # resumed exactly at an epoch's end
                self.epoch, self.batches_yielded = self.epoch + 1, 0
                continue
            while self.batches_yielded < len(batches):
                batch = batches[self.batches_yielded]
                self.batches_yielded += 1
                yield batch[lo:hi].tolist()
            self.epoch, self.batches_yielded = self.epoch + 1, 0
            if not self.infinite:
                return

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "num_examples": len(self.lengths),
            "global_batch_size": self.global_batch_size,
            "order": self.order,
            "seed": self.seed,
            "group_size_multiplier": self.group_size_multiplier,
            "drop_last": self.drop_last,
        }

    def state_dict(self) -> dict[str, Any]:
        """Position (epoch, global batches consumed) plus what it is only valid for. Equal on all ranks."""
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position. The global batch size must match; the rank count may differ."""
        mismatched = [
            f"{key}: saved {state[key]!r}, now {value!r}"
            for key, value in self._fingerprint().items()
            if key in state and state[key] != value
        ]
        if mismatched:
            raise ValueError(
                "the sampler state was saved for a different data order (" + "; ".join(mismatched) + "); "
                "resume with the same documents, seed, data.sampler and data.batch_size * dp world size, "
                "or start the data order afresh (drop the loader state)"
            )
        self.epoch = int(state["epoch"])
        self.batches_yielded = int(state["batches_yielded"])


def _mix(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from ``(seed, epoch)``, the same on every platform and process."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
