"""The Llama 3 family (3, 3.1, 3.2 text models): its arguments and published flavours.

Everything else is the shared decoder (``portatrain.models.common``): pre-norm blocks, grouped-query
attention without q/k norms, SwiGLU, RoPE with Llama 3.1 frequency scaling (:class:`RopeScaling`).
What is Llama's own:

* :class:`LlamaArgs` -- field names follow Meta's ``params.json``; ``head_dim`` is ``dim / n_heads``
  and the SwiGLU width follows Meta's ``multiple_of`` / ``ffn_dim_multiplier`` rule unless given.
* :data:`LLAMA3_FLAVORS` -- a CPU ``debug`` size and the published 1B/3B (Llama 3.2) and 8B/70B (3.1).

Module and parameter names are those of Hugging Face's ``LlamaForCausalLM`` minus its ``model.``
prefix, so checkpoints map onto HF by renaming alone -- no q/k permutation (see ``hf.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from portatrain.models.common.decoder import Decoder, DecoderArgs, DerivedHeadDim, TransformerBlock
from portatrain.models.common.rope import RopeScaling, rope_inv_freq


@dataclass(frozen=True)
class LlamaArgs(DerivedHeadDim, DecoderArgs):
    """Architecture of one Llama 3 model: the shared fields (``DecoderArgs``, whose defaults are Llama 3
    8B's) plus Meta's SwiGLU sizing rule and RoPE scaling. ``head_dim = dim // n_heads``; the 3.2 1B
    and 3B tie their embeddings."""

    ffn_hidden_dim: int | None = None
    """SwiGLU width (HF ``intermediate_size``); ``None`` derives it from ``multiple_of`` and
    ``ffn_dim_multiplier`` as Meta's reference code does (see :attr:`ffn_dim`)."""
    multiple_of: int = 256
    """The derived SwiGLU width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Extra factor on the derived SwiGLU width (1.3 for 8B/70B, 1.5 for 1B, 1.0 for 3B)."""
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    """Llama 3.1 frequency scaling; ``None`` is plain RoPE."""

    def family_problems(self) -> list[str]:
        problems = super().family_problems()
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim <= 0:
            problems.append(f"model.ffn_dim={self.ffn_hidden_dim} must be positive")
        return problems

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden width: ``ffn_hidden_dim`` or Meta's rule.

        Meta starts from the classic 4*dim, takes 2/3 of it so the three SwiGLU matrices cost
        what two GELU matrices would, applies ``ffn_dim_multiplier`` and rounds up to
        ``multiple_of`` (8B: 4096 -> 14336; 70B: 8192 -> 28672).
        """
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# Meta's params.json values; the RoPE tables span the published 128k context.
LLAMA3_FLAVORS: dict[str, LlamaArgs] = {
    # ~0.85M parameters: a few hundred steps of 8 x 256 byte tokens train in about a minute on 2 CPU
    # cores. Same code paths as the real sizes: GQA, rope_theta 5e5 and 3.1 scaling (which here only
    # slows the lowest frequencies, whose wavelengths exceed 8192).
    "debug": LlamaArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=258,
        multiple_of=64,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=8192),
        max_seq_len=512,
    ),
    "1b": LlamaArgs(  # Llama 3.2 1B
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0),
        tie_embeddings=True,
    ),
    "3b": LlamaArgs(  # Llama 3.2 3B
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0),
        tie_embeddings=True,
    ),
    "8b": LlamaArgs(  # Llama 3.1 8B
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=RopeScaling(factor=8.0),
    ),
    "70b": LlamaArgs(  # Llama 3.1 70B
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=RopeScaling(factor=8.0),
    ),
}


LLAMA3_PUBLISHED_PARAMS: dict[str, int] = {
    "1b": 1_235_814_400,
    "3b": 3_212_749_824,
    "8b": 8_030_261_248,
    "70b": 70_553_706_496,
}
"""Parameter counts of the published checkpoints (the tied matrix once), as their safetensors hold."""


class Llama(Decoder):
    """A Llama 3 decoder-only language model returning next-token logits (``Decoder`` as it is)."""


__all__ = [
    "LLAMA3_FLAVORS",
    "LLAMA3_PUBLISHED_PARAMS",
    "Llama",
    "LlamaArgs",
    "RopeScaling",
    "TransformerBlock",
    "rope_inv_freq",
]
