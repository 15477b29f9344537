"""Grouped-query causal attention through ``F.scaled_dot_product_attention`` only, shared by the families.

Without a mask (rows of one document from position 0: ``data.collator=pad_to_max`` or ``bucket``),
SDPA's own grouped-query support (``enable_gqa=True``, PyTorch >= 2.5) reads each k/v head for its
``n_heads / n_kv_heads`` query heads, so the repeated k/v tensors are never materialized, nor
summed back in the backward; measured 3% faster training steps than explicit repetition at the
debug size (fp32, CPU; docs/benchmarks.md, "Compiled against Hugging Face"). Hugging Face's SDPA path makes the
same choice. Where a backend has no fused grouped-query kernel, SDPA's composite implementation
repeats the heads itself, so results never depend on the backend.

With a mask (the packing collator's block-diagonal causal mask), k/v heads are repeated explicitly
(:func:`repeat_kv`): CUDA's fused kernels accept ``enable_gqa`` only without an explicit mask and
would otherwise fall back to the math kernel, materializing ``S x S`` scores.

The mask may instead be an :data:`AttentionFn`, a callable that computes the attention itself: the
seam through which context parallelism (``portatrain.parallel.context``) attends a rank's sequence
shard over the whole row's keys, with no parallel code in the model, and through which a key/value
cache (``portatrain.models.common.kv_cache``) attends new tokens over every cached one
(:func:`cached_attention`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]
"""``attention(q, k, v, scale) -> out`` (``scale`` None: SDPA's default), given where a mask would go:
replaces the causal attention below."""


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, n_kv_heads, S, D] -> [B, n_kv_heads * n_rep, S, D]``, each kv head repeated ``n_rep`` times
    consecutively (query head ``h`` reads kv head ``h // n_rep``, as in Meta's and HF's code)."""
    if n_rep == 1:
        return x
    b, n_kv, s, d = x.shape
    return x[:, :, None].expand(b, n_kv, n_rep, s, d).reshape(b, n_kv * n_rep, s, d)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | AttentionFn | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, H, S, D]`` over ``k [B, H_kv, S, D]``, ``v [B, H_kv, S, D_v]`` (``H`` a
    multiple of ``H_kv``; ``D_v`` may differ from ``D``, as in latent attention).

    ``attn_mask``: ``None`` for plain causal attention, else a boolean ``[B, 1, S, S]`` mask, ``True``
    where a query may attend to a key, which must already include causality, or an
    :data:`AttentionFn` that attends itself. Scaled by ``scale``, default ``1/sqrt(D)`` (SDPA's).
    Returns ``[B, H, S, D_v]``.
    """
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        return attn_mask(q, k, v, scale)
    if attn_mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def cached_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, H, S, D]``, the queries at ``positions [S]``, over a whole key/value cache
    ``keys [B, H_kv, L, D]``, ``values [B, H_kv, L, D_v]``: query ``s`` sees the slots ``<= positions[s]``
    (and, with a sliding ``window``, ``> positions[s] - window``: the same band as a full forward's).

    Every shape is the cache's, whatever has been written so far, so a decode step compiles once per
    cache length; the mask of visible slots is computed on the device from ``positions`` (no host
    read). Slots past a query's position may hold anything (a padded prefill's keys): they are masked.

    Grouped-query heads are folded into the query length rather than repeated: the ``n_rep`` query
    heads that read one k/v head become ``n_rep * S`` rows of that head (``[B, H_kv, n_rep * S, D]``,
    the mask repeated to match), so the cache is never copied ``n_rep`` times per step and SDPA gets
    no ``enable_gqa`` with a mask (which CUDA's fused kernels refuse, see above). Returns
    ``[B, H, S, D_v]``.
    """
    batch, heads, seq_len, head_dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    n_rep = heads // kv_heads
    slots = torch.arange(length, device=q.device)
    visible = slots <= positions[:, None]  # [S, L]
    if window is not None:
        visible = visible & (slots > positions[:, None] - window)
    out = F.scaled_dot_product_attention(
        q.reshape(batch, kv_heads, n_rep * seq_len, head_dim),  # head h = kv head h // n_rep, as repeat_kv
        keys,
        values,
        attn_mask=visible.repeat(n_rep, 1),
        scale=scale,
    )
    return out.view(batch, heads, seq_len, -1)
