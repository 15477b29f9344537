"""NKI (Trainium) kernels for RMSNorm, SwiGLU and RoPE, forward and backward.

Written against the current NKI API -- the standalone ``nki`` package (``import nki``,
``nki.language as nl``, ``@nki.jit``), not the old ``neuronxcc.nki`` namespace. NOT RUN HERE: the
``nki`` package comes from AWS's Neuron pip repository (PyPI's ``nki`` is an empty placeholder),
so these kernels have been checked neither on a NeuronCore nor in ``nki.simulate``; their parity
tests (``tests/test_kernels_nki.py``) run wherever ``nki.simulate`` exists and skip elsewhere.

Documentation followed (AWS Neuron docs, "latest" as of Neuron SDK 2.33):

* ``@nki.jit``, ``nl.ndarray(..., buffer=nl.shared_hbm)``, ``nl.load``/``nl.store``,
  ``nl.affine_range``: https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html
  and the simulator quick start
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/guides/nki_simulator.html
* the RMSNorm tutorial's tiling (128 rows on the partition dimension, the hidden dimension on the
  free dimension, the gain broadcast across partitions with ``broadcast_to``):
  aws-neuron/aws-neuron-sdk ``nki/examples/rmsnorm/rmsnorm_nki_kernels.py``
* ``nl.silu``, ``nl.sigmoid``, ``nl.rsqrt``: https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.language.silu.html
  (and the sibling ``nki.language.sigmoid`` / ``rsqrt`` pages)
* the RoPE half-split arithmetic of the NKI Library's ``rope_hf`` (aws-neuron/nki-library,
  ``nkilib/core/embeddings/rope_hf.py``): ``[x1, x2] * cos + [-x2, x1] * sin`` on free-dim halves.

Shape contract (the torch side in ``bridge.py`` reshapes and pads to it): 2-D ``[rows, hidden]``
inputs with ``rows`` a multiple of 128 (one partition tile); RoPE takes ``[B, H, S, D]`` with ``S``
a multiple of 128 and tables ``[B', S, D]``. Every kernel computes in fp32 and stores in the input
dtype. The RMSNorm backward returns the per-row weight-gradient terms ``g * x / rms`` and leaves the
sum over rows to PyTorch (a cross-partition reduction is the obvious next optimisation).
"""

from __future__ import annotations

from typing import Any

import nki
import nki.language as nl

_FREE_CHUNK = 2048
"""Columns per SwiGLU tile: 3 fp32 tiles of 128 x 2048 stay well inside one partition's SBUF."""


def _col_chunk(cols: int) -> int:
    # Largest power-of-two chunk up to _FREE_CHUNK that divides cols; the whole row otherwise.
    chunk = _FREE_CHUNK
    while chunk >= 128:
        if cols % chunk == 0:
            return chunk
        chunk //= 2
    return cols


