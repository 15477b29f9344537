"""DeepSeek-V3: what is its own beyond the conformance suite (``tests/test_conformance.py`` runs parity
with transformers, export/``init_from``, FSDP2, the memory estimate and published counts for it).

* The bias-balanced group router against transformers' ``DeepseekV3TopkRouter``, bias and groups on.
* YaRN at the published configuration against transformers' frequencies and softmax scale.
* Latent attention: value heads narrower than query/key heads through SDPA, against attention
  written out by hand.
* Active parameters against the model cards (37B of 671B; Moonlight 3B of 16B).
* Auxiliary-loss-free balance on the bundled corpus: with the bias update on, the busiest expert's
  load over the mean falls over training; with it off, it does not. The bias is in the checkpoint and
  a resumed run continues the uninterrupted one.
* Bad group, latent and rotary settings: one error each, exit 2; the 671B dry run says it fits.
* ``ep=2`` on two processes equal to one process (slow).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from portatrain.models.common.mla import LatentAttention
from portatrain.models.common.moe import BiasedRouter, MoE
from portatrain.models.common.rope import YarnScaling, rope_inv_freq, rope_tables
from portatrain.models.deepseek_v3.model import (
    DEEPSEEK_V3_FLAVORS,
    DEEPSEEK_V3_PUBLISHED_ACTIVE,
    DEEPSEEK_V3_PUBLISHED_PARAMS,
)
from portatrain.plan import describe_plan
from portatrain.validate import config_problems
from tests import shared_launch
from tests.helpers import TINY, compose_config, fit, run_cli, train_records

DS3 = [*TINY, "model=deepseek_v3_debug"]


def test_router_equals_transformers_with_bias_and_groups() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    theirs = DeepseekV3TopkRouter(config)
    ours = BiasedRouter(
        32,
        16,
        4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        bias_update_rate=0.0,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        ours.weight.normal_()
        ours.e_score_correction_bias.normal_(std=0.3)  # large enough to change selections
        theirs.weight.copy_(ours.weight)
        theirs.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(64, 32)
    weights, experts, probs = ours(x)
    _, their_weights, their_experts = theirs(x)
    order, their_order = experts.argsort(dim=1), their_experts.argsort(dim=1)
    assert torch.equal(experts.gather(1, order), their_experts.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))
    # Selection used the bias and the groups: a plain top-k of the scores picks differently.
    assert not torch.equal(experts.sort(dim=1).values, probs.topk(4, dim=1).indices.sort(dim=1).values)
    groups = experts // 4  # each token's experts come from at most topk_group groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_yarn_at_the_published_configuration_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    args = DEEPSEEK_V3_FLAVORS["671b"]
    rope = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    config = transformers.DeepseekV3Config(rope_parameters=dict(rope), max_position_embeddings=163840)
    inv_freq, table_scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = rope_inv_freq(64, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(64, 10000.0, None))  # the scaling changed something
    assert args.rope_scaling.table_scale() == pytest.approx(table_scale)
    assert args.softmax_scale == pytest.approx(yarn_apply_mscale(rope, 192**-0.5))
    assert args.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))
    cos, _ = rope_tables(64, 10000.0, 8, YarnScaling(factor=40.0, mscale=2.0, mscale_all_dim=1.0))
    assert cos[0, 0] == pytest.approx(YarnScaling(mscale=2.0).table_scale())  # the tables carry it


def test_latent_attention_equals_attention_written_out() -> None:
    torch.manual_seed(0)
    attn = LatentAttention(
        32, 4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
        softmax_scale=0.3,
    )  # fmt: skip
    attn.init_weights(0.3, 0.3)
    x = torch.randn(2, 7, 32)
    cos, sin = rope_tables(4, 10000.0, 7)
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(2, 7, 4, 10)
    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([8, 4], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(2, 7, 4, 16)

    def rotate(t: torch.Tensor) -> torch.Tensor:  # [..., S, 4] in halves
        return t * cos + torch.cat([-t[..., 2:], t[..., :2]], dim=-1) * sin

    q_rope = rotate(q[..., 6:].transpose(1, 2))
    k_rope = rotate(k_rope[:, None])  # one rotary key for every head
    scores = q[..., :6].transpose(1, 2) @ kv[..., :6].permute(0, 2, 3, 1) + q_rope @ k_rope.transpose(2, 3)
    scores = scores * 0.3 + torch.full((7, 7), float("-inf")).triu(1)
    out = F.softmax(scores, dim=-1) @ kv[..., 6:].transpose(1, 2)  # values 10 wide, not 10 = 6 + 4 by luck
    expected = attn.o_proj(out.transpose(1, 2).reshape(2, 7, 40))
    torch.testing.assert_close(attn(x, cos, sin, None), expected, rtol=1e-5, atol=1e-6)


def test_total_and_active_counts_match_the_model_cards() -> None:
    for flavor, (total, active) in {"671b": (671, 37), "16b_a3b": (16, 3)}.items():
        args = DEEPSEEK_V3_FLAVORS[flavor]
        assert args.num_params() == DEEPSEEK_V3_PUBLISHED_PARAMS[flavor]
        assert args.num_params(active=True) == DEEPSEEK_V3_PUBLISHED_ACTIVE[flavor]
        assert round(args.num_params() / 1e9) == total
        # The cards' active figure leaves out the input embedding, a lookup (37.55B with it, 36.63B without).
        assert round(args.num_params(exclude_embedding=True, active=True) / 1e9) == active
    # The checkpoint of the 671B model holds its 58 MoE layers' routing biases as tensors too.
    assert DEEPSEEK_V3_PUBLISHED_PARAMS["671b"] + 58 * 256 == 671_026_419_200


def test_bias_update_balances_expert_load_on_the_bundled_corpus(tmp_path: Path) -> None:
    """40 steps at a rate of 0.01 (the paper's 0.001 needs more steps than a test should take)."""
    run = [*DS3, "trainer.steps=40", "trainer.log_every=5", "checkpoint.enabled=false"]
    imbalance = {}
    for rate in (0.0, 0.01):
        trainer = fit([*run, f"model.bias_update_rate={rate}"], tmp_path / str(rate))
        imbalance[rate] = [r["moe_load_max_mean"] for r in train_records(tmp_path / str(rate))]
        biases = [m.gate.e_score_correction_bias for m in trainer.model.modules() if isinstance(m, MoE)]
        assert all(bool(b.any()) == (rate > 0) for b in biases)
    off, on = imbalance[0.0], imbalance[0.01]
    assert len(on) == len(off) == 8
    assert sum(on[-3:]) / 3 < 0.6 * sum(on[1:4]) / 3, on  # falls over training
    assert max(on[-3:]) < min(off[-3:]), (on, off)  # and ends below the frozen router's
    assert sum(off[-3:]) / 3 >= sum(off[1:4]) / 3 * 0.95, off  # which does not balance itself


def test_the_bias_is_checkpointed_and_a_resumed_run_continues_the_uninterrupted_one(tmp_path: Path) -> None:
    run = [*DS3, "model.bias_update_rate=0.01", "checkpoint.every=2"]
    whole = fit(run, tmp_path / "whole")
    from torch.distributed.checkpoint import FileSystemReader

    saved = tmp_path / "whole" / "checkpoints" / "step_0000002"
    keys = FileSystemReader(saved).read_metadata().state_dict_metadata
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    fit([*run, f"checkpoint.resume={saved}"], tmp_path / "resumed")
    want, got = train_records(tmp_path / "whole")[2:], train_records(tmp_path / "resumed")
    assert [r["step"] for r in got] == [3, 4]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-6)
    layer = whole.model.layers["1"].mlp.gate
    assert layer.e_score_correction_bias.abs().sum() > 0


