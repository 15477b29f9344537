"""PyTorch custom ops around the NKI kernels: torch_neuronx's ``nki_op`` on Trainium, ``nki.simulate`` on CPU.

The kernels (``kernels.py``) take 2-D ``[rows, hidden]`` tensors with ``rows`` a multiple of 128
(RoPE: ``[B, H, S, D]`` with ``S`` a multiple of 128); the functions here reshape and zero-pad to
that and slice back. Zero rows are harmless: RMSNorm of a zero row is zero (``eps`` keeps the
rsqrt finite) and padded output gradients are zero, so they add nothing to the weight gradient.

``build_device`` -- ``torch_neuronx.nki_op(name, mutates_args=...)`` registers a function that
    calls an ``@nki.jit`` kernel as a PyTorch custom op, usable eagerly and as one node inside
    ``torch.compile(backend="neuron")``; a backward is added with ``register_autograd``
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html,
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/get-started/quickstart-nki-kernel.html).
    Padding happens outside the op, in differentiable PyTorch, so the op's gradient contract is the
    kernel's own shapes. Needs a Trainium host with torch-neuronx and nki. NOT RUN HERE.

``build_simulated`` -- ``nki.simulate(kernel)`` runs a kernel on NumPy arrays on the CPU
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.simulate.html);
    registered through :func:`portatrain.kernels.custom_ops.define` like the Pallas interpreter, so the
    parity check exercises the same autograd rule. fp32 only (NumPy has no bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from portatrain.kernels import custom_ops
from portatrain.kernels.nki import kernels as K

_TILE = 128
"""Rows per partition tile (``nl.tile_size.pmax``)."""


def _pad_dim(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """``t`` zero-padded along ``dim`` to a multiple of 128, and the original length."""
    n = t.shape[dim]
    pad = (-n) % _TILE
    if not pad:
        return t, n
    widths = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, pad]
    return F.pad(t, widths), n


def _rope_tables(cos: torch.Tensor) -> torch.Tensor:
    """``[S, D]`` or ``[B, 1, S, D]`` -> ``[B', S, D]``."""
    return cos.reshape(-1, cos.shape[-2], cos.shape[-1])


# --- Trainium: nki_op ---

_DEVICE: dict[str, Callable[..., torch.Tensor]] = {}


def _register(nki_op: Any, name: str, fn: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    op = nki_op(name, mutates_args=())(fn)
    if getattr(op, "_abstract_fn", None) is None:  # nki_op may infer one already
        op.register_fake(fake)
    return op


def build_device(operation: str) -> Callable[..., torch.Tensor]:
    """The ``nki_<operation>`` callable (reference signature) running on a NeuronCore."""
    if operation in _DEVICE:
        return _DEVICE[operation]
    from torch_neuronx import nki_op

    Tensor = torch.Tensor
    if operation == "rmsnorm":

        def rms_fwd(x: Tensor, weight: Tensor, eps: float) -> Tensor:
            return K.rmsnorm_fwd_kernel(x, weight, eps)

        def rms_bwd(x: Tensor, weight: Tensor, grad: Tensor, eps: float) -> tuple[Tensor, Tensor]:
            return K.rmsnorm_bwd_kernel(x, weight, grad, eps)

        fwd = _register(nki_op, "portatrain::nki_rmsnorm", rms_fwd, lambda x, w, eps: x.new_empty(x.shape))
        bwd = _register(
            nki_op,
            "portatrain::nki_rmsnorm_bwd",
            rms_bwd,
            lambda x, w, g, eps: (x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.float32)),
        )

        def rms_grads(x: Tensor, weight: Tensor, grad: Tensor, eps: float) -> tuple[Tensor, Tensor]:
            dx, dw_rows = bwd(x, weight, grad, eps)
            return dx, dw_rows.sum(0, keepdim=True).to(weight.dtype)

        custom_ops.attach_autograd("rmsnorm", fwd, rms_grads)

        def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
            d = x.shape[-1]
            x2, n = _pad_dim(x.reshape(-1, d), 0)
            return fwd(x2, weight.reshape(1, d), eps)[:n].reshape(x.shape)

        _DEVICE[operation] = rmsnorm
    elif operation == "swiglu":

        def swi_fwd(gate: Tensor, up: Tensor) -> Tensor:
            return K.swiglu_fwd_kernel(gate, up)

        def swi_bwd(gate: Tensor, up: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
            return K.swiglu_bwd_kernel(gate, up, grad)

        fwd = _register(nki_op, "portatrain::nki_swiglu", swi_fwd, custom_ops.FAKES["swiglu"][0])
        bwd = _register(nki_op, "portatrain::nki_swiglu_bwd", swi_bwd, custom_ops.FAKES["swiglu"][1])
        custom_ops.attach_autograd("swiglu", fwd, bwd)

        def swiglu(gate: Tensor, up: Tensor) -> Tensor:
            f = gate.shape[-1]
            g2, n = _pad_dim(gate.reshape(-1, f), 0)
            u2, _ = _pad_dim(up.reshape(-1, f), 0)
            return fwd(g2, u2)[:n].reshape(gate.shape)

        _DEVICE[operation] = swiglu
    elif operation == "rope":

        def rope_fwd(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            return K.rope_kernel(x, cos, sin)

        fwd = _register(nki_op, "portatrain::nki_rope", rope_fwd, custom_ops.FAKES["rope"][0])
        # Backward = the forward kernel with -sin (see kernels.rope_kernel).
        custom_ops.attach_autograd("rope", fwd, lambda grad, cos, sin: fwd(grad, cos, -sin))

        def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            seq = x.shape[2]
            x4, _ = _pad_dim(x, 2)
            cos3, _ = _pad_dim(_rope_tables(cos), 1)
            sin3, _ = _pad_dim(_rope_tables(sin), 1)
            return fwd(x4.contiguous(), cos3.contiguous(), sin3.contiguous())[:, :, :seq]

        _DEVICE[operation] = rope
    else:
        raise KeyError(f"no NKI kernel for operation {operation!r}")
    return _DEVICE[operation]


# --- CPU: nki.simulate ---


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.float32:
        raise TypeError(
            f"the NKI simulator bridge takes float32 tensors (NumPy has no bfloat16), got {t.dtype}"
        )
    return t.detach().contiguous().numpy()


def _torch(a: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32))


def _simulated_impls(operation: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    import nki

    if operation == "rmsnorm":

        def fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            d = x.shape[-1]
            x2, n = _pad_dim(x.reshape(-1, d), 0)
            y = nki.simulate(K.rmsnorm_fwd_kernel)(_np(x2), _np(weight.reshape(1, d)), eps)
            return _torch(y)[:n].reshape(x.shape).contiguous()

        def bwd(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float) -> Any:
            d = x.shape[-1]
            x2, n = _pad_dim(x.reshape(-1, d), 0)
            g2, _ = _pad_dim(grad.reshape(-1, d), 0)
            dx, dw_rows = nki.simulate(K.rmsnorm_bwd_kernel)(_np(x2), _np(weight.reshape(1, d)), _np(g2), eps)
            return _torch(dx)[:n].reshape(x.shape).contiguous(), _torch(dw_rows).sum(0)

    elif operation == "swiglu":

        def fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            f = gate.shape[-1]
            g2, n = _pad_dim(gate.reshape(-1, f), 0)
            u2, _ = _pad_dim(up.reshape(-1, f), 0)
            return (
                _torch(nki.simulate(K.swiglu_fwd_kernel)(_np(g2), _np(u2)))[:n]
                .reshape(gate.shape)
                .contiguous()
            )

        def bwd(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> Any:
            f = gate.shape[-1]
            g2, n = _pad_dim(gate.reshape(-1, f), 0)
            u2, _ = _pad_dim(up.reshape(-1, f), 0)
            o2, _ = _pad_dim(grad.reshape(-1, f), 0)
            dgate, dup = nki.simulate(K.swiglu_bwd_kernel)(_np(g2), _np(u2), _np(o2))
            return (
                _torch(dgate)[:n].reshape(gate.shape).contiguous(),
                _torch(dup)[:n].reshape(up.shape).contiguous(),
            )

    elif operation == "rope":

        def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            seq = x.shape[2]
            x4, _ = _pad_dim(x, 2)
            cos3, _ = _pad_dim(_rope_tables(cos), 1)
            sin3, _ = _pad_dim(_rope_tables(sin), 1)
            y = nki.simulate(K.rope_kernel)(_np(x4), _np(cos3), _np(sin3))
            return _torch(y)[:, :, :seq].contiguous()

        def fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return _rope(x, cos, sin)

        def bwd(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return _rope(grad, cos, -sin)

    else:
        raise KeyError(f"no NKI kernel for operation {operation!r}")
    return fwd, bwd


def build_simulated(operation: str) -> Callable[..., torch.Tensor]:
    """The NKI kernel for ``operation`` in ``nki.simulate``, as a custom op with autograd (CPU, fp32)."""
    fwd, bwd = _simulated_impls(operation)
    return custom_ops.define(f"portatrain::nki_simulate_{operation}", operation, fwd, bwd)
