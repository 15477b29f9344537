"""Context parallelism (``parallel.cp``): each row's positions split over ``cp`` ranks.

What this file does:

* :func:`chunk_order` / :func:`shard_sequence` -- load-balanced causal sharding. A row of ``S``
  positions is cut into ``2 * cp`` chunks of ``c = S / (2 * cp)``; rank ``r`` holds chunk ``r`` (from
  the head) and chunk ``2 * cp - 1 - r`` (from the tail). Under a causal mask a query at chunk ``j``
  attends ``(j + 1) * c`` keys, so every rank's two chunks together attend ``(2 * cp + 1) * c`` keys:
  the attention work is the same on every rank (a rank holding two adjacent chunks would not be).
* :class:`ContextParallel` -- what the Trainer holds: cuts a device batch (full-length loader rows)
  into this rank's shard -- token ids, labels and RoPE positions, which keep their original values --
  and replaces the document ids by a :class:`ShardedAttention` for the model.
* :class:`ShardedAttention` -- the attention of this rank's queries over the whole row. It is handed
  to the model where a mask would go (``attn_mask``); ``portatrain.models.attention`` calls it, so
  the model holds no context-parallel code. Keys and values are all-gathered over the ``cp`` ranks
  (one collective per layer forward, its reduce-scatter backward), put back in row order, and each
  local chunk attends its key prefix through ``F.scaled_dot_product_attention`` with an exact mask:
  causal by original position, and -- for packed rows -- never across a document boundary, so a
  document that crosses a shard boundary attends exactly as it does on one rank.
* :func:`context_problems` -- bad ``parallel.cp`` input, reported before any process group starts.
* :func:`exchanged_bytes` / :func:`gathered_kv_bytes` -- the analytic traffic and the replicated
  activations, for the benchmark and the dry run.

Why all-gather and not ring attention. A ring passes k/v chunks around and merges each partial
result by its softmax log-sum-exp; ``F.scaled_dot_product_attention`` does not return that
log-sum-exp on every backend (only the CUDA/CPU flash kernels' private aten ops do), so a ring here
would need backend-specific kernels. The all-gather needs none, takes any mask (document masks
included), and with grouped-query attention gathers little: k and v are ``2 * n_kv_heads / n_heads``
of a query's width (1/2 for Llama 3 8B), against activations that are all split ``cp`` ways. Llama 3
trained at 128k positions this way, for the same reasons (Llama 3 herd paper,
https://arxiv.org/abs/2407.21783, section 3.3.2). Its cost: ``(cp - 1) / cp`` of every layer's k/v
crosses the links forward (and the same again as gradients backward), not overlapped with compute,
and each rank keeps a row's k/v per layer until backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Tensors of a batch that are not cut along the sequence: the document ids become the attention.
_NOT_SHARDED = ("document_ids", "attn_mask")


def chunk_order(cp: int) -> list[int]:
    """Which chunk of the row each gathered chunk is: rank ``r`` contributes ``(r, 2cp-1-r)``.

    ``order[i]`` is the row chunk of the ``i``-th chunk in rank-major gathered order.
    """
    return [chunk for rank in range(cp) for chunk in (rank, 2 * cp - 1 - rank)]


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s two chunks of ``x`` along ``dim`` (head chunk, then tail chunk), concatenated."""
    c = x.shape[dim] // (2 * cp)
    head, tail = x.narrow(dim, rank * c, c), x.narrow(dim, (2 * cp - 1 - rank) * c, c)
    return torch.cat([head, tail], dim=dim)


def unshard_sequence(gathered: torch.Tensor, cp: int, dim: int = 0) -> torch.Tensor:
    """The row back in order from every rank's shard concatenated rank-major along ``dim``."""
    chunks = gathered.chunk(2 * cp, dim=dim)
    by_row = sorted(zip(chunk_order(cp), chunks), key=lambda pair: pair[0])
    return torch.cat([chunk for _, chunk in by_row], dim=dim)


