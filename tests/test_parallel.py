"""Parallel layout validation, the dry-run plan of a tp x dp layout, and single-process pieces of
the parallel stack (activation checkpointing, gradient clipping). Multi-process runs are in
``test_distributed.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portatrain.errors import ConfigError
from portatrain.models import build_model
from portatrain.parallel import ParallelDims, clip_grad_norm_
from portatrain.parallel.activation_checkpoint import apply_activation_checkpointing
from portatrain.parallel.parallel_dims import expected_world_size, layout_problems
from portatrain.plan import describe_plan
from portatrain.validate import validate
from tests.conftest import TINY, compose_config, run_cli


def test_dp_shard_is_inferred_from_the_world_size() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 4, 2, 8)
    assert dims.describe() == "dp_replicate=2 x dp_shard=4 x tp=2 = 16 devices"
    assert dims.fsdp_enabled and dims.tp_enabled and dims.dp_replicate_enabled


def test_layout_mismatch_names_the_numbers_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelDims(dp_replicate=1, dp_shard=3, tp=2, world_size=4)
    assert "dp_replicate(1) * dp_shard(3) * tp(2) = 6 != world size 4" in str(err.value)
    assert "set parallel.dp_shard=2" in str(err.value)
    assert "launch 6 processes" in str(err.value)


def test_every_layout_problem_is_reported_at_once() -> None:
    problems = layout_problems(dp_replicate=0, dp_shard=0, tp=-1, world_size=4)
    assert len(problems) == 3
    assert any("parallel.dp_replicate=0 must be >= 1" in p for p in problems)
    assert any("parallel.tp=-1 must be >= 1" in p for p in problems)
    assert any("parallel.dp_shard=0" in p and "-1 to infer" in p for p in problems)
    (indivisible,) = layout_problems(dp_replicate=1, dp_shard=-1, tp=3, world_size=4)
    assert "tp(3) = 3 does not divide world size 4" in indivisible
    assert "launch a multiple of 3 processes" in indivisible


def test_validate_lists_layout_model_and_data_problems_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = compose_config(
        [*TINY, "parallel.dp_shard=3", "parallel.tp=3", "data.seq_len=100", "parallel.reduce_dtype=fp8"]
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert "parallel.reduce_dtype='fp8' is not one of float32, bfloat16" in message
    cfg.parallel.reduce_dtype = "float32"
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert "dp_replicate(1) * dp_shard(3) * tp(3) = 9 != world size 4; launch 9 processes" in message
    assert "parallel.tp=3 must divide n_heads(4) and n_kv_heads(2)" in message and "[1, 2]" in message
    assert "data.seq_len has row length(s) [100] not divisible by parallel.tp=3" in message


def test_cli_prints_the_layout_error_without_a_traceback(tmp_path: Path) -> None:
    out = run_cli([*TINY, "parallel.dp_shard=3", "parallel.tp=2"], cwd=tmp_path, env={"WORLD_SIZE": "4"})
    assert out.returncode == 2
    assert "dp_replicate(1) * dp_shard(3) * tp(2) = 6 != world size 4; set parallel.dp_shard=2" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_world_size_outside_torchrun_comes_from_the_job_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = compose_config(["parallel.launch.nodes=4", "parallel.launch.procs_per_node=8"])
    assert expected_world_size(cfg.parallel, cfg.launch) == 32
    cfg = compose_config(["dry_run=true", "parallel.dp_shard=8", "parallel.tp=8"])
    assert expected_world_size(cfg.parallel, cfg.launch, dry_run=True) == 64  # a plan, not a launch
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert expected_world_size(cfg.parallel, cfg.launch, dry_run=True) == 2


def test_dry_run_of_llama70b_plans_a_tp_x_dp_layout_without_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plan = describe_plan(
        compose_config(
            ["recipe=llama70b", "device=cuda", "dry_run=true", "parallel.dp_shard=8", "parallel.tp=8"]
        )
    )
    assert "70,553,706,496" in plan
    assert "dp_replicate=1 x dp_shard=8 x tp=8 = 64 devices" in plan
    total = float(next(line for line in plan.splitlines() if line.startswith("total")).split()[1])
    small = describe_plan(
        compose_config(["recipe=llama70b", "device=cuda", "dry_run=true", "parallel.dp_shard=8"])
    )
    total_dp_only = float(next(line for line in small.splitlines() if line.startswith("total")).split()[1])
    assert 0 < total < total_dp_only / 4  # tp=8 divides parameters, optimizer state and activations


def test_dry_run_cli_of_llama70b(tmp_path: Path) -> None:
    out = run_cli(
        ["recipe=llama70b", "device=cpu", "dry_run=true", "parallel.dp_shard=8", "parallel.tp=8"],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "= 64 devices" in out.stdout and "estimated memory per device" in out.stdout


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_gradients_and_names(mode: str) -> None:
    cfg = compose_config(TINY)
    torch.manual_seed(0)
    tokens = torch.randint(0, 258, (2, 32))

    def grads(ac: str) -> dict[str, torch.Tensor]:
        model = build_model(cfg.model)
        torch.manual_seed(1)
        model.init_weights()
        apply_activation_checkpointing(model.layers, ac)
        model(tokens).float().logsumexp(-1).sum().backward()
        return {k: p.grad for k, p in model.named_parameters()}, model.state_dict().keys()

    ref, ref_keys = grads("none")
    got, keys = grads(mode)
    assert list(keys) == list(ref_keys)  # checkpoint keys are unchanged by the wrapper
    for (name, g), r in zip(got.items(), ref.values()):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)


def test_clip_grad_norm_matches_torch_on_plain_tensors() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
