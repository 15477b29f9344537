"""Static attention masks shared by the families: sliding windows and attention sinks, through SDPA.

* :func:`window_mask` -- the causal band of a sliding window: query ``i`` sees keys
  ``i - window < j <= i`` (Hugging Face's ``sliding_window_overlay``: a window of 4096 keeps 4096 keys,
  the query's own included). Gemma 3 (5 local layers to 1 global) and GPT-OSS (alternating) use it.
* :func:`sliding_window_mask` -- what a sliding layer passes to SDPA: the band alone, or the band and a
  caller's mask (packed documents) together. It depends on the row length only, so the decoder builds
  it once per forward for every sliding layer, and a compiled block sees a fixed-shape input; no value
  leaves the device. A row no longer than the window needs no band: plain causal attention (SDPA's
  ``is_causal`` path) is then exact, and cheaper.
* :func:`sink_attention` -- attention with a learned per-head sink logit (GPT-OSS; Xiao et al. 2023,
  "Efficient Streaming Language Models with Attention Sinks", https://arxiv.org/abs/2309.17453): one
  extra key column whose score is the sink, whose value is zero. SDPA takes it as a float mask over
  ``S + 1`` keys, so the softmax's denominator gains ``exp(sink)`` and each head may attend to
  "nothing"; the sink's gradient flows through the mask.

Context parallel (an attention callable in place of the mask) splits the keys over ranks, so no band or
extra column can be added here; the shared plan refuses ``parallel.cp > 1`` for such models
(``portatrain.models.common.parallelize.layout_problems``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portatrain.models.attention import repeat_kv


def window_mask(seq_len: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """``[S, S]`` bool, ``True`` where query ``i`` may attend to key ``j``: ``i - window < j <= i``."""
    query = torch.arange(seq_len, device=device)[:, None]
    key = torch.arange(seq_len, device=device)[None, :]
    return (key <= query) & (key > query - window)


def sliding_window_mask(
    attn_mask: torch.Tensor | None, seq_len: int, window: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """The mask of a sliding layer for rows of ``seq_len`` tokens.

    ``attn_mask`` is the full layers' mask: None (plain causal) or a bool ``[B, 1, S, S]`` that already
    holds causality (packed documents). Returns None when ``seq_len <= window`` and there is no mask
    (the band is then the causal triangle itself), else the band, and-ed with ``attn_mask`` if given.
    """
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise ValueError(
            "sliding-window attention takes a boolean mask or None, not an attention callable (context "
            "parallel): set parallel.cp=1"
        )
    if seq_len <= window:
        return attn_mask
    band = window_mask(seq_len, window, device)
    return band if attn_mask is None else attn_mask & band


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [B, H, S, D]`` over ``k, v [B, H_kv, S, D]`` plus one sink per head.

    ``attn_mask``: None (causal) or bool ``[B, 1, S, S]`` / ``[S, S]`` with causality in it (packed
    documents, a sliding window). ``sinks [H]``: each head's sink logit, compared with the scaled
    ``q . k`` scores (as transformers' ``GptOssAttention``). The float mask is ``[B or 1, H, S, S + 1]``:
    ``B * H * S * (S + 1)`` values SDPA keeps for backward, as a fused kernel could not.
    Returns ``[B, H, S, D]``.
    """
    heads, seq_len = q.shape[1], q.shape[2]
    allowed = window_mask(seq_len, seq_len, q.device) if attn_mask is None else attn_mask
    if allowed.dim() == 2:
        allowed = allowed[None, None]
    # 0 where a key is visible, -inf where not, then each head's sink as the last column.
    scores = torch.full(allowed.shape, float("-inf"), dtype=q.dtype, device=q.device).masked_fill(
        allowed, 0.0
    )
    sink_column = sinks.to(q.dtype)[None, :, None, None].expand(scores.shape[0], heads, seq_len, 1)
    mask = torch.cat([scores.expand(-1, heads, -1, -1), sink_column], dim=-1)
    # The sink's key and value are zeros: its score is the mask's value alone, its output nothing.
    n_rep = heads // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    k = torch.cat([k, k.new_zeros(k.shape[0], heads, 1, k.shape[-1])], dim=2)
    v = torch.cat([v, v.new_zeros(v.shape[0], heads, 1, v.shape[-1])], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
