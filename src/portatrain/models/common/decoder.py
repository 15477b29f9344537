"""The decoder every family in this repository is: embedding -> blocks -> final norm -> logits.

* :class:`DecoderArgs` (``decoder_args.py``, re-exported here) -- what a family's frozen arguments
  dataclass inherits: the shared fields (``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``,
  ``vocab_size``, ``norm_eps``, ``rope_theta``, ``max_seq_len``, ``tie_embeddings``; the family adds
  ``head_dim`` and ``ffn_dim``), the two architectural switches (:attr:`~DecoderArgs.qk_norm`,
  :attr:`~DecoderArgs.norm_placement`), every shape problem, the analytic parameter count and the
  FLOPs-per-token convention.
* :class:`TransformerBlock` -- one decoder layer, its norms placed before (Llama, Qwen 3), after
  (OLMo 2) or before and after (Gemma 3) each sub-layer, inside the residual branch.
* :class:`Decoder` -- the whole model; a family's model class is a subclass that changes nothing but
  its name (or overrides :meth:`Decoder.build_block` for a block of its own).

Module and parameter names are Hugging Face's minus the ``model.`` prefix, so checkpoints convert by
renaming alone (``portatrain.models.common.hf``). The model knows nothing about devices, meshes or
compilers. The intended life cycle is::

    with torch.device("meta"):
        model = Llama(args)          # no memory allocated
    ...parallelize (TP, activation checkpointing, compile, FSDP2)...
    model.to_empty(device=device)    # allocate, uninitialized
    model.init_weights(std=0.02)     # or load a checkpoint

Constructing on a real device also works: PyTorch's default init runs and the RoPE tables are
filled, but call :meth:`Decoder.init_weights` for the initialization this file intends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.models.common.decoder_args import DecoderArgs as DecoderArgs
from portatrain.models.common.decoder_args import DerivedHeadDim as DerivedHeadDim
from portatrain.models.common.decoder_args import NormPlacement as NormPlacement
from portatrain.models.common.kv_cache import KVCache
from portatrain.models.common.layers import Attention, FeedForward, RMSNorm, trunc_normal_
from portatrain.models.common.masks import sliding_window_mask
from portatrain.models.common.mtp import MultiTokenPrediction
from portatrain.models.common.rope import rope_tables


class TransformerBlock(nn.Module):
    """One decoder layer: attention then the feed-forward, each in a residual branch with an RMSNorm.

    ``norm_placement="pre"``: ``h = x + attn(input_layernorm(x))``, ``h + mlp(post_attention_layernorm(h))``.
    ``norm_placement="post"``: ``h = x + post_attention_layernorm(attn(x))``,
    ``h + post_feedforward_layernorm(mlp(h))``.
    ``norm_placement="both"``: ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``,
    ``h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`` (HF's names for all three).

    A standalone module so parallelization can wrap each block on its own (activation
    checkpointing, ``torch.compile``, ``fully_shard``).
    """

    def __init__(
        self, args: DecoderArgs, mlp: nn.Module | None = None, attn: nn.Module | None = None
    ) -> None:
        super().__init__()
        if args.norm_placement not in ("pre", "post", "both"):
            raise ValueError(f"norm_placement={args.norm_placement!r} is not one of pre, post, both")
        self.norm_placement = args.norm_placement

        def norm() -> RMSNorm:
            return RMSNorm(args.dim, args.norm_eps, unit_offset=args.norm_unit_offset)

        if args.norm_placement != "post":
            self.input_layernorm = norm()
        # A family's own attention (latent attention) or the shared grouped-query one.
        if attn is None:
            attn = Attention(
                args.dim,
                args.n_heads,
                args.n_kv_heads,
                args.head_dim,
                norm_eps=args.norm_eps,
                qk_norm=args.qk_norm,
                softmax_scale=args.softmax_scale,
                bias=args.attention_bias,
                sinks=args.attention_sinks,
                norm_unit_offset=args.norm_unit_offset,
            )
        self.self_attn = attn
        self.post_attention_layernorm = norm()
        if args.norm_placement == "both":
            self.pre_feedforward_layernorm = norm()
        # A family's own feed-forward (a mixture of experts) or the shared gated one.
        self.mlp = FeedForward(args.dim, args.ffn_dim, args.activation) if mlp is None else mlp
        if args.norm_placement != "pre":
            self.post_feedforward_layernorm = norm()

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in self.norms():
            norm.reset_parameters()
        self.self_attn.init_weights(std, out_std)
        self.mlp.init_weights(std, out_std)

    def norms(self) -> list[RMSNorm]:
        """The block's residual-stream norms, in order (attention's, then the feed-forward's)."""
        if self.norm_placement == "pre":
            return [self.input_layernorm, self.post_attention_layernorm]
        if self.norm_placement == "post":
            return [self.post_attention_layernorm, self.post_feedforward_layernorm]
        return [
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        ]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.norm_placement == "pre":
            h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
            return h + self.mlp(self.post_attention_layernorm(h))
        if self.norm_placement == "post":
            h = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attn_mask))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn_mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Decoder(nn.Module):
    """A decoder-only language model returning next-token logits.

    ``layers`` is an ``nn.ModuleDict`` keyed ``"0", "1", ...`` (as in torchtitan): its state-dict
    keys are the same as a ``ModuleList``'s, but blocks can be replaced by wrapped versions
    (checkpointing, compile) or deleted (pipeline stages) without renumbering the survivors, so
    checkpoint keys stay stable.

    With ``tie_embeddings`` there is no ``lm_head`` module at all: the output projection reads
    ``embed_tokens.weight`` directly. A second module holding the same ``Parameter`` would be
    silently untied by ``to_empty`` and by per-module sharding.

    A pipeline stage (``portatrain.parallel.pipeline``) is this model with parts removed: without
    ``embed_tokens`` it takes hidden states ``[B, S, dim]`` instead of token ids, without ``norm`` (and
    ``lm_head``) it returns the hidden states after its blocks.
    """

    optional_state = ("mtp.",)
    """State-dict prefixes a checkpoint may lack or hold in excess: multi-token prediction's depths,
    which a resumed run may add (initialized afresh) or drop (``portatrain.checkpoint``)."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        problems = args.problems()
        if problems:
            raise ValueError(f"invalid {type(args).__name__}:\n  - " + "\n  - ".join(problems))
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps, unit_offset=args.norm_unit_offset)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Multi-token prediction's depths (DeepSeek-V3), trained beside the main model when targets are set.
        self.mtp = MultiTokenPrediction(args, self.build_block) if args.mtp_layers > 0 else None
        # Derived from args, so kept out of checkpoints (non-persistent) and rebuilt by init_weights
        # after to_empty(). fp32 even in bf16 runs; the rope op casts at use.
        cos, sin = self._rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if args.rope_local_theta is not None:  # the sliding layers' own base (Gemma 3)
            cos, sin = self._local_rope_tables()
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)

    def build_block(self, args: Any, layer_id: int) -> nn.Module:
        """Block ``layer_id``; a family with blocks of its own overrides this."""
        return TransformerBlock(args)

    def _rope_tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        return rope_tables(a.head_dim, a.rope_theta, a.max_seq_len, a.rope_scaling, device=device)

    def _local_rope_tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        return rope_tables(a.head_dim, a.rope_local_theta, a.max_seq_len, None, device=device)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Initialize every parameter and rebuild the RoPE tables on their current device.

        Deterministic under the current torch seed: each part (the embedding, block ``i``, the final
        norm and head) draws from its own seed, derived from that seed and the part's place in the
        unsplit model, so a pipeline stage holding some of the parts initializes them exactly as the
        whole model does. Weights are truncated normal with ``std``; the two projections that write into the
        residual stream (``o_proj``, ``down_proj``) use ``std / sqrt(2 * n_layers)`` (GPT-2,
        Megatron) so the residual's variance does not grow with depth. Norm gains start at 1.
        """
        cos, sin = self._rope_tables(device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if self.args.rope_local_theta is not None:
            cos, sin = self._local_rope_tables(device=self.rope_local_cos.device)
            self.rope_local_cos.copy_(cos)
            self.rope_local_sin.copy_(sin)
        out_std = std / math.sqrt(2 * self.args.n_layers)
        seed = torch.initial_seed()
        if self.embed_tokens is not None:
            torch.manual_seed(seed)
            trunc_normal_(self.embed_tokens.weight, std)
        for name, block in self.layers.items():
            torch.manual_seed(seed + 1 + int(name))
            block.init_weights(std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.lm_head is not None:
            torch.manual_seed(seed + 1 + self.args.n_layers)
            trunc_normal_(self.lm_head.weight, std)
        if getattr(self, "mtp", None) is not None:  # (a pipeline stage has none)
            torch.manual_seed(seed + 2 + self.args.n_layers)
            self.mtp.init_weights(std, out_std)
        torch.manual_seed(seed)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        output_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, vocab_size]`` in the compute dtype, or ``output_fn``'s result.

        Args:
            tokens: ``[B, S]`` token ids.
            positions: ``[B, S]`` RoPE positions; default ``0..S-1`` in every row. Packed rows pass
                positions that restart at 0 at each document boundary. Values must be below
                ``max_seq_len`` (not checked: that would need a device sync).
            attn_mask: ``[B, 1, S, S]`` boolean, ``True`` where a query may attend to a key (e.g. the
                packing collator's block-diagonal causal mask); ``None`` is plain causal attention; or a
                callable that attends itself (``portatrain.models.attention.AttentionFn``: context parallel).
            output_fn: called as ``output_fn(hidden, weight)`` with the final normalized hidden states
                ``[B, S, dim]`` and the output projection's matrix ``[vocab_size, dim]`` in place of
                the projection (e.g. ``portatrain.losses``' chunked loss, which never builds the full
                logits). Inside ``forward``, so FSDP2 has the matrix gathered.
            cache: a key/value cache (``portatrain.models.common.kv_cache``): the tokens' keys and
                values are stored in it at ``positions`` and every block attends over the whole cache,
                for decoding a token at a time. ``positions`` is then ``[S]``, the slots of the ``S``
                new tokens (the same in every row), and ``attn_mask`` must be None.
        """
        if cache is not None and (positions is None or positions.dim() != 1 or attn_mask is not None):
            raise ValueError(
                "a forward with a KV cache takes positions [S] (the slots written) and no attn_mask"
            )
        if cache is not None and self.args.attention_sinks:
            raise ValueError(
                "a KV cache does not implement attention sinks (GPT-OSS) yet; decode without one"
            )
        seq_len = tokens.shape[1]  # token ids [B, S], or a later pipeline stage's hidden states [B, S, dim]
        if seq_len > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} > max_seq_len {self.args.max_seq_len}; "
                f"shorten the rows or raise model.max_seq_len"
            )
        cos, sin = _rope_at(self.rope_cos, self.rope_sin, positions, seq_len)

        h = tokens if self.embed_tokens is None else self.embed_tokens(tokens)
        if self.embed_tokens is not None and self.args.scale_embeddings:
            # sqrt(dim) rounded to the embeddings' dtype first, as Gemma's reference (and HF) do:
            # in bf16 sqrt(3072) = 55.43 becomes 55.5, and checkpoints were trained with that.
            h = h * torch.tensor(self.args.dim**0.5, dtype=h.dtype, device=h.device)
        local = None  # the sliding layers' RoPE tables and mask, built once for all of them
        if self.args.sliding_window is not None:
            if self.args.rope_local_theta is not None:
                local_tables = _rope_at(self.rope_local_cos, self.rope_local_sin, positions, seq_len)
            else:
                local_tables = (cos, sin)
            window = None  # with a cache, each layer's cache attention applies its window
            if cache is None:
                window = sliding_window_mask(attn_mask, seq_len, self.args.sliding_window, h.device)
            local = (*local_tables, window)
        for name, block in self.layers.items():
            sliding = local is not None and self.args.is_sliding(int(name))
            block_cos, block_sin, mask = local if sliding else (cos, sin, attn_mask)
            if cache is not None:
                mask = cache.attention(name, positions, window=self.args.sliding_window if sliding else None)
            h = block(h, block_cos, block_sin, mask)
        if self.norm is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if output_fn is not None:
            out = output_fn(h, head)
        else:
            out = F.linear(h, head) if self.lm_head is None else self.lm_head(h)
        if getattr(self, "mtp", None) is not None and self.mtp.targets is not None:
            # After the main head (FSDP2 has gathered it); the runtime hook collects the loss sum.
            self.mtp.loss_sum = self.mtp(h, self.embed_tokens, head, cos, sin, attn_mask, output_fn)
        return out

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Count the parameters actually held (a tied matrix once); see :meth:`DecoderArgs.num_params`."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.embed_tokens.weight.numel() if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token; convention in :meth:`DecoderArgs.flops_per_token`."""
        return self.args.flops_per_token(seq_len)


def _rope_at(
    cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor | None, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of RoPE tables for ``positions`` (None: ``0..seq_len-1``), shaped to broadcast over q/k."""
    if positions is None:
        return cos_table[:seq_len], sin_table[:seq_len]  # [S, D], broadcast over B, H
    if positions.dim() == 1:  # a cached forward's slots, shared by every row
        return cos_table[positions], sin_table[positions]  # [S, D]
    return cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # [B, 1, S, D]
