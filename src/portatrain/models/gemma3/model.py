"""The Gemma 3 text family (Google DeepMind; Gemma Team, "Gemma 3 Technical Report",
https://arxiv.org/abs/2503.19786): its arguments and published flavours.

Gemma 3 is the shared decoder (``portatrain.models.common``) with these switches, all declared in
:class:`Gemma3Args`:

1. **Local and global layers, 5 to 1**: five layers attend within a sliding window of 1,024 tokens
   (512 in 1B), the sixth to the whole row (``sliding_window_pattern`` 6;
   ``portatrain.models.common.masks``). Local layers' RoPE base is 10,000, global ones' 1,000,000,
   stretched 8x by linear interpolation in 4B-27B (128k context).
2. **q/k norm per head** (as Qwen 3) and **a norm before and after each sub-layer**
   (``norm_placement = "both"``); every norm's gain is stored as an offset from 1.
3. **Embeddings scaled by sqrt(dim)**, tied to the output projection; **GELU-tanh gated MLP**.
4. **Attention scaled by** ``query_pre_attn_scalar ** -0.5`` (256: ``1/sqrt(head_dim)`` except in
   27B, where it is ``dim / n_heads`` = 168 with 128-wide heads).

No logit soft-capping (Gemma 2's, replaced by the q/k norms). Names are ``Gemma3ForCausalLM``'s minus
its ``model.`` prefix (``hf.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from portatrain.models.common.decoder import Decoder, DecoderArgs
from portatrain.models.common.rope import LinearScaling


@dataclass(frozen=True)
class Gemma3Args(DecoderArgs):
    """Architecture of one Gemma 3 text model (defaults: 4B's; HF names in the docstrings)."""

    qk_norm: ClassVar[str] = "head"
    norm_placement: ClassVar[str] = "both"
    activation: ClassVar[str] = "gelu_tanh"
    norm_unit_offset: ClassVar[bool] = True
    scale_embeddings: ClassVar[bool] = True
    positive_fields: ClassVar[tuple[str, ...]] = (
        *DecoderArgs.positive_fields,
        "head_dim",
        "ffn_dim",
        "sliding_window",
        "sliding_window_pattern",
        "query_pre_attn_scalar",
    )

    head_dim: int = 256
    """Width of one attention head, independent of ``dim / n_heads`` (HF ``head_dim``)."""
    ffn_dim: int = 10240
    """GELU-gated MLP width (HF ``intermediate_size``)."""
    query_pre_attn_scalar: int = 256
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (HF's name)."""
    sliding_window: int = 1024
    """Keys a local layer's query sees, itself included (HF's name)."""
    sliding_window_pattern: int = 6
    """Every ``sliding_window_pattern``-th block is global, the others local (HF's name)."""
    rope_local_theta: float = 10_000.0
    """RoPE base of the local layers (HF ``rope_local_base_freq``)."""
    rope_scaling: LinearScaling | None = LinearScaling(8.0)
    """The global layers' RoPE scaling (HF ``rope_scaling``); None in 1B."""
    # Shared fields whose Gemma 3 defaults differ.
    dim: int = 2560
    n_layers: int = 34
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 262_208
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = True

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern != 0

    @property
    def softmax_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def family_problems(self) -> list[str]:
        problems = []
        if self.rope_local_theta <= 1:
            problems.append(f"model.rope_local_theta={self.rope_local_theta} must be > 1")
        if self.rope_scaling is not None:
            problems += self.rope_scaling.problems()
        return problems


_4B = Gemma3Args()

# Published dimensions: config.json of google/gemma-3-1b-pt and the text_config of
# google/gemma-3-{4b,12b,27b}-pt on the Hugging Face Hub (the rest are Gemma3TextConfig's defaults).
GEMMA3_FLAVORS: dict[str, Gemma3Args] = {
    # ~1M parameters for CPU tests. Local and global layers alternate (pattern 2), so the two-block
    # cut the tests run has one of each; a 16-token window, shorter than the test rows, so the band
    # is applied; heads wider than dim / n_heads and a scale of their own, as in 27B; linear RoPE
    # scaling on the global layers, as in 4B-27B.
    "debug": dataclasses.replace(
        _4B,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=384,
        vocab_size=258,
        max_seq_len=512,
        query_pre_attn_scalar=48,
        sliding_window=16,
        sliding_window_pattern=2,
    ),
    "1b": dataclasses.replace(
        _4B,
        dim=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        ffn_dim=6912,
        vocab_size=262_144,
        max_seq_len=32_768,
        sliding_window=512,
        rope_scaling=None,
    ),
    "4b": _4B,
    "12b": dataclasses.replace(_4B, dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_dim=15360),
    "27b": dataclasses.replace(
        _4B,
        dim=5376,
        n_layers=62,
        n_heads=32,
        n_kv_heads=16,
        head_dim=128,
        ffn_dim=21504,
        query_pre_attn_scalar=168,
    ),
}

GEMMA3_PUBLISHED_PARAMS: dict[str, int] = {
    "1b": 999_885_952,
    "4b": 3_880_263_168,
    "12b": 11_766_034_176,
    "27b": 27_009_346_304,
}
"""Parameters of the published language models (the tied matrix once). 1B: the safetensors total
of google/gemma-3-1b-pt. 4B-27B: the text part of the multimodal checkpoints, counted from the
shapes of their ``text_config``; the technical report (table 1) gives their non-embedding parameters
as 3,209M, 10,759M and 25,600M (698M for 1B), which ``tests/test_gemma3.py`` checks."""


class Gemma3(Decoder):
    """A Gemma 3 text decoder returning next-token logits (``Decoder`` with Gemma's switches)."""


__all__ = ["GEMMA3_FLAVORS", "GEMMA3_PUBLISHED_PARAMS", "Gemma3", "Gemma3Args"]
