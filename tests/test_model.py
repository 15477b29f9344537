"""Llama model behaviour on CPU in fp32: positions, the RoPE table's length, init scales, published
sizes and Hub configs, FLOPs, argument checks, config overrides and grouped-query attention.

What every family in the registry must do (meta build, masks and packing, causality, parameter
counts, Hugging Face parity, kernel slots, training) is checked in ``tests/test_conformance.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from portatrain.models import SPECS, build_model, model_args
from portatrain.models.llama.hf import hf_config
from portatrain.models.llama.model import LLAMA3_FLAVORS, Llama, LlamaArgs, RopeScaling

# Small but complete: GQA (4 query heads share 2 kv heads), RoPE scaling that changes frequencies.
TINY = LlamaArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=97,
    ffn_hidden_dim=160,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=32),
    max_seq_len=64,
)


def make_model(args: LlamaArgs = TINY, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(args)
    model.init_weights()
    return model.eval()


def tokens(batch: int = 2, seq_len: int = 16, vocab: int = TINY.vocab_size, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def test_default_positions_equal_explicit_arange():
    model = make_model()
    x = tokens(2, 16)
    positions = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(model(x), model(x, positions=positions), atol=0, rtol=0)
    # ...and positions are really used: the first token's logits depend on its absolute position
    # only through later tokens, so compare the whole sequence at a non-trivial shift.
    shuffled = torch.randperm(16).expand(2, 16)
    assert not torch.allclose(model(x), model(x, positions=shuffled), atol=1e-4)


def test_sequence_longer_than_rope_table_is_rejected():
    model = make_model()
    with pytest.raises(ValueError, match="max_seq_len 64"):
        model(tokens(1, 65))


def test_init_weights_scales_residual_projections():
    model = make_model(replace(TINY, n_layers=8, dim=256, n_heads=4, ffn_hidden_dim=512))
    block = model.layers["0"]
    out_std = 0.02 / math.sqrt(2 * 8)
    assert abs(block.self_attn.q_proj.weight.std().item() - 0.02) < 0.002
    assert abs(block.self_attn.o_proj.weight.std().item() - out_std) < 0.001
    assert abs(block.mlp.down_proj.weight.std().item() - out_std) < 0.001
    assert torch.equal(block.input_layernorm.weight, torch.ones(256))
    assert block.self_attn.q_proj.weight.abs().max() <= 3 * 0.02


def test_parameter_count_without_the_embedding_on_meta():
    """The published counts themselves are checked for every family in test_conformance.py."""
    for flavor in ("1b", "8b"):  # tied and untied
        args = LLAMA3_FLAVORS[flavor]
        with torch.device("meta"):
            model = Llama(args)
        embedding = args.vocab_size * args.dim
        assert model.num_params(exclude_embedding=True) == args.num_params() - embedding, flavor
        assert args.num_params(exclude_embedding=True) == args.num_params() - embedding, flavor


# Fields of the config.json files Meta publishes on the Hugging Face Hub.
HUB_CONFIGS = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, rope_factor=32.0, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, rope_factor=32.0, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, rope_factor=8.0, tie_word_embeddings=False),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, rope_factor=8.0, tie_word_embeddings=False),
}  # fmt: skip


@pytest.mark.parametrize("flavor", sorted(HUB_CONFIGS))
def test_real_flavours_match_published_hf_configs(flavor):
    expected = dict(HUB_CONFIGS[flavor])
    factor = expected.pop("rope_factor")
    expected |= dict(
        vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072
    )
    config = hf_config(LLAMA3_FLAVORS[flavor])
    assert {k: config[k] for k in expected} == expected
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_flops_per_token_convention():
    args = LLAMA3_FLAVORS["8b"]
    n = 8_030_261_248 - 128256 * 4096  # the embedding lookup is free; the (untied) lm_head is not
    assert args.flops_per_token(8192) == 6 * n + 12 * 32 * 32 * 128 * 8192
    tied = LLAMA3_FLAVORS["1b"]  # the shared matrix is still a matmul at the output
    assert tied.flops_per_token(2048) == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 2048
    with torch.device("meta"):
        assert Llama(args).flops_per_token(8192) == args.flops_per_token(8192)


def test_invalid_args_report_every_problem():
    args = LlamaArgs(dim=100, n_heads=3, n_kv_heads=2)
    problems = args.problems()
    assert any("divisible by n_heads(3)" in p for p in problems)
    assert any("model.n_kv_heads=2 must divide model.n_heads=3" in p for p in problems)
    with pytest.raises(ValueError) as info, torch.device("meta"):
        Llama(args)  # the model refuses to build from invalid arguments
    message = str(info.value)
    assert "divisible by n_heads(3)" in message and "n_kv_heads=2 must divide" in message


def test_build_model_applies_tokenizer_and_config_overrides():
    from portatrain.config import ModelConfig

    assert SPECS["llama3"].flavors is LLAMA3_FLAVORS
    with torch.device("meta"):
        model = build_model(ModelConfig(flavor="8b", max_seq_len=4096), vocab_size=258)
    assert model.args.vocab_size == 258 and model.args.max_seq_len == 4096 and model.args.n_layers == 32
    assert model.rope_cos.shape == (4096, 128)
    assert model_args(ModelConfig(flavor="debug", vocab_size=320), vocab_size=258).vocab_size == 320
    with pytest.raises(ValueError, match=r"model\.vocab_size=100 < tokenizer vocabulary 258"):
        model_args(ModelConfig(vocab_size=100), vocab_size=258)
    with pytest.raises(ValueError, match="choose one of debug, 1b, 3b, 8b, 70b"):
        model_args(ModelConfig(flavor="7b"))


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attention_equals_explicitly_repeated_heads(masked):
    """``causal_attention``: SDPA's ``enable_gqa`` (no mask) and the repeated-heads path (mask) both
    equal plain SDPA over explicitly repeated k/v heads, forward and backward."""
    from portatrain.models.attention import causal_attention

    torch.manual_seed(0)
    b, h, h_kv, s, d = 2, 6, 2, 16, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for n in (h, h_kv, h_kv))
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s) if masked else None
    got = causal_attention(q, k, v, mask)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    # Query head i reads kv head i // (h / h_kv).
    k_rep, v_rep = (x.repeat_interleave(h // h_kv, dim=1) for x in (k, v))
    want = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
