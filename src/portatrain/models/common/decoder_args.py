"""The arguments every decoder family shares (:class:`DecoderArgs`): fields, shape problems, the
analytic parameter count and the FLOPs-per-token convention; :class:`DerivedHeadDim` for families
whose head width is ``dim / n_heads``. Re-exported by ``portatrain.models.common.decoder``, whose
docstring describes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from portatrain.models.common.layers import Activation, QKNorm
from portatrain.models.common.rope import RopeScaling

NormPlacement = Literal["pre", "post", "both"]
"""``pre``: ``h = x + f(norm(x))`` (Llama, Qwen 3); ``post``: ``h = x + norm(f(x))``, the norm inside
the residual branch after each sub-layer (OLMo 2, https://arxiv.org/abs/2501.00656, section 3.2);
``both``: ``h = x + norm2(f(norm1(x)))``, a norm before and one after each sub-layer (Gemma 2 and 3,
https://arxiv.org/abs/2408.00118, section 2)."""


@dataclass(frozen=True)
class DecoderArgs:
    """The fields every family shares, the shape problems, parameter count and FLOPs; a family's
    frozen arguments dataclass subclasses it.

    A family adds its own fields (or derived properties) for ``head_dim`` and ``ffn_dim``, sets the
    class-level switches below, and redeclares a shared field only to change its default (the
    defaults here are Llama 3 8B's). Frozen because flavour tables share instances: derive variants
    with ``dataclasses.replace``. Construction does not validate (a config validator wants every
    problem, not the first): see :meth:`problems`, which :class:`Decoder` checks before building.
    """

    qk_norm: ClassVar[QKNorm] = "none"
    """Where attention normalizes q and k; see ``portatrain.models.common.layers.QKNorm``."""
    norm_placement: ClassVar[NormPlacement] = "pre"
    """Where each block's norms sit; see :data:`NormPlacement`."""
    rope_scaling: ClassVar[RopeScaling | None] = None
    """RoPE frequency scaling; a family that supports it declares it as a field (Llama)."""
    activation: ClassVar[Activation] = "silu"
    """The feed-forward's gate; see ``portatrain.models.common.layers.Activation``."""
    norm_unit_offset: ClassVar[bool] = False
    """Every norm's gain is stored as its offset from 1 (Gemma's ``1 + weight``)."""
    scale_embeddings: ClassVar[bool] = False
    """Multiply the embeddings by ``sqrt(dim)`` (Gemma), rounded to their dtype as Gemma's reference does."""
    attention_bias: ClassVar[bool] = False
    """The q/k/v/o projections have biases (GPT-OSS)."""
    attention_sinks: ClassVar[bool] = False
    """Each attention head has a learned sink logit (GPT-OSS; ``portatrain.models.common.masks``)."""
    sliding_window: ClassVar[int | None] = None
    """Keys a sliding layer's query sees (itself included); a family with sliding layers declares it as
    a field and says which layers slide in :meth:`is_sliding`."""
    rope_local_theta: ClassVar[float | None] = None
    """RoPE base of the sliding layers, when it differs from ``rope_theta`` (Gemma 3: 10,000 locally,
    1,000,000 globally); those layers' RoPE is never scaled. A family declares it as a field."""
    mtp_layers: ClassVar[int] = 0
    """Multi-token-prediction depths trained after the main model (``portatrain.models.common.mtp``);
    0: none. A family that supports it declares it, and ``mtp_loss_weight``, as fields."""
    mtp_loss_weight: ClassVar[float] = 0.0
    """The multi-token-prediction loss's weight (the paper's lambda), shared by the depths."""
    positive_fields: ClassVar[tuple[str, ...]] = (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "max_seq_len",
    )
    """Fields that must be positive (``model.<name>`` config keys)."""
    size_bounds: ClassVar[dict[str, int]] = {
        "n_layers": 10_000,
        "dim": 2**20,
        "n_heads": 2**16,
        "n_kv_heads": 2**16,
    }
    """Upper bounds, each far past any trained transformer (DeepNet's 1,000 blocks,
    https://arxiv.org/abs/2203.00555; widths of tens of thousands; a few hundred heads). Validation,
    ``portatrain plan`` and the build work per block, and the divisibility hints below per unit of
    width or head: ``model.n_layers=100000000`` took half a minute to validate, and a build on the
    meta device costs about 2.5 ms a block (2,000 blocks: 5 s)."""

    dim: int = 4096
    """Hidden size (HF ``hidden_size``)."""
    n_layers: int = 32
    """Number of transformer blocks (HF ``num_hidden_layers``)."""
    n_heads: int = 32
    """Query heads (HF ``num_attention_heads``)."""
    n_kv_heads: int = 8
    """Key/value heads for grouped-query attention; must divide ``n_heads`` (HF ``num_key_value_heads``)."""
    vocab_size: int = 128256
    """Rows of the embedding table and of the output projection."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon of every norm, q/k norms included (HF ``rms_norm_eps``)."""
    rope_theta: float = 500000.0
    """RoPE base period."""
    max_seq_len: int = 131072
    """Length of the RoPE table, i.e. the longest position the model can be fed (HF
    ``max_position_embeddings``). Lower it for training: the cos/sin tables cost
    ``2 * max_seq_len * head_dim`` fp32 values per device."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection."""

    def problems(self) -> list[str]:
        """Every inconsistency, each naming the values and the fix; empty when the arguments are valid.

        Collected rather than raised one at a time, so a bad flavour or custom sizes given on the
        command line (``model.dim=... model.n_heads=...``) are fixed in one edit.
        """
        problems = [
            f"model.{name}={getattr(self, name)} must be positive"
            for name in self.positive_fields
            if getattr(self, name) <= 0
        ]
        too_large = [
            f"model.{name}={getattr(self, name):,} is above {bound:,}: far past any trained transformer, and "
            f"more than the checks, the plan and the build handle in reasonable time; choose "
            f"model.{name}<={bound:,}"
            for name, bound in self.size_bounds.items()
            if getattr(self, name) > bound
        ]
        if too_large:  # the checks below take time in proportion to these sizes
            return problems + too_large
        if self.norm_eps <= 0:
            problems.append(f"model.norm_eps={self.norm_eps} must be positive")
        if self.rope_theta <= 1:
            problems.append(f"model.rope_theta={self.rope_theta} must be > 1")
        own = self.family_problems()  # (may make the derived head_dim meaningless)
        problems += own
        if not own and self.n_heads > 0 and self.head_dim > 0 and self.head_dim % 2:
            problems.append(
                f"model.head_dim={self.head_dim} must be even: RoPE rotates channel pairs; "
                "choose sizes that give an even head_dim"
            )
        if self.n_heads > 0 and self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            divisors = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            problems.append(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads} for "
                f"grouped-query attention; choose model.n_kv_heads in {divisors}"
            )
        return problems

    def family_problems(self) -> list[str]:
        """A family's own checks (none by default); guard divisions, sizes may be zero here."""
        return []

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer`` holds a mixture of experts (none in a dense family)."""
        return False

    def is_sliding(self, layer: int) -> bool:
        """Whether block ``layer`` attends within :attr:`sliding_window` only (none by default)."""
        return False

    @property
    def softmax_scale(self) -> float | None:
        """Attention's softmax scale; None: SDPA's ``1/sqrt(head_dim)``."""
        return None

    @property
    def q_dim(self) -> int:
        """Width of all query heads together, ``n_heads * head_dim`` (may differ from ``dim``)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together, ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def qk_norm_params(self) -> int:
        """Parameters of one block's q and k norms (their gains)."""
        return {"none": 0, "head": 2 * self.head_dim, "proj": self.q_dim + self.kv_dim}[self.qk_norm]

    @property
    def attention_params(self) -> int:
        """Parameters of one block's attention and its residual norms (everything but the MLP)."""
        attn = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim  # q, o and k, v projections
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim + self.dim
        if self.attention_sinks:
            attn += self.n_heads
        norms = (4 if self.norm_placement == "both" else 2) * self.dim  # the block's RMSNorm gains
        return attn + norms + self.qk_norm_params

    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of block ``layer``'s feed-forward (``active``: those one token uses)."""
        return 3 * self.dim * self.ffn_dim

    def num_params(self, exclude_embedding: bool = False, *, active: bool = False) -> int:
        """Parameter count computed from the shapes alone (nothing is built).

        ``exclude_embedding`` drops the input embedding table. With tied embeddings that table is
        also the output projection, so it leaves the model without any vocabulary matrix.
        ``active``: only the parameters one token passes through (a mixture of experts' routed
        experts count ``top_k`` of them); equal to the total for a dense model.
        """
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        blocks = sum(
            self.attention_params + self.mlp_params(i, active=active)
            for i in range(self.n_layers + self.mtp_layers)
        )
        # A multi-token-prediction depth adds its three norms and eh_proj to its block (embedding and head shared).
        mtp = self.mtp_layers * (3 * self.dim + 2 * self.dim * self.dim)
        total = embedding + blocks + mtp + self.dim + output  # + final norm
        return total - embedding if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at context length ``seq_len``.

        The convention of PaLM (Chowdhery et al. 2022, https://arxiv.org/abs/2204.02311, appendix B)
        and torchtitan, so MFU numbers compare with theirs:

        * ``6 * N`` for the weight matmuls: 2 FLOPs per multiply-add forward, twice that backward
          (gradients for inputs and for weights). ``N`` counts active parameters only (a token's
          ``top_k`` experts, not all of them), excludes the embedding lookup, which is a gather,
          but includes the output projection even when it is tied to the embedding.
        * ``12 * n_layers * n_heads * head_dim * seq_len`` for attention: ``QK^T`` and ``AV`` each
          cost ``2 * seq_len * head_dim`` per head and token forward (4 together), backward twice
          that (8). The full ``seq_len x seq_len`` square is counted (no discount for the causal
          mask), as PaLM does.
        """
        matmul_params = self.num_params(exclude_embedding=True, active=True)
        if self.tie_embeddings:
            matmul_params += self.vocab_size * self.dim
        # Multi-token prediction: each depth's block and eh_proj are in the count; its pass through the
        # shared output head and its attention are added here.
        matmul_params += self.mtp_layers * self.vocab_size * self.dim
        return 6 * matmul_params + 12 * (self.n_layers + self.mtp_layers) * self.q_dim * seq_len


class DerivedHeadDim:
    """Mixed in before :class:`DecoderArgs` by families whose head width is ``dim / n_heads`` (Llama,
    OLMo 2), so ``n_heads * head_dim == dim``."""

    dim: int
    n_heads: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def family_problems(self) -> list[str]:
        if self.dim <= 0 or self.n_heads <= 0 or self.dim % self.n_heads == 0:
            return []
        fits = [n for n in range(1, self.dim + 1) if self.dim % n == 0 and n <= 2 * self.n_heads][-3:]
        return [
            f"dim({self.dim}) must be divisible by n_heads({self.n_heads}) (head_dim = dim / n_heads); "
            f"change dim or use n_heads in {fits}"
        ]