class ShardedAttention:
    """This rank's queries (two chunks) attending the whole row's keys, through SDPA only.

    Called as ``attention(q, k, v)`` with ``q [B, H, 2c, D]`` and ``k, v [B, H_kv, 2c, D]`` of this
    rank's positions (heads may be this rank's tensor-parallel share); returns ``[B, H, 2c, D]``.

    ``gather`` all-gathers a tensor over the cp ranks along dim 0 with autograd (reduce-scatter in
    backward); a single-process test passes one that stacks every rank's tensors itself.
    ``document_ids`` is the full ``[B, S]`` row's (None: one causal sequence per row).
    """

    def __init__(
        self,
        *,
        seq_len: int,
        cp: int,
        rank: int,
        gather: Callable[[torch.Tensor], torch.Tensor],
        document_ids: torch.Tensor | None = None,
    ) -> None:
        self.cp, self.rank, self.gather = cp, rank, gather
        self.chunk = seq_len // (2 * cp)
        self.chunks = (rank, 2 * cp - 1 - rank)
        self.document_ids = document_ids
        self._order: torch.Tensor | None = None
        self._masks: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        keys, values = self._gather_row(k, v)
        c, n_rep = self.chunk, q.shape[1] // k.shape[1]
        cpu = cpu_flash_kernel(q.device)
        outs = []
        for i, j in enumerate(self.chunks):
            end = (j + 1) * c  # a query in row chunk j attends keys [0, end)
            qi, kj, vj = q[:, :, i * c : (i + 1) * c], keys[:, :, :end], values[:, :, :end]
            if not cpu and n_rep > 1:  # query head h reads kv head h // n_rep
                kj, vj = kj.repeat_interleave(n_rep, dim=1), vj.repeat_interleave(n_rep, dim=1)
            gqa = cpu and n_rep > 1
            if self.document_ids is not None:
                mask = self._document_mask(i, q.dtype, q.device)
                out = F.scaled_dot_product_attention(qi, kj, vj, attn_mask=mask, scale=scale, enable_gqa=gqa)
            elif cpu:
                # Queries in reverse order see a Toeplitz mask (a function of query + key index):
                # a strided view of one vector, so no [c, end] mask exists, in forward or saved.
                mask = self._causal_view(end, q.dtype, q.device)
                out = F.scaled_dot_product_attention(
                    qi.flip(2), kj, vj, attn_mask=mask, scale=scale, enable_gqa=gqa
                ).flip(2)
            else:
                # The queries are the last c of the end keys' positions: bottom-right causal, which
                # CUDA's fused kernels apply without a mask tensor.
                # Imported here: torch.nn.attention.bias imports torch._dynamo (~1 s), which
                # `import portatrain` (a dry run, `plan`, `render`) otherwise pays for nothing.
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(c, end)
                out = F.scaled_dot_product_attention(qi, kj, vj, attn_mask=mask, scale=scale)
            outs.append(out)
        return torch.cat(outs, dim=2)

    def _gather_row(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's k and v, in row order: ``[B, H_kv, S, D_k]`` and ``[B, H_kv, S, D_v]`` views of one
        gathered tensor (the widths may differ: latent attention's values are narrower than its keys)."""
        batch, n_kv, _, k_dim = k.shape
        c, cp = self.chunk, self.cp
        # Sequence-major so the gather concatenates positions: [2c, B, H_kv, D_k + D_v], one collective
        # for k and v.
        local = torch.cat([k, v], dim=-1).permute(2, 0, 1, 3).contiguous()
        width = local.shape[-1]
        gathered = self.gather(local).view(2 * cp, c, batch, n_kv, width)
        if self._order is None:  # gathered chunk i is row chunk chunk_order(cp)[i]; invert that
            order = chunk_order(cp)
            self._order = torch.tensor([order.index(j) for j in range(2 * cp)], device=k.device)
        row = gathered.index_select(0, self._order).view(2 * cp * c, batch, n_kv, width)
        row = row.permute(1, 2, 0, 3)  # [B, H_kv, S, D_k + D_v]
        return row[..., :k_dim], row[..., k_dim:]

    def _document_mask(self, i: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask ``[B, 1, c, (j+1)c]`` of local chunk ``i`` (row chunk ``j``) over its key prefix:
        0 where the key is at an earlier or equal position of the same document, ``-inf`` elsewhere
        (every query sees itself, so no row is fully masked).

        Built once per step and shared by every layer, so autograd saves one copy for all of them (a
        boolean mask would be converted by SDPA in every layer, and each copy saved).
        """
        if (dtype, i) not in self._masks:
            c, j, docs = self.chunk, self.chunks[i], self.document_ids
            query = torch.arange(j * c, (j + 1) * c, device=device)
            causal = torch.arange((j + 1) * c, device=device)[None, :] <= query[:, None]
            same = docs[:, j * c : (j + 1) * c, None] == docs[:, None, : (j + 1) * c]
            self._masks[dtype, i] = _additive((causal & same)[:, None], dtype)
        return self._masks[dtype, i]

    def _causal_view(self, end: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[c, end]`` causal mask for the chunk's queries in reverse order, as a view of ``c + end - 1``
        values: reversed query ``r`` (position ``end - 1 - r``) may see key ``t`` iff ``r + t <= end - 1``."""
        if (dtype, end) not in self._masks:
            allowed = torch.arange(self.chunk + end - 1, device=device) <= end - 1
            self._masks[dtype, end] = _additive(allowed, dtype)
        return self._masks[dtype, end].as_strided((self.chunk, end), (1, 1))


def cpu_flash_kernel(device: torch.device) -> bool:
    """Whether SDPA runs CPU's flash kernel, which (measured, torch 2.13) reads grouped-query k/v heads
    under a mask tensor without repeating them, and reads a strided mask without copying it (saving
    the view). CUDA's fused kernels take ``enable_gqa`` only without a mask (with one they fall back
    to the math kernel), so elsewhere k/v heads are repeated under a mask."""
    return device.type == "cpu"


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, ``-inf`` elsewhere, in ``dtype`` (SDPA adds it to the scores)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


class ContextParallel:
    """This rank's view of context parallelism: cuts batches, sums losses over the cp ranks.

    ``mesh`` is the ``cp`` sub-mesh (None in a single-process test, which passes ``gather``).
    """

    def __init__(
        self,
        cp: int,
        rank: int,
        mesh: DeviceMesh | None = None,
        *,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.cp, self.rank, self.mesh = cp, rank, mesh
        if gather is None:
            if mesh is None:
                raise ValueError("ContextParallel needs the cp mesh or a gather function")
            gather = self._all_gather
        self.gather = gather

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ContextParallel:
        return cls(mesh.size(), mesh.get_local_rank(), mesh)

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        # Autograd-aware: the backward reduce-scatters (sums) each rank's k/v gradients to their owner.
        return funcol.all_gather_single_autograd(x, 0, group=self.mesh)

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of a device batch of full-length ``[B, S]`` rows.

        Every ``[B, S]`` tensor is cut (``positions``, made ``0..S-1`` when absent, keep their
        original values, so RoPE sees the positions one rank would); ``document_ids`` stay whole
        inside the returned ``attn_mask``, a :class:`ShardedAttention`.
        """
        tokens = batch["input_ids"]
        seq_len = tokens.shape[1]
        if seq_len % (2 * self.cp):
            raise ValueError(f"row length {seq_len} is not a multiple of 2 * parallel.cp = {2 * self.cp}")
        if "positions" not in batch:
            positions = torch.arange(seq_len, device=tokens.device).expand(tokens.shape[0], -1)
            batch = {**batch, "positions": positions}
        out = {
            key: shard_sequence(value, self.cp, self.rank)
            for key, value in batch.items()
            if key not in _NOT_SHARDED
        }
        out["attn_mask"] = ShardedAttention(
            seq_len=seq_len,
            cp=self.cp,
            rank=self.rank,
            gather=self.gather,
            document_ids=batch.get("document_ids"),
        )
        return out


def context_problems(cp: int, tp: int, row_lengths: Sequence[int], row_key: str) -> list[str]:
    """Row lengths ``parallel.cp`` cannot split: each must be a multiple of ``2 * cp`` (two chunks
    per rank), times ``tp`` with tensor parallel (sequence parallel then splits a rank's shard)."""
    unit = 2 * cp * tp
    uneven = [n for n in row_lengths if n % unit]
    if not uneven:
        return []
    why = f"2 * parallel.cp({cp})" + (f" * parallel.tp({tp})" if tp > 1 else "")
    return [
        f"{row_key} has row length(s) {uneven} not divisible by {why} = {unit}: context parallel cuts each "
        f"row into 2 * cp chunks (one from the head and one from the tail per rank); use multiples of {unit}"
    ]


def exchanged_bytes(
    *, batch: int, seq_len: int, n_layers: int, kv_dim: int, cp: int, act_bytes: int, recompute: bool = False
) -> int:
    """Bytes each rank receives per training step for attention: per layer an all-gather of k and v
    forward (the other ranks' ``(cp - 1) / cp`` of the row's ``2 * kv_dim`` values) and a
    reduce-scatter of their gradients backward (the same amount; a ring sends as much as it
    receives). A block recomputed under activation checkpointing gathers once more."""
    per_gather = (cp - 1) * batch * (seq_len // cp) * 2 * kv_dim * act_bytes
    return n_layers * per_gather * (3 if recompute else 2)


def context_activation_bytes(
    *,
    batch: int,
    seq_len: int,
    cp: int,
    n_layers: int,
    q_dim: int,
    kv_dim: int,
    act_bytes: int,
    repeated: bool,
    documents: bool,
    activation_checkpointing: str,
) -> int:
    """Activation bytes per rank context parallel adds to a ``seq_len / cp`` row's (for the dry run).

    Each layer keeps the whole row's k and v for backward instead of its own ``2c`` positions'
    (``c = seq_len / (2 cp)``): ``2 * S * kv_dim`` gathered, or -- where the kernel needs the heads
    repeated (``repeated``, off CPU) -- the two chunks' key prefixes, ``2 * (S + c) * q_dim``. Under
    full activation checkpointing only the block being recomputed holds them. Packed documents add
    the two chunks' additive masks, ``c * (S + c)`` values, shared by the layers.
    """
    c = seq_len // (2 * cp)
    held = (seq_len + c) * 2 * q_dim if repeated else seq_len * 2 * kv_dim
    held -= 2 * c * 2 * kv_dim  # its own k and v, already in the 1/cp share
    layers = 1 if activation_checkpointing == "full" else n_layers
    masks = c * (seq_len + c) if documents else 0
    return batch * (layers * held + masks) * act_bytes
