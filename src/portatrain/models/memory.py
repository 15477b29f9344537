"""Per-device training memory estimate for a dense decoder-only transformer, for the dry run and planning.

Generic over the model family: :func:`estimate_memory` reads only the architecture attributes every
family built from ``portatrain.models.common`` carries (``dim``, ``n_layers``, ``n_heads``,
``n_kv_heads``, ``head_dim``, ``ffn_dim``, ``vocab_size``, ``qk_norm``, ``attention_params``,
``mlp_params()``, ``num_params()``; see :class:`TransformerShape`). A family whose blocks save other tensors wraps it in
its own estimate and registers that in its ``ModelSpec.estimate_memory``.

:func:`estimate_memory` counts, in bytes per device:

* ``params``, ``grads``, ``optimizer`` -- the persistent state, divided over ``shard_degree * tp_degree``
  ranks. FSDP2 pads each parameter's dim 0 to a multiple of the shard degree; that padding is ignored.
  With LoRA (``lora_params``) the base is frozen: stored, but with neither gradients nor optimizer
  state; the adapters are stored, and only they have gradients and AdamW moments. The activations
  are full fine-tuning's: the adapters' own saved tensors (``A x``: ``rank`` values per token and
  adapted layer) are left out, a few per cent of a block's at rank 8.
* ``fsdp_buffers`` -- transient unsharded copies FSDP keeps while it computes: the current unit's
  and the prefetched next unit's all-gathered parameters, plus one unit's unsharded gradients before
  the reduce-scatter. A unit is one transformer block, or the embedding / output projection if larger.
* ``activations`` -- tensors saved for backward (formula below) plus the output head's buffers.
* ``tied_grad_sum`` -- tied embeddings (``tie_embeddings``) that train: the matrix gets two gradients,
  the output projection's (first, kept by autograd through backward) and the lookup's
  (``embedding_dense_backward``, last), summed out of place, so at the end of backward both (``2 V h``,
  unsharded) are alive beside every gradient: 1.16 GiB at Qwen3-0.6B, the whole of the estimate's
  former shortfall there (0.885 of the allocator's peak; docs/benchmarks.md).

``total`` is not the sum of the components: gradients and activations peak at different times. At
the start of backward every activation is alive and only the output head's gradient exists; at the
end every gradient exists and the activations are gone. So ``total = params + optimizer +
fsdp_buffers + max(activations + output-head gradient, grads + tied_grad_sum)``.

It does not count the CUDA/XLA caching allocator's fragmentation, framework workspaces, the data
batch, a packed attention mask (``B * S * S`` bytes) or the optimizer step's temporaries; leave
10-20% headroom on accelerators. Checked against measured peaks on CPU (torch's CPU allocator,
``scripts/bench_memory.py``, docs/benchmarks.md "The dry run against measured peaks"): within -1%..+10%
over three sizes, two sequence lengths, the three checkpointing modes, the chunked loss and FSDP2
on two processes, and to the MiB at the Qwen3-0.6B shape, full fine-tune and LoRA. It predicts the
allocator's peak, not the resident set (1.2-1.4 GiB more at 0.6B); ``tests/test_conformance.py``
keeps two such comparisons for every family, ``tests/test_memory.py`` one for LoRA and one for a
tied embedding.

Activations saved for backward, per token and layer, in elements of the activation dtype
(``h`` = dim, ``q`` = ``n_heads * head_dim`` (= ``h`` for Llama), ``f`` = SwiGLU width, ``a`` = query
heads), counted from this repo's Llama ``model.py``:

=========================================  =========  ===========================================
saved tensor                               elements   saved by
=========================================  =========  ===========================================
block input                                h          input RMSNorm
normalized input                           h          q/k/v projections (one tensor for all three)
q after RoPE                               q          SDPA
k, v (repeated with a mask, see below)     2q         SDPA
attention output                           q          SDPA and ``o_proj`` (a view of the same data)
attention residual sum                     h          post-attention RMSNorm
normalized MLP input                       h          gate/up projections
gate, up, silu(gate), silu(gate) * up      4f         SiLU, product, ``down_proj``
=========================================  =========  ===========================================

With an attention mask (packing with ``data.packing_attention=document``) k/v heads are repeated
before SDPA and saved repeated (``2q``); without one, SDPA's grouped-query path saves them as they
are (``2 * kv``, ``kv = n_kv_heads * head_dim``; ``portatrain.models.attention``). With a mask that
is ``4h + 4q + 4f`` elements (``8h + 4f`` for Llama) plus two fp32 RMSNorm statistics and ``a`` fp32 softmax
log-sum-exps per token (a fused attention kernel is assumed: no ``S x S`` score matrix is kept).
Where the norms sit does not change the count: a post-norm block (OLMo 2) saves the block input
(read by q/k/v), the attention output (its norm's input), the residual sum (read by gate/up) and the
MLP output (its norm's input) -- ``4h`` as the pre-norm rows above.

q/k norms (``qk_norm`` ``head``, Qwen 3, or ``proj``, OLMo 2) add, per token and layer, their inputs --
the q and k projection outputs, ``q + kv`` elements -- and their fp32 inverse RMS: one per head
(``n_heads + n_kv_heads``) or one per projection (2). RoPE after the norms saves nothing beyond its
(buffer) tables. Checkpointing recomputes them (pointwise work), so with ``full`` or ``selective``
the extra lives only in the one block being recomputed.

A norm before and after each sub-layer (Gemma 3, ``norm_placement="both"``) keeps two more rows of
``h`` (the sub-layers' outputs, read by the post-norms) and two more norm statistics. A sliding-window
layer whose rows are longer than its window attends with a mask, so its k/v are saved repeated
(``2q``). Attention sinks (GPT-OSS) give SDPA a float mask that needs a gradient, which no fused
kernel takes: per token and layer, the mask's and the softmax's ``a * (S + 1)`` values each.

Compare Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
``s*b*h*(34 + 5*a*s/h)`` bytes per layer for GPT in fp16 with dropout: that count's MLP has
``f = 4h`` and no gate, and its ``5*a*s/h`` term is the materialized softmax and dropout that fused
kernels avoid.

``activation_checkpointing``:

* ``none`` -- every layer keeps the table above.
* ``full`` -- each block keeps only its input (``h``); one block at a time is recomputed in
  backward and holds the full table meanwhile (after the output head's buffers are freed, so the
  larger of the two counts).
* ``selective`` -- torchtitan's op-level policy: keep the attention output (and log-sum-exp) and
  every second matmul output, recompute norms, pointwise ops and the other matmuls. Estimated as
  block input + attention output + half of the matmul outputs (``q, k, v, o, gate, up, down`` =
  ``q + 2h + 2*kv + 2f`` with ``kv = n_kv_heads * head_dim``), plus one block's recomputation peak.

After the last block, with the plain loss: final-norm input and output (``2h``), the logits (``V``)
in the activation dtype, fp32 log-probabilities for the loss and, at the start of backward, the
fp32 gradient of the logits (``2V``, 4 bytes). With ``trainer.loss=chunked`` (``loss_chunk_size``):
norm input/output and the hidden states' gradient (``3h``) per token, plus one chunk of fp32 logits.
Multi-token prediction's depths (``mtp_layers``) are blocks checkpointed as the main ones, each with
its inputs and final norm (``5h``) and its loss: fp32 log-probabilities (``V``), or with the chunked loss
a hidden-states gradient (``h``) and an fp32 gradient of the output matrix.

Tensor parallelism is assumed to come with sequence parallelism and a vocabulary-parallel loss
(torchtitan's plan), so activations and logits are divided by ``tp_degree`` too.

Multi-head latent attention (``portatrain.models.common.mla``, arguments with a ``kv_lora_rank``)
saves other tensors than the table's attention rows (:func:`latent_attention_saved`): with ``H``
heads, query/key heads ``d_qk`` wide and value heads ``d_v``, per token and layer the query latent
and its normalized form (``2 r_q``, when queries have a latent), the key/value latent and its
normalized form (``2 r_kv``), the full queries and keys SDPA reads (``2 H d_qk``), the latent's
up-projection, of which the values are a view (``H (d_nope + d_v)``), and the attention output
(``H d_v``); fp32: two more norm statistics and ``H`` log-sum-exps. No head is repeated.

Expert parallel (``ep_degree``) leaves every sharded state divided over ``shard_degree`` ranks (experts
over ``ep`` and the ranks that hold the same experts together), but a block's FSDP unit then holds
only the rank's ``n_experts / ep`` experts when gathered.
"""

