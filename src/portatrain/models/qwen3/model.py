"""The Qwen 3 dense family (0.6B to 32B) as one readable, single-device PyTorch file.

What is here, top to bottom:

* :class:`Qwen3Args` -- the architecture hyper-parameters, every inconsistency in them
  (:meth:`Qwen3Args.problems`), the analytic parameter count and the FLOPs-per-token convention.
* :data:`QWEN3_FLAVORS` -- a CPU ``debug`` size and the published 0.6B, 1.7B, 4B, 8B, 14B and 32B.
* RoPE (plain, ``rope_theta`` 1e6) in Hugging Face's ``rotate_half`` layout.
* :class:`RMSNorm`, :class:`Attention` (grouped-query with per-head q/k RMSNorm, through
  ``F.scaled_dot_product_attention`` only), :class:`FeedForward` (SwiGLU), :class:`TransformerBlock`
  and the full :class:`Qwen3`.

Qwen 3 is Llama 3's decoder with three changes, each visible in :class:`Attention`:

1. **q/k RMSNorm**: queries and keys are RMS-normalized per head, over ``head_dim``, with one learned
   gain of ``head_dim`` values shared by all heads, *before* RoPE. It bounds the attention logits,
   which is what lets Qwen 3 drop the q/k/v biases of Qwen 2.
2. **Decoupled head dimension**: ``head_dim`` is its own hyper-parameter (128 in every published
   size), so ``n_heads * head_dim`` need not equal ``dim`` (0.6B: 16 x 128 = 2048 vs dim 1024;
   ``q_proj`` is 1024 -> 2048 and ``o_proj`` 2048 -> 1024).
3. **No attention bias**, RMSNorm epsilon 1e-6, ``rope_theta`` 1e6 and no RoPE frequency scaling.

Module and parameter names are those of Hugging Face's ``Qwen3ForCausalLM`` minus its ``model.``
prefix (``layers.3.self_attn.q_norm.weight``...), so checkpoints convert by renaming (``hf.py``).

The model knows nothing about devices, meshes or compilers. Life cycle, as for every family::

    with torch.device("meta"):
        model = Qwen3(args)          # no memory allocated
    ...parallelize (TP, activation checkpointing, compile, FSDP2)...
    model.to_empty(device=device)    # allocate, uninitialized
    model.init_weights(std=0.02)     # or load a checkpoint
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.kernels.reference import rmsnorm, rope, swiglu
from portatrain.models.attention import causal_attention

_POSITIVE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_dim",
    "vocab_size",
    "max_seq_len",
)


@dataclass(frozen=True)
class Qwen3Args:
    """Architecture of one Qwen 3 dense model. Names follow portatrain's ``model.*`` config keys;
    the Hugging Face ``config.json`` name of each is in its docstring.

    Frozen because the flavour table shares instances: derive variants with ``dataclasses.replace``.
    Construction does not validate (so a config validator can collect :meth:`problems` from custom
    sizes); building a :class:`Qwen3` from invalid arguments raises with all of them.
    """

    dim: int = 4096
    """Hidden size (HF ``hidden_size``)."""
    n_layers: int = 36
    """Number of transformer blocks (HF ``num_hidden_layers``)."""
    n_heads: int = 32
    """Query heads (HF ``num_attention_heads``)."""
    n_kv_heads: int = 8
    """Key/value heads for grouped-query attention; must divide ``n_heads``."""
    head_dim: int = 128
    """Width of one attention head, independent of ``dim / n_heads`` (HF ``head_dim``)."""
    ffn_dim: int = 12288
    """SwiGLU width (HF ``intermediate_size``)."""
    vocab_size: int = 151936
    """Rows of the embedding table and of the output projection."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon of every norm, q/k norms included (HF ``rms_norm_eps``)."""
    rope_theta: float = 1_000_000.0
    """RoPE base period."""
    max_seq_len: int = 40960
    """Length of the RoPE table, i.e. the longest position the model can be fed (HF
    ``max_position_embeddings``). Lower it for training: the cos/sin tables cost
    ``2 * max_seq_len * head_dim`` fp32 values per device."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection (0.6B, 1.7B and 4B do)."""

    def problems(self) -> list[str]:
        """Every inconsistency, each naming the values and the fix; empty when the arguments are valid."""
        problems = [
            f"model.{name}={getattr(self, name)} must be positive"
            for name in _POSITIVE_FIELDS
            if getattr(self, name) <= 0
        ]
        if self.norm_eps <= 0:
            problems.append(f"model.norm_eps={self.norm_eps} must be positive")
        if self.rope_theta <= 1:
            problems.append(f"model.rope_theta={self.rope_theta} must be > 1")
        if self.head_dim > 0 and self.head_dim % 2:
            problems.append(
                f"model.head_dim={self.head_dim} must be even: RoPE rotates channel pairs; "
                f"set model.head_dim={self.head_dim + 1}"
            )
        if self.n_heads > 0 and self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            divisors = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            problems.append(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads} for "
                f"grouped-query attention; choose model.n_kv_heads in {divisors}"
            )
        return problems

    @property
    def q_dim(self) -> int:
        """Width of all query heads together, ``n_heads * head_dim`` (may differ from ``dim``)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together, ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        """Parameters of one :class:`TransformerBlock`."""
        attn = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim  # q, o and k, v projections
        mlp = 3 * self.dim * self.ffn_dim
        norms = 2 * self.dim + 2 * self.head_dim  # input/post-attention gains + q/k norm gains
        return attn + mlp + norms

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

        The PaLM / torchtitan convention (as for Llama): ``6 * N`` for the weight matmuls, the output
        projection included even when tied, plus ``12 * n_layers * n_heads * head_dim * seq_len``
        for ``QK^T`` and ``AV`` over the full square. ``head_dim`` here is the decoupled one, so the
        attention term uses the real query width (0.6B: 2048, not ``dim`` = 1024).
        """
        matmul_params = self.num_params(exclude_embedding=True)
        if self.tie_embeddings:
            matmul_params += self.vocab_size * self.dim
        return 6 * matmul_params + 12 * self.n_layers * self.q_dim * seq_len


