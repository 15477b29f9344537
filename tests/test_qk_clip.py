"""QK-clip (``optim.qk_clip``, ``portatrain.models.common.qk_clip``), in this process.

* The chunked maximum equals the maximum of the materialized, masked scores, to the bit (causal,
  packed documents, a sliding window; grouped-query heads; a row length no multiple of the chunk).
* After the post-step hook (fp32): every clipped head's recomputed largest logit is tau (1e-5), the
  other heads' logits do not move, and a key group with no clipped head keeps its weights to the bit;
  grouped-query attention (Llama) and latent attention (DeepSeek-V3: the shared rotary key untouched).
* The same in bf16 (autocast): within a bound derived from the roundings of q and k.
* A skipped step scales nothing and forgets its maxima; an evaluation forward records none.
* The runs QK-clip refuses: one line each, exit 2.

Its layouts (FSDP2, TP) are in ``tests/test_muon.py``'s two-process launch, each against one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portatrain.config import ModelConfig, OptimConfig
from portatrain.models import build_model
from portatrain.models.attention import repeat_kv
from portatrain.models.common import runtime
from portatrain.models.common.masks import window_mask
from portatrain.models.common.qk_clip import attention_layers, max_logits
from portatrain.models.spec import RuntimeOptions
from portatrain.optim import optim_problems
from tests.helpers import bf16_tolerance
from tests.test_command_errors import run


def _packed_mask(batch: int, seq_len: int, cuts: list[int]) -> torch.Tensor:
    """``[B, 1, S, S]``: causal within the documents that start at ``cuts``, nothing across them."""
    doc = torch.zeros(seq_len, dtype=torch.long)
    for cut in cuts:
        doc[cut:] += 1
    same = doc[:, None] == doc[None, :]
    return (same & window_mask(seq_len, seq_len))[None, None].expand(batch, 1, -1, -1)


def _materialized(q, k, mask, scale):  # noqa: ANN001, ANN202
    scores = (q @ repeat_kv(k, q.shape[1] // k.shape[1]).transpose(-1, -2)) * scale  # [B, H, S, S]
    allowed = window_mask(q.shape[2], q.shape[2]) if mask is None else mask
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("mask_kind", ["causal", "packed", "window", "packed_window"])
def test_chunked_max_equals_the_masked_materialized_scores(mask_kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq_len, dim = 2, 6, 2, 37, 8
    # Small integers: every dot product is exact in fp32 whatever order a matmul kernel sums in (a
    # chunk's shape may pick another kernel), so the two answers may be compared to the bit.
    q = torch.randint(-4, 5, (batch, heads, seq_len, dim), generator=gen).float()
    k = torch.randint(-4, 5, (batch, kv_heads, seq_len, dim), generator=gen).float()
    mask = {
        "causal": None,
        "packed": _packed_mask(batch, seq_len, [9, 30]),
        "window": window_mask(seq_len, 5),
        "packed_window": _packed_mask(batch, seq_len, [20]) & window_mask(seq_len, 5),
    }[mask_kind]
    # Make the largest unmasked score of head 0 sit beside a larger masked one: a mask applied
    # wrongly (or not at all) changes the answer.
    k[:, 0, 3] = 0
    q[:, 0, 2] = 0
    q[:, 0, 2, 0] = 50.0
    k[:, 0, 3, 0] = 50.0  # query 2 may not see key 3 under any of the masks
    want = _materialized(q, k, mask, dim**-0.5)
    for chunk in (1, 8, 64):
        got = max_logits(q, k, mask, chunk=chunk)
        assert torch.equal(got, want), (chunk, got, want)
    assert float(want[0]) < 50.0 * 50.0 * dim**-0.5 / 2
    # Real-valued scores: the same up to the summation order of a dot product of 8 terms.
    q, k = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    torch.testing.assert_close(max_logits(q, k, mask, chunk=8), _materialized(q, k, mask, dim**-0.5))


def _model(name: str, **dims: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name, flavor="debug", **dims))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model.train()


def _clip_hooks(model: torch.nn.Module, threshold: float):  # noqa: ANN202
    options = RuntimeOptions(
        moe_dispatch="dropless", capacity_factor=1.0, aux_loss_scale=0.0, qk_clip=threshold
    )
    return runtime(model, options)


def _inputs(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor | None) -> list[tuple]:
    """Each attention layer's inputs ``(x, cos, sin, attn_mask)`` in one training forward of ``model``."""
    seen, handles = [], []
    for layer in attention_layers(model):
        handles.append(layer.register_forward_pre_hook(lambda module, args: seen.append(args)))
    model(tokens, attn_mask=mask)
    for handle in handles:
        handle.remove()
    return seen


def _maxima(model: torch.nn.Module, inputs: list[tuple]) -> torch.Tensor:
    """Every attention layer's per-head largest logit on its recorded ``inputs``, ``[L, H]``: the same
    inputs before and after a clip (a clip of one layer would otherwise move the next one's input)."""
    found = []
    for layer, args in zip(attention_layers(model), inputs, strict=True):
        layer(*args)
        found.append(layer.qk_clip.take())
    return torch.stack(found)


