"""Parallelize a (meta-device) decoder: tensor parallel -> activation checkpointing -> compile -> FSDP2.

The shared plan of every family built from ``portatrain.models.common``; it reads the block's
structure (norm placement, q/k norm kind) off the module, so a family declares nothing to use it.
The order matters and is torchtitan's (``torchtitan/models/llama3/infra/parallelize.py``):

1. **Tensor parallel** first, because it replaces parameters by DTensors on the ``tp`` mesh and
   installs the input/output redistributions the later wrappers must see as part of the block.
2. **Activation checkpointing** wraps each block (with its TP hooks inside it).
3. **Compile** each (wrapped) block, so one graph serves every layer.
4. **FSDP2** ``fully_shard`` last, per block and at the root, sharding the (possibly TP-sharded)
   parameters over the data-parallel mesh; its all-gathers and reduce-scatters stay outside the
   compiled graphs.

Expert parallel (``parallel.ep``, mixture-of-experts families) comes first, beside tensor parallel:
each MoE layer's experts become DTensors split over the ``ep`` mesh and the layer's ``exchange`` slot
moves tokens to them (``portatrain.parallel.expert``). FSDP2 then shards the experts over the ranks
that hold the same ones (``dp_shard / ep``, as torchtitan's ``dp_shard_mod_ep``) and everything else
over all of ``dp_shard``.

The model knows nothing of any of this. Attention reads its head count from the projected width
(``view(..., -1, head_dim)``), so column-sharded q/k/v projections give each rank
``n_heads / tp`` query and ``n_kv_heads / tp`` key/value heads with no change to the model; rank r
holds query heads ``[r*n_heads/tp, (r+1)*n_heads/tp)`` and exactly the kv heads they read.

What the plan cannot shard it refuses before any process starts (:func:`layout_problems`, a
family's ``ModelSpec.parallel_problems``): q/k norms over the whole projection (OLMo 2) would need
the sum of squares of every rank's heads; tensor parallel of a mixture of experts or of attention
sinks; expert parallel of a dense model, or over a number of ranks that does not divide the experts;
context parallel of sliding-window layers or attention sinks (the masks of
``portatrain.models.common.masks`` need every key of the row on one rank).

Tied embeddings (Llama 3.2 1B/3B) are tensor-parallel too: one vocabulary-sharded matrix serves the
embedding and the output projection (:func:`_tied_output_projection`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from portatrain.models.common.layers import RMSNorm
from portatrain.models.common.moe import MoE
from portatrain.parallel.activation_checkpoint import apply_activation_checkpointing
from portatrain.parallel.expert import apply_ep
from portatrain.parallel.parallel_dims import ParallelDims


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    activation_checkpointing: str = "none",
    compile_block: Callable[[nn.Module], nn.Module] | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    adapt: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply the parallel plan in place and return the model (the ``ModelSpec.parallelize`` protocol).

    Args:
        model: a ``portatrain.models.common.decoder.Decoder`` (``embed_tokens``, ``layers``, ``norm``,
            ``lm_head`` or None when tied; block submodules named as in HF), preferably on meta.
        parallel_dims: the layout, with its mesh built (``build_mesh``) when more than one rank runs.
        activation_checkpointing: ``none``, ``full`` or ``selective`` (see
            ``portatrain.parallel.activation_checkpoint``).
        compile_block: compiles one block (given by the compile stage); None leaves blocks eager.
        param_dtype: FSDP2 all-gathers parameters in this dtype and computes in it (bf16 on
            accelerators; fp32 on CPU). The sharded master parameters stay fp32.
        reduce_dtype: FSDP2 reduce-scatters gradients in this dtype (fp32 by default).
        adapt: changes the model in place after tensor parallel, before everything else (LoRA adds
            its adapters there: ``portatrain.finetune.lora``); None changes nothing.
    """
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        problems = layout_problems(parallel_dims, model.args)
        if problems:  # validation refuses these layouts first; this guards direct callers
            raise ValueError("; ".join(problems))
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.tp_mesh)
    if parallel_dims.ep_enabled:
        apply_ep(moe_layers(model), parallel_dims.ep_mesh)
    if adapt is not None:
        adapt(model)
    apply_activation_checkpointing(model.layers, activation_checkpointing)
    if getattr(model, "mtp", None) is not None:  # multi-token prediction's depths: blocks too
        apply_activation_checkpointing(model.mtp.layers, activation_checkpointing)
    if compile_block is not None:
        for name, block in list(model.layers.named_children()):
            if parallel_dims.ep_enabled and moe_layers(block):
                _compile_around_experts(block, compile_block)
            else:
                model.layers[name] = compile_block(block)
        if parallel_dims.tp_enabled and model.embed_tokens is not None:
            _detach_view_from_compiled_blocks(model)
    if parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh,
            expert_mesh=parallel_dims.expert_fsdp_mesh if parallel_dims.ep_enabled else None,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        )
    return model


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _compile_around_experts(block: nn.Module, compile_block: Callable[[nn.Module], nn.Module]) -> None:
    """Compile a block with an expert-parallel MoE layer part by part, leaving the layer itself eager.

    The experts are an FSDP2 unit of their own (on the expert mesh) and the layer exchanges tokens
    with the other ranks (dropless: sized on the host), neither of which a one-graph block can hold.
    So the attention, the norms, the router and any shared experts are compiled each on its own, as
    torchtitan compiles its MoE blocks (``torchtitan/models/llama4/infra/parallelize.py``,
    ``apply_compile``); the routing and dispatch between them run eagerly.
    """
    inner = getattr(block, "_checkpoint_wrapped_module", block)  # under activation checkpointing
    for child in inner.children():
        if isinstance(child, MoE):
            for part in (child.gate, child.shared_experts):
                if part is not None:
                    compile_block(part)
        else:
            compile_block(child)


