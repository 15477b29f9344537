"""The one ``torch.library`` registration every kernel override goes through.

A kernel reaches PyTorch as two custom ops, ``portatrain::<override>`` (forward) and
``portatrain::<override>_bwd`` (backward), joined by ``register_autograd``. ``torch.compile`` sees
each as a single opaque node with a fake (meta) implementation for shape propagation, so a
compiled graph keeps the kernel in place instead of breaking around it.

Who creates the two ops differs per bridge; the autograd rule attached to them does not:

* :func:`define` -- ops whose implementation is a host Python function on torch tensors (the Pallas
  interpret-mode bridge): registered here with ``torch.library.custom_op`` and the fakes below.
* TorchTPU's ``torch.tpu.pallas.jax_op`` and torch_neuronx's ``nki_op`` create the ops themselves;
  the bridges then call :func:`attach_autograd` on what they return.

The schemas (one per operation, :data:`SCHEMAS`) are the contract: a backward returns one gradient
per tensor input, shaped like that input, and every output is contiguous (:data:`FAKES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SCHEMAS: dict[str, tuple[str, str]] = {
    "rmsnorm": (
        "(Tensor x, Tensor weight, float eps) -> Tensor",
        "(Tensor x, Tensor weight, Tensor grad, float eps) -> (Tensor, Tensor)",
    ),
    "swiglu": (
        "(Tensor gate, Tensor up) -> Tensor",
        "(Tensor gate, Tensor up, Tensor grad) -> (Tensor, Tensor)",
    ),
    "rope": (
        "(Tensor x, Tensor cos, Tensor sin) -> Tensor",
        "(Tensor grad, Tensor cos, Tensor sin) -> Tensor",
    ),
}
"""Forward and backward schema of each operation's custom ops."""


# Fakes promise contiguous outputs (``new_empty``, not ``empty_like``, which would copy a
# transposed input's strides): every implementation returns contiguous tensors, and a compiled
# graph that views an output relies on the fake's strides being the real ones.


def _fake_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


def _fake_rmsnorm_bwd(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _fake_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate.new_empty(gate.shape)


def _fake_swiglu_bwd(
    gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _fake_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


FAKES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "rmsnorm": (_fake_rmsnorm, _fake_rmsnorm_bwd),
    "swiglu": (_fake_swiglu, _fake_swiglu_bwd),
    "rope": (_fake_rope, _fake_rope),
}
"""Forward and backward fake implementations: outputs shaped (and typed) like the inputs."""


# --- autograd rules: save what the backward op needs, call it, return one grad per input ---


def _rmsnorm_autograd(bwd: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        dx, dweight = bwd(x, weight, grad, ctx.eps)
        return dx, dweight, None

    return setup_context, backward


def _swiglu_autograd(bwd: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gate, up = ctx.saved_tensors
        return tuple(bwd(gate, up, grad))

    return setup_context, backward


def _rope_autograd(bwd: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, cos, sin = inputs
        ctx.save_for_backward(cos, sin)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        cos, sin = ctx.saved_tensors
        # cos/sin are non-trainable buffers (rebuilt by init_weights): no gradient for them.
        return bwd(grad, cos, sin), None, None

    return setup_context, backward


_AUTOGRAD = {"rmsnorm": _rmsnorm_autograd, "swiglu": _swiglu_autograd, "rope": _rope_autograd}


def attach_autograd(operation: str, fwd: Any, bwd: Callable[..., Any]) -> Any:
    """Register ``bwd`` (a callable with the operation's backward schema) as ``fwd`` 's gradient."""
    setup_context, backward = _AUTOGRAD[operation](bwd)
    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd


_DEFINED: dict[str, Any] = {}


def define(qualname: str, operation: str, fwd_impl: Callable[..., Any], bwd_impl: Callable[..., Any]) -> Any:
    """Register ``qualname`` and ``qualname + "_bwd"`` from host implementations; return the forward op.

    Idempotent per process: ``torch.library`` allows one definition per name, so a second call
    returns the op made by the first.
    """
    if qualname in _DEFINED:
        return _DEFINED[qualname]
    fwd_schema, bwd_schema = SCHEMAS[operation]
    fake_fwd, fake_bwd = FAKES[operation]
    fwd = torch.library.custom_op(qualname, fwd_impl, mutates_args=(), schema=fwd_schema)
    fwd.register_fake(fake_fwd)
    bwd = torch.library.custom_op(qualname + "_bwd", bwd_impl, mutates_args=(), schema=bwd_schema)
    bwd.register_fake(fake_bwd)
    _DEFINED[qualname] = attach_autograd(operation, fwd, bwd)
    return _DEFINED[qualname]
