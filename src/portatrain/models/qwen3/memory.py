"""Per-device training memory estimate of a Qwen 3 model: the generic dense-transformer estimate
(``portatrain.models.memory``) plus what Qwen 3's q/k norms save for backward.

The generic table already uses the decoupled query width ``q = n_heads * head_dim`` for the query,
key/value (after the GQA repeat) and attention-output tensors. Qwen 3 adds, per token and layer:

===========================================  ===================  ==========================
saved tensor                                 elements             saved by
===========================================  ===================  ==========================
q projection output (the q norm's input)     ``n_heads*head_dim``     q RMSNorm
k projection output (the k norm's input)     ``n_kv_heads*head_dim``  k RMSNorm
per-head inverse RMS                         ``n_heads + n_kv_heads`` fp32  q/k RMSNorm
===========================================  ===================  ==========================

RoPE after the norms saves nothing beyond its (buffer) tables. The norms are pointwise work, so
``selective`` checkpointing recomputes them and ``full`` keeps only the block input: in both modes
the extra lives only in the one block being recomputed. Like every activation, it is divided by
``tp_degree`` (heads are sharded).
"""

from __future__ import annotations

from typing import Any

from portatrain.models.memory import estimate_memory as estimate_dense_memory
from portatrain.models.qwen3.model import Qwen3Args


def estimate_memory(
    args: Qwen3Args,
    *,
    batch_size: int,
    seq_len: int,
    activation_checkpointing: str = "none",
    tp_degree: int = 1,
    param_dtype_bytes: int = 4,
    activation_dtype_bytes: int | None = None,
    **options: Any,
) -> dict[str, int]:
    """Estimated bytes per device; arguments and result as ``portatrain.models.memory.estimate_memory``."""
    estimate = estimate_dense_memory(
        args,
        batch_size=batch_size,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        tp_degree=tp_degree,
        param_dtype_bytes=param_dtype_bytes,
        activation_dtype_bytes=activation_dtype_bytes,
        **options,
    )  # validates every argument, so the arithmetic below is safe
    act_bytes = param_dtype_bytes if activation_dtype_bytes is None else activation_dtype_bytes
    per_token_layer = (args.q_dim + args.kv_dim) * act_bytes + (args.n_heads + args.n_kv_heads) * 4
    layers_holding = args.n_layers if activation_checkpointing == "none" else 1
    extra = -(-batch_size * seq_len * layers_holding * per_token_layer // tp_degree)
    estimate["activations"] += extra
    estimate["total"] += extra
    return estimate
