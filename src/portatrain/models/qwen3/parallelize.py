"""Parallelize a (meta-device) Qwen 3: Llama's plan (TP -> activation checkpointing -> compile -> FSDP2)
plus the q/k norms.

Qwen 3's blocks have Llama's module names, so the plan is Llama's
(``portatrain.models.llama.parallelize``); only the per-head q/k RMSNorms are new. Under tensor
parallel each rank holds ``n_heads / tp`` query and ``n_kv_heads / tp`` kv heads, and the norms
normalize each head over ``head_dim``, so they run on the local heads with no communication. Their
gain is one ``head_dim`` vector shared by all heads, hence by all ranks: it is kept replicated, and
its gradient -- each rank's sum over its own heads -- is all-reduced over the tp group (HF's
``replicated_with_grad_allreduce``). ``SequenceParallel(sequence_dim=2)`` says exactly that: the
input ``[B, S, heads, head_dim]`` is sharded on dim 2 (heads, not the sequence, despite the style's
name), the weight is replicated, and DTensor sums the weight gradient's partials.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from portatrain.models.llama.parallelize import parallelize_llama
from portatrain.parallel.parallel_dims import ParallelDims


def qk_norm_plan() -> dict[str, ParallelStyle]:
    """Tensor-parallel styles of one block's q/k norms (inputs sharded over heads, gains replicated)."""
    return {
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


def parallelize_qwen3(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    activation_checkpointing: str = "none",
    compile_block: Callable[[nn.Module], nn.Module] | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Apply the parallel plan in place and return the model (the ``ModelSpec.parallelize`` protocol);
    arguments as :func:`~portatrain.models.llama.parallelize.parallelize_llama`."""
    return parallelize_llama(
        model,
        parallel_dims,
        activation_checkpointing=activation_checkpointing,
        compile_block=compile_block,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        extra_block_plan=qk_norm_plan,
    )