from __future__ import annotations

from typing import Protocol

from portatrain.parallel.activation_checkpoint import AC_MODES as _CHECKPOINTING

_GIB = 1024**3


class TransformerShape(Protocol):
    """The architecture attributes the estimate reads (a family's frozen arguments dataclass)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    qk_norm: str

    def is_sparse(self, layer: int) -> bool: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def ffn_dim(self) -> int: ...

    @property
    def attention_params(self) -> int: ...

    def mlp_params(self, layer: int) -> int: ...

    def num_params(self) -> int: ...


def estimate_memory(
    args: TransformerShape,
    *,
    batch_size: int,
    seq_len: int,
    param_dtype_bytes: int = 4,
    grad_dtype_bytes: int | None = None,
    optim_state_bytes_per_param: int = 8,
    shard_degree: int = 1,
    tp_degree: int = 1,
    activation_checkpointing: str = "none",
    activation_dtype_bytes: int | None = None,
    loss_chunk_size: int | None = None,
    attn_mask: bool = True,
    capacity_factor: float | None = None,
    ep_degree: int = 1,
    lora_params: int | None = None,
) -> dict[str, int]:
    """Estimated bytes per device for training ``args`` with one micro-batch in flight.

    Args:
        args: the model architecture.
        batch_size: micro-batch rows per device.
        seq_len: tokens per row.
        param_dtype_bytes: bytes per stored parameter (4 fp32, 2 bf16).
        grad_dtype_bytes: bytes per gradient element; default ``param_dtype_bytes``.
        optim_state_bytes_per_param: AdamW keeps two fp32 moments (8); add 4 for an fp32 master
            copy when the stored parameters are bf16 (12).
        shard_degree: FSDP shard degree (``dp_shard``); replicas (``dp_replicate``) do not divide memory.
        tp_degree: tensor-parallel degree.
        activation_checkpointing: ``none``, ``full`` or ``selective`` (see module docstring).
        activation_dtype_bytes: bytes per activation element and per all-gathered FSDP parameter
            (the compute dtype, e.g. 2 under bf16 mixed precision); default ``param_dtype_bytes``.
        loss_chunk_size: ``trainer.loss=chunked``'s positions per chunk (``portatrain.losses``);
            None for the plain loss over full logits.
        attn_mask: the batches carry an attention mask (packing with document masks), so k/v heads
            are saved repeated; False: SDPA's grouped-query path, k/v saved unrepeated.
        capacity_factor: a mixture of experts dispatched to fixed-capacity slots (``capacity``
            mode) with this factor; None: dropless (see :func:`mlp_saved`).
        ep_degree: expert-parallel degree (``parallel.ep``; divides ``shard_degree``).
        lora_params: LoRA (``finetune.method=lora``): the adapters' parameters, the only ones that
            train; the architecture's own are frozen. None: every parameter trains.

    Returns:
        ``params``, ``grads``, ``optimizer``, ``fsdp_buffers``, ``activations`` (``tied_grad_sum`` too
        for tied embeddings that train) and ``total``, in bytes.
    """
    grad_dtype_bytes = param_dtype_bytes if grad_dtype_bytes is None else grad_dtype_bytes
    act_bytes = param_dtype_bytes if activation_dtype_bytes is None else activation_dtype_bytes

    positive = {"batch_size": batch_size, "seq_len": seq_len, "param_dtype_bytes": param_dtype_bytes}
    positive |= {"grad_dtype_bytes": grad_dtype_bytes, "activation_dtype_bytes": act_bytes}
    positive |= {"shard_degree": shard_degree, "tp_degree": tp_degree, "ep_degree": ep_degree}
    _check_inputs(args, positive, optim_state_bytes_per_param, activation_checkpointing)

    ranks = shard_degree * tp_degree
    params, grads, optimizer, head_grad = _persistent_state(
        args, ranks, param_dtype_bytes, grad_dtype_bytes, optim_state_bytes_per_param, lora_params
    )
    fsdp_buffers = 0
    if shard_degree > 1:
        fsdp_buffers = _fsdp_buffers(args, tp_degree, ep_degree, act_bytes, grad_dtype_bytes, lora_params)
    per_token_blocks, per_token_recompute = _block_activations(
        args, seq_len, batch_size, act_bytes, activation_checkpointing, attn_mask, capacity_factor
    )
    tokens = batch_size * seq_len
    head = _head_activations(args, tokens, act_bytes, loss_chunk_size)
    activations = _ceil_div(tokens * per_token_blocks + max(head, tokens * per_token_recompute), tp_degree)
    # A tied matrix's two gradients, alive together while autograd sums them (module docstring).
    tied = getattr(args, "tie_embeddings", False) and lora_params is None
    tied_sum = _ceil_div(2 * args.vocab_size * args.dim * grad_dtype_bytes, tp_degree) if tied else 0
    # Gradients and activations peak at different times: at the start of backward every
    # activation is alive but only the output head's gradient exists; at its end every gradient
    # exists and the activations are gone.
    total = params + optimizer + fsdp_buffers + max(activations + head_grad, grads + tied_sum)
    estimate = dict(
        params=params, grads=grads, optimizer=optimizer, fsdp_buffers=fsdp_buffers, activations=activations
    )
    return estimate | ({"tied_grad_sum": tied_sum} if tied else {}) | {"total": total}


def _persistent_state(
    args: TransformerShape,
    ranks: int,
    param_bytes: int,
    grad_bytes: int,
    optim_bytes: int,
    lora_params: int | None,
) -> tuple[int, int, int, int]:
    """Bytes per device of the parameters, gradients, optimizer state and the output head's gradient
    (:func:`estimate_memory`'s arguments). LoRA freezes the architecture's parameters, the head's
    included: only the adapters get gradients and optimizer state (``portatrain.optim`` skips frozen
    parameters), but both are stored."""
    n_params = args.num_params()
    trained = n_params if lora_params is None else lora_params
    stored = n_params + (lora_params or 0)
    head = args.vocab_size * args.dim if lora_params is None else 0
    return (
        _ceil_div(stored * param_bytes, ranks),
        _ceil_div(trained * grad_bytes, ranks),
        _ceil_div(trained * optim_bytes, ranks),
        _ceil_div(head * grad_bytes, ranks),
    )


def _fsdp_buffers(
    args: TransformerShape,
    tp_degree: int,
    ep_degree: int,
    act_bytes: int,
    grad_bytes: int,
    lora_params: int | None,
) -> int:
    """Bytes of FSDP's unsharded copies: two units' gathered parameters (this one and the prefetched
    next) and one unit's gradients before the reduce-scatter -- with LoRA, a block's adapters only."""
    adapters = 0 if lora_params is None else _ceil_div(lora_params, args.n_layers)  # a block's, about
    block = max(_fsdp_unit(args, i, ep_degree) for i in range(args.n_layers)) + adapters
    unit = max(block, args.vocab_size * args.dim)
    grad_unit = unit if lora_params is None else adapters
    return _ceil_div(unit * 2 * act_bytes + grad_unit * grad_bytes, tp_degree)


def _check_inputs(
    args: TransformerShape,
    positive: dict[str, int],
    optim_state_bytes_per_param: int,
    activation_checkpointing: str,
) -> None:
    """Raise one ValueError listing every input :func:`estimate_memory` cannot take."""
    problems = []
    for name, value in positive.items():
        if value <= 0:
            problems.append(f"{name}={value} must be positive")
    if optim_state_bytes_per_param < 0:
        problems.append(f"optim_state_bytes_per_param={optim_state_bytes_per_param} must be >= 0")
    if activation_checkpointing not in _CHECKPOINTING:
        problems.append(
            f"activation_checkpointing={activation_checkpointing!r} is not one of {', '.join(_CHECKPOINTING)}"
        )
    tp_degree = positive["tp_degree"]
    if tp_degree > 0 and (args.n_heads % tp_degree or args.n_kv_heads % tp_degree):
        problems.append(
            f"tp_degree={tp_degree} must divide n_heads={args.n_heads} and n_kv_heads={args.n_kv_heads}; "
            f"choose a tp degree that divides {args.n_kv_heads}"
        )
    if problems:
        raise ValueError("cannot estimate memory:\n  - " + "\n  - ".join(problems))


def _block_activations(
    args: TransformerShape,
    seq_len: int,
    batch_size: int,
    act_bytes: int,
    activation_checkpointing: str,
    attn_mask: bool,
    capacity_factor: float | None,
) -> tuple[int, int]:
    """Bytes per token the blocks keep until backward, and those one block's recomputation holds
    meanwhile (checkpointing only); the arguments are :func:`estimate_memory`'s."""
    h, a = args.dim, args.n_heads
    q = args.n_heads * args.head_dim
    kv = args.n_kv_heads * args.head_dim
    # A norm before and after each sub-layer (Gemma) keeps two more residual-width rows (the
    # sub-layers' outputs, the post-norms' inputs) and two more norm statistics.
    both = getattr(args, "norm_placement", "pre") == "both"
    residual, norm_stats = (6 * h, 4) if both else (4 * h, 2)
    sinks = getattr(args, "attention_sinks", False)
    window = getattr(args, "sliding_window", None)

    def attention_bytes(layer: int) -> int:
        """The table without the MLP + fp32 log-sum-exps and norm statistics. A mask (packing, a
        sliding window shorter than the row, attention sinks) makes SDPA read repeated k/v heads."""
        sliding = window is not None and args.is_sliding(layer) and seq_len > window
        saved_kv = 2 * q if attn_mask or sliding or sinks else 2 * kv  # k, v as SDPA saves them
        saved = (
            (residual + 2 * q + saved_kv) * act_bytes + (a + norm_stats) * 4 + qk_norm_bytes(args, act_bytes)
        )
        if sinks:
            # SDPA cannot fuse a float mask that needs a gradient: its math path keeps the softmax
            # over S + 1 keys per head, and the mask itself (per row too with a packing mask).
            saved += a * (seq_len + 1) * act_bytes
            saved += _ceil_div(a * (seq_len + 1) * act_bytes, 1 if attn_mask else batch_size)
        return saved

    # The main blocks, then multi-token prediction's depths (checkpointed as the main blocks), each
    # with its inputs: the embedding, the two normalized halves concatenated, its final norm's input
    # and output (``5h``) and two norm statistics; its checkpoint keeps two inputs (``h`` more).
    depths = getattr(args, "mtp_layers", 0)
    blocks = args.n_layers + depths
    attention = [attention_bytes(layer) for layer in range(blocks)]
    attn_matmuls = q + h + 2 * kv  # q, o, k, v projections' outputs (selective checkpointing)
    if hasattr(args, "kv_lora_rank"):  # latent attention
        elements, fp32, attn_matmuls = latent_attention_saved(args)
        attention = [(4 * h + elements) * act_bytes + fp32 * 4] * blocks
        q = args.n_heads * args.v_head_dim  # the attention output kept by selective checkpointing
    mlps = [mlp_saved(args, layer, capacity_factor) for layer in range(blocks)]
    per_layer = [
        att + saved * act_bytes + fp32 * 4 for att, (saved, fp32, _) in zip(attention, mlps, strict=True)
    ]
    # Per token: what the blocks keep until backward, and what one block's recomputation holds
    # meanwhile (checkpointing only; it happens after the output head's buffers are freed).
    recompute = max(per_layer)
    if activation_checkpointing == "none":
        per_token_blocks, recompute = sum(per_layer), 0
    elif activation_checkpointing == "full":
        per_token_blocks = (blocks + depths) * h * act_bytes
    else:  # selective: half of the matmul outputs (q, o, k, v and the MLP's)
        per_token_blocks = sum((h + q + (attn_matmuls + mm) // 2) * act_bytes + a * 4 for _, _, mm in mlps)
    return per_token_blocks + depths * (5 * h * act_bytes + 2 * 4), recompute


def _head_activations(
    args: TransformerShape, tokens: int, act_bytes: int, loss_chunk_size: int | None
) -> int:
    """Bytes the output head and the loss hold at the start of backward, for ``tokens`` tokens; with
    multi-token prediction (``mtp_layers``) each depth's loss too."""
    h, v = args.dim, args.vocab_size
    depths = getattr(args, "mtp_layers", 0)
    if loss_chunk_size is None:
        # Logits, their fp32 log-probabilities, and -- at the start of backward, the peak -- the
        # fp32 gradient of the logits. A depth keeps its fp32 log-probabilities only.
        head = tokens * ((2 * h + v) * act_bytes + 2 * v * 4) + depths * tokens * v * 4
    else:
        # Chunked loss: one chunk of fp32 logits (plus its compute-dtype projection under mixed
        # precision) and the hidden states' gradient, computed in forward. The matrix's gradient,
        # also computed in forward, is the output head's entry of ``grads``; a depth keeps its own
        # (fp32) beside its hidden states' gradient.
        chunk = min(loss_chunk_size, tokens)
        head = tokens * 3 * h * act_bytes + chunk * v * (4 + (act_bytes if act_bytes != 4 else 0))
        head += depths * (tokens * h * act_bytes + v * h * 4)
    return head


def mlp_saved(
    args: TransformerShape, layer: int, capacity_factor: float | None = None
) -> tuple[int, int, int]:
    """``(elements, fp32 values, matmul outputs)`` block ``layer``'s feed-forward saves per token.

    Dense SwiGLU: gate, up, ``silu(gate)``, their product (``4f``); matmul outputs gate, up, down
    (``2f + h``). A mixture of experts (``portatrain.models.common.moe``), per token and for each of
    its ``top_k`` assignments: the gathered input and the weighted expert output (``2h``) and the
    expert's SwiGLU table (``4i``, ``i`` = expert width), plus the router's fp32 probabilities
    (``n_experts``) and top-k weights; its matmul outputs are gate/up and down per assignment
    (``k * (2i + h)``). ``capacity_factor`` (capacity dispatch) scales the per-assignment terms: each
    expert holds that many slots per expected assignment, filled or not.
    """
    if not args.is_sparse(layer):
        return 4 * args.ffn_dim, 0, 2 * args.ffn_dim + args.dim
    h, i, k = args.dim, args.moe_ffn_dim, args.top_k
    slots = k if capacity_factor is None else capacity_factor * k
    # Another gate keeps more (GPT-OSS's clamped one with biases: ``expert_saved_widths`` 9 and a
    # gathered output bias of width h per assignment).
    gate = getattr(args, "expert_saved_widths", 4)
    bias = h if getattr(args, "expert_bias", False) else 0
    elements = slots * (2 * h + gate * i + bias)
    # Shared experts: one dense SwiGLU ``n_shared * i`` wide, and its output summed in.
    shared = getattr(args, "n_shared_experts", 0) * i
    elements += 4 * shared + (h if shared else 0)
    matmuls = slots * (2 * i + h) + (2 * shared + h if shared else 0)
    return int(elements), args.n_experts + 2 * k, int(matmuls)


def latent_attention_saved(args: TransformerShape) -> tuple[int, int, int]:
    """``(elements, fp32 values, matmul outputs)`` latent attention saves per token (module
    docstring), the block's residual-stream rows (``4h``) excluded."""
    heads, d_qk, d_v = args.n_heads, args.head_dim, args.v_head_dim
    q_latent = args.q_lora_rank or 0
    up = heads * (args.qk_nope_head_dim + d_v)  # kv_b_proj's output; the values are a view of it
    elements = 2 * q_latent + 2 * args.kv_lora_rank + 2 * heads * d_qk + up + heads * d_v
    fp32 = heads + 2 + (2 if q_latent else 1)  # log-sum-exps, the block's and the latents' norms
    matmuls = q_latent + heads * d_qk + args.kv_lora_rank + args.qk_rope_head_dim + up + args.dim
    return elements, fp32, matmuls


def _fsdp_unit(args: TransformerShape, layer: int, ep_degree: int) -> int:
    """Parameters block ``layer``'s FSDP unit all-gathers: under expert parallel its routed experts
    are the rank's ``1/ep`` share."""
    block = args.attention_params + args.mlp_params(layer)
    if ep_degree == 1 or not args.is_sparse(layer):
        return block
    experts = args.n_experts * 3 * args.dim * args.moe_ffn_dim
    return block - experts + experts // ep_degree


def qk_norm_bytes(args: TransformerShape, act_bytes: int) -> int:
    """Bytes per token and layer the q/k norms save for backward (module docstring); 0 without them."""
    if args.qk_norm == "none":
        return 0
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    stats = args.n_heads + args.n_kv_heads if args.qk_norm == "head" else 2
    return (q + kv) * act_bytes + stats * 4


def format_memory_report(estimate: dict[str, int], *, title: str | None = None) -> str:
    """A fixed-width table of an :func:`estimate_memory` result in GiB: each component's own size,
    what of it the peak (``total``) holds, and that as a share of the total (the shares add up to 100%).

    Gradients and activations peak at different times (``total = params + optimizer + fsdp_buffers
    + max(activations + the output head's gradient, grads + tied_grad_sum)``), so the peak holds either
    every activation and only the head's gradient (the start of backward) or every gradient (with a
    tied matrix's two summands) and no activation (its end): which one follows from ``total``.
    """
    total = estimate["total"]
    held = {name: value for name, value in estimate.items() if name != "total"}
    phase = None
    if {"params", "grads", "optimizer", "fsdp_buffers", "activations"} <= held.keys() and total != sum(
        held.values()
    ):
        rest = total - estimate["params"] - estimate["optimizer"] - estimate["fsdp_buffers"]
        if rest == estimate["grads"] + estimate.get("tied_grad_sum", 0):  # the end of backward
            held["activations"], phase = 0, "the end of backward: every gradient, no activation"
        else:  # the start of backward
            held["grads"] = rest - estimate["activations"]
            if "tied_grad_sum" in held:
                held["tied_grad_sum"] = 0
            grads = "the output head's gradient only" if held["grads"] else "no gradient yet"
            phase = f"the start of backward: every activation, {grads}"
    lines = [title] if title else []
    lines.append(f"{'component':<14}{'GiB':>8}{'at peak':>10}{'share':>8}")
    for name, value in estimate.items():
        if name != "total":
            share = held[name] / total if total else 0.0
            lines.append(f"{name:<14}{value / _GIB:>8.2f}{held[name] / _GIB:>10.2f}{share:>8.1%}")
    lines.append(f"{'total':<14}{'':>8}{total / _GIB:>10.2f}{1 if total else 0:>8.1%}")
    if phase:
        lines.append(f"(gradients and activations peak at different times; the peak is at {phase})")
    return "\n".join(lines)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
