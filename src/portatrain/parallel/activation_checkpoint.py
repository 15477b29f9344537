"""Activation checkpointing per transformer block: ``none``, ``full`` or ``selective``.

* ``full`` keeps only each block's input and recomputes the whole block in backward.
* ``selective`` is op-level (torchtitan's policy): inside a block, the attention kernel's outputs
  and every second matrix multiply are saved, everything else (norms, RoPE, SiLU, the other
  matmuls) is recomputed -- about half the activation memory of ``none`` for a small fraction of
  the recompute of ``full``. ``portatrain.models.memory`` estimates the three modes with the same
  rule.

Blocks are wrapped with ``checkpoint_wrapper`` (non-reentrant), whose state-dict hooks strip the
``_checkpoint_wrapped_module.`` prefix, so checkpoint keys are unchanged.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# Outputs always kept: attention (costly to recompute, cheap to keep thanks to fused kernels)
# and collectives (recomputing would repeat the communication).
_ALWAYS_SAVE = {
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
_MATMULS = {_aten.mm.default, _aten.bmm.default, _aten.addmm.default}


def _selective_context():
    # One counter for the forward and one for the recomputation, so the i-th matmul of the
    # recompute makes the same save/recompute choice as the i-th of the forward.
    counts: Counter[bool] = Counter()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _MATMULS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1  # 1st, 3rd, 5th... matmul of the block
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        if op in _ALWAYS_SAVE:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(blocks: nn.ModuleDict, mode: str) -> None:
    """Wrap every block of ``blocks`` in place for ``mode`` (``none`` leaves them alone)."""
    if mode not in AC_MODES:
        raise ValueError(f"parallel.activation_checkpointing={mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "none":
        return
    for name, block in list(blocks.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, context_fn=_selective_context, preserve_rng_state=False)
        blocks[name] = wrapped
