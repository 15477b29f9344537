"""Qwen 3 (dense): published sizes, argument checks, and what is Qwen 3's own against Hugging Face's
``Qwen3ForCausalLM`` in fp32 on CPU: a query width narrower than ``dim``, the q/k norms, the Hub's
``config.json``.

Logits parity both ways (untied and tied, GQA and MHA), the HF config of every flavour and the
parameter counts are checked for every family in ``tests/test_conformance.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from portatrain.models.qwen3 import QWEN3
from portatrain.models.qwen3.hf import args_from_hf_config, hf_config, to_hf
from portatrain.models.qwen3.model import QWEN3_FLAVORS, Qwen3, Qwen3Args

# Model cards of Qwen/Qwen3-<size> on the Hugging Face Hub, "Model Overview": total and
# non-embedding parameters, rounded as published (non-embedding excludes the output head too).
PUBLISHED = {
    "0.6b": (0.6e9, 0.44e9),
    "1.7b": (1.7e9, 1.4e9),
    "4b": (4.0e9, 3.6e9),
    "8b": (8.2e9, 6.95e9),
    "14b": (14.8e9, 13.2e9),
    "32b": (32.8e9, 31.2e9),
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_published_parameter_counts(flavor: str) -> None:
    args = QWEN3_FLAVORS[flavor]
    total, non_embedding = PUBLISHED[flavor]
    count = QWEN3.published_params[flavor]  # exact; equal to the model's, see test_conformance.py
    # The cards round to the digits they print: 0.6 -> within 0.05B, 6.95 -> within 0.005B.
    digits = {0.6e9: 0.05e9, 0.44e9: 0.005e9, 6.95e9: 0.005e9}
    assert abs(count - total) <= digits.get(total, 0.05e9)
    heads = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    assert abs(count - heads - non_embedding) <= digits.get(non_embedding, 0.05e9)
    assert args.tie_embeddings == (flavor in ("0.6b", "1.7b", "4b"))
    assert (args.head_dim, args.n_kv_heads, args.vocab_size) == (128, 8, 151936)
    assert (args.rope_theta, args.norm_eps, args.max_seq_len) == (1e6, 1e-6, 40960)


def test_the_q_width_is_decoupled() -> None:
    args = QWEN3_FLAVORS["0.6b"]
    with torch.device("meta"):
        model = Qwen3(args)
    attn = model.layers["0"].self_attn
    assert tuple(attn.q_proj.weight.shape) == (16 * 128, 1024)  # 2048 != dim
    assert tuple(attn.o_proj.weight.shape) == (1024, 2048)
    assert tuple(attn.q_norm.weight.shape) == tuple(attn.k_norm.weight.shape) == (128,)
    assert model.lm_head is None
    debug = QWEN3_FLAVORS["debug"]
    assert debug.q_dim != debug.dim  # the CPU flavour exercises the decoupled width too


def test_problems_are_collected_with_the_fix() -> None:
    bad = replace(QWEN3_FLAVORS["debug"], n_kv_heads=3, head_dim=63, dim=0)
    problems = bad.problems()
    assert len(problems) == 3
    assert any("model.dim=0 must be positive" in p for p in problems)
    assert any("model.head_dim=63 must be even" in p for p in problems)
    assert any("model.n_kv_heads=3 must divide model.n_heads=4" in p and "[1, 2, 4]" in p for p in problems)
    with pytest.raises(ValueError, match="head_dim=63"):
        Qwen3(bad)
    # dim need not be a multiple of n_heads: head_dim is its own hyper-parameter.
    assert replace(QWEN3_FLAVORS["debug"], dim=96, n_heads=8, n_kv_heads=4).problems() == []


def test_spec_applies_custom_sizes() -> None:
    args = QWEN3.args("debug", dim=64, head_dim=32, n_layers=2, ffn_dim=None)
    assert (args.dim, args.head_dim, args.n_layers, args.ffn_dim) == (64, 32, 2, 384)


def test_flops_use_the_query_width() -> None:
    args = QWEN3_FLAVORS["0.6b"]
    attention = args.flops_per_token(4096) - args.flops_per_token(0)
    assert attention == 12 * 28 * 16 * 128 * 4096  # n_heads * head_dim = 2048, not dim = 1024
    assert args.flops_per_token(0) == 6 * args.num_params()  # tied: the head counts once as a matmul


# ---------------------------------------------------------------------------------------------
# Parity with transformers' Qwen3ForCausalLM
# ---------------------------------------------------------------------------------------------

SMALL = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,  # q width 128 != dim 64
    ffn_dim=160,
    vocab_size=97,
    norm_eps=1e-6,
    rope_theta=10000.0,  # low theta: every frequency turns within the test's positions
    max_seq_len=96,
)
NARROW = replace(SMALL, n_kv_heads=4, head_dim=8)
"""Query width 32 < dim 64 (the debug flavour, checked for every family in test_conformance.py, has
the opposite: 256 > 128)."""
ATOL = 1e-4


def _transformers():
    return pytest.importorskip("transformers")


def hf_model(args: Qwen3Args) -> torch.nn.Module:
    transformers = _transformers()
    config = transformers.Qwen3Config(**hf_config(args, torch_dtype="float32"), attn_implementation="sdpa")
    return transformers.Qwen3ForCausalLM(config).eval()


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with noise, norm gains around 1, so no weight is left at its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.05 * noise)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 24), generator=gen)
    positions = torch.stack([torch.arange(24) + 60, torch.arange(24) + 3])
    return tokens, positions


def test_query_width_narrower_than_dim_matches_hf() -> None:
    ours = Qwen3(NARROW).eval()
    randomize_(ours, seed=1)
    theirs = hf_model(NARROW)
    theirs.load_state_dict(to_hf(ours.state_dict()), strict=True)
    tokens, positions = batch()
    with torch.no_grad():
        expected = theirs(input_ids=tokens, position_ids=positions).logits
        assert (ours(tokens, positions=positions) - expected).abs().max().item() <= ATOL
    assert args_from_hf_config(theirs.config.to_dict()) == NARROW


def test_q_k_norms_matter() -> None:
    """A model that skipped the q/k norms (or applied them after RoPE) would still pass with gains of
    exactly 1 and unit-RMS heads; with random gains the logits move, so parity above tests them."""
    ours = Qwen3(SMALL).eval()
    randomize_(ours, seed=3)
    tokens, _ = batch()
    with torch.no_grad():
        before = ours(tokens)
        for block in ours.layers.values():
            block.self_attn.q_norm.weight.mul_(1.5)
        assert (ours(tokens) - before).abs().max().item() > 1e-3


def test_args_from_hub_config_of_qwen3_0_6b() -> None:
    # config.json of Qwen/Qwen3-0.6B as published (transformers 4.51 layout).
    hub = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    args = args_from_hf_config(hub)
    assert args == QWEN3_FLAVORS["0.6b"]
    assert args.num_params() == 596_049_920
    transformers = _transformers()
    v5 = transformers.Qwen3Config(**hub).to_dict()  # transformers 5 moves rope_theta into rope_parameters
    assert args_from_hf_config(v5) == args
    with pytest.raises(ValueError, match="rope_type='yarn'") as err:
        args_from_hf_config(
            {**hub, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "attention_bias": True}
        )
    assert "attention_bias=True" in str(err.value)  # every problem at once
    with pytest.raises(ValueError, match="model_type='llama'"):
        args_from_hf_config({**hub, "model_type": "llama"})
