"""The Qwen 3 dense family (0.6B to 32B): its arguments and published flavours.

Qwen 3 is the shared pre-norm decoder (``portatrain.models.common``) with three differences, all
declared in :class:`Qwen3Args`:

1. **q/k RMSNorm per head** (``qk_norm = "head"``): queries and keys are RMS-normalized per head,
   over ``head_dim``, with one learned gain of ``head_dim`` values shared by all heads, *before*
   RoPE. It bounds the attention logits, which is what lets Qwen 3 drop the q/k/v biases of Qwen 2.
2. **Decoupled head dimension**: ``head_dim`` is its own hyper-parameter (128 in every published
   size), so ``n_heads * head_dim`` need not equal ``dim`` (0.6B: 16 x 128 = 2048 vs dim 1024;
   ``q_proj`` is 1024 -> 2048 and ``o_proj`` 2048 -> 1024).
3. **No attention bias**, RMSNorm epsilon 1e-6, ``rope_theta`` 1e6 and no RoPE frequency scaling.

Module and parameter names are those of Hugging Face's ``Qwen3ForCausalLM`` minus its ``model.``
prefix (``layers.3.self_attn.q_norm.weight``...), so checkpoints convert by renaming (``hf.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from portatrain.models.common.decoder import Decoder, DecoderArgs, TransformerBlock


@dataclass(frozen=True)
class Qwen3Args(DecoderArgs):
    """Architecture of one Qwen 3 dense model: the shared fields (``DecoderArgs``) plus a decoupled
    ``head_dim`` and an explicit SwiGLU width."""

    qk_norm: ClassVar[str] = "head"
    positive_fields: ClassVar[tuple[str, ...]] = (*DecoderArgs.positive_fields, "head_dim", "ffn_dim")

    head_dim: int = 128
    """Width of one attention head, independent of ``dim / n_heads`` (HF ``head_dim``)."""
    ffn_dim: int = 12288
    """SwiGLU width (HF ``intermediate_size``)."""
    # Shared fields whose Qwen 3 defaults differ (0.6B, 1.7B and 4B tie their embeddings).
    n_layers: int = 36
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960


_PUBLISHED = Qwen3Args()  # the shared values below: vocab 151936, eps 1e-6, theta 1e6, 40960 positions

# Published dimensions: the config.json of each Qwen/Qwen3-<size> on the Hugging Face Hub (also
# torchtitan's qwen3 flavours); head_dim 128 and 8 kv heads throughout.
QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # ~1M parameters for CPU tests. head_dim 64 with dim 128 and 4 heads, so q_proj is 128 -> 256
    # and the decoupled-width code paths run exactly as in the published sizes; tied like 0.6B-4B.
    "debug": dataclasses.replace(
        _PUBLISHED,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=384,
        vocab_size=258,
        max_seq_len=512,
        tie_embeddings=True,
    ),
    "0.6b": dataclasses.replace(
        _PUBLISHED, dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tie_embeddings=True
    ),
    "1.7b": dataclasses.replace(
        _PUBLISHED, dim=2048, n_layers=28, n_heads=16, ffn_dim=6144, tie_embeddings=True
    ),
    "4b": dataclasses.replace(
        _PUBLISHED, dim=2560, n_layers=36, n_heads=32, ffn_dim=9728, tie_embeddings=True
    ),
    "8b": dataclasses.replace(_PUBLISHED, dim=4096, n_layers=36, n_heads=32, ffn_dim=12288),
    "14b": dataclasses.replace(_PUBLISHED, dim=5120, n_layers=40, n_heads=40, ffn_dim=17408),
    "32b": dataclasses.replace(_PUBLISHED, dim=5120, n_layers=64, n_heads=64, ffn_dim=25600),
}


QWEN3_PUBLISHED_PARAMS: dict[str, int] = {
    "0.6b": 596_049_920,
    "1.7b": 1_720_574_976,
    "4b": 4_022_468_096,
    "8b": 8_190_735_360,
    "14b": 14_768_307_200,
    "32b": 32_762_123_264,
}
"""Parameter counts of the published checkpoints (the tied matrix once)."""


class Qwen3(Decoder):
    """A Qwen 3 dense decoder-only language model returning next-token logits (``Decoder`` as it is)."""


__all__ = ["QWEN3_FLAVORS", "QWEN3_PUBLISHED_PARAMS", "Qwen3", "Qwen3Args", "TransformerBlock"]
