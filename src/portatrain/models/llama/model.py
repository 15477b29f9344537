"""The Llama 3 family (3, 3.1, 3.2 text models) as one readable, single-device PyTorch file.

What is here, top to bottom:

* :class:`RopeScaling` and :class:`LlamaArgs` -- the architecture hyper-parameters, plus the analytic
  parameter count and the FLOPs-per-token convention used for MFU.
* :data:`LLAMA3_FLAVORS` -- a CPU ``debug`` size and the published 1B/3B (Llama 3.2) and 8B/70B (Llama 3.1).
* RoPE with Llama 3.1 frequency scaling, in Hugging Face's ``rotate_half`` layout.
* :class:`RMSNorm`, :class:`Attention` (grouped-query, through ``F.scaled_dot_product_attention`` only),
  :class:`FeedForward` (SwiGLU), :class:`TransformerBlock` and the full :class:`Llama`.

RMSNorm, the SwiGLU activation and the RoPE rotation are called through module attributes
(``rmsnorm_fn``, ``swiglu_fn``, ``rope_fn``) holding the pure-PyTorch references of
``portatrain.kernels.reference``; ``portatrain.kernels.apply`` points them at opt-in kernels.

Module and parameter names are those of Hugging Face's ``LlamaForCausalLM`` minus its ``model.``
prefix (``layers.3.self_attn.q_proj.weight``...), and RoPE uses the same half-split rotation, so
checkpoints map onto HF by renaming alone -- no q/k permutation (see ``hf.py``).

The model knows nothing about devices, meshes or compilers. The intended life cycle is::

    with torch.device("meta"):
        model = Llama(args)          # no memory allocated
    ...parallelize (TP, activation checkpointing, compile, FSDP2)...
    model.to_empty(device=device)    # allocate, uninitialized
    model.init_weights(std=0.02)     # or load a checkpoint

Constructing on a real device also works: PyTorch's default init runs and the RoPE tables are
filled, but call :meth:`Llama.init_weights` for the initialization this file intends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# The three small ops kernels may replace (``kernels.enabled``); modules call them through slots.
from portatrain.kernels.reference import rmsnorm, rope, swiglu
from portatrain.models.attention import causal_attention


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (HF ``rope_type="llama3"``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept,
    those longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, and the band between is interpolated smoothly. This is how Llama 3.1 extends an
    8k-token pre-training context to 128k.
    """

    factor: float = 8.0
    """Divisor applied to the low frequencies (8 for Llama 3.1, 32 for Llama 3.2 1B/3B)."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are left alone."""
    original_max_position_embeddings: int = 8192
    """Context length the unscaled model was pre-trained at."""