def layout_problems(parallel: Any, args: Any) -> list[str]:
    """Layouts this plan cannot apply to a model of ``args``, each with the fix (``ModelSpec.parallel_problems``).

    ``parallel`` is a ``ParallelConfig`` or ``ParallelDims`` (anything with ``tp`` and ``ep``).
    """
    problems = []
    sparse = [layer for layer in range(args.n_layers) if args.is_sparse(layer)]
    if parallel.ep > 1 and not sparse:
        problems.append(
            f"parallel.ep={parallel.ep}: this model has no mixture-of-experts layer, so there are no experts "
            "to split; set parallel.ep=1"
        )
    elif parallel.ep > 1 and args.n_experts % parallel.ep:
        divisors = [d for d in range(1, args.n_experts + 1) if args.n_experts % d == 0]
        problems.append(
            f"parallel.ep={parallel.ep} must divide model.n_experts={args.n_experts} (each rank holds "
            f"n_experts/ep whole experts); set parallel.ep in {divisors}"
        )
    if parallel.tp > 1 and sparse:
        problems.append(
            f"parallel.tp={parallel.tp}: tensor parallel does not shard a mixture of experts' experts; "
            "set parallel.tp=1 and shard with FSDP2 instead (parallel.dp_shard)"
        )
    sliding = getattr(args, "sliding_window", None) is not None
    if getattr(parallel, "cp", 1) > 1 and (sliding or args.attention_sinks):
        what = "sliding-window layers" if sliding else "attention sinks"
        problems.append(
            f"parallel.cp={parallel.cp}: context parallel does not implement {what} (their mask needs every key "
            "of the row on one rank); set parallel.cp=1 and shard with FSDP2 (parallel.dp_shard)"
        )
    if parallel.tp > 1 and args.attention_sinks and not sparse:
        problems.append(
            f"parallel.tp={parallel.tp}: tensor parallel does not split attention sinks over ranks; set "
            "parallel.tp=1 and shard with FSDP2 (parallel.dp_shard)"
        )
    if parallel.tp > 1 and args.qk_norm == "proj":
        problems.append(
            f"parallel.tp={parallel.tp}: this model normalizes q and k over all heads at once "
            "(qk_norm='proj', as OLMo 2), which tensor parallel would split across ranks; set parallel.tp=1 "
            "and shard with FSDP2 instead (parallel.dp_shard)"
        )
    return problems


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """Tensor-parallel styles of one :class:`~portatrain.models.common.decoder.TransformerBlock`.

    Between sub-layers the residual stream is sequence-sharded (``Shard(1)``), so every residual
    norm is ``SequenceParallel`` wherever it sits (pre-norm: on the block input and the attention
    sum; post-norm: on the row-parallel outputs, which arrive as ``Shard(1)``). Per-head q/k norms
    (Qwen 3) see ``[B, S, heads, head_dim]`` sharded over heads (dim 2) and normalize each head on
    its own rank; their gain is one ``head_dim`` vector shared by all heads, hence by all ranks: it
    is kept replicated and its gradient -- each rank's sum over its own heads -- is all-reduced over
    the tp group (HF's ``replicated_with_grad_allreduce``). ``SequenceParallel(sequence_dim=2)`` says
    exactly that (dim 2 is heads here, despite the style's name).
    """
    plan: dict[str, ParallelStyle] = {
        # forward(x, cos, sin, attn_mask): gather x over the sequence; RoPE tables and the
        # mask are plain, full-length tensors already.
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    # A norm after a sub-layer (post, both) returns into the residual sum, a plain local tensor: its
    # output is made local too (a norm before one feeds a PrepareModuleInput, which takes a DTensor).
    after = (
        set() if block.norm_placement == "pre" else {"post_attention_layernorm", "post_feedforward_layernorm"}
    )
    for name, child in block.named_children():
        if isinstance(child, RMSNorm):  # the residual-stream norms, wherever the family places them
            plan[name] = SequenceParallel(use_local_output=name in after)
    if block.self_attn.qk_norm == "head":
        for name in ("self_attn.q_norm", "self_attn.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallel with sequence parallel in between.

    Inside a block, q/k/v and gate/up are column-parallel (each rank computes its heads / its slice
    of the SwiGLU width) and o/down row-parallel (partial sums), so attention and the MLP each need
    one collective forward and one backward. Between them the residual stream is sharded over the
    sequence (``Shard(1)``): the norms run on ``S / tp`` positions, and the row-parallel outputs are
    reduce-scattered instead of all-reduced (same bytes, 1/tp of the norm work and activation memory).
    Megatron-LM: Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198.

    The embedding is row-parallel over the vocabulary (each rank looks up the ids it owns, zeros the
    rest; the reduce-scatter sums them into sequence shards). The output projection is
    column-parallel over the vocabulary and its logits are all-gathered (``Replicate``), so the
    trainer's ``compute_loss`` hook -- and any research override of it -- sees a plain, full tensor.
    (torchtitan's vocabulary-parallel loss keeps them sharded and saves ``(tp-1)/tp`` of the logits'
    memory, at the price of a loss hook that must handle DTensors; not done here.)

    A tied model (``lm_head`` is None) has one vocabulary matrix for both ends, see
    :func:`_tied_output_projection`.

    Sequence parallel needs every row length to be a multiple of ``tp`` (validated with the config).
    A pipeline stage lacks some of the root's parts; between stages the activation travels as
    this rank's sequence shard, the same plain ``[B, S/tp, dim]`` tensor the blocks pass each other.
    """
    root_plan: dict[str, ParallelStyle] = {}
    if model.embed_tokens is not None:
        root_plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.lm_head is not None:
        root_plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    # One matrix at both ends (a pipeline's first stage has no output, its last a copy as lm_head).
    if model.args.tie_embeddings and model.lm_head is None and model.norm is not None:
        _tied_output_projection(model)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block))


def _tied_output_projection(model: nn.Module) -> None:
    """Tensor-parallel output projection through the embedding's own (sharded) matrix.

    The row-parallel embedding holds ``embed_tokens.weight`` as a DTensor sharded over the vocabulary
    (``Shard(0)``): rank r owns rows ``[r*V/tp, (r+1)*V/tp)``. A column-parallel output projection
    shards the very same matrix the very same way (its output features are the vocabulary), so the
    one parameter serves both ends and nothing is copied or re-tied (Megatron's and torchtitan's
    vocabulary-parallel tied embedding). The model's tied forward is ``F.linear(h, embed_tokens.weight)``;
    two hooks give it ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``'s layouts:

    * after the final norm, the sequence-sharded ``h`` is all-gathered (``Replicate``), so
      ``F.linear`` on DTensors yields this rank's vocabulary slice of the logits (``Shard(2)``), with
      no communication; in backward the input gradient (a partial sum over vocabulary shards) is
      reduce-scattered back to sequence shards by the same redistribution;
    * after the model, those logits are all-gathered into a plain full tensor, as for an untied head.

    Autograd accumulates the weight's gradient from both uses into the one DTensor ``.grad``: the
    lookup's rows (only the ids this rank owns) plus ``dlogits_local^T @ h`` -- each rank's shard
    only, with no collective, as a column-parallel linear's weight gradient is.
    """

    def gather_sequence(module: nn.Module, args: Any, output: DTensor) -> DTensor:
        return output.redistribute(placements=[Replicate()])

    def gather_logits(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if isinstance(output, DTensor):
            return output.redistribute(placements=[Replicate()]).to_local()
        return output

    # Hooks run in registration order: this one sees the norm's sequence-sharded DTensor output.
    model.norm.register_forward_hook(gather_sequence)
    model.register_forward_hook(gather_logits)


def _detach_view_from_compiled_blocks(model: nn.Module) -> None:
    """Give the first compiled block a fresh tensor, not the view ``to_local()`` returns.

    Under TP the embedding's output leaves DTensor land through ``to_local()``, which returns a
    *view* of the local shard. A compiled block taking that view as input (torch 2.13, inductor
    and aot_eager alike) routes its input gradient around the view's autograd node, and the
    embedding's redistribution then receives a plain tensor in backward:
    ``AttributeError: 'Tensor' object has no attribute '_local_tensor'``. Copying the embedding
    output (one ``[B, S/tp, dim]`` activation per step) sidesteps it; eager blocks do not need it.
    """
    model.embed_tokens.register_forward_hook(lambda module, args, output: output.clone())


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    *,
    expert_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """``fully_shard`` each block, the embedding and the output head, then the root.

    A 1-D ``fsdp_mesh`` is FSDP; a 2-D ``(dp_replicate, dp_shard)`` mesh is HSDP (shard within a
    replica group, all-reduce across groups). Units: every block; the embedding on its own (freed
    right after the lookup, not held for the whole forward); the final norm with the output head,
    not resharded after forward because backward needs them at once; the root takes whatever is
    left (the embedding too when it is tied to the output, since the root's forward reads it).

    Gradient division is turned off: the trainer already divides every rank's loss by the number of
    target tokens in the whole global step, so the plain sum FSDP then reduces is the single-device
    gradient of the global batch. FSDP's default mean over ranks would divide it again by ``dp``.

    With expert parallel, ``expert_mesh`` is the mesh each MoE layer's experts (already split over
    ``ep``) are sharded over: they get a unit of their own, first, so the block's unit leaves them out.
    The layer calls the experts' ``grouped``/``batched``, not their ``forward``: those are registered
    as forward methods, so FSDP2 all-gathers before them and reduce-scatters after their backward.
    Their gradient needs no reduction over ``ep``: the all-to-all's backward already brought every
    rank's tokens' contributions to the rank that holds the expert.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    config: dict[str, Any] = {"mesh": fsdp_mesh, "mp_policy": mp_policy}
    if expert_mesh is not None:
        for moe in moe_layers(model):
            # Fewer experts per rank than ranks sharding them: dim-0 shards would be mostly padding,
            # so shard the experts' next dim instead (as torchtitan's llama4 apply_fsdp does).
            local_experts = moe.experts.gate_up_proj.to_local().shape[0]
            placement = (lambda param: Shard(1)) if local_experts < expert_mesh.size(-1) else None
            fully_shard(moe.experts, **{**config, "mesh": expert_mesh}, shard_placement_fn=placement)
            for method in ("grouped", "batched"):
                register_fsdp_forward_method(moe.experts, method)
    # One module at both ends (a tied model; on a pipeline's stages each end is a matrix of its own).
    tied = model.args.tie_embeddings and model.lm_head is None and model.norm is not None
    if not tied and model.embed_tokens is not None:  # (a later pipeline stage has none)
        fully_shard(model.embed_tokens, **config)
    for block in model.layers.values():
        fully_shard(block, **config)
    if not tied and model.lm_head is not None:  # (an earlier pipeline stage has none)
        fully_shard([model.norm, model.lm_head], **config, reshard_after_forward=False)
    fully_shard(model, **config)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A factor of 1 needs no pre-multiplied sum: plain SUM collectives (the only kind gloo
            # has, and NCCL's zero-copy kind).
            module.set_force_sum_reduction_for_comms(True)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to the model's root."""
    return isinstance(model, FSDPModule)
