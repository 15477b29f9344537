"""A key/value cache of static shape, for decoding one token at a time with any family.

:class:`KVCache` keeps, for every attention layer, the keys ``[B, H_kv, L, D]`` and values
``[B, H_kv, L, D_v]`` of the positions fed so far, in buffers of a fixed length ``L`` (the prompt
plus the tokens to generate, rounded up to a bucket by the caller). A forward with the cache
(``Decoder.forward(tokens, positions, cache=cache)``, ``positions [S]`` the slots the ``S`` new
tokens take) writes each layer's new keys and values at ``positions`` with ``index_copy_`` and
attends over the whole buffer with a mask of the valid slots
(:func:`portatrain.models.attention.cached_attention`, SDPA only). Nothing about it depends on how
much has been written, so one decode step is one graph per cache length: what a compiler that
builds a graph per shape (XLA, the Neuron compiler, inductor with ``dynamic=False``) needs to
compile once and replay for every token. gpt-fast keeps its cache the same way
(pytorch-labs/gpt-fast, ``model.py``: ``KVCache.update`` assigns at ``input_pos``, and the mask spans
the whole cache).

It reaches the attention through the seam every family's attention already has: the mask argument
may be a callable that attends itself (:data:`portatrain.models.attention.AttentionFn`), so
grouped-query attention and multi-head latent attention are cached alike, with no branch in their
code; a sliding-window layer (Gemma 3, GPT-OSS) masks the slots outside its window, and keeps them
all (the cache stays one static shape). For latent attention (DeepSeek-V3) the cache holds the full key and value of every head (the
latent expanded), not the ``kv_lora_rank`` latent the paper's inference caches: simpler, the same
numbers, ``n_heads * (qk_head_dim + v_head_dim) / (kv_lora_rank + qk_rope_head_dim)`` times the
memory (71x at 671B's sizes; fine for evaluation-sized generation, not for serving).

Buffers are allocated by the first forward (the prefill), in the dtype and on the device of that
forward's keys and values (bf16 under autocast), so the cache needs no knowledge of any family's
head layout. Every later forward writes into them in place.
"""

from __future__ import annotations

import torch

from portatrain.models.attention import AttentionFn, cached_attention


class KVCache:
    """Every layer's keys and values, ``length`` positions long; see the module docstring.

    ``keys[layer]`` / ``values[layer]`` (layer names as in ``model.layers``) exist after the first
    forward; :attr:`nbytes` is their memory.
    """

    def __init__(self, length: int) -> None:
        if length <= 0:
            raise ValueError(f"KVCache length={length} must be positive")
        self.length = length
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    def attention(self, layer: str, positions: torch.Tensor, window: int | None = None) -> AttentionFn:
        """The attention of ``layer`` in a forward whose new tokens take slots ``positions [S]``: store
        their keys and values there, then attend over the whole cache (within the last ``window``
        positions, the query's own included, for a sliding-window layer)."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
            keys, values = self._write(layer, positions, k, v)
            return cached_attention(q, keys, values, positions, scale, window=window)

        return attend

    def _write(
        self, layer: str, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:  # the prefill: the buffers take this forward's shapes and dtype
            batch = k.shape[0]
            self.keys[layer] = k.new_zeros(batch, k.shape[1], self.length, k.shape[-1])
            self.values[layer] = v.new_zeros(batch, v.shape[1], self.length, v.shape[-1])
        keys = self.keys[layer].index_copy_(2, positions, k.to(self.keys[layer].dtype))
        values = self.values[layer].index_copy_(2, positions, v.to(self.values[layer].dtype))
        return keys, values
