"""Muon (``optim.name=muon``, ``portatrain.optim.muon``).

* One process: three steps equal ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same split
  (fp32 weights, 1e-6); the split (blocks' matrices and stacked experts to Muon; embedding, head,
  norms and routers to AdamW); experts orthogonalized one by one; bad values one error each, exit 2.
* The trainer, in this process: 20 steps with a falling loss; a bf16 run within the derived bound of fp32.
* Layouts in ONE two-process launch, each against one process (fp32, 1e-5): FSDP2 (``dp_shard=2``,
  saving a checkpoint that resumes in one process with the same next loss), TP (``tp=2``) and EP
  (``ep=2``, a tiny Qwen 3 MoE).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from portatrain.config import ModelConfig, MuonConfig, OptimConfig
from portatrain.models import build_model
from portatrain.optim import build_optimizer, param_groups
from portatrain.optim.muon import Muon, orthogonalize, split_params
from tests.helpers import (
    BF16,
    TINY,
    bf16_tolerance,
    decoder_roundings,
    fit,
    launch_runs,
    train_records,
)
from tests.test_command_errors import run

# A small Llama (two blocks of dim 64) that tp=2 can split: its whole step takes milliseconds.
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_dim=128"]
# A constant LR after warm-up: the first steps of runs of different lengths are the same.
MUON = [*TINY, *SMALL, "optim.name=muon", "optim.decay=constant"]
# The layouts' runs orthogonalize in fp32: in bf16 (the default, torch.optim.Muon's) a gradient that
# differs in its last fp32 bit between layouts (another summation order) rounds to another bf16
# value now and then, and the runs part by about 1e-5 within 3 steps (seen: 1.1e-5 at step 3).
NS_FP32 = ["optim.muon.ns_dtype=float32"]
# capacity_factor = n_experts / top_k: no token is dropped, on one process or on each ep rank.
MOE = [
    *TINY,
    "optim.name=muon",
    *NS_FP32,
    "model=qwen3_moe_debug",
    "model.moe_dispatch=capacity",
    "model.capacity_factor=4",
]


def _small_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(name="llama3", flavor="debug", dim=64, n_layers=2, n_heads=2, n_kv_heads=2)
    )
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model


def test_three_steps_match_torch_muon_and_adamw_on_the_same_split() -> None:
    model = _small_llama()
    reference = copy.deepcopy(model)
    cfg = OptimConfig(name="muon", lr=2e-2, betas=[0.9, 0.95], weight_decay=0.1)
    optimizer = build_optimizer(model, cfg, fused=False)
    hidden, rest = split_params(reference)
    torch_muon = torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    torch_adamw = torch.optim.AdamW(param_groups(reference, 0.1, rest), lr=2e-2, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for net, optimizers in ((model, [optimizer]), (reference, [torch_muon, torch_adamw])):
            net(tokens).logsumexp(-1).mean().backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    moved = 0.0
    for (name, got), want, start in zip(
        model.named_parameters(), reference.parameters(), _small_llama().parameters()
    ):
        assert torch.allclose(got, want, rtol=0, atol=1e-6), name
        moved = max(moved, float((got - start).detach().abs().max()))
    assert moved > 1e-2  # the steps did move the weights


def test_split_sends_matrices_and_experts_to_muon_the_rest_to_adamw() -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(name="qwen3_moe", flavor="debug"))
    names = {id(p): n for n, p in model.named_parameters()}
    hidden, rest = split_params(model)
    hidden_names, rest_names = {names[id(p)] for p in hidden}, {names[id(p)] for p in rest}
    assert {
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.experts.gate_up_proj",
        "layers.2.mlp.down_proj.weight",
    } <= hidden_names
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.mlp.gate.weight"} <= rest_names
    assert all(p.ndim in (2, 3) for p in hidden) and not hidden_names & rest_names
    assert len(hidden) + len(rest) == len(list(model.parameters()))
    optimizer = build_optimizer(model, OptimConfig(name="muon", lr=1e-3, muon=MuonConfig(lr=0.02)))
    assert isinstance(optimizer, Muon)
    assert [(g["algorithm"], g["lr"], len(g["params"])) for g in optimizer.param_groups] == [
        ("muon", 0.02, len(hidden)),
        ("adamw", 1e-3, sum(p.ndim >= 2 for p in rest)),
        ("adamw", 1e-3, sum(p.ndim < 2 for p in rest)),
    ]


def test_experts_are_orthogonalized_one_by_one() -> None:
    experts = torch.randn(4, 24, 40, generator=torch.Generator().manual_seed(0))
    batched = orthogonalize(experts)
    assert torch.equal(batched, torch.stack([orthogonalize(e) for e in experts]))
    # Each expert's result is (nearly) orthogonal: its singular values in the band five steps reach,
    # about [0.5, 1.5] (torch.optim.Muon's docstring), each expert normalized on its own.
    singular = torch.linalg.svdvals(batched.float())
    assert singular.min() > 0.5 and singular.max() < 1.5, singular


def test_bad_muon_values_are_each_one_error_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    status, err = run(
        [
            "device=cpu",
            "dry_run=true",
            "optim.name=muon",
            "optim.muon.momentum=1.0",
            "optim.muon.ns_steps=0",
            "optim.muon.adjust_lr=rms",
            "optim.muon.ns_coefficients=[1,2]",
        ],
        capsys,
    )
    assert status == 2 and "Traceback" not in err, err[-3000:]
    for expected in (
        "optim.muon.momentum=1.0 must be in [0, 1)",
        "optim.muon.ns_steps=0 must be in [1, 99]",
        "optim.muon.adjust_lr='rms' is not one of original, match_rms_adamw",
        "optim.muon.ns_coefficients=[1.0, 2.0] must have three values",
    ):
        assert sum(expected in line for line in err.splitlines()) == 1, (expected, err)


# ---------------------------------------------------------------------------------------------
# The trainer, in this process
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """fp32: 20 steps of the small Llama (Newton-Schulz in bf16, the default); the layouts' references,
    4 steps of it and of the MoE (Newton-Schulz in fp32)."""
    records = {}
    for name, overrides in {
        "default": [*MUON, "trainer.steps=20", "checkpoint.enabled=false"],
        "dense": [*MUON, *NS_FP32, "checkpoint.enabled=false"],
        "moe": [*MOE, "checkpoint.enabled=false"],
    }.items():
        run_dir = tmp_path_factory.mktemp(f"one_{name}")
        fit(overrides, run_dir)
        records[name] = train_records(run_dir)
    return records


def test_muon_trains_the_small_llama(one_process: dict[str, list[dict]]) -> None:
    losses = [r["loss"] for r in one_process["default"]]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # 5.6 -> about 3.5 (AdamW: the same)


def test_muon_in_bf16_falls_within_the_bound_of_fp32(
    one_process: dict[str, list[dict]], tmp_path: Path
) -> None:
    fit([*MUON, *BF16, "trainer.steps=8", "checkpoint.enabled=false"], tmp_path)
    fp32 = [r["loss"] for r in one_process["default"]]
    bf16 = [r["loss"] for r in train_records(tmp_path)]
    assert bf16[-1] < bf16[0] - 0.3, bf16
    # Step k's loss: the forward's roundings bound it relative to the loss (tolerance of one bf16
    # run's forward), and each earlier update differs from fp32's by the gradient's relative error
    # at most (Newton-Schulz runs in bf16 in both runs and normalizes the scale), so the loss that
    # update bought -- the fall since step 1 -- may differ by that fraction of it.
    forward = bf16_tolerance(decoder_roundings(2))
    backward = bf16_tolerance(decoder_roundings(2, backward=True))
    for step, (got, want) in enumerate(zip(bf16, fp32), start=1):
        bound = forward * want + backward * (fp32[0] - want)
        assert abs(got - want) <= bound, (step, got, want, bound)


# ---------------------------------------------------------------------------------------------
# FSDP2, TP and EP in one two-process launch, each against one process
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    runs = {
        # Per rank 2 rows: the one-process run's global batch of 4.
        "fsdp2": [*MUON, *NS_FP32, "parallel.dp_shard=2", "data.batch_size=2", "checkpoint.every=3"],
        "tp2": [*MUON, *NS_FP32, "parallel.tp=2", "parallel.dp_shard=1", "checkpoint.enabled=false"],
        "ep2": [
            *MOE,
            "parallel.dp_shard=2",
            "parallel.ep=2",
            "data.batch_size=2",
            "checkpoint.enabled=false",
        ],
    }
    return launch_runs(2, runs, tmp_path_factory.mktemp("muon_layouts"))


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want], (got, want)
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "ep2"])
def test_layout_matches_one_process(layout: str, layouts: dict[str, Path], one_process) -> None:
    want = one_process["moe" if layout == "ep2" else "dense"][:4]
    _assert_same_steps(train_records(layouts[layout]), want)


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_in_one_process(layouts: dict[str, Path], tmp_path: Path) -> None:
    saved = layouts["fsdp2"] / "checkpoints" / "step_0000003"
    fit([*MUON, *NS_FP32, f"checkpoint.resume={saved}", "checkpoint.enabled=false"], tmp_path)
    resumed = train_records(tmp_path)
    _assert_same_steps(resumed, train_records(layouts["fsdp2"])[3:])
