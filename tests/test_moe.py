"""The shared mixture-of-experts layer (``portatrain.models.common.moe``) and its wiring.

Routing and both dispatch modes against a plain per-token reference; the grouped-matmul custom ops
(torch.library's own checks, the native path against the loop); the load-balancing loss against
transformers' and its gradient; the Trainer's dispatch choice, routing metrics and compiled runs
with changing routing (one graph per batch shape, no recompiles); the dry run's accounting; the sim
device's zero host syncs in capacity mode. The family itself (Qwen 3 MoE) goes through
``tests/test_conformance.py`` with every other family.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from portatrain.models.common.moe import MoE, grouped_linear, routing_stats
from tests.helpers import ROOT, TINY, fit, read_metrics, run_cli
from tests.test_command_errors import run

MOE = [*TINY, "model=qwen3_moe_debug", "checkpoint.enabled=false"]


def _layer(seed: int = 0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(32, 16, 8, 2, norm_topk_prob=True, **kwargs)
    layer.init_weights(0.2, 0.2)
    return layer


def _reference(layer: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Each token through its experts one at a time, weighted (``keep[t, j]`` False drops choice ``j``)."""
    weights, experts, _ = layer.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            if keep is not None and not keep[t, j]:
                continue
            e = experts[t, j]
            gate, up = (layer.experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (layer.experts.down_proj[e] @ (F.silu(gate) * up))
    return out


def test_dropless_equals_the_per_token_reference_with_gradients() -> None:
    layer, x = _layer(), torch.randn(40, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref_layer = _layer()
    got, want = layer(x), _reference(ref_layer, x_ref)
    assert torch.allclose(got, want, atol=1e-5)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    for (name, p), q in zip(layer.named_parameters(), ref_layer.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


def test_capacity_mode_drops_the_weakest_choices_first_and_counts_them() -> None:
    x = torch.randn(40, 32)
    layer = _layer()
    layer.dispatch = "capacity"
    layer.capacity_factor = 8.0  # room for everything: the same as dropless
    assert layer.capacity(40) == 40
    assert torch.allclose(layer(x), _reference(_layer(), x), atol=1e-5)

    layer.reset_stats()
    layer.capacity_factor = 0.5  # 40 * 2 / 8 * 0.5 = 5 slots per expert
    assert layer.capacity(40) == 5
    _, experts, _ = layer.gate(x)
    # Slots go to first choices in token order, then to second choices: the reference's keep mask.
    keep, used = torch.zeros(40, 2, dtype=torch.bool), [0] * 8
    for j in range(2):
        for t in range(40):
            e = int(experts[t, j])
            if used[e] < 5:
                keep[t, j], used[e] = True, used[e] + 1
    assert not keep.all()
    assert torch.allclose(layer(x), _reference(layer, x, keep), atol=1e-5)
    expected_load = layer.expert_load.max() / layer.expert_load.mean()
    stats = routing_stats(layer)
    assert stats["moe_dropped"] == pytest.approx((~keep).sum().item() / 80)
    assert stats["moe_load_max_mean"] == pytest.approx(expected_load.item())
    assert layer.dropped.item() == 0  # read and reset


def test_routing_stats_of_every_layer_are_one_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A logging step reads all layers' routing statistics at once (one ``tolist``), never one
    ``.item()`` per figure and layer; layers that saw no forward are left out."""
    model = torch.nn.ModuleList([_layer(), _layer(), _layer()])
    x = torch.randn(40, 32)
    model[0](x)
    model[1](x)
    reads: list[str] = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, _o=original, _n=name: reads.append(_n) or _o(self)
        )
    stats = routing_stats(model)
    assert reads == ["tolist"]
    assert set(stats) == {"moe_load_max_mean", "moe_aux_loss"}
    assert stats["moe_aux_loss"] > 0 and stats["moe_load_max_mean"] >= 1.0


def test_aux_loss_equals_transformers_and_reaches_the_router_gradient() -> None:
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    x = torch.randn(40, 32)
    layer = _layer()
    logits = F.linear(x, layer.gate.weight)
    theirs = modeling.load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    layer(x)
    assert routing_stats(layer)["moe_aux_loss"] == pytest.approx(theirs.item(), rel=1e-5)

    # The loss joins the gradient (coefficient x scale), not the output.
    plain, weighted = _layer(), _layer(aux_loss_coef=0.5)
    weighted.aux_loss_scale = 0.25
    out_plain, out_weighted = plain(x), weighted(x)
    assert torch.equal(out_plain, out_weighted)
    out_plain.sum().backward()
    out_weighted.sum().backward()
    aux_only = _layer()
    probs = aux_only.gate.scores(x)
    _, experts = torch.topk(probs, 2, dim=-1)
    load = torch.zeros(8).index_add_(0, experts.reshape(-1), torch.ones(80))
    aux = 8 * (load / 40 * probs.mean(0)).sum()
    (0.5 * 0.25 * aux).backward()
    expected = plain.gate.weight.grad + aux_only.gate.weight.grad
    assert torch.allclose(weighted.gate.weight.grad, expected, atol=1e-6)
    assert not torch.allclose(weighted.gate.weight.grad, plain.gate.weight.grad)


native_mm = torch._grouped_mm


def test_grouped_linear_ops_pass_torch_library_checks_and_the_loop_equals_native(monkeypatch) -> None:
    x = torch.randn(24, 16, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    offs = torch.tensor([5, 5, 24], dtype=torch.int32)  # an empty group in the middle
    for native in (True, False):
        torch.library.opcheck(grouped_linear, (x, w, offs, native))
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or native_mm(*a, **k))
    native = grouped_linear(x, w, offs, True)
    grads = torch.autograd.grad(native.square().sum(), (x, w))
    assert len(calls) == 3  # forward, input gradient, weight gradient: torch's kernel each time
    # An input that needs no gradient gets none (its grouped matmul is skipped); the weight's is unchanged.
    (weight_only,) = torch.autograd.grad(grouped_linear(x.detach(), w, offs, True).square().sum(), (w,))
    assert torch.equal(weight_only, grads[1])
    calls.clear()
    loop = grouped_linear(x, w, offs, False)
    assert torch.allclose(loop, native, atol=1e-5)
    for a, b in zip(torch.autograd.grad(loop.square().sum(), (x, w)), grads, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
    assert calls == []  # the loop


def test_trainer_picks_the_dispatch_logs_routing_and_compiles_once_per_shape(tmp_path: Path) -> None:
    """16 steps with changing routing, per-block compiled (dynamo only, to keep the test short) with
    warm-up over three buckets: one graph per block kind and shape, no recompile, in both modes;
    routing metrics logged."""
    # The steps after warm-up visit every bucket with routing of their own (the data is seeded: 64 at
    # step 1, 16 at step 2, 32 at steps 10 and 11), and steps follow each log step: a guard on routing
    # or on what logging resets fails within them (200 steps: ~4x the CPU, no recompile either).
    buckets = ["data.collator=bucket", "data.buckets=[16,32,64]", "trainer.steps=16", "trainer.log_every=4"]
    compiled = [
        "compile.enabled=true",
        "compile.warmup=true",
        "compile.dynamic=false",
        "compile.backend=eager",
    ]
    for mode in ("dropless", "capacity"):
        torch._dynamo.reset()  # dynamo keeps graphs per code object for the whole process
        run_dir = tmp_path / mode
        trainer = fit([*MOE, *buckets, *compiled, f"model.moe_dispatch={mode}"], run_dir)
        layers = [m for m in trainer.model.modules() if isinstance(m, MoE)]
        assert len(layers) == 2 and all(m.dispatch == mode for m in layers)  # block 2 of 3 is dense
        assert all(m.aux_loss_scale == 1.0 for m in layers)  # one micro-batch, one rank
        records = [r for r in read_metrics(run_dir) if "loss" in r]
        assert [r["step"] for r in records] == [4, 8, 12, 16]
        # Two block kinds (experts, dense) x three bucket shapes, all made at warm-up; none after.
        assert (records[-1]["compile_graphs"], records[-1]["compile_recompiles"]) == (6, 0), mode
        assert all(r["moe_load_max_mean"] >= 1.0 and r["moe_aux_loss"] > 0 for r in records)
        assert ("moe_dropped" in records[-1]) == (mode == "capacity")
    torch._dynamo.reset()
    auto = compose(["model=qwen3_moe_debug"])
    from portatrain.models import moe_dispatch

    assert moe_dispatch(auto.model, static_shapes=True) == "capacity"
    assert moe_dispatch(auto.model, static_shapes=False) == "dropless"


def compose(overrides: list[str]):
    from tests.helpers import compose_config

    return compose_config([*TINY, *overrides])


def test_dry_run_prints_total_and_active_parameters(tmp_path: Path) -> None:
    out = run_cli(["plan", "recipe=qwen3_moe_30b_a3b", "device=neuron", "parallel.dp_shard=64"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "parameters: 30,532,122,624 (30.53B)" in out.stdout
    assert "active per token: 3,353,032,704 (3.35B)" in out.stdout
    assert "experts dispatched capacity (capacity_factor 1.25)" in out.stdout  # neuron wants static shapes


def test_bad_moe_settings_are_one_error_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # ``portatrain`` in this process, as the CLI runs it
    bad = ["model.top_k=9", "model.moe_dispatch=sometimes", "model.capacity_factor=0"]
    status, err = run(["model=qwen3_moe_debug", *bad, "device=cpu", "dry_run=true"], capsys)
    assert status == 2 and "Traceback" not in err
    assert "model.top_k=9 exceeds model.n_experts=8" in err
    assert "model.moe_dispatch='sometimes' is not one of auto, dropless, capacity" in err
    assert "model.capacity_factor=0.0 must be a positive number" in err
    status, err = run(["model=qwen3_debug", "model.n_experts=4", "device=cpu", "dry_run=true"], capsys)
    assert status == 2 and "model.n_experts=4: not an option of the qwen3 family" in err


@pytest.mark.slow  # a fresh process: installing the sim device is process-global
def test_sim_capacity_mode_has_no_host_sync_between_logging_steps(tmp_path: Path) -> None:
    from tests.test_sim import run_python

    out = run_python(
        f"""
        import json
        from pathlib import Path
        from tests.helpers import TINY, compose_config, train_records
        from portatrain.trainer import Trainer

        base = [o for o in TINY if not o.startswith("device=")] + [
            "device=sim", "model=qwen3_moe_debug", "audit.runtime=true", "checkpoint.enabled=false",
            "trainer.steps=6", "trainer.log_every=3"]
        trainer = Trainer(compose_config(base, Path({str(tmp_path)!r})))
        try:
            trainer.fit()
            dispatch = sorted({{m.dispatch for m in trainer.model.modules() if hasattr(m, "dispatch")}})
        finally:
            trainer.close()
        records = train_records(Path({str(tmp_path)!r}))
        print(json.dumps({{"dispatch": dispatch, "syncs": [r["audit_host_syncs"] for r in records],
                          "fallbacks": [r["audit_cpu_fallbacks"] for r in records]}}))
        """,
        env={"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    res = json.loads(out.strip().splitlines()[-1])
    assert res["dispatch"] == ["capacity"]  # the sim device wants static shapes, as tpu and neuron do
    assert res["syncs"] == [0, 0] and res["fallbacks"] == [0, 0]


def test_capacity_is_static_in_the_batch_shape() -> None:
    layer = _layer()
    assert layer.capacity(1000) == math.ceil(1.25 * 1000 * 2 / 8)
