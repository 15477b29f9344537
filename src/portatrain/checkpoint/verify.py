"""Is a checkpoint whole? Content checksums written with every save and checked at every load, and the
finiteness rule that resume and ``portatrain export`` share.

- :func:`checksums` -- per tensor of the model and optimizer state, the wrapping integer sum of its
  elements' bit patterns: each element read as a signed integer of its own width (float32 as int32,
  bfloat16 as int16) and summed modulo ``2**width``. Addition does not care about order, so the sum
  does not depend on how a tensor is sharded: each rank sums its own shard (a DTensor shard
  replicated over a mesh dimension counts once), one all-reduce adds the shards up, and a checkpoint
  saved by 8 ranks is verified when 2 load it. Any change to a tensor's bytes in a ``.distcp`` file
  (a flipped bit, 4 KB of random bytes, a NaN written in) changes its sum unless the changes cancel
  exactly -- about one chance in ``2**32`` for 4-byte elements, ``2**16`` for 2-byte ones. A
  same-width wrapping sum is one vectorized pass over memory (a widening sum is 20-40x slower on
  CPU), which keeps the cost under 5% of a save: ``python scripts/bench_checksum.py`` measures it.
  It is an error check, not a signature: it finds damage, not a deliberate forgery.
- :func:`nonfinite_keys` -- the tensors holding a NaN or an infinity: a checkpoint is loaded (and
  exported) only when every weight and optimizer moment is finite.
- :func:`verify_loaded` -- both checks on the tensors a load has just read; raises
  :class:`DamagedCheckpointError`, the same verdict on every rank.

Every function here is collective when a process group exists: call it on every rank, at the same
point. Ranks may hold different keys (pipeline stages hold different layers): the keys are gathered
first, and a plain tensor counts on the lowest rank that holds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from portatrain.checkpoint.common import DIGEST_KEY, CheckpointError, get_rank, json_digest, some

ALGORITHM = "wrapping-int-sum/1"
"""Names the checksum recorded in ``trainer_state.json``; another name is not checked."""

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose tensors are unreadable, differ from what was saved, or are not finite.

    ``checkpoint.resume=auto`` skips such a checkpoint and loads the one before it; an explicit
    ``checkpoint.resume=PATH`` to it is this error.
    """


def check_json_digest(file: Path, value: dict[str, Any], fix: str) -> dict[str, Any]:
    """``value`` (a checkpoint JSON object just read from ``file``) without its digest, after checking
    the digest matches the rest; a file written before digests existed has none and is taken as is."""
    value = dict(value)
    recorded = value.pop(DIGEST_KEY, None)
    if recorded is not None and recorded != json_digest(value):
        raise DamagedCheckpointError(
            f"checkpoint file {file} was changed after it was saved (its content no longer matches the "
            f"SHA-256 written with it); {fix}"
        )
    return value


def flat_tensors(tree: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"model": {...}, "optim": {fqn: {"exp_avg": t}}}`` -> ``{"optim.<fqn>.exp_avg": t, ...}``:
    every tensor of a nested state dict under the dotted key DCP stores it by."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            flat[name] = value
        elif isinstance(value, Mapping):
            flat.update(flat_tensors(value, f"{name}."))
    return flat


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach()


def _counted_here(tensor: torch.Tensor, owner: int = 0) -> bool:
    """Whether this rank's part of ``tensor`` enters the global sum: each element counts once.

    A DTensor's shard counts on the ranks at coordinate 0 of every mesh dimension it is replicated
    over; a plain tensor (the same on every rank holding it, e.g. an optimizer step count) counts on
    ``owner``, the lowest rank that holds it.
    """
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return get_rank() == owner
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, tensor.placements) if p.is_replicate())


def _device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """Where the all-reduce runs: the accelerator the state lives on (CPU when it is all on CPU)."""
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type not in ("cpu", "meta"):
            return local.device
    return torch.device("cpu")


