"""Expert parallelism: a mixture of experts' experts split over the ``ep`` mesh, tokens moved by all-to-all.

What this file does:

* :func:`apply_ep` -- for each mixture-of-experts layer it is given
  (``portatrain.models.common.moe.MoE``; this package sits below the models and reads only the
  layer's ``experts`` and ``exchange``), store the stacked expert weights as DTensors sharded over
  the experts (``Shard(0)`` on the ``ep`` mesh: rank ``r`` of ``ep`` holds experts
  ``[r*E/ep, (r+1)*E/ep)``), have the experts compute with that local shard (their ``weight_view``
  slot) and put an :class:`ExpertParallel` in the layer's ``exchange`` slot. The router, shared
  experts and everything else stay whole on every rank. FSDP2 then shards each rank's experts over
  the ranks that hold the same ones (``ParallelDims.expert_fsdp_mesh``); a DCP checkpoint sees each
  expert weight as one ``[n_experts, ...]`` tensor, so it resumes at any ``ep`` and world size.
* :class:`ExpertParallel` -- the exchange, in both dispatch modes:

  - ``capacity``: the layer's fixed ``[n_experts, slots, dim]`` buffer goes out in ``ep`` equal
    chunks (chunk ``r`` holds rank ``r``'s experts) and comes back the same way. Every size is known
    from the batch shape, so no count leaves the device: the static shapes XLA-style compilers need.
    Every ep rank must then run the same number of tokens per step (validation refuses row lengths
    that may differ between ranks).
  - ``dropless``: each rank's row counts per expert are exchanged first (one small all-to-all and one
    host sync per layer, to size the second), then the rows themselves with uneven splits.

  Each row's routing weight travels beside it (a second, ``dim`` times smaller, all-to-all). Rows and
  weights arrive in the dtype the experts' matmuls run in (the layer casts them before dispatch: bf16
  under autocast, half the bytes of the fp32 activations) and go back in it; the layer combines them
  in the activations' dtype.

The design is torchtitan's (``torchtitan/distributed/expert_parallel.py``, ``ExpertParallel``:
``Shard(0)`` expert weights, count exchange, then ``all_to_all_single_autograd`` of the tokens, and a
permutation from source-rank-major to expert-major order); here it fills the layer's slot instead of
wrapping the experts module's forward, so one class serves both dispatch modes. Gradients need no
collective of their own: the all-to-all's backward returns each token's gradient to its rank, and the
experts' weight gradients are whole on the rank that holds them (every ep rank's tokens reached them).

Traffic per MoE layer and step, elements each rank hands to all-to-all, each of the experts' matmul
dtype's size (``scripts/bench_ep_bytes.py`` measures it): ``capacity``: ``n_experts * slots * (dim + 1)`` out (rows and routing weights),
``n_experts * slots * dim`` back, and as much again in backward (the gradients), ``(ep-1)/ep`` of it
to other ranks. ``dropless``: the same with ``top_k * tokens`` assignments in place of
``n_experts * slots`` (exactly, summed over the ranks), plus ``n_experts`` counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class ExpertParallel:
    """``MoE.exchange`` for experts split over ``mesh`` (1-D, the ``ep`` ranks)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.degree = mesh.size()

    def _exchange(
        self, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None
    ) -> torch.Tensor:
        """All-to-all along dim 0 (``None`` splits: ``ep`` equal chunks), differentiable: its backward
        is the reverse exchange."""
        return all_to_all_single_autograd(x, out_splits, in_splits, self.group)

    def batched(self, experts: Any, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n_experts, n_slots, dim = slots.shape
        ep, local = self.degree, n_experts // self.degree
        # Equal splits: chunk r (rank r's experts) goes to rank r; what arrives is ordered
        # [source rank, local expert, slot], and each local expert takes its slots from every source.
        x = self._exchange(slots.reshape(n_experts * n_slots, dim), None, None)
        x = x.view(ep, local, n_slots, dim).transpose(0, 1).reshape(local, ep * n_slots, dim)
        w = self._exchange(weights.reshape(n_experts * n_slots), None, None)
        w = w.view(ep, local, n_slots).transpose(0, 1).reshape(local, ep * n_slots)
        out = experts.batched(x, w)
        back = out.reshape(local, ep, n_slots, dim).transpose(0, 1).reshape(n_experts * n_slots, dim)
        return self._exchange(back, None, None).view(n_experts, n_slots, dim)

    def grouped(
        self, experts: Any, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        ep, local = self.degree, counts.numel() // self.degree
        with torch.no_grad():
            # received[s, e]: how many rows rank s sends to this rank's local expert e.
            received = all_to_all_single(counts, None, None, self.group).view(ep, local)
            send_splits = counts.view(ep, local).sum(dim=1).tolist()
            recv_splits = received.sum(dim=1).tolist()  # the host sync that sizes the exchange
            # Rows arrive source-major ([s, e] blocks in order); the grouped matmul wants them
            # expert-major: a stable sort by local expert keeps each expert's sources in order.
            expert_of_row = torch.arange(local, device=rows.device).repeat(ep)
            expert_of_row = expert_of_row.repeat_interleave(
                received.reshape(-1), output_size=sum(recv_splits)
            )
            order = torch.argsort(expert_of_row, stable=True)
            offs = torch.cumsum(received.sum(dim=0), dim=0, dtype=torch.int32)
        x = self._exchange(rows, recv_splits, send_splits)[order]
        w = self._exchange(weights, recv_splits, send_splits)[order]
        out = experts.grouped(x, offs, w)
        back = torch.empty_like(out).index_copy(0, order, out)  # source-major again
        return self._exchange(back, send_splits, recv_splits)


def apply_ep(layers: Iterable[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Shard each MoE layer's experts over ``ep_mesh`` and set its exchange.

    The layers may be on meta (``distribute_tensor`` of a meta tensor only records the layout); on a
    real device every rank must hold the same full weights (each keeps its slice, no communication).
    """
    for moe in layers:
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        # The experts compute with their rank's shard (``to_local`` is differentiable: the gradient
        # comes back as the DTensor's local shard).
        experts.weight_view = DTensor.to_local
        moe.exchange = ExpertParallel(ep_mesh)