@dataclass(frozen=True)
class LlamaArgs:
    """Architecture of one Llama 3 model. Field names follow Meta's ``params.json``.

    Frozen because the flavour table shares instances: derive variants with ``dataclasses.replace``.
    Construction does not validate (a config validator wants every problem, not the first); see
    :meth:`problems`, which :class:`Llama` checks before building anything.
    """

    dim: int = 4096
    """Hidden size (HF ``hidden_size``)."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads; ``head_dim = dim // n_heads``."""
    n_kv_heads: int = 8
    """Key/value heads for grouped-query attention; must divide ``n_heads``."""
    vocab_size: int = 128256
    """Rows of the embedding table and of the output projection."""
    ffn_hidden_dim: int | None = None
    """SwiGLU width (HF ``intermediate_size``); ``None`` derives it from ``multiple_of`` and
    ``ffn_dim_multiplier`` as Meta's reference code does (see :attr:`ffn_dim`)."""
    multiple_of: int = 256
    """The derived SwiGLU width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Extra factor on the derived SwiGLU width (1.3 for 8B/70B, 1.5 for 1B, 1.0 for 3B)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (HF ``rms_norm_eps``)."""
    rope_theta: float = 500000.0
    """RoPE base period."""
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    """Llama 3.1 frequency scaling; ``None`` is plain RoPE."""
    max_seq_len: int = 131072
    """Length of the RoPE table, i.e. the longest position the model can be fed (HF
    ``max_position_embeddings``). Lower it for training: the cos/sin tables cost
    ``2 * max_seq_len * head_dim`` fp32 values per device."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection (Llama 3.2 1B/3B do)."""

    def problems(self) -> list[str]:
        """Every inconsistency of these arguments, each with the values and the fix (empty: valid).

        Collected rather than raised one at a time, so a bad flavour or a custom size given on the
        command line (``model.dim=... model.n_heads=...``) is fixed in one edit.
        """
        problems = [
            f"{name}={getattr(self, name)} must be positive"
            for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")
            if getattr(self, name) <= 0
        ]
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim <= 0:
            problems.append(f"ffn_dim={self.ffn_hidden_dim} must be positive")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            problems.append(f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be positive")
        if problems:  # the divisibility checks below would divide by zero
            return problems
        if self.dim % self.n_heads:
            fits = [n for n in range(1, self.dim + 1) if self.dim % n == 0 and n <= 2 * self.n_heads][-3:]
            problems.append(
                f"dim({self.dim}) must be divisible by n_heads({self.n_heads}) (head_dim = dim / n_heads); "
                f"change dim or use n_heads in {fits}"
            )
        elif (self.dim // self.n_heads) % 2:
            problems.append(
                f"head_dim = dim/n_heads = {self.dim}/{self.n_heads} = {self.dim // self.n_heads} must be "
                "even for RoPE (it rotates pairs of channels)"
            )
        if self.n_heads % self.n_kv_heads:
            fits = [n for n in range(1, self.n_heads + 1) if self.n_heads % n == 0]
            problems.append(
                f"n_heads({self.n_heads}) must be a multiple of n_kv_heads({self.n_kv_heads}) for "
                f"grouped-query attention; choose n_kv_heads in {fits}"
            )
        return problems

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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

    @property
    def block_params(self) -> int:
        """Parameters of one :class:`TransformerBlock`."""
        attn = 2 * self.dim * self.n_heads * self.head_dim + 2 * self.dim * self.n_kv_heads * self.head_dim
        mlp = 3 * self.dim * self.ffn_dim
        return attn + mlp + 2 * self.dim  # + two RMSNorm gains

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count computed from the shapes alone (nothing is built).

        ``exclude_embedding`` drops the input embedding table. With tied embeddings that table is
        also the output projection, so it leaves the model without any vocabulary matrix.
        """
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = embedding + self.n_layers * self.block_params + self.dim + output  # + final norm
        return total - embedding if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at context length ``seq_len``.

        The convention of PaLM (Chowdhery et al. 2022, appendix B) and torchtitan, so MFU numbers
        compare with theirs:

        * ``6 * N`` for the weight matmuls: 2 FLOPs per multiply-add forward, twice that backward
          (gradients for inputs and for weights). ``N`` excludes the embedding lookup, which is a
          gather, but includes the output projection even when it is tied to the embedding.
        * ``12 * n_layers * n_heads * head_dim * seq_len`` for attention: ``QK^T`` and ``AV`` each
          cost ``2 * seq_len * head_dim`` per head and token forward (4 together), backward twice
          that (8). The full ``seq_len x seq_len`` square is counted (no discount for the causal
          mask), as PaLM does.
        """
        matmul_params = self.num_params(exclude_embedding=True)
        if self.tie_embeddings:
            matmul_params += self.vocab_size * self.dim
        return 6 * matmul_params + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


# Meta's params.json values; the RoPE tables span the published 128k context.
# (Param counts, checked by tests: 1b 1,235,814,400; 3b 3,212,749,824; 8b 8,030,261,248; 70b 70,553,706,496.)
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


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/head_dim)``, with Llama 3.1 scaling when ``scaling`` is set.

    Same arithmetic, in fp32, as Meta's ``apply_scaling`` and HF's ``_compute_llama3_parameters``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) never completed a turn within the pre-training context:
    # stretch them by `factor` so positions up to factor * original length stay in familiar range.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # In between, blend the stretched and the original frequency linearly in 1/wavelength.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_tables(args: LlamaArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[max_seq_len, head_dim]`` in fp32.

    HF layout: the ``head_dim/2`` angles are repeated (``cat(angles, angles)``), pairing channel
    ``i`` with channel ``i + head_dim/2`` -- see ``portatrain.kernels.reference.rope``. Meta's original code pairs
    adjacent channels (2i, 2i+1) instead; HF permutes q/k weights on conversion so that its layout
    is equivalent, and we use HF's so its checkpoints load without any permutation.
    """
    inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling, device=device)
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain and no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.rmsnorm_fn = rmsnorm  # F.rms_norm, unless a kernel override replaces it
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rmsnorm_fn(x, self.weight, self.eps)


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    # Cut at 3 std: nn.init's default cut-off is an absolute +-2, a no-op at std 0.02.
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``F.scaled_dot_product_attention`` only.

    See ``portatrain.models.attention`` for how k/v heads are shared: SDPA's ``enable_gqa`` without a
    mask, explicitly repeated heads with the packing collator's mask.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.rope_fn = rope  # x * cos + rotate_half(x) * sin, unless a kernel override replaces it

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            _trunc_normal_(linear.weight, std)
        _trunc_normal_(self.o_proj.weight, out_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # Heads are read off the projected width (-1), not the config, so a tensor-parallel plan
        # that column-shards the projections (fewer heads per rank) needs no change here.
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope_fn(q, cos, sin), self.rope_fn(k, cos, sin)
        out = causal_attention(q, k, v, attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.swiglu_fn = swiglu  # silu(gate) * up, unless a kernel override replaces it

    def init_weights(self, std: float, out_std: float) -> None:
        _trunc_normal_(self.gate_proj.weight, std)
        _trunc_normal_(self.up_proj.weight, std)
        _trunc_normal_(self.down_proj.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu_fn(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    """One pre-norm decoder layer: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``.

    A standalone module so parallelization can wrap each block on its own (activation
    checkpointing, ``torch.compile``, ``fully_shard``).
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args.dim, args.ffn_dim)

    def init_weights(self, std: float, out_std: float) -> None:
        self.input_layernorm.reset_parameters()
        self.self_attn.init_weights(std, out_std)
        self.post_attention_layernorm.reset_parameters()
        self.mlp.init_weights(std, out_std)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """A Llama 3 decoder-only language model returning next-token logits.

    ``layers`` is an ``nn.ModuleDict`` keyed ``"0", "1", ...`` (as in torchtitan): its state-dict
    keys are the same as a ``ModuleList``'s, but blocks can be replaced by wrapped versions
    (checkpointing, compile) or deleted (pipeline stages) without renumbering the survivors, so
    checkpoint keys stay stable.

    With ``tie_embeddings`` there is no ``lm_head`` module at all: the output projection reads
    ``embed_tokens.weight`` directly. A second module holding the same ``Parameter`` would be
    silently untied by ``to_empty`` and by per-module sharding.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        problems = args.problems()
        if problems:
            raise ValueError("invalid LlamaArgs:\n  - " + "\n  - ".join(problems))
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so kept out of checkpoints (non-persistent) and rebuilt by init_weights
        # after to_empty(). fp32 even in bf16 runs; rope casts at use.
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Initialize every parameter and rebuild the RoPE tables on their current device.

        Deterministic under the current torch seed (parameters are drawn in a fixed order).
        Weights are truncated normal with ``std``; the two projections that write into the
        residual stream (``o_proj``, ``down_proj``) use ``std / sqrt(2 * n_layers)`` (GPT-2,
        Megatron) so the residual's variance does not grow with depth. Norm gains start at 1.
        """
        cos, sin = rope_tables(self.args, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        out_std = std / math.sqrt(2 * self.args.n_layers)
        _trunc_normal_(self.embed_tokens.weight, std)
        for block in self.layers.values():
            block.init_weights(std, out_std)
        self.norm.reset_parameters()
        if self.lm_head is not None:
            _trunc_normal_(self.lm_head.weight, std)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        output_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, vocab_size]`` in the compute dtype, or ``output_fn``'s result.

        Args:
            tokens: ``[B, S]`` token ids.
            positions: ``[B, S]`` RoPE positions; default ``0..S-1`` in every row. Packed rows pass
                positions that restart at 0 at each document boundary. Values must be below
                ``max_seq_len`` (not checked: that would need a device sync).
            attn_mask: ``[B, 1, S, S]`` boolean, ``True`` where a query may attend to a key (e.g. the
                packing collator's block-diagonal causal mask); ``None`` is plain causal attention.
            output_fn: called as ``output_fn(hidden, weight)`` with the final normalized hidden states
                ``[B, S, dim]`` and the output projection's matrix ``[vocab_size, dim]`` in place of
                the projection (e.g. ``portatrain.losses``' chunked loss, which never builds the full
                logits). Inside ``forward``, so FSDP2 has the matrix gathered.
        """
        seq_len = tokens.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} > max_seq_len {self.args.max_seq_len}; "
                f"shorten the rows or raise model.max_seq_len"
            )
        if positions is None:
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]  # [S, D], broadcast over B, H
        else:
            cos, sin = (
                self.rope_cos[positions].unsqueeze(1),
                self.rope_sin[positions].unsqueeze(1),
            )  # [B,1,S,D]

        h = self.embed_tokens(tokens)
        for block in self.layers.values():
            h = block(h, cos, sin, attn_mask)
        h = self.norm(h)
        if output_fn is not None:
            return output_fn(h, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        if self.lm_head is None:
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Count the parameters actually held (a tied matrix once); see :meth:`LlamaArgs.num_params`."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.embed_tokens.weight.numel() if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token; convention in :meth:`LlamaArgs.flops_per_token`."""
        return self.args.flops_per_token(seq_len)
