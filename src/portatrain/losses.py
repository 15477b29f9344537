"""The next-token loss, plain or memory-lean (``trainer.loss=plain|chunked``).

The plain loss takes the model's logits ``[B, S, V]`` and runs ``F.cross_entropy`` on them: the
logits, their fp32 log-softmax and, in backward, their gradient are each ``B * S * V`` elements.
At Llama 3's 128,256-entry vocabulary that is 1 GiB per 2,048 positions *per tensor* in fp32 --
usually the largest activation of the whole step.

:func:`chunked_cross_entropy` never builds them. It receives the final hidden states ``[N, D]``
and the output projection's matrix ``[V, D]`` and walks the positions ``chunk_size`` at a time:
project one chunk to its logits, take the loss, and -- this is the memory trick -- compute that
chunk's gradients right away (``softmax - one_hot``, then ``@ W`` for the hidden states and
``^T @ h`` for the matrix), so the chunk's logits can be freed before the next chunk. Backward
then only scales the stored gradients by the incoming scalar. Peak extra memory is one chunk of
logits plus a gradient the size of the hidden states and one the size of the matrix (which the
plain loss's backward also creates).

Why gradients in forward rather than a backward that recomputes each chunk's logits: the loss is a
scalar, so its backward is exact as ``grad_output * stored_grad``; recomputing costs one more
``N x D x V`` matmul (a third more output-head FLOPs, the dominant cost at a large vocabulary and a
small model), whereas this costs the same FLOPs as the plain loss. (Liger-Kernel's fused linear
cross-entropy does the same; Apple's Cut Cross-Entropy goes further with a fused kernel.) The cost:
gradients are computed even if the caller never calls backward -- so under ``torch.no_grad`` (or
when neither input requires a gradient) they are skipped.

Where it runs: inside the model's ``forward`` (the model calls ``output_fn(hidden, weight)`` in
place of its output projection, see the families' ``forward``), so FSDP2 has the output matrix
gathered, as for the plain head; FSDP2 finishes the head's parameter group itself when the
``lm_head`` module is not called. Under tensor parallelism the matrix is a ``DTensor`` sharded
over the vocabulary: each rank projects onto its own vocabulary slice only and the softmax's max,
sum and target logit are all-reduced over the ``tp`` group (a vocabulary-parallel loss: no rank
ever holds the full logits, not even a chunk of them), then the hidden states' gradient
(a partial sum over vocabulary shards) is all-reduced once.

The trainer (``portatrain.trainer``) uses it with ``trainer.loss=chunked`` unless a subclass
overrides ``compute_loss(logits, batch)``: that hook's contract takes full logits, so an override
keeps the plain path and its logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

LOSSES = ("plain", "chunked")
"""Allowed values of ``trainer.loss``."""

IGNORE_INDEX = -100


def loss_problems(loss: str, chunk_size: int) -> list[str]:
    """Problems of ``trainer.loss`` / ``trainer.loss_chunk_size`` (the validator's loss check)."""
    problems = []
    if loss not in LOSSES:
        problems.append(f"trainer.loss={loss!r} is not one of {', '.join(LOSSES)}")
    if chunk_size <= 0:
        problems.append(
            f"trainer.loss_chunk_size={chunk_size} must be positive (positions per chunk, e.g. 1024)"
        )
    return problems


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain loss: sum of next-token cross-entropy over positions whose label is not -100."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(hidden @ weight.T, labels))`` chunk by chunk, gradients computed in forward.

    ``weight`` may be this rank's vocabulary shard (rows ``[vocab_start, vocab_start + V_local)``),
    with ``group`` the process group over which the vocabulary is split; ``group=None`` is the
    whole vocabulary on this rank.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        group: dist.ProcessGroup | None,
        vocab_start: int,
    ) -> torch.Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        vocab_local = weight.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulation over chunks whatever the compute dtype (the plain path's autograd
        # accumulates in the parameter's dtype; fp32 is never worse).
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            y = labels[start : start + chunk_size]
            logits = F.linear(h, weight).float()  # [n, V_local]; autocast picks the matmul dtype
            valid = y != IGNORE_INDEX
            local_y = y - vocab_start
            owned = valid & (local_y >= 0) & (local_y < vocab_local)
            index = local_y.clamp(0, vocab_local - 1).unsqueeze(1)
            target = torch.where(owned, logits.gather(1, index).squeeze(1), 0.0)
            # log-sum-exp in place on the chunk's logits (no second [n, V] buffer): they become
            # exp(logits - max), then the softmax that the gradient starts from.
            row_max = logits.amax(dim=-1)
            if group is not None:  # vocabulary-parallel: global max, global sum, the owner's target
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            probs = logits.sub_(row_max.unsqueeze(1)).exp_()
            sum_exp = probs.sum(dim=-1)
            if group is not None:
                dist.all_reduce(sum_exp, group=group)
                dist.all_reduce(target, group=group)  # only the owning rank contributed
            lse = row_max + sum_exp.log()
            loss += torch.where(valid, lse - target, 0.0).sum()
            if not (need_hidden or need_weight):
                continue
            # d loss / d logits = softmax - one_hot(label), zero on ignored rows.
            grad = probs.div_(sum_exp.unsqueeze(1))
            grad.scatter_add_(1, index, -owned.to(grad.dtype).unsqueeze(1))
            grad.mul_(valid.unsqueeze(1).to(grad.dtype))
            # The matmuls run in the forward's precision (autocast casts them as it cast the projection).
            grad = grad.to(weight.dtype)
            if need_hidden:
                grad_hidden[start : start + chunk_size] = grad @ weight
            if need_weight:
                if h.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type):
                    grad_weight.addmm_(grad.t(), h)  # no [V, D] temporary
                else:
                    grad_weight += (grad.t() @ h).float()
            del logits, probs, grad
        if need_hidden and group is not None:
            dist.all_reduce(grad_hidden, group=group)  # each rank holds its vocabulary shard's share
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # In place: no second [V, D] buffer. A second backward through the same graph then fails
        # loudly (autograd's version check on saved tensors) instead of scaling twice.
        out_hidden = grad_hidden.mul_(grad_loss).to(hidden_dtype) if grad_hidden is not None else None
        out_weight = grad_weight.mul_(grad_loss).to(weight_dtype) if grad_weight is not None else None
        return out_hidden, out_weight, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 1024
) -> torch.Tensor:
    """Sum of ``cross_entropy(hidden @ weight.T, labels)`` over labels != -100, without full logits.

    Args:
        hidden: ``[..., D]`` final (normalized) hidden states; a ``DTensor`` under tensor parallelism
            (any placement: it is replicated here).
        weight: ``[V, D]`` output projection (``lm_head.weight``, or the tied embedding); a
            ``DTensor`` sharded over the vocabulary (``Shard(0)``) or replicated under tensor
            parallelism.
        labels: ``[...]`` target ids, ``-100`` where no loss is taken (same leading shape as hidden).
        chunk_size: positions projected at once; peak extra memory is about
            ``chunk_size * V_local * 4`` bytes (fp32 logits) times two.

    Returns:
        A 0-dim fp32 tensor (a plain tensor, also under tensor parallelism: every ``tp`` rank holds
        the same value), differentiable with respect to ``hidden`` and ``weight``.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    group, vocab_start = None, 0
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(weight, DTensor):
        placements = tuple(weight.placements)
        if (
            len(placements) != 1
            or not isinstance(placements[0], (Shard, Replicate))
            or (isinstance(placements[0], Shard) and placements[0].dim != 0)
        ):
            raise ValueError(
                f"chunked_cross_entropy supports an output matrix sharded over the vocabulary "
                f"(Shard(0)) or replicated on a 1-D mesh, got placements {placements}; use trainer.loss=plain"
            )
        if isinstance(placements[0], Shard):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, placements)
            vocab_start, group = int(offset[0]), weight.device_mesh.get_group()
        weight = weight.to_local()  # backward hands this shard's gradient back as a Shard(0) DTensor
    if isinstance(hidden, DTensor):
        # Every rank needs every position (its vocabulary slice of all of them). The gradient this
        # function returns is the full, all-reduced one, so Replicate is its true placement.
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree: "
            "labels must have the hidden states' shape without the last dimension"
        )
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size, group, vocab_start
    )


class ChunkedLoss:
    """The ``output_fn(hidden, weight)`` a model's forward calls in place of its output projection:
    :func:`chunked_cross_entropy` against ``labels``. :meth:`with_labels` is the same loss against
    other targets, for heads beside the main one (multi-token prediction's depths), so they never
    build full logits either."""

    def __init__(self, labels: torch.Tensor, chunk_size: int) -> None:
        self.labels, self.chunk_size = labels, chunk_size

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(hidden, weight, self.labels, chunk_size=self.chunk_size)

    def with_labels(self, labels: torch.Tensor) -> ChunkedLoss:
        return ChunkedLoss(labels, self.chunk_size)


def chunked_loss_fn(labels: torch.Tensor, chunk_size: int) -> ChunkedLoss:
    """The ``output_fn(hidden, weight)`` of ``trainer.loss=chunked`` (:class:`ChunkedLoss`)."""
    return ChunkedLoss(labels, chunk_size)


__all__ = [
    "LOSSES",
    "ChunkedLoss",
    "chunked_cross_entropy",
    "chunked_loss_fn",
    "cross_entropy_sum",
    "loss_problems",
]
