"""The OLMo 2 family (Ai2; Team OLMo, "2 OLMo 2 Furious", https://arxiv.org/abs/2501.00656): its
arguments and published flavours. Everything else is the shared decoder (``portatrain.models.common``).

OLMo 2 is the shared decoder with two switches set, both for training stability (paper, section 3.2):

1. **Post-norm inside the residual branch** (``norm_placement = "post"``): each sub-layer's output is
   normalized before it joins the residual stream, ``h = x + norm(attn(x))``, ``h + norm(mlp(h))``;
   the residual stream itself is never normalized until the final norm.
2. **q/k norm over the whole projection** (``qk_norm = "proj"``): queries and keys are
   RMS-normalized over all heads at once, with one gain per channel, before RoPE. Tensor parallel
   would split that norm across ranks, so the shared plan refuses ``parallel.tp > 1`` for OLMo 2
   (``portatrain.models.common.parallelize.layout_problems``) during validation.

Module and parameter names are those of Hugging Face's ``Olmo2ForCausalLM`` minus its ``model.``
prefix, so checkpoints convert by renaming (``hf.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from portatrain.models.common.decoder import Decoder, DecoderArgs, DerivedHeadDim


@dataclass(frozen=True)
class Olmo2Args(DerivedHeadDim, DecoderArgs):
    """Architecture of one OLMo 2 model (``head_dim = dim / n_heads``). Frozen: derive variants with
    ``dataclasses.replace``."""

    qk_norm: ClassVar[str] = "proj"
    norm_placement: ClassVar[str] = "post"
    positive_fields: ClassVar[tuple[str, ...]] = (*DecoderArgs.positive_fields, "ffn_dim")

    ffn_dim: int = 11008
    """SwiGLU width (HF ``intermediate_size``)."""
    # Shared fields whose OLMo 2 defaults differ: full multi-head attention up to 13B, 4096 positions.
    n_kv_heads: int = 32
    vocab_size: int = 100352
    norm_eps: float = 1e-6
    max_seq_len: int = 4096


_7B = Olmo2Args()

# Published dimensions: the config.json of allenai/OLMo-2-0425-1B, OLMo-2-1124-7B and OLMo-2-1124-13B
# on the Hugging Face Hub (vocabulary 100352, rope_theta 5e5, 4096 positions, untied).
OLMO2_FLAVORS: dict[str, Olmo2Args] = {
    # ~1M parameters for CPU tests, with grouped-query attention (2 kv heads) so that path runs too.
    "debug": dataclasses.replace(
        _7B, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=258, max_seq_len=512
    ),
    "1b": dataclasses.replace(_7B, dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=8192),
    "7b": _7B,
    "13b": dataclasses.replace(_7B, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824),
}

OLMO2_PUBLISHED_PARAMS: dict[str, int] = {
    "1b": 1_484_916_736,  # model card: 1.48B
    "7b": 7_298_617_344,  # model card: 7.30B
    "13b": 13_716_198_400,  # model card: 13.7B
}
"""Parameter counts of the published checkpoints (safetensors' totals; the model cards round them)."""


class Olmo2(Decoder):
    """An OLMo 2 decoder-only language model returning next-token logits (``Decoder`` as it is)."""


__all__ = ["OLMO2_FLAVORS", "OLMO2_PUBLISHED_PARAMS", "Olmo2", "Olmo2Args"]
