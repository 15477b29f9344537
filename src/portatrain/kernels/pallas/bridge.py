"""PyTorch custom ops around the Pallas kernels: TorchTPU's bridge on TPU, JAX's interpreter on CPU.

:func:`build` returns, for one operation, a callable with the reference's signature that runs the
kernel in :mod:`portatrain.kernels.pallas.kernels` as a ``torch.library`` custom op with an
autograd rule (:mod:`portatrain.kernels.custom_ops`). Two bridges make the op:

``mode="tpu"`` -- TorchTPU's ``torch.tpu.pallas.jax_op(name, fn)`` (torch-tpu 0.2.0,
    ``torch_tpu/_internal/pallas/pallas.py``, exported as ``torch.tpu.pallas.jax_op`` by
    ``torch_tpu/_internal/public_api.py``). It reads ``fn`` 's annotations: ``jax.Array``
    parameters become tensors, the others (``eps``) static arguments hashed into the compile
    cache; it jits and exports ``fn`` per input signature, runs it on the TPU through the PJRT
    custom-kernel path, and registers a fake that traces ``fn`` for output shapes. It registers no
    autograd, so the backward kernel becomes a second ``jax_op`` and :func:`attach_autograd`
    joins them -- the same shape as TorchTPU's own splash attention
    (``torch_tpu/_internal/ops/splash_attention.py``). Needs a TPU host with torch_tpu and jax.

``mode="interpret"`` -- for CPU: the same JAX functions with ``interpret=True`` (Pallas'
    interpreter, which runs the kernel body through XLA:CPU), registered with
    ``torch.library.custom_op``; tensors cross by DLPack. This is what the parity tests and the
    CPU proof run use: identical kernel code and identical autograd rule, only the bridge differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from portatrain.kernels import custom_ops
from portatrain.kernels.pallas import kernels as K

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _to_jax(t: torch.Tensor) -> jax.Array:
    if t.device.type != "cpu":
        raise ValueError(
            f"the Pallas interpret-mode bridge runs on CPU tensors, got one on {t.device}; "
            "on a TPU enable pallas_* overrides instead of pallas_interpret_*"
        )
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"Pallas kernels take {_SUPPORTED_DTYPES}, got {t.dtype}")
    return jnp.from_dlpack(t.detach().contiguous())


def _to_torch(a: jax.Array) -> torch.Tensor:
    # Copy out of JAX's buffer: JAX assumes its arrays immutable, while autograd may accumulate
    # into a returned gradient in place.
    return torch.from_dlpack(a).clone()


def _interpret_impls(operation: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if operation == "rmsnorm":

        def fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return _to_torch(K.rmsnorm_fwd(_to_jax(x), _to_jax(weight), eps, interpret=True))

        def bwd(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float) -> Any:
            dx, dw = K.rmsnorm_bwd(_to_jax(x), _to_jax(weight), _to_jax(grad), eps, interpret=True)
            return _to_torch(dx), _to_torch(dw)

    elif operation == "swiglu":

        def fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return _to_torch(K.swiglu_fwd(_to_jax(gate), _to_jax(up), interpret=True))

        def bwd(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> Any:
            dgate, dup = K.swiglu_bwd(_to_jax(gate), _to_jax(up), _to_jax(grad), interpret=True)
            return _to_torch(dgate), _to_torch(dup)

    elif operation == "rope":

        def fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return _to_torch(K.rope_fwd(_to_jax(x), _to_jax(cos), _to_jax(sin), interpret=True))

        def bwd(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return _to_torch(K.rope_bwd(_to_jax(grad), _to_jax(cos), _to_jax(sin), interpret=True))

    else:
        raise KeyError(f"no Pallas kernel for operation {operation!r}")
    return fwd, bwd


# --- TPU: annotated JAX entry points for jax_op (it derives the op schema from these) ---


def _tpu_rmsnorm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return K.rmsnorm_fwd(x, weight, eps)


def _tpu_rmsnorm_bwd(
    x: jax.Array, weight: jax.Array, grad: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    return K.rmsnorm_bwd(x, weight, grad, eps)


def _tpu_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return K.swiglu_fwd(gate, up)


def _tpu_swiglu_bwd(gate: jax.Array, up: jax.Array, grad: jax.Array) -> tuple[jax.Array, jax.Array]:
    return K.swiglu_bwd(gate, up, grad)


def _tpu_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # jax_op hands the tables over in their own dtype (fp32); the kernel casts per tile.
    return K.rope_fwd(x, cos, sin)


def _tpu_rope_bwd(grad: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return K.rope_bwd(grad, cos, sin)


_TPU_FNS = {
    "rmsnorm": (_tpu_rmsnorm, _tpu_rmsnorm_bwd),
    "swiglu": (_tpu_swiglu, _tpu_swiglu_bwd),
    "rope": (_tpu_rope, _tpu_rope_bwd),
}

_TPU_OPS: dict[str, Any] = {}


def _tpu_op(operation: str) -> Any:
    if operation in _TPU_OPS:
        return _TPU_OPS[operation]
    # torch.tpu exists only once torch_tpu is loaded, which the TPU accelerator adapter does.
    tpu = getattr(torch, "tpu", None)
    if tpu is None or not hasattr(tpu, "pallas"):
        raise RuntimeError(
            f"pallas_{operation} needs TorchTPU's torch.tpu.pallas bridge (torch_tpu on a TPU host); "
            "it is not loaded in this process"
        )
    fwd_fn, bwd_fn = _TPU_FNS[operation]
    name = f"portatrain::pallas_{operation}"
    fwd = tpu.pallas.jax_op(name, fwd_fn)
    bwd = tpu.pallas.jax_op(name + "_bwd", bwd_fn)
    _TPU_OPS[operation] = custom_ops.attach_autograd(operation, fwd, bwd)
    return _TPU_OPS[operation]


def build(operation: str, mode: str) -> Callable[..., torch.Tensor]:
    """The custom op running the Pallas kernel for ``operation`` through the ``mode`` bridge."""
    if mode == "tpu":
        return _tpu_op(operation)
    if mode == "interpret":
        fwd, bwd = _interpret_impls(operation)
        return custom_ops.define(f"portatrain::pallas_interpret_{operation}", operation, fwd, bwd)
    raise ValueError(f"unknown Pallas bridge mode {mode!r}; expected 'tpu' or 'interpret'")
