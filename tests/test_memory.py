"""Memory estimate: exact persistent state, and activation behaviour under sharding and checkpointing."""

from __future__ import annotations

import pytest

from portatrain.models.llama.model import LLAMA3_FLAVORS
from portatrain.models.memory import estimate_memory, format_memory_report

N_8B = 8_030_261_248
ARGS_8B = LLAMA3_FLAVORS["8b"]


def estimate(**overrides):
    kwargs = dict(batch_size=1, seq_len=2048, param_dtype_bytes=4, optim_state_bytes_per_param=8)
    return estimate_memory(ARGS_8B, **(kwargs | overrides))


def test_8b_fp32_single_device_state():
    est = estimate()
    assert est["params"] == 4 * N_8B  # ~32 GB
    assert est["grads"] == 4 * N_8B
    assert est["optimizer"] == 8 * N_8B
    assert est["fsdp_buffers"] == 0
    # Gradients and activations peak at different times: the total holds the larger phase.
    head_grad = 4 * ARGS_8B.vocab_size * ARGS_8B.dim
    peak = max(est["activations"] + head_grad, est["grads"])
    assert est["total"] == est["params"] + est["optimizer"] + est["fsdp_buffers"] + peak
    bf16 = estimate(param_dtype_bytes=2, optim_state_bytes_per_param=12)
    assert bf16["params"] == 2 * N_8B and bf16["grads"] == 2 * N_8B and bf16["optimizer"] == 12 * N_8B


def test_sharding_divides_state_but_not_activations():
    single, sharded = estimate(), estimate(shard_degree=8)
    for key in ("params", "grads", "optimizer"):
        assert sharded[key] * 8 == single[key], key
    assert sharded["activations"] == single["activations"]
    # FSDP's unsharded working set: the largest unit is the 128256 x 4096 embedding.
    assert sharded["fsdp_buffers"] == 128256 * 4096 * (2 * 4 + 4)


def test_tensor_parallel_divides_state_and_activations():
    single, tp = estimate(), estimate(tp_degree=2)
    assert tp["params"] * 2 == single["params"]
    assert tp["activations"] * 2 == single["activations"]


def test_activations_scale_with_tokens_and_shrink_with_checkpointing():
    none = estimate(activation_checkpointing="none")["activations"]
    selective = estimate(activation_checkpointing="selective")["activations"]
    full = estimate(activation_checkpointing="full")["activations"]
    assert full < selective < none
    assert full < none / 5  # 32 blocks keep only their input instead of ~22x that
    assert estimate(batch_size=2)["activations"] == 2 * none
    half_precision = estimate(activation_dtype_bytes=2)["activations"]
    assert half_precision < none


def test_invalid_arguments_are_all_reported():
    with pytest.raises(ValueError) as info:
        estimate(shard_degree=0, activation_checkpointing="some", tp_degree=3)
    message = str(info.value)
    assert "shard_degree=0" in message and "'some'" in message and "tp_degree=3" in message


def test_report_lists_every_component():
    est = estimate(shard_degree=8)
    report = format_memory_report(est, title="llama3 8b")
    assert report.splitlines()[0] == "llama3 8b"
    for key in est:
        assert key in report
    assert f"{est['total'] / 1024**3:.2f}" in report


def test_without_a_mask_kv_heads_are_counted_unrepeated():
    """SDPA's grouped-query path (no mask) saves k/v with ``n_kv_heads``; the packing mask's path saves
    them repeated to ``n_heads``: per token and layer ``2 * (q - kv)`` elements apart. The dry run
    picks the path from the data config (``has_attention_mask``)."""
    from portatrain.data.loader import has_attention_mask
    from tests.conftest import compose_config

    masked, plain = estimate(attn_mask=True), estimate(attn_mask=False)
    q, kv = ARGS_8B.n_heads * ARGS_8B.head_dim, ARGS_8B.n_kv_heads * ARGS_8B.head_dim
    assert masked["activations"] - plain["activations"] == ARGS_8B.n_layers * 2048 * 2 * (q - kv) * 4
    assert has_attention_mask(compose_config(["data.collator=packing"]).data)
    assert not has_attention_mask(
        compose_config(["data.collator=packing", "data.packing_attention=causal"]).data
    )
    assert not has_attention_mask(compose_config(["data.collator=bucket"]).data)


def test_plan_counts_in_closed_form_and_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``portatrain plan`` reads the size from the architecture's formula: building even on the meta
    device cost ~2.5 ms a block (``model.n_layers=100000``: minutes and gigabytes)."""
    from portatrain.models.common.decoder import Decoder
    from portatrain.plan import describe_plan
    from tests.helpers import compose_config

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the plan built the model")

    monkeypatch.setattr(Decoder, "__init__", never)
    text = describe_plan(compose_config(["recipe=llama8b", "dry_run=true", "device=cpu"]))
    assert f"parameters: {N_8B:,} (8.03B), counted from the architecture, nothing built" in text
    assert "estimated memory per device" in text
