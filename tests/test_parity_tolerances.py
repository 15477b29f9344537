"""``portatrain.parity``'s tolerances come from the arithmetic, so rounding passes on any CPU and a
real divergence still fails.

In process, against a CPU target (the sim renames PrivateUse1 for good: ``tests/test_sim_parity.py``
runs it in fresh processes). A CPU target computes what the reference computes bit for bit, so each
test plants what it checks: rounding-sized noise on the target's gradients (what a device summing in
another order produces), or a wrong optimizer setting.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from portatrain.parity import adam_update_bound, run_parity, step_tolerance, unit_roundoff
from tests.helpers import TINY, compose_config

U = 2.0**-24


def test_the_step_tolerance_is_the_rounding_model_with_its_tail() -> None:
    # fp32 against fp32: λ · sqrt(2) · sqrt(L) · (sqrt(K) + 1) · u, λ = 8.
    assert unit_roundoff(torch.float32) == U and unit_roundoff(torch.bfloat16) == 2.0**-8
    tol = step_tolerance(torch.float32, reduction=384, stages=102)
    assert tol == pytest.approx(8 * math.sqrt(2) * math.sqrt(102) * (math.sqrt(384) + 1) * U)
    assert 1e-4 < tol < 2e-4  # the debug recipe's, as docs/portability/sim.md quotes it
    # Grows as the square roots of the reduction and the depth; bf16 output rounding dominates.
    assert step_tolerance(torch.float32, reduction=4 * 384, stages=102) < 2 * tol
    assert step_tolerance(torch.float32, reduction=384, stages=4 * 102) == pytest.approx(2 * tol)
    assert step_tolerance(torch.bfloat16, reduction=384, stages=102) > 100 * tol


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.0, 0.5)])
def test_adams_update_bound_is_reached_and_never_exceeded(betas: tuple[float, float]) -> None:
    """``c_t`` bounds |m̂| / sqrt(v̂) whatever the gradients, and the gradients proportional to
    a_j / b_j (Cauchy-Schwarz's equality case) reach it: checked on torch's own Adam."""
    beta1, beta2 = betas
    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 5):
        worst = [(beta1 / beta2) ** (t - j) if beta1 else float(j == t) for j in range(1, t + 1)]
        for grads, equal in ((worst, True), (torch.randn(t, generator=gen).tolist(), False)):
            p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
            adam = torch.optim.Adam([p], lr=1.0, betas=betas, eps=1e-300)  # no 0/0 on zero gradients
            for g in grads:
                before = p.detach().clone()
                p.grad = torch.tensor([g], dtype=torch.float64)
                adam.step()
            step = float((p.detach() - before).abs())
            bound = adam_update_bound(betas, t)
            assert step <= bound * (1 + 1e-12)
            if equal:
                assert step == pytest.approx(bound, rel=1e-12)
    assert adam_update_bound((0.9, 0.95), 1) == 1.0


def _rounding_noise(trainer) -> None:
    """Each nonzero gradient element moved by a length-P summation's rounding, sqrt(P) · u · max|g|
    (P = the positions a weight gradient sums over): what another summation order does. Exact
    zeros stay zero, as they do on any device."""
    gen = torch.Generator().manual_seed(0)
    positions = 4 * 64  # TINY: data.batch_size=4, data.seq_len=64
    for p in trainer.model.parameters():
        p.register_hook(
            lambda g: (
                g + math.sqrt(positions) * U * g.abs().max() * torch.randn(g.shape, generator=gen) * (g != 0)
            )
        )


def test_rounding_sized_gradient_differences_pass_though_step_2s_outputs_move(tmp_path: Path) -> None:
    report = run_parity(compose_config(TINY, run_dir=tmp_path), 2, prepare_target=_rounding_noise)
    first, second = report.steps
    assert 0 < max(d.rel for d in first.gradients) < report.tolerance  # planted, and rounding-sized
    # AdamW's lr * sign(g) turned it into weight differences: step 2's module outputs are far off
    # (a module-by-module check there fails every correct device that rounds differently)...
    assert max(d.rel for d in second.activations) > 10 * report.tolerance
    assert second.weight_distance > 0
    # ...while the losses agree and every optimizer update is AdamW's, to rounding.
    assert second.loss_rel < report.tolerance
    assert all(0 <= d.rel < d.tolerance for s in report.steps for d in s.updates)
    assert report.ok, report.format()
    assert report.format().splitlines()[-1].startswith("PASS:")


def test_a_wrong_optimizer_setting_on_the_target_is_named_at_its_first_update(tmp_path: Path) -> None:
    def wrong_epsilon(trainer) -> None:
        for group in trainer.optimizer.param_groups:
            group["eps"] = 1e-7  # the reference's is optim.eps=1e-8

    report = run_parity(compose_config(TINY, run_dir=tmp_path), 1, prepare_target=wrong_epsilon)
    (step,) = report.steps
    assert all(d.rel == 0 for d in step.activations + step.gradients) and step.loss_rel == 0
    first = report.first_divergence
    assert first is not None and (first.step, first.kind) == (1, "update"), report.format()
    assert first.rel > 1000 * first.tolerance
    verdict = report.format().splitlines()[-1]
    assert verdict.startswith("FAIL: first divergence at step 1: update of 'embed_tokens.weight' differs by")
