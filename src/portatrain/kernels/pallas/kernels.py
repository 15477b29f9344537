"""Pallas (TPU) kernels for RMSNorm, SwiGLU and RoPE, forward and backward, as plain JAX functions.

Each public function takes and returns ``jax.Array`` s, with non-array arguments (``eps``,
``interpret``) static. :mod:`portatrain.kernels.pallas.bridge` turns them into PyTorch custom ops:
through TorchTPU's ``torch.tpu.pallas.jax_op`` on a TPU, or through JAX's CPU interpreter
(``interpret=True``) for the parity tests and the CPU proof run.

* :func:`rmsnorm_fwd` / :func:`rmsnorm_bwd` -- rows tiled along the grid, the whole hidden
  dimension in one block; the backward writes one partial weight-gradient row per block and sums
  them outside the kernel (a grid-wide reduction inside a kernel would serialize the grid).
* :func:`swiglu_fwd` / :func:`swiglu_bwd` -- elementwise over 2-D row x column tiles.
* :func:`rope_fwd` / :func:`rope_bwd` -- one (batch, head, sequence-block) tile per grid step; the
  rotation is a lane roll by ``head_dim/2`` with a sign mask, which Mosaic lowers to one XLU
  rotate instead of a lane-unaligned concatenate.

Every kernel computes in fp32 and casts once on store, so bf16 results differ from the PyTorch
reference (which rounds after each op) by about one bf16 ulp -- see ``parity.py`` for tolerances.

Block shapes keep Mosaic's TPU rule (the last two block dims are multiples of (8, 128) or span
the whole array) and a ~2 MiB per-buffer budget so double-buffered inputs and outputs fit the
default scoped VMEM of every TPU generation. The row grid uses ``pl.cdiv``: Pallas masks the
writes of the ragged last block, and the weight-gradient partials mask its rows explicitly.

``block_rows`` (static) overrides the row tile; the tests use 8 to force several blocks and a
ragged last one. Not yet run on a TPU: Mosaic lowering of these exact block shapes (notably
``pltpu.roll`` on a 64-lane head_dim) is unverified; the TPU interpreter checks the semantics.

Pallas API: ``jax.experimental.pallas`` (``pallas_call``, ``BlockSpec``, ``program_id``) and
``jax.experimental.pallas.tpu.roll``; see https://docs.jax.dev/en/latest/pallas/ .
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_BLOCK_BYTES = 2 * 1024 * 1024
"""Target size of one fp32 block; inputs and outputs are double-buffered in VMEM."""


def _row_block(n_rows: int, row_elems: int, block_rows: int | None) -> int:
    """Rows per block: ``block_rows`` if given (a multiple of 8), else the whole array if it fits
    the byte budget, else the largest multiple of 16 that does."""
    if block_rows is not None:
        if block_rows % 8:
            raise ValueError(f"block_rows={block_rows} must be a multiple of 8 (TPU sublane tiling)")
        rows = block_rows
    else:
        # Multiples of 16, not 8: bf16 packs two rows per sublane, so its native tile is (16, 128).
        rows = max(16, (_BLOCK_BYTES // (4 * row_elems)) // 16 * 16)
    return n_rows if n_rows <= rows else rows


def _col_block(n_cols: int) -> int:
    """Columns per block: the whole row up to 2048 lanes, else 2048 (a multiple of 128)."""
    return n_cols if n_cols <= 2048 else 2048


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


def _rmsnorm_fwd_kernel(x_ref: Any, w_ref: Any, o_ref: Any, *, eps: float) -> None:
    x = x_ref[...].astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = (x * inv_rms * w_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _rmsnorm_bwd_kernel(
    x_ref: Any, w_ref: Any, g_ref: Any, dx_ref: Any, dw_ref: Any, *, eps: float, n_rows: int, block: int
) -> None:
    # y = n * w with n = x * r, r = rsqrt(mean(x^2) + eps):
    #   dx = r * (g*w - n * mean(g*w*n)),  dw = sum over rows of g * n.
    x = x_ref[...].astype(jnp.float32)
    w = w_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = x * inv_rms
    gw = g * w
    dx = inv_rms * (gw - normed * jnp.mean(gw * normed, axis=-1, keepdims=True))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    # The last block may hang past the array: its extra rows hold whatever the pipeline read
    # (NaN under TPU interpret mode), so drop them from the weight-gradient partial.
    row = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, g.shape, 0)
    contrib = jnp.where(row < n_rows, g * normed, 0.0)
    dw_ref[...] = jnp.sum(contrib, axis=0, keepdims=True)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_rows"))
def rmsnorm_fwd(
    x: jax.Array, weight: jax.Array, eps: float, interpret: Any = False, block_rows: int | None = None
) -> jax.Array:
    """RMSNorm of ``x`` ``[..., D]`` with gain ``weight`` ``[D]``; output in ``x.dtype``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, d = x2.shape
    block = _row_block(n, d, block_rows)
    out = pl.pallas_call(
        functools.partial(_rmsnorm_fwd_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct((n, d), x.dtype),
        grid=(pl.cdiv(n, block),),
        in_specs=[pl.BlockSpec((block, d), lambda i: (i, 0)), pl.BlockSpec((1, d), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((block, d), lambda i: (i, 0)),
        interpret=interpret,
    )(x2, weight.reshape(1, d))
    return out.reshape(shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_rows"))
def rmsnorm_bwd(
    x: jax.Array,
    weight: jax.Array,
    grad: jax.Array,
    eps: float,
    interpret: Any = False,
    block_rows: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gradients ``(dx, dweight)`` of :func:`rmsnorm_fwd` for output gradient ``grad``."""
    shape = x.shape
    x2, g2 = x.reshape(-1, shape[-1]), grad.reshape(-1, shape[-1])
    n, d = x2.shape
    block = _row_block(n, d, block_rows)
    n_blocks = pl.cdiv(n, block)
    dx, dw_partial = pl.pallas_call(
        functools.partial(_rmsnorm_bwd_kernel, eps=eps, n_rows=n, block=block),
        out_shape=(
            jax.ShapeDtypeStruct((n, d), x.dtype),
            # [blocks, 1, D]: a (1, D) block spans the array's last two dims, as Mosaic requires.
            jax.ShapeDtypeStruct((n_blocks, 1, d), jnp.float32),
        ),
        grid=(n_blocks,),
        in_specs=[
            pl.BlockSpec((block, d), lambda i: (i, 0)),
            pl.BlockSpec((1, d), lambda i: (0, 0)),
            pl.BlockSpec((block, d), lambda i: (i, 0)),
        ],
        out_specs=(
            pl.BlockSpec((block, d), lambda i: (i, 0)),
            pl.BlockSpec((None, 1, d), lambda i: (i, 0, 0)),
        ),
        interpret=interpret,
    )(x2, weight.reshape(1, d), g2)
    return dx.reshape(shape), dw_partial.sum(axis=(0, 1)).astype(weight.dtype)


# ---------------------------------------------------------------------------------------------
# SwiGLU activation
# ---------------------------------------------------------------------------------------------


def _swiglu_fwd_kernel(gate_ref: Any, up_ref: Any, o_ref: Any) -> None:
    gate = gate_ref[...].astype(jnp.float32)
    up = up_ref[...].astype(jnp.float32)
    o_ref[...] = (gate * jax.nn.sigmoid(gate) * up).astype(o_ref.dtype)


def _swiglu_bwd_kernel(gate_ref: Any, up_ref: Any, g_ref: Any, dgate_ref: Any, dup_ref: Any) -> None:
    # d silu(a)/da = s * (1 + a * (1 - s)) with s = sigmoid(a).
    gate = gate_ref[...].astype(jnp.float32)
    up = up_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    dgate_ref[...] = (g * up * sig * (1.0 + gate * (1.0 - sig))).astype(dgate_ref.dtype)
    dup_ref[...] = (g * gate * sig).astype(dup_ref.dtype)


def _elementwise_call(
    kernel: Any, arrays: list[jax.Array], n_out: int, interpret: Any, block_rows: int | None
) -> Any:
    """Run an elementwise ``kernel`` over same-shape ``arrays`` viewed as ``[rows, last dim]``."""
    shape, dtype = arrays[0].shape, arrays[0].dtype
    flat = [a.reshape(-1, shape[-1]) for a in arrays]
    n, f = flat[0].shape
    cols = _col_block(f)
    rows = _row_block(n, cols, block_rows)
    spec = pl.BlockSpec((rows, cols), lambda i, j: (i, j))
    out_shape = jax.ShapeDtypeStruct((n, f), dtype)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape if n_out == 1 else (out_shape,) * n_out,
        grid=(pl.cdiv(n, rows), pl.cdiv(f, cols)),
        in_specs=[spec] * len(flat),
        out_specs=spec if n_out == 1 else (spec,) * n_out,
        interpret=interpret,
    )(*flat)
    if n_out == 1:
        return outs.reshape(shape)
    return tuple(o.reshape(shape) for o in outs)


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows"))
def swiglu_fwd(
    gate: jax.Array, up: jax.Array, interpret: Any = False, block_rows: int | None = None
) -> jax.Array:
    """``silu(gate) * up`` for same-shape ``gate``/``up``; output in their dtype."""
    return _elementwise_call(_swiglu_fwd_kernel, [gate, up], 1, interpret, block_rows)


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows"))
def swiglu_bwd(
    gate: jax.Array, up: jax.Array, grad: jax.Array, interpret: Any = False, block_rows: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Gradients ``(dgate, dup)`` of :func:`swiglu_fwd` for output gradient ``grad``."""
    return _elementwise_call(_swiglu_bwd_kernel, [gate, up, grad], 2, interpret, block_rows)


# ---------------------------------------------------------------------------------------------
# Rotary embedding (half-split rotate_half layout)
# ---------------------------------------------------------------------------------------------


def _rope_kernel(x_ref: Any, cos_ref: Any, sin_ref: Any, o_ref: Any, *, inverse: bool) -> None:
    # rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1.., +1..]: a roll by half the lanes swaps
    # the halves (in either direction), the sign mask negates the new first half.
    x = x_ref[...].astype(jnp.float32)
    half = x.shape[-1] // 2
    lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    rotated = pltpu.roll(x, half, x.ndim - 1) * jnp.where(lane < half, -1.0, 1.0)
    sin = sin_ref[...].astype(jnp.float32)
    # The transpose of rotate_half is -rotate_half, and the tables repeat each angle in both
    # halves (sin commutes with the rotation), so the backward is the forward with -sin.
    if inverse:
        sin = -sin
    o_ref[...] = (x * cos_ref[...].astype(jnp.float32) + rotated * sin).astype(o_ref.dtype)


def _rope_call(
    x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool, interpret: Any, block_rows: int | None
) -> jax.Array:
    batch, heads, seq, dim = x.shape
    # Tables arrive as [S, D] (shared) or [B, 1, S, D] (per-row positions): view them as [B', S, D].
    cos3 = cos.reshape(-1, cos.shape[-2], cos.shape[-1])
    sin3 = sin.reshape(-1, sin.shape[-2], sin.shape[-1])
    per_row = cos3.shape[0] > 1
    block = _row_block(seq, dim, block_rows)

    def table_index(b: Any, h: Any, s: Any) -> tuple[Any, Any, Any]:
        return (b if per_row else 0, s, 0)

    table_spec = pl.BlockSpec((None, block, dim), table_index)
    x_spec = pl.BlockSpec((None, None, block, dim), lambda b, h, s: (b, h, s, 0))
    return pl.pallas_call(
        functools.partial(_rope_kernel, inverse=inverse),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(batch, heads, pl.cdiv(seq, block)),
        in_specs=[x_spec, table_spec, table_spec],
        out_specs=x_spec,
        interpret=interpret,
    )(x, cos3, sin3)


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows"))
def rope_fwd(
    x: jax.Array, cos: jax.Array, sin: jax.Array, interpret: Any = False, block_rows: int | None = None
) -> jax.Array:
    """Rotary embedding of ``x`` ``[B, H, S, D]`` with ``cos``/``sin`` ``[S, D]`` or ``[B, 1, S, D]``."""
    return _rope_call(x, cos, sin, inverse=False, interpret=interpret, block_rows=block_rows)


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows"))
def rope_bwd(
    grad: jax.Array, cos: jax.Array, sin: jax.Array, interpret: Any = False, block_rows: int | None = None
) -> jax.Array:
    """Gradient of :func:`rope_fwd` with respect to ``x`` (the tables get none: they are buffers)."""
    return _rope_call(grad, cos, sin, inverse=True, interpret=interpret, block_rows=block_rows)
