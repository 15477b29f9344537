"""Grouped matmuls for a mixture of experts: every group of rows times its own matrix, as custom ops.

* :func:`grouped_linear` -- ``x[offs[g-1]:offs[g]] @ w[g].T`` for every group ``g``, with its
  backward (:func:`grouped_mm` for the input's gradient, :func:`grouped_outer` for the weight's);
* ``torch._grouped_mm`` where the accelerator adapter says it runs in the dtype
  (``Accelerator.supports_grouped_mm``, passed down by ``moe.configure_moe``) and the rows are
  16-byte aligned, a loop over the groups elsewhere.

Custom ops, opaque to ``torch.compile`` (their output shapes are static), so a compiled block never
traces the data-dependent group sizes.
"""

from __future__ import annotations

import torch


def _native_grouped_mm(native: bool, *tensors: torch.Tensor) -> bool:
    """Whether to call ``torch._grouped_mm``: the device runs it in this dtype (``native``, the
    accelerator adapter's answer, ``Accelerator.supports_grouped_mm``) and every row stride is a
    multiple of 16 bytes (its alignment rule)."""
    return native and all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # a host sync: the fallback path only
    return list(zip([0, *ends[:-1]], ends, strict=True))


@torch.library.custom_op("portatrain::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, native: bool) -> torch.Tensor:
    """``[N, K] x [G, K, M] -> [N, M]``: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]`` (``offs``:
    int32 cumulative group ends, ``offs[-1] == N``); ``native``: ``torch._grouped_mm`` may run."""
    if _native_grouped_mm(native, a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    for g, (start, end) in enumerate(_group_bounds(offs)):
        out[start:end] = a[start:end] @ b[g]
    return out


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, native: bool) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("portatrain::grouped_outer", mutates_args=())
def grouped_outer(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, native: bool) -> torch.Tensor:
    """``[N, K], [N, M] -> [G, K, M]``: ``a[group].T @ b[group]`` per group (a weight gradient)."""
    if _native_grouped_mm(native, a, b) and a.shape[0] * a.element_size() % 16 == 0:
        return torch._grouped_mm(a.t(), b, offs=offs)
    out = a.new_zeros(offs.shape[0], a.shape[1], b.shape[1])
    for g, (start, end) in enumerate(_group_bounds(offs)):
        out[g] = a[start:end].t() @ b[start:end]
    return out


@grouped_outer.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, native: bool) -> torch.Tensor:
    return a.new_empty(offs.shape[0], a.shape[1], b.shape[1])


@torch.library.custom_op("portatrain::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, native: bool) -> torch.Tensor:
    """``nn.Linear`` per group: rows of group ``g`` times ``weight[g].T`` (``weight [G, out, in]``, the
    layout the experts store, so gradients come back in it with no copy)."""
    return grouped_mm(x, weight.transpose(1, 2), offs, native)


@grouped_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, native: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def _grouped_linear_setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    x, weight, offs, native = inputs
    ctx.save_for_backward(x, weight, offs)
    ctx.native = native


def _grouped_linear_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    x, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grouped_mm(grad, weight, offs, ctx.native) if ctx.needs_input_grad[0] else None
    grad_weight = grouped_outer(grad, x, offs, ctx.native) if ctx.needs_input_grad[1] else None
    return grad_x, grad_weight, None, None


grouped_linear.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)