_PUBLISHED = Qwen3Args()  # the shared values below: vocab 151936, eps 1e-6, theta 1e6, 40960 positions

# Published dimensions: the config.json of each Qwen/Qwen3-<size> on the Hugging Face Hub (also
# torchtitan's qwen3 flavours); head_dim 128 and 8 kv heads throughout. Parameter counts (the tied
# matrix once), checked by tests/test_qwen3.py against the model cards' rounded figures:
# 0.6b 596,049,920; 1.7b 1,720,574,976; 4b 4,022,468,096; 8b 8,190,735,360; 14b 14,768,307,200;
# 32b 32,762,123,264.
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


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (plain: Qwen 3 uses no frequency scaling for its 40960 positions)
# ---------------------------------------------------------------------------------------------


def rope_tables(
    head_dim: int, theta: float, max_seq_len: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[max_seq_len, head_dim]`` in fp32, HF's half-split layout:
    the ``head_dim/2`` angles are repeated (``cat(angles, angles)``), pairing channel ``i`` with
    channel ``i + head_dim/2`` (see :func:`portatrain.kernels.reference.rope`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned gain and no bias."""

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
    """Grouped-query causal self-attention with per-head q/k RMSNorm, through SDPA only.

    k/v heads are shared as ``portatrain.models.attention`` describes (SDPA's ``enable_gqa`` without a
    mask, repeated heads with one).
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.q_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.kv_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.kv_dim, bias=False)
        self.o_proj = nn.Linear(args.q_dim, args.dim, bias=False)
        # One gain of head_dim values, shared by every head (HF: "only on the head dim").
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.rope_fn = rope  # x * cos + rotate_half(x) * sin, unless a kernel override replaces it

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            _trunc_normal_(linear.weight, std)
        _trunc_normal_(self.o_proj.weight, out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # Heads are read off the projected width (-1), so a tensor-parallel plan that column-shards
        # the projections (fewer heads per rank) needs no change here. The q/k norms see
        # [B, S, heads, head_dim] and normalize the last dimension, per head and position.
        q = self.q_norm(self.q_proj(x).view(batch, seq_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope_fn(q, cos, sin), self.rope_fn(k, cos, sin)  # after the norms, as in Qwen 3
        # SDPA scales by 1/sqrt(q.shape[-1]) = 1/sqrt(head_dim): the decoupled width, as HF does.
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

    def __init__(self, args: Qwen3Args) -> None:
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


class Qwen3(nn.Module):
    """A Qwen 3 dense decoder-only language model returning next-token logits.

    ``layers`` is an ``nn.ModuleDict`` keyed ``"0", "1", ...`` (as in torchtitan), so blocks can be
    replaced by wrapped versions without renaming checkpoint keys.

    With ``tie_embeddings`` there is no ``lm_head`` module at all: the output projection reads
    ``embed_tokens.weight`` directly. A second module holding the same ``Parameter`` would be
    silently untied by ``to_empty`` and by per-module sharding.
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        problems = args.problems()
        if problems:
            raise ValueError("invalid Qwen3Args:\n  - " + "\n  - ".join(problems))
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so kept out of checkpoints (non-persistent) and rebuilt by init_weights
        # after to_empty(). fp32 even in bf16 runs; the rope op casts at use.
        cos, sin = rope_tables(args.head_dim, args.rope_theta, args.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Initialize every parameter and rebuild the RoPE tables on their current device.

        Deterministic under the current torch seed (parameters are drawn in a fixed order).
        Weights are truncated normal with ``std``; the two projections that write into the
        residual stream (``o_proj``, ``down_proj``) use ``std / sqrt(2 * n_layers)`` so the
        residual's variance does not grow with depth. Norm gains, q/k norms included, start at 1.
        """
        cos, sin = rope_tables(
            self.args.head_dim, self.args.rope_theta, self.args.max_seq_len, self.rope_cos.device
        )
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
            cos = self.rope_cos[positions].unsqueeze(1)  # [B, 1, S, D]
            sin = self.rope_sin[positions].unsqueeze(1)

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
        """Count the parameters actually held (a tied matrix once); see :meth:`Qwen3Args.num_params`."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.embed_tokens.weight.numel() if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token; convention in :meth:`Qwen3Args.flops_per_token`."""
        return self.args.flops_per_token(seq_len)