@nki.jit
def rmsnorm_fwd_kernel(x: Any, weight: Any, eps: float) -> Any:
    """``x`` ``[N, D]`` (N % 128 == 0), ``weight`` ``[1, D]`` -> ``x / rms(x) * weight``."""
    n, d = x.shape
    p = nl.tile_size.pmax
    out = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    w = nl.load(weight, dtype=nl.float32).broadcast_to((p, d))
    for i in nl.affine_range(n // p):
        xt = nl.load(x[i * p : (i + 1) * p, :], dtype=nl.float32)
        mean_sq = nl.multiply(nl.sum(nl.square(xt), axis=[1], keepdims=True), 1.0 / d)
        inv_rms = nl.rsqrt(nl.add(mean_sq, eps))
        y = nl.multiply(nl.multiply(xt, inv_rms), w, dtype=x.dtype)
        nl.store(out[i * p : (i + 1) * p, :], value=y)
    return out


@nki.jit
def rmsnorm_bwd_kernel(x: Any, weight: Any, grad: Any, eps: float) -> Any:
    """``(dx [N, D], dweight_rows [N, D] fp32)``; ``dweight`` is ``dweight_rows.sum(0)``.

    ``dx = r * (g*w - n * mean(g*w*n))`` with ``n = x * r``, ``r = rsqrt(mean(x^2) + eps)``.
    """
    n, d = x.shape
    p = nl.tile_size.pmax
    dx = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    dw_rows = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.shared_hbm)
    w = nl.load(weight, dtype=nl.float32).broadcast_to((p, d))
    for i in nl.affine_range(n // p):
        xt = nl.load(x[i * p : (i + 1) * p, :], dtype=nl.float32)
        gt = nl.load(grad[i * p : (i + 1) * p, :], dtype=nl.float32)
        mean_sq = nl.multiply(nl.sum(nl.square(xt), axis=[1], keepdims=True), 1.0 / d)
        inv_rms = nl.rsqrt(nl.add(mean_sq, eps))
        normed = nl.multiply(xt, inv_rms)
        gw = nl.multiply(gt, w)
        proj = nl.multiply(nl.sum(nl.multiply(gw, normed), axis=[1], keepdims=True), 1.0 / d)
        dxt = nl.multiply(nl.subtract(gw, nl.multiply(normed, proj)), inv_rms, dtype=x.dtype)
        nl.store(dx[i * p : (i + 1) * p, :], value=dxt)
        nl.store(dw_rows[i * p : (i + 1) * p, :], value=nl.multiply(gt, normed))
    return dx, dw_rows


@nki.jit
def swiglu_fwd_kernel(gate: Any, up: Any) -> Any:
    """``gate``, ``up`` ``[N, F]`` (N % 128 == 0) -> ``silu(gate) * up``."""
    n, f = gate.shape
    p = nl.tile_size.pmax
    c = _col_chunk(f)
    out = nl.ndarray((n, f), dtype=gate.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n // p):
        for j in nl.affine_range(f // c):
            a = nl.load(gate[i * p : (i + 1) * p, j * c : (j + 1) * c], dtype=nl.float32)
            b = nl.load(up[i * p : (i + 1) * p, j * c : (j + 1) * c], dtype=nl.float32)
            y = nl.multiply(nl.silu(a), b, dtype=gate.dtype)
            nl.store(out[i * p : (i + 1) * p, j * c : (j + 1) * c], value=y)
    return out


@nki.jit
def swiglu_bwd_kernel(gate: Any, up: Any, grad: Any) -> Any:
    """``(dgate, dup)``: ``dgate = g * up * silu'(gate)``, ``dup = g * silu(gate)``,
    with ``silu'(a) = s + silu(a) * (1 - s)``, ``s = sigmoid(a)``."""
    n, f = gate.shape
    p = nl.tile_size.pmax
    c = _col_chunk(f)
    dgate = nl.ndarray((n, f), dtype=gate.dtype, buffer=nl.shared_hbm)
    dup = nl.ndarray((n, f), dtype=up.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n // p):
        for j in nl.affine_range(f // c):
            a = nl.load(gate[i * p : (i + 1) * p, j * c : (j + 1) * c], dtype=nl.float32)
            b = nl.load(up[i * p : (i + 1) * p, j * c : (j + 1) * c], dtype=nl.float32)
            g = nl.load(grad[i * p : (i + 1) * p, j * c : (j + 1) * c], dtype=nl.float32)
            s = nl.sigmoid(a)
            silu = nl.multiply(a, s)
            dsilu = nl.add(s, nl.subtract(silu, nl.multiply(silu, s)))
            gb = nl.multiply(g, b)
            nl.store(
                dgate[i * p : (i + 1) * p, j * c : (j + 1) * c],
                value=nl.multiply(gb, dsilu, dtype=gate.dtype),
            )
            nl.store(
                dup[i * p : (i + 1) * p, j * c : (j + 1) * c], value=nl.multiply(g, silu, dtype=up.dtype)
            )
    return dgate, dup


@nki.jit
def rope_kernel(x: Any, cos: Any, sin: Any) -> Any:
    """``x`` ``[B, H, S, D]`` (S % 128 == 0), tables ``[B', S, D]`` with B' in {1, B}.

    Forward with ``sin``; the backward is the same kernel with ``-sin`` (the tables repeat each angle
    in both halves, so the transpose of the rotation is the rotation by the opposite angle).
    """
    batch, heads, seq, d = x.shape
    half = d // 2
    p = nl.tile_size.pmax
    per_row = cos.shape[0] > 1
    out = nl.ndarray((batch, heads, seq, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for b in nl.affine_range(batch):
        tb = b if per_row else 0
        for s in nl.affine_range(seq // p):
            c = nl.load(cos[tb, s * p : (s + 1) * p, :], dtype=nl.float32)
            sn = nl.load(sin[tb, s * p : (s + 1) * p, :], dtype=nl.float32)
            for h in nl.affine_range(heads):
                xt = nl.load(x[b, h, s * p : (s + 1) * p, :], dtype=nl.float32)
                # [x1, x2] * cos + [-x2, x1] * sin, one free-dim half at a time.
                lo = nl.subtract(
                    nl.multiply(xt[:, 0:half], c[:, 0:half]), nl.multiply(xt[:, half:d], sn[:, 0:half])
                )
                hi = nl.add(
                    nl.multiply(xt[:, half:d], c[:, half:d]), nl.multiply(xt[:, 0:half], sn[:, half:d])
                )
                nl.store(out[b, h, s * p : (s + 1) * p, 0:half], value=nl.copy(lo, dtype=x.dtype))
                nl.store(out[b, h, s * p : (s + 1) * p, half:d], value=nl.copy(hi, dtype=x.dtype))
    return out