def test_bad_group_latent_and_rotary_settings_are_one_error_each(tmp_path: Path) -> None:
    base = ["model=deepseek_v3_debug", "device=cpu", "dry_run=true"]
    cases = {
        "model.topk_group=5": "model.topk_group=5 exceeds model.n_group=4",
        "model.n_group=3": "model.n_experts=8 is not divisible by model.n_group=3",
        "model.qk_rope_head_dim=15": "model.qk_rope_head_dim=15 must be even",
        "model.n_kv_heads=2": "model.n_kv_heads=2 must equal model.n_heads=4",
        "model.kv_lora_rank=0": "model.kv_lora_rank=0 must be positive",
        "device.memory_gib=0": "device.memory_gib=0.0 must be positive",
    }
    for override, message in cases.items():
        problems = config_problems(compose_config([*base, override]))
        assert len(problems) == 1 and message in problems[0], (override, problems)
    out = run_cli([*base, "model.topk_group=5", "model.qk_rope_head_dim=15"], cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n  - ") == 2, out.stderr
    assert (
        "model.topk_group=5 exceeds" in out.stderr and "model.qk_rope_head_dim=15 must be even" in out.stderr
    )
    refused = config_problems(compose_config([*base, "parallel.tp=2"]))
    assert any("parallel.tp=2" in p for p in refused), refused


def test_the_671b_dry_run_prints_memory_per_device_and_whether_it_fits() -> None:
    layout = [
        "recipe=deepseek_v3_16b", "model=deepseek_v3_671b", "device=neuron", "dry_run=true",
        "parallel.dp_shard=1024", "parallel.ep=64", "parallel.activation_checkpointing=full",
        "data.batch_size=1",
    ]  # fmt: skip
    report = describe_plan(compose_config([*layout, "device.memory_gib=24"]))
    assert "parameters: 671,026,404,352 (671.03B)" in report
    assert "active per token: 37,552,282,624 (37.55B)" in report
    assert "experts over ep=64" in report and "estimated memory per device" in report
    assert "\nfits: " in report, report
    small = describe_plan(compose_config([*layout, "device.memory_gib=8"]))
    assert "\ndoes not fit: " in small, small


def test_flavour_shapes_are_the_published_ones() -> None:
    big, moon = DEEPSEEK_V3_FLAVORS["671b"], DEEPSEEK_V3_FLAVORS["16b_a3b"]
    assert (big.n_experts, big.top_k, big.n_group, big.topk_group, big.first_k_dense_replace) == (
        256,
        8,
        8,
        4,
        3,
    )
    assert (moon.n_experts, moon.top_k, moon.n_shared_experts, moon.q_lora_rank) == (64, 6, 2, None)
    assert dataclasses.replace(big, topk_group=9).problems()  # checked, not assumed


# config.json of deepseek-ai/DeepSeek-V3 as published (transformers 4.33 layout; auto_map and the
# fp8 quantization_config left out), and the keys of moonshotai/Moonlight-16B-A3B's that differ.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
MOONLIGHT_CONFIG = {
    **DEEPSEEK_V3_CONFIG, "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 11264,
    "max_position_embeddings": 8192, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "topk_group": 1, "vocab_size": 163840,
}  # fmt: skip


def test_the_published_configs_read_into_the_flavours() -> None:
    from portatrain.models.deepseek_v3 import hf

    assert hf.args_from_hf_config(DEEPSEEK_V3_CONFIG) == DEEPSEEK_V3_FLAVORS["671b"]
    assert hf.args_from_hf_config(MOONLIGHT_CONFIG) == DEEPSEEK_V3_FLAVORS["16b_a3b"]
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        hf.args_from_hf_config({**DEEPSEEK_V3_CONFIG, "scoring_func": "softmax"})


# ---------------------------------------------------------------------------------------------
# Expert parallel on two processes
# ---------------------------------------------------------------------------------------------


EP_RUN = [*DS3, "model.bias_update_rate=0.01", "checkpoint.enabled=false"]
two_processes = shared_launch.declare(
    "two_processes", 2, {"ep2": [*EP_RUN, "parallel.dp_shard=2", "parallel.ep=2", "data.batch_size=2"]}
)


@pytest.mark.slow
def test_ep2_matches_one_process(two_processes, tmp_path: Path) -> None:
    """Two ranks, each with 4 of the 8 experts and half the global batch of 4, dropless, the bias
    moving every step: the same losses as one process (the bias updates agree across ranks)."""
    fit(EP_RUN, tmp_path / "one")
    got, want = train_records(two_processes["ep2"]), train_records(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)
