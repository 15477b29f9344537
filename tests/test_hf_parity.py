"""Parity with Hugging Face ``LlamaForCausalLM`` (SDPA attention) where it is Llama's own, in fp32 on CPU:
Llama 3.1 RoPE frequency scaling, untying a tied checkpoint, the Hub's ``config.json``.

Our random weights go through ``to_hf`` into an HF model built from ``hf_config``; HF's random
weights come back through ``from_hf``. Logits must agree to 1e-4 both ways at positions where the
scaling changes the rotation. Parity of the debug flavour (untied and tied, GQA and MHA) is checked
for every family in ``tests/test_conformance.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from portatrain.models.llama.hf import args_from_hf_config, from_hf, hf_config, to_hf  # noqa: E402
from portatrain.models.llama.model import Llama, LlamaArgs, RopeScaling, rope_inv_freq  # noqa: E402

# head_dim 16, theta 1e4: wavelengths 6.3, 19.9, 62.8, ... With original_max_position_embeddings=32
# the scaling band is 8..32, so one frequency is kept, one is blended and the rest are divided by 8:
# a wrong scaling formula changes the logits.
SCALED = LlamaArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=97,
    ffn_hidden_dim=160,
    norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
    ),
    max_seq_len=64,
)
ATOL = 1e-4


def hf_model(args: LlamaArgs) -> torch.nn.Module:
    config = transformers.LlamaConfig(**hf_config(args, torch_dtype="float32"), attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with noise, norm gains around 1, so no weight is left at its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.05 * noise)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SCALED.vocab_size, (2, 24), generator=gen)
    # Row 0 runs past the original context length (32) where scaling matters; row 1 starts mid-way.
    positions = torch.stack([torch.arange(24) + 40, torch.arange(24) + 3])
    return tokens, positions


def test_inv_freq_matches_hf_and_scaling_is_exercised():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**hf_config(SCALED))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = rope_inv_freq(SCALED.head_dim, SCALED.rope_theta, SCALED.rope_scaling)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-6)
    plain = rope_inv_freq(SCALED.head_dim, SCALED.rope_theta, None)
    kept = torch.isclose(ours, plain)
    divided = torch.isclose(ours, plain / 8)
    assert kept.sum() == 1 and divided.sum() == 6 and not (kept | divided)[1]  # index 1 is blended


def test_ours_to_hf_logits_match_with_rope_scaling():
    args = SCALED
    ours = Llama(args).eval()
    randomize_(ours, seed=1)
    theirs = hf_model(args)
    theirs.load_state_dict(to_hf(ours.state_dict()), strict=True)

    tokens, positions = batch()
    with torch.no_grad():
        for pos in (None, positions):
            expected = theirs(input_ids=tokens, position_ids=pos).logits
            actual = ours(tokens, positions=pos)
            assert (actual - expected).abs().max().item() <= ATOL, f"positions={pos is not None}"


def test_hf_to_ours_with_rope_scaling():
    args = SCALED
    torch.manual_seed(2)
    theirs = hf_model(args)
    randomize_(theirs, seed=2)
    assert args_from_hf_config(theirs.config.to_dict()) == replace(args, ffn_hidden_dim=args.ffn_dim)

    ours = Llama(args).eval()
    ours.load_state_dict(from_hf(theirs.state_dict(), tie_embeddings=args.tie_embeddings), strict=True)
    tokens, positions = batch()
    with torch.no_grad():
        expected = theirs(input_ids=tokens, position_ids=positions).logits
        assert (ours(tokens, positions=positions) - expected).abs().max().item() <= ATOL


def test_from_hf_unties_tied_checkpoint_and_rejects_foreign_keys():
    sd = {"model.embed_tokens.weight": torch.randn(5, 4), "model.norm.weight": torch.ones(4)}
    untied = from_hf(sd, tie_embeddings=False)
    assert torch.equal(untied["lm_head.weight"], untied["embed_tokens.weight"])
    assert untied["lm_head.weight"].data_ptr() != untied["embed_tokens.weight"].data_ptr()
    with pytest.raises(KeyError, match="vision_tower"):
        from_hf({**sd, "vision_tower.weight": torch.ones(1)})


def test_args_from_hub_config_of_llama_3_1_8b():
    # config.json of meta-llama/Llama-3.1-8B as published (transformers 4.43 layout).
    hub = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 128256,
    }  # fmt: skip
    args = args_from_hf_config(hub)
    assert args.num_params() == 8_030_261_248
    assert args.rope_scaling == RopeScaling(factor=8.0)
    # transformers 5 moves rope_theta into rope_parameters; both layouts read the same.
    v5 = transformers.LlamaConfig(**hub).to_dict()
    assert "rope_parameters" in v5
    assert args_from_hf_config(v5) == args
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        args_from_hf_config({**hub, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_export_config_of_a_short_context_loads_without_a_warning():
    """The debug flavour trains 512 positions under Llama 3.1's scaling (pre-scaling context 8192):
    its config.json states a context transformers accepts, so loading an export prints nothing."""
    from transformers.testing_utils import CaptureLogger

    from portatrain.models.llama.model import LLAMA3_FLAVORS

    debug = LLAMA3_FLAVORS["debug"]
    config = hf_config(debug, torch_dtype="float32")
    assert config["max_position_embeddings"] > config["rope_scaling"]["original_max_position_embeddings"]
    with CaptureLogger(transformers.logging.get_logger("transformers")) as captured:
        transformers.LlamaConfig(**config)
    assert captured.out == ""
    # The frequencies come from rope_scaling alone: the same as the flavour's own.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**config))
    torch.testing.assert_close(rope_inv_freq(debug.head_dim, debug.rope_theta, debug.rope_scaling), theirs)
