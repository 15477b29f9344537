"""Qwen 3 (dense): published sizes, argument checks, and logits parity with Hugging Face's
``Qwen3ForCausalLM`` (SDPA attention) in fp32 on CPU.

Our random weights go through ``to_hf`` into an HF model built from ``hf_config``; HF's random
weights come back through ``from_hf``. Logits must agree to 1e-4 both ways, which checks the config
translation, the key mapping, the q/k norms (per head, before RoPE), the decoupled head dimension,
GQA and tied embeddings.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from portatrain.models.qwen3 import QWEN3
from portatrain.models.qwen3.hf import args_from_hf_config, from_hf, hf_config, to_hf
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
# Exact counts from the published config.json dimensions (the first is the widely quoted 596,049,920).
EXACT = {
    "0.6b": 596_049_920,
    "1.7b": 1_720_574_976,
    "4b": 4_022_468_096,
    "8b": 8_190_735_360,
    "14b": 14_768_307_200,
    "32b": 32_762_123_264,
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_published_parameter_counts(flavor: str) -> None:
    args = QWEN3_FLAVORS[flavor]
    total, non_embedding = PUBLISHED[flavor]
    assert args.num_params() == EXACT[flavor]
    # The cards round to the digits they print: 0.6 -> within 0.05B, 6.95 -> within 0.005B.
    digits = {0.6e9: 0.05e9, 0.44e9: 0.005e9, 6.95e9: 0.005e9}
    assert abs(args.num_params() - total) <= digits.get(total, 0.05e9)
    heads = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    assert abs(args.num_params() - heads - non_embedding) <= digits.get(non_embedding, 0.05e9)
    assert args.tie_embeddings == (flavor in ("0.6b", "1.7b", "4b"))
    assert (args.head_dim, args.n_kv_heads, args.vocab_size) == (128, 8, 151936)
    assert (args.rope_theta, args.norm_eps, args.max_seq_len) == (1e6, 1e-6, 40960)


def test_built_model_counts_match_the_formula_and_the_q_width_is_decoupled() -> None:
    args = QWEN3_FLAVORS["0.6b"]
    with torch.device("meta"):
        model = Qwen3(args)
    assert model.num_params() == args.num_params()
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
VARIANTS = {
    "untied-gqa": SMALL,
    "tied-gqa": replace(SMALL, tie_embeddings=True),
    "mha-narrow-heads": replace(SMALL, n_kv_heads=4, head_dim=8),  # q width 32 < dim
}
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


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ours_to_hf_logits_match(variant: str) -> None:
    args = VARIANTS[variant]
    ours = Qwen3(args).eval()
    randomize_(ours, seed=1)
    theirs = hf_model(args)
    result = theirs.load_state_dict(to_hf(ours.state_dict()), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if args.tie_embeddings else [])
    if args.tie_embeddings:
        assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    tokens, positions = batch()
    with torch.no_grad():
        for pos in (None, positions):
            expected = theirs(input_ids=tokens, position_ids=pos).logits
            actual = ours(tokens, positions=pos)
            assert (actual - expected).abs().max().item() <= ATOL, f"positions={pos is not None}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_to_ours_round_trip(variant: str) -> None:
    args = VARIANTS[variant]
    torch.manual_seed(2)
    theirs = hf_model(args)
    randomize_(theirs, seed=2)
    assert args_from_hf_config(theirs.config.to_dict()) == args

    ours = Qwen3(args).eval()
    ours.load_state_dict(from_hf(theirs.state_dict(), tie_embeddings=args.tie_embeddings), strict=True)
    tokens, positions = batch()
    with torch.no_grad():
        expected = theirs(input_ids=tokens, position_ids=positions).logits
        assert (ours(tokens, positions=positions) - expected).abs().max().item() <= ATOL
    state = ours.state_dict()
    back = from_hf(to_hf(state), tie_embeddings=args.tie_embeddings)
    assert back.keys() == state.keys()
    assert all(back[k] is v for k, v in state.items())  # renaming only, tensors untouched


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


def test_hf_config_of_every_flavour_builds_in_transformers() -> None:
    transformers = _transformers()
    for flavor, args in QWEN3_FLAVORS.items():
        config = transformers.Qwen3Config(**hf_config(args))
        assert args_from_hf_config(config.to_dict()) == args, flavor
