"""GPT-OSS: what is its own beyond the conformance suite (``tests/test_conformance.py`` runs parity
with transformers' ``GptOssForCausalLM``, export/``init_from``, bf16 in both dispatch modes, FSDP2, the
memory estimate and the published totals for it).

* Total and active parameters against the model card.
* The biased router and the biased, clamped experts against transformers' ``GptOssMLP`` on their own,
  in both dispatch modes, with weights large enough for the clamps to bite.
* MXFP4 checkpoints refused with the fix, from their config and from their tensors.
* Capacity dispatch with expert parallel on two processes equal to one process (slow).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from portatrain.models.common.moe import configure_moe
from portatrain.models.gpt_oss import GPT_OSS
from portatrain.models.gpt_oss.model import GPT_OSS_FLAVORS, GPT_OSS_PUBLISHED_ACTIVE, GptOss
from tests import shared_launch
from tests.helpers import TINY, fit, train_records


def test_total_and_active_counts_are_the_model_cards() -> None:
    """Model card (https://arxiv.org/abs/2508.10925), table 1, in billions: active without the input embedding."""
    card = {"20b": (20.91, 3.61), "120b": (116.83, 5.13)}
    for flavor, (total, active) in card.items():
        args = GPT_OSS_FLAVORS[flavor]
        assert round(args.num_params() / 1e9, 2) == total, flavor
        assert args.num_params(active=True) == GPT_OSS_PUBLISHED_ACTIVE[flavor]
        assert round(GPT_OSS_PUBLISHED_ACTIVE[flavor] / 1e9, 2) == active, flavor
        # FLOPs count the unembedding, never the lookup: the same whichever way active is counted.
        expected = args.num_params(exclude_embedding=True, active=True)
        assert args.num_params(active=True) == expected


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_router_and_experts_equal_transformers(dispatch: str) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    args = dataclasses.replace(GPT_OSS_FLAVORS["debug"], n_layers=1)
    ours = GptOss(args).layers["0"].mlp.eval()
    configure_moe(ours, dispatch=dispatch, capacity_factor=args.n_experts / args.top_k, aux_loss_scale=1.0)
    config = transformers.GptOssConfig(**GPT_OSS.hf.config(args, torch_dtype="float32"))
    theirs = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():  # std 2: many gate and up values past the clamp at 7
            p.copy_(2 * torch.randn(p.shape, generator=gen))
        state = GPT_OSS.hf.to_hf({f"layers.0.mlp.{k}": v for k, v in ours.state_dict().items()})
        theirs.load_state_dict({k.removeprefix("model.layers.0.mlp."): v for k, v in state.items()})
        x = torch.randn(2, 12, args.dim, generator=gen)
        gate_up = (
            x.reshape(-1, args.dim) @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]
        )
        assert (gate_up.abs() > args.swiglu_limit).float().mean() > 0.1  # the clamps change values
        want, _ = theirs(x)
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-4)


def test_mxfp4_checkpoints_are_refused_with_the_fix() -> None:
    config = GPT_OSS.hf.config(GPT_OSS_FLAVORS["debug"], torch_dtype="bfloat16")
    with pytest.raises(ValueError, match="quant_method='mxfp4'.*Mxfp4Config\\(dequantize=True\\)"):
        GPT_OSS.hf.args_from_config({**config, "quantization_config": {"quant_method": "mxfp4"}})
    blocks = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1),
        "model.norm.weight": torch.ones(1),
    }
    with pytest.raises(ValueError, match="gate_up_proj_blocks: MXFP4.*Mxfp4Config\\(dequantize=True\\)"):
        GPT_OSS.hf.from_hf(blocks)


EP_RUN = [
    *TINY,
    "model=gpt_oss_debug",
    "model.moe_dispatch=capacity",
    "model.capacity_factor=4",
    "checkpoint.enabled=false",
]
two_processes = shared_launch.declare(
    "two_processes", 2, {"ep2": [*EP_RUN, "parallel.dp_shard=2", "parallel.ep=2", "data.batch_size=2"]}
)


@pytest.mark.slow
def test_capacity_dispatch_with_ep2_matches_one_process(two_processes, tmp_path: Path) -> None:
    """Two ranks, each with 4 of the 8 experts and half the global batch, capacity dispatch with slots
    for every assignment (nothing dropped, whatever a rank's share): one process's losses."""
    fit(EP_RUN, tmp_path / "one")
    got, want = train_records(two_processes["ep2"]), train_records(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)
        assert g["moe_dropped"] == 0, g