def _every_rank_keys(local: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The union of every rank's ``{key: element size}`` and, per key, the lowest rank holding it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(local), dict.fromkeys(local, get_rank())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(local))
    union: dict[str, int] = {}
    owner: dict[str, int] = {}
    for rank, keys in enumerate(gathered):
        for key, size in keys.items():
            union.setdefault(key, size)
            owner.setdefault(key, rank)
    return union, owner


def _sum_over_ranks(vector: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    return vector


def _word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor``: the wrapping sum of its elements read as same-width integers."""
    local = _local(tensor)
    ints = local.view(_INT_OF_WIDTH[local.element_size()])  # same width: a view, never a copy
    return ints.sum(dtype=ints.dtype).to(torch.int64)


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """``{key: checksum}`` of every tensor of every rank (collective; one all-reduce of one int64 per
    tensor)."""
    sizes, owner = _every_rank_keys(
        {k: t.element_size() for k, t in tensors.items() if t.element_size() in _INT_OF_WIDTH}
    )
    keys = sorted(sizes)
    if not keys:
        return {}
    device = _device(tensors.values())
    zero = torch.zeros((), dtype=torch.int64, device=device)
    parts = [
        _word_sum(tensors[k]).to(device)
        if k in tensors and _counted_here(tensors[k], owner[k]) and _local(tensors[k]).numel()
        else zero
        for k in keys
    ]
    totals = _sum_over_ranks(torch.stack(parts)).tolist()
    # Shards were summed in their own width, then added in int64: reduce back to that width.
    return {k: int(v) % (1 << (8 * sizes[k])) for k, v in zip(keys, totals)}


def state_bytes(tree: Mapping[str, Any]) -> int:
    """Bytes of this rank's part of the tensors of a nested state dict (each element counted on one
    rank, as :func:`checksums` counts it): what a save of it writes, roughly."""
    return sum(_local(t).numel() * t.element_size() for t in flat_tensors(tree).values() if _counted_here(t))


def nonfinite_keys(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Keys of the floating-point tensors that hold a NaN or an infinity (on any rank; collective).

    First one sum per tensor (a NaN or inf anywhere makes it non-finite; one fast pass), then, for the
    rare tensor whose sum overflowed or is non-finite, the element-wise test that decides.
    """
    floats = sorted(_every_rank_keys({k: 0 for k, t in tensors.items() if t.is_floating_point()})[0])
    candidates = _flagged(tensors, floats, lambda local: ~torch.isfinite(local.sum()))
    return _flagged(tensors, candidates, lambda local: ~torch.isfinite(local).all())


def _flagged(tensors: Mapping[str, torch.Tensor], keys: list[str], bad: Any) -> list[str]:
    if not keys:
        return []
    device = _device(tensors[k] for k in keys if k in tensors)
    flags = [
        bad(_local(tensors[k])).to(device, torch.int64)
        if k in tensors and _local(tensors[k]).numel()
        else torch.zeros((), dtype=torch.int64, device=device)
        for k in keys
    ]
    totals = _sum_over_ranks(torch.stack(flags)).tolist()
    return [k for k, n in zip(keys, totals) if n]


def verify_loaded(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    saved: Mapping[str, Any] | None,
    saved_dtypes: Mapping[str, torch.dtype],
) -> None:
    """Check the tensors just loaded from checkpoint ``path`` (collective).

    ``saved`` is the ``checksums`` entry of its ``trainer_state.json`` (None for a checkpoint written
    before checksums existed: only finiteness is checked); ``saved_dtypes`` the dtype of each tensor in
    the checkpoint (a tensor loaded into another dtype was converted and cannot be compared). Raises
    :class:`DamagedCheckpointError` naming the tensors.
    """
    fix = "Resume from an earlier step_* directory (checkpoint.resume=auto skips this one)"
    if saved is not None and saved.get("algorithm") == ALGORITHM:
        expected = saved.get("tensors", {})
        keys = [k for k in tensors if k in expected and saved_dtypes.get(k) == tensors[k].dtype]
        actual = checksums({k: tensors[k] for k in keys})  # every rank's keys: one verdict everywhere
        wrong = [k for k in sorted(actual) if actual[k] != expected[k]]
        if wrong:
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: the content checksum of {some(wrong)} does not match the "
                "one written when it was saved (a *.distcp file was overwritten or corrupted on disk). " + fix
            )
    bad = nonfinite_keys(tensors)
    if bad:
        raise DamagedCheckpointError(
            f"checkpoint {path} holds non-finite (NaN/inf) values in {some(bad)}; training from it would "
            "fail at its first step. " + fix
        )


__all__ = [
    "ALGORITHM",
    "DamagedCheckpointError",
    "checksums",
    "flat_tensors",
    "nonfinite_keys",
    "state_bytes",
    "verify_loaded",
]
