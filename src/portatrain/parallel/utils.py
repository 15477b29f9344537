"""Helpers the Trainer needs once parameters are DTensors on a mesh.

What this file does:

* :func:`full_tensor_init` -- a context under which ``model.init_weights()`` gives every sharded
  parameter exactly the values a single-device run draws, whatever the layout.
* :func:`clip_grad_norm_` -- global gradient-norm clipping over FSDP, TP and FSDP x TP gradients
  (and plain tensors), returning the norm as a plain tensor equal on every rank.
* :func:`dp_all_reduce` -- sum or mean of a scalar over the data-parallel ranks; :func:`token_all_reduce`
  -- sum over the ranks holding different tokens (data- times context-parallel).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from portatrain.parallel.parallel_dims import ParallelDims

# In-place initializers that draw random numbers. Each receives the tensor to fill first.
_RANDOM_INPLACE = {
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.bernoulli_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.xavier_uniform_,
    torch.nn.init.xavier_normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_,
    torch.nn.init.orthogonal_,
}


# Reads of a tensor's value into Python. On a DTensor they see only the local shard (a Partial
# ``mask.any()`` is this rank's answer), so data-dependent control flow in an initializer -- the
# rejection loop of ``nn.init.trunc_normal_`` -- would take different paths on different ranks.
_VALUE_READS = {
    torch.Tensor.__bool__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
}


class _FullTensorRandomInit(TorchFunctionMode):
    """Redirect a random fill of a DTensor to a full-size tensor, then keep this rank's shard.

    Why: a random op on a DTensor fills only the local shard. On CPU (and any device DTensor's
    offset-based RNG tracker does not cover) every rank then draws the same first numbers, so the
    shards are copies of each other and nothing like the single-device weights; where the tracker
    works the values still depend on the layout. Drawing the full tensor from the ordinary
    generator -- same seed, same order on every rank -- reproduces the single-device draw exactly,
    and slicing it locally (``src_data_rank=None``: no communication) keeps the right shard for any
    placement, ``_StridedShard`` from FSDP-over-TP included.

    Initializers with data-dependent loops (``trunc_normal_`` redraws out-of-range values until
    none is left) must take the same path on every rank as on one device, so a DTensor's value read
    into Python (``bool``, ``item``) is the global value here.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READS and args and isinstance(args[0], DTensor):
            return func(args[0].full_tensor(), *args[1:], **kwargs)
        # ``torch.nn.init`` functions hand their tensor over as the keyword ``tensor``, methods as args[0].
        target = args[0] if args else kwargs.get("tensor")
        if func in _RANDOM_INPLACE and isinstance(target, DTensor):
            full = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            # re-enters this mode with a plain tensor: runs as is
            func(full, *args[1:], **kwargs) if args else func(**{**kwargs, "tensor": full})
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def full_tensor_init(enabled: bool = True) -> Iterator[None]:
    """Within this context, random initializers applied to DTensors draw the full tensor.

    Trade-off: each rank transiently holds one full parameter (the largest of Llama 3 70B is the
    1.05B-element embedding: 4.2 GB in fp32) and spends the time to draw all of it. In exchange a run
    on N devices starts from bit-identical weights to the 1-device run with the same seed, for any
    ``dp_replicate x dp_shard x tp`` -- the basis of the parity tests and of comparing layouts.
    ``parallel.init_full_tensors=false`` draws only local shards instead (cheaper; values then
    depend on the layout, and on CPU the shards repeat each other).
    """
    if not enabled:
        yield
        return
    with _FullTensorRandomInit():
        yield


PIPELINE_COPY = "_pipeline_copy"
"""Marks a parameter that is a pipeline stage's copy of another stage's (counted once in the norm)."""


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients to a global norm across every mesh they live on; return that norm.

    Gradients may be plain tensors, DTensors on the FSDP mesh, on the TP mesh or on the 2-D
    FSDP x TP mesh. ``torch.nn.utils.get_total_norm`` reduces DTensors of one mesh correctly (a
    ``Shard`` placement becomes a ``Partial`` norm that ``full_tensor()`` sums; a ``Replicate`` is
    counted once), but cannot mix meshes, so norms are taken per mesh and combined here. The result
    is a plain tensor, identical on every rank, equal to the single-device norm of the same gradients.
    With pipeline parallel (``pp_mesh``) each rank holds its stages' parameters only: the norms of
    the ``pp`` ranks are combined too. A last stage's copy of a parameter the first stage holds (the
    embedding, marked :data:`PIPELINE_COPY`; ``portatrain.parallel.pipeline``) is clipped, not counted:
    the matrix counts once, as in one process.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    groups: dict[Any, list[torch.Tensor]] = {}  # parameters by their gradient's mesh
    for param in params:
        key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
        groups.setdefault(key, []).append(param)
    norms = []
    for group in groups.values():
        counted = [p.grad for p in group if not getattr(p, PIPELINE_COPY, False)]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    norms = torch.stack([n.to(device) for n in norms])
    total = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum().pow(1.0 / norm_type)
    if pp_mesh is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        total = total if math.isinf(norm_type) else total.pow(norm_type)
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())
        total = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    if math.isfinite(max_norm):
        # Per mesh as well: a foreach op cannot mix DTensors of different meshes (expert parallel's
        # experts have their own); ``total`` is a plain tensor, the same factor for every group.
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def dp_all_reduce(value: torch.Tensor, parallel_dims: ParallelDims | None, op: str = "sum") -> torch.Tensor:
    """``op`` (``sum`` or ``mean``) of ``value`` over the data-parallel ranks; identity on one rank.

    Tensor-parallel (and context-parallel) ranks of one data-parallel group read the same rows, so
    reducing over ``dp`` alone counts every row once.
    """
    return _all_reduce(value, None if parallel_dims is None else parallel_dims.dp_mesh, op)


def token_all_reduce(value: torch.Tensor, parallel_dims: ParallelDims | None) -> torch.Tensor:
    """Sum of ``value`` over the ranks holding different tokens: ``dp`` times ``cp`` (context-parallel
    ranks hold different positions of one row). For loss sums and per-token statistics."""
    return _all_reduce(value, None if parallel_dims is None else parallel_dims.loss_mesh, "sum")


def token_all_max(value: torch.Tensor, parallel_dims: ParallelDims | None) -> torch.Tensor:
    """Maximum of ``value`` over the same ranks as :func:`token_all_reduce` (QK-clip's logits)."""
    return _all_reduce(value, None if parallel_dims is None else parallel_dims.loss_mesh, "max")


def _all_reduce(value: torch.Tensor, mesh: Any, op: str) -> torch.Tensor:
    if mesh is None or mesh.size() == 1:
        return value
    out = value.detach().clone()
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    dist.all_reduce(out, op=reduce_op, group=mesh.get_group())
    return out / mesh.size() if op == "mean" else out
