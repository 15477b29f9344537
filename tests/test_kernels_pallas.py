"""Pallas kernels against the PyTorch references: interpret mode on CPU; the TorchTPU bridge on a TPU.

* Parity through the registered custom ops (``pallas_interpret_*``): the cases and tolerances of
  ``portatrain.kernels.parity`` -- what ``portatrain kernels check`` runs.
* The kernels alone, with a small ``block_rows`` so every grid has several blocks and a ragged last
  one, under both interpreters: ``interpret=True`` and the TPU interpreter
  (``pltpu.InterpretParams``: TPU memory semantics, uninitialized memory filled with NaN, so a
  kernel that reads past the array into a reduction shows up).
* ``torch.compile(fullgraph=True)`` keeps each kernel as one custom op.
* The TorchTPU bridge (``pallas_*``) needs a TPU and torch_tpu: skipped elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'portatrain[pallas]')")

import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from portatrain.kernels import OVERRIDES, apply, reference, resolve  # noqa: E402
from portatrain.kernels.pallas import kernels as K  # noqa: E402
from portatrain.kernels.parity import TOLERANCES, rope_tables, run_check  # noqa: E402


@pytest.mark.parametrize("operation", ["rmsnorm", "swiglu", "rope"])
def test_interpret_override_matches_reference_forward_and_backward(operation: str) -> None:
    results = run_check(OVERRIDES[f"pallas_interpret_{operation}"])
    assert {r.dtype for r in results} == {torch.float32, torch.bfloat16}
    for r in results:
        assert r.ok, r


def _j(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.numpy())


def _t(a: jax.Array) -> torch.Tensor:
    return torch.from_numpy(np.array(a))  # a writable copy


INTERPRETERS = [pytest.param(True, id="interpret"), pytest.param(pltpu.InterpretParams(), id="tpu_interpret")]


@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_rmsnorm_kernel_over_several_blocks_and_a_ragged_one(interpret: object) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 21, 128, generator=gen) * 2  # 63 rows in blocks of 8: the last holds 7
    w = 1 + 0.1 * torch.randn(128, generator=gen)
    g = torch.randn(x.shape, generator=gen)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    reference.rmsnorm(xr, wr, 1e-5).backward(g)
    out = K.rmsnorm_fwd(_j(x), _j(w), 1e-5, interpret=interpret, block_rows=8)
    dx, dw = K.rmsnorm_bwd(_j(x), _j(w), _j(g), 1e-5, interpret=interpret, block_rows=8)
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(_t(out), reference.rmsnorm(x, w, 1e-5), atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(_t(dx), xr.grad, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(_t(dw), wr.grad, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_swiglu_kernel_over_row_and_column_blocks(interpret: object) -> None:
    gen = torch.Generator().manual_seed(2)
    # 2304 columns: one 2048-lane block and a ragged 256-lane one; 13 rows in blocks of 8.
    a, b, g = (torch.randn(13, 2304, generator=gen) for _ in range(3))
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    reference.swiglu(ar, br).backward(g)
    out = K.swiglu_fwd(_j(a), _j(b), interpret=interpret, block_rows=8)
    da, db = K.swiglu_bwd(_j(a), _j(b), _j(g), interpret=interpret, block_rows=8)
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(_t(out), reference.swiglu(a, b), atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(_t(da), ar.grad, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(_t(db), br.grad, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("interpret", INTERPRETERS)
@pytest.mark.parametrize("per_row", [False, True], ids=["tables_SD", "tables_B1SD"])
def test_rope_kernel_over_sequence_blocks(interpret: object, per_row: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 20, 16, generator=gen)  # 20 positions in blocks of 8: the last holds 4
    positions = torch.randint(0, 64, (2, 20), generator=gen) if per_row else torch.arange(20)
    cos, sin = rope_tables(positions, 16)
    if per_row:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    g = torch.randn(x.shape, generator=gen)
    xr = x.clone().requires_grad_()
    reference.rope(xr, cos, sin).backward(g)
    out = K.rope_fwd(_j(x), _j(cos), _j(sin), interpret=interpret, block_rows=8)
    dx = K.rope_bwd(_j(g), _j(cos), _j(sin), interpret=interpret, block_rows=8)
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(_t(out), reference.rope(x, cos, sin), atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(_t(dx), xr.grad, atol=tol.atol, rtol=tol.rtol)


def test_block_rows_must_fit_tpu_sublanes() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        K.rmsnorm_fwd(jnp.ones((16, 128)), jnp.ones((128,)), 1e-5, interpret=True, block_rows=12)


def test_interpret_ops_compile_to_one_graph_without_breaks() -> None:
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))
            self.gate = nn.Linear(32, 64, bias=False)
            self.up = nn.Linear(32, 64, bias=False)
            self.rmsnorm_fn, self.swiglu_fn, self.rope_fn = (
                reference.rmsnorm,
                reference.swiglu,
                reference.rope,
            )

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            h = self.rmsnorm_fn(x, self.weight, 1e-5)
            h = self.rope_fn(h.view(2, 4, 2, 16).transpose(1, 2), cos, sin).transpose(1, 2).reshape(2, 4, 32)
            return self.swiglu_fn(self.gate(h), self.up(h)).sum()

    block = Block()
    apply(
        block,
        resolve(["pallas_interpret_rmsnorm", "pallas_interpret_swiglu", "pallas_interpret_rope"], "cpu"),
    )
    x = torch.randn(2, 4, 32, requires_grad=True)
    cos, sin = rope_tables(torch.arange(4), 16)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x, cos, sin)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    targets = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    for op in ("pallas_interpret_rmsnorm", "pallas_interpret_swiglu", "pallas_interpret_rope"):
        assert any(op in t for t in targets), (op, targets)
    eager = block(x, cos, sin)
    (eager_grad,) = torch.autograd.grad(eager, x)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, cos, sin)
    (compiled_grad,) = torch.autograd.grad(compiled, x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_grad, eager_grad)


@pytest.mark.skipif(getattr(torch, "tpu", None) is None, reason="needs a TPU and torch_tpu")
@pytest.mark.parametrize("operation", ["rmsnorm", "swiglu", "rope"])
def test_tpu_bridge_matches_reference(operation: str) -> None:  # pragma: no cover - TPU hosts only
    for r in run_check(OVERRIDES[f"pallas_{operation}"]):
        assert r.ok, r


def test_kernels_check_prints_error_against_tolerance_and_exit_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import portatrain.kernels.cli as cli

    subset = {name: OVERRIDES[name] for name in ("pallas_rope", "pallas_interpret_swiglu")}
    monkeypatch.setattr(cli, "OVERRIDES", subset)
    assert cli.check_kernels() == 0
    out = capsys.readouterr().out
    assert "SKIP pallas_rope: TorchTPU bridge on a TPU -- needs a TPU and torch_tpu" in out
    assert out.count("ok   pallas_interpret_swiglu") == 3
    assert "max err" in out and "tol atol=1e-05 rtol=0.0001" in out
    # A kernel that disagrees with its reference fails the check with a non-zero status.
    monkeypatch.setattr(cli, "run_check", lambda ov: [_failed_result(ov.name)])
    assert cli.check_kernels() == 1
    assert "FAIL pallas_interpret_swiglu" in capsys.readouterr().out


def _failed_result(name: str):
    from portatrain.kernels.parity import CaseResult, Comparison

    return CaseResult(
        name, "case", torch.float32, TOLERANCES[torch.float32], (Comparison("output", 1.0, 5.0),)
    )


# --- the debug recipe, trained with the Pallas kernels (interpret bridge) vs the references ---

PROOF_RUN = [
    "recipe=debug",
    "device=cpu",
    "trainer.steps=6",
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "checkpoint.enabled=false",
    # Every transformer block compiled; aot_eager traces forward and backward like inductor would,
    # without generating code (2 CPU cores).
    "compile.enabled=true",
    "compile.backend=aot_eager",
    "compile.dynamic=false",
]
ALL_INTERPRET = "kernels.enabled=[pallas_interpret_rmsnorm,pallas_interpret_swiglu,pallas_interpret_rope]"
LOSS_RTOL = 1e-4
"""Stated tolerance for the loss curves: the kernels differ from the references by ~1e-6 per op in
fp32 (see the parity tests); six AdamW steps keep that far below 1e-4 relative."""


def _train(
    overrides: list[str], run_dir
) -> tuple[list[float], dict[str, torch.Tensor], tuple[int, int], int]:
    import json

    from torch._dynamo.utils import counters

    from portatrain.trainer import Trainer
    from tests.conftest import compose_config

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(compose_config(PROOF_RUN + overrides, run_dir=run_dir))
    try:
        trainer.fit()
        params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        n_layers = len(trainer.model.layers)
    finally:
        trainer.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    graphs = (int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values()))
    torch._dynamo.reset()
    return [r["loss"] for r in records if "loss" in r], params, graphs, n_layers


@pytest.mark.slow
def test_debug_recipe_with_pallas_kernels_matches_reference_losses(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: dict[str, int] = {}
    for name in ("rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd", "rope_fwd", "rope_bwd"):
        fn = getattr(K, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(K, name, counted)

    ref_losses, ref_params, ref_graphs, n_layers = _train([], tmp_path / "reference")
    assert not calls  # the reference run never touches a kernel
    losses, params, graphs, _ = _train([ALL_INTERPRET], tmp_path / "pallas")

    # Every kernel ran, forward and backward, in every step: 2 norms per block + the final norm,
    # q and k rotations per block, one SwiGLU per block.
    steps = len(losses)
    assert steps == 6
    expected = {
        "rmsnorm": (2 * n_layers + 1) * steps,
        "rope": 2 * n_layers * steps,
        "swiglu": n_layers * steps,
    }
    for op, n in expected.items():
        assert calls[f"{op}_fwd"] == n and calls[f"{op}_bwd"] == n, calls
    # (graphs, graph breaks): the blocks share one code object, hence one graph; a break at a
    # kernel would split it. Same count as the reference run and no break: each kernel stayed one
    # custom op inside the compiled block.
    assert graphs == ref_graphs == (1, 0), (graphs, ref_graphs)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0.0)
    # The weights moved the same way (the kernels are not bit-identical to the references, but close).
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(getattr(torch, "tpu", None) is not None, reason="torch.tpu is loaded: the bridge exists")
def test_tpu_bridge_without_torch_tpu_says_what_is_missing() -> None:
    from portatrain.kernels.pallas.bridge import build

    with pytest.raises(RuntimeError, match=r"torch\.tpu\.pallas bridge \(torch_tpu on a TPU host\)"):
        build("rmsnorm", "tpu")