def _projections(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "proj" in n}


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_clipped_heads_land_on_tau_and_the_others_do_not_move(family: str) -> None:
    # Llama: 4 query heads over 2 key heads (grouped-query); DeepSeek-V3: latent attention, 4 heads
    # (one block: its first is dense, no experts to build).
    model = _model(
        family,
        **(
            {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2}
            if family == "llama3"
            else {"n_layers": 1}
        ),
    )
    hooks = _clip_hooks(model, 1.0)
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = _packed_mask(2, 24, [10])
    inputs = _inputs(model, tokens, mask)  # this training forward's logits are the ones the hook clips
    recorded = torch.stack([layer.qk_clip.take() for layer in attention_layers(model)])
    before = _maxima(model, inputs)
    assert torch.equal(before, recorded)
    # tau between the two heads of the first key group (or the first two heads): one clipped, one not.
    tau = float(before[0, :2].mean())
    hooks.threshold = tau
    weights = _projections(model)
    model(tokens, attn_mask=mask)
    hooks.post_optimizer_step(torch.tensor(True))
    after = _maxima(model, inputs)
    clipped = before > tau
    assert clipped[0, :2].sum() == 1 and 0 < clipped.sum() < clipped.numel(), before
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[~clipped], before[~clipped], rtol=1e-5, atol=0)
    metrics = hooks.metrics()
    assert metrics["qk_clipped_heads"] == int(clipped.sum())
    assert metrics["max_attn_logit"] == pytest.approx(float(before.max()), rel=1e-6)
    moved = {n for n, p in model.named_parameters() if n in weights and not torch.equal(p, weights[n])}
    for i, layer in enumerate(attention_layers(model)):
        prefix = next(n for n, m in model.named_modules() if m is layer)
        if family == "deepseek_v3":
            # Only the heads' own query rows and key rows; the shared rotary key and values never.
            assert f"{prefix}.kv_a_proj_with_mqa.weight" not in moved
            kv = model.get_submodule(f"{prefix}.kv_b_proj").weight.view(4, 16 + 24, -1)
            assert torch.equal(kv[:, 16:], weights[f"{prefix}.kv_b_proj.weight"].view(4, 40, -1)[:, 16:])
        else:
            # A key group with no clipped head keeps its query and key rows to the bit.
            for group in range(2):
                rows = slice(group * 2 * 16, (group + 1) * 2 * 16)  # head_dim 16 (dim 64 / 4 heads)
                same = torch.equal(layer.q_proj.weight[rows], weights[f"{prefix}.q_proj.weight"][rows])
                assert same == (not clipped[i, 2 * group : 2 * group + 2].any()), (i, group)
        assert f"{prefix}.o_proj.weight" not in moved


def test_in_bf16_clipped_heads_land_on_tau_within_the_derived_bound() -> None:
    model = _model("llama3", dim=64, n_heads=4, n_kv_heads=2, n_layers=2)
    hooks = _clip_hooks(model, 1.0)
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(3))
    # One autocast region per forward, as the trainer's: a region caches its bf16 copies of the weights.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inputs = _inputs(model, tokens, None)
        before = _maxima(model, inputs)
    hooks.threshold = tau = float(before[0, :2].mean())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    hooks.post_optimizer_step(torch.tensor(True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after = _maxima(model, inputs)
    clipped = before > tau
    assert 0 < clipped.sum() < clipped.numel(), before
    # Each measured logit is a dot product of bf16 queries and keys, each a bf16 rounding of the
    # projection (1) of a rounded input (1), then rotated (1): 3 roundings per side, 6 in all, summed
    # in fp32. The clip divides by one such measurement and the check takes another: twice the bound.
    bound = 2 * bf16_tolerance(6)
    assert ((after[clipped] - tau).abs() <= bound * tau).all(), (after, tau, bound)
    assert ((after[~clipped] - before[~clipped]).abs() <= bound * before[~clipped]).all(), (after, before)


def test_a_skipped_step_scales_nothing_and_forgets_its_maxima() -> None:
    model = _model("llama3", dim=64, n_heads=4, n_kv_heads=2, n_layers=2)
    hooks = _clip_hooks(model, 1e-3)  # every head above it
    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(2))
    weights = _projections(model)
    with torch.no_grad():  # an evaluation forward: nothing recorded
        model(tokens)
    assert all(layer.qk_clip.value is None for layer in attention_layers(model))
    model(tokens)
    hooks.post_optimizer_step(torch.tensor(False))
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if n in weights)
    assert all(layer.qk_clip.value is None for layer in attention_layers(model))
    assert "max_attn_logit" not in hooks.metrics()  # no applied step since the last log


def test_refused_runs_are_one_line_each_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert optim_problems(OptimConfig(qk_clip=-1.0)) == [
        "optim.qk_clip=-1.0 must be > 0 (the report's: 100), or null (0) for off"
    ]
    monkeypatch.chdir(tmp_path)
    status, err = run(
        [
            "device=cpu",
            "dry_run=true",
            "model=qwen3_debug",
            "optim.qk_clip=100",
            "finetune.method=lora",
            "parallel.cp=2",
        ],
        capsys,
    )
    assert status == 2 and "Traceback" not in err, err[-3000:]
    for expected in (
        "optim.qk_clip=100.0: this model normalizes queries and keys after their projections (qk_norm=head)",
        "optim.qk_clip=100.0 with LoRA",
        "optim.qk_clip=100.0 with parallel.cp=2",
    ):
        assert sum(expected in line for line in err.splitlines()) == 1, (expected, err)
