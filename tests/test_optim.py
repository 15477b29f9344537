"""The optimizer stage: AdamW parameter groups, the warm-up + decay schedule, and config problems."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from portatrain.config import OptimConfig
from portatrain.errors import ConfigError
from portatrain.optim import build_lr_scheduler, build_optimizer, lr_lambda, optim_problems
from portatrain.optim.resume import changed_hyperparameters, resume_param_groups


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


def test_adamw_decays_matrices_only_and_takes_the_config() -> None:
    model = _model()
    cfg = OptimConfig(lr=0.5, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.1, fused=None)
    opt = build_optimizer(model, cfg, fused=False)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient signal: only decoupled weight decay moves weights
    opt.step()
    weight, bias, ln_weight, ln_bias = before
    after = list(model.parameters())
    assert torch.allclose(after[0], weight * (1 - 0.5 * 0.1))  # the matrix: p -= lr * wd * p
    for old, new in zip([bias, ln_weight, ln_bias], after[1:]):
        assert torch.equal(old, new)  # biases and norm gains: no decay


def test_fused_follows_the_adapter_unless_the_config_says() -> None:
    assert build_optimizer(_model(), OptimConfig(fused=None), fused=False).defaults["fused"] is False
    assert build_optimizer(_model(), OptimConfig(fused=False), fused=True).defaults["fused"] is False


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays_to_the_floor(decay: str) -> None:
    kw = {"warmup_steps": 4, "total_steps": 14, "decay": decay, "min_lr_ratio": 0.1}
    ramp = [lr_lambda(s, **kw) for s in range(5)]
    assert ramp == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # step 0 already learns; peak at warm-up
    end = lr_lambda(14, **kw)
    middle = lr_lambda(9, **kw)  # half-way through the decay
    if decay == "constant":
        assert end == middle == 1.0
    elif decay == "linear":
        assert middle == pytest.approx(0.1 + 0.9 * 0.5) and end == pytest.approx(0.1)
    else:
        assert middle == pytest.approx(
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))
        ) and end == pytest.approx(0.1)
    assert lr_lambda(100, **kw) == pytest.approx(end)  # held at the floor past the end


def test_scheduler_drives_the_optimizer_lr() -> None:
    cfg = OptimConfig(lr=1e-2, warmup_steps=2, decay="linear", min_lr_ratio=0.0)
    opt = build_optimizer(_model(), cfg)
    sched = build_lr_scheduler(opt, cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [
        1e-2 * lr_lambda(s, warmup_steps=2, total_steps=6, decay="linear", min_lr_ratio=0.0) for s in range(6)
    ]
    assert seen == pytest.approx(expected)


def test_every_problem_at_once() -> None:
    problems = optim_problems(OptimConfig(name="sgd", decay="step", lr=0.0, betas=[0.9], min_lr_ratio=2.0))
    text = "\n".join(problems)
    assert len(problems) == 5
    for expected in (
        "optim.name='sgd'",
        "optim.decay='step'",
        "optim.lr=0.0",
        "optim.betas=[0.9]",
        "min_lr_ratio=2.0",
    ):
        assert expected in text
    with pytest.raises(ConfigError, match="optim.name='sgd'"):
        build_optimizer(_model(), OptimConfig(name="sgd"))


def test_resume_takes_the_configs_hyperparameters_and_logs_each_change(caplog) -> None:
    """The optimizer stage's resume policy (the checkpointer is handed it): the current groups win; a
    checkpoint's JSON list equals the optimizer's tuple, and each real change is one logged item."""
    saved = [{"initial_lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": [0]}]
    current = [{"initial_lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05, "params": [0]}]
    changes = ["optim.lr 0.003 -> 0.001", "optim.weight_decay 0.1 -> 0.05"]
    assert changed_hyperparameters(saved, current) == changes
    with caplog.at_level("WARNING"):
        groups = resume_param_groups(saved, current, Path("step_3"))
    assert groups == current and groups[0] is not current[0]
    assert (
        f"resuming step_3 with changed optimizer settings, applied from the config: {changes[0]}"
        in caplog.text
    )
    assert changed_hyperparameters(saved, saved) == []
