"""Kernel registry: opt-in names, backend errors, swapping model slots, custom ops under torch.compile.

Backend-free: the custom-op tests register a pure-PyTorch stand-in kernel through the same
``portatrain.kernels.custom_ops.define`` the Pallas interpret bridge uses, so they run everywhere.
The Pallas parity tests are in ``test_kernels_pallas.py``, the NKI ones in ``test_kernels_nki.py``; that
every model family routes its norms, feed-forwards and rotations through the slots is checked in
``test_conformance.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from portatrain.kernels import (
    OPERATIONS,
    OVERRIDES,
    KernelConfigError,
    KernelSet,
    apply,
    config_problems,
    custom_ops,
    reference,
    resolve,
)
from portatrain.kernels.cli import list_kernels, main
from portatrain.kernels.parity import CASES, rope_tables, run_case
from tests.helpers import launch_env, python


def test_every_operation_has_an_override_per_backend_and_parity_cases() -> None:
    assert set(OPERATIONS) == {"rmsnorm", "swiglu", "rope"}
    for op in OPERATIONS:
        backends = {ov.backend for ov in OVERRIDES.values() if ov.operation == op}
        assert backends == {"tpu", "cpu", "neuron"}, op
        dtypes = {case.dtype for case in CASES[op]}
        assert dtypes == {torch.float32, torch.bfloat16}, op
    assert OVERRIDES["pallas_rmsnorm"].backend == "tpu"
    assert OVERRIDES["nki_rope"].backend == "neuron"
    assert OVERRIDES["pallas_interpret_swiglu"].backend == "cpu"


def test_no_kernels_enabled_is_no_problem_and_an_empty_set() -> None:
    assert config_problems([], "cpu") == []
    kernel_set = resolve([], "cpu")
    assert not kernel_set
    model = _StandIn()
    assert apply(model, kernel_set) == {}
    assert model.norm.rmsnorm_fn is reference.rmsnorm


def test_unknown_name_lists_what_exists() -> None:
    (problem,) = config_problems(["rmsnrom"], "tpu")
    assert "unknown kernel 'rmsnrom'" in problem
    for name in ("pallas_rmsnorm", "pallas_interpret_rope", "nki_swiglu"):
        assert name in problem


def test_override_for_another_backend_is_an_error_naming_the_right_ones() -> None:
    (problem,) = config_problems(["pallas_rmsnorm"], "cpu")
    assert "pallas_rmsnorm runs on device.type=tpu" in problem
    assert "device.type=cpu" in problem
    assert "pallas_interpret_rmsnorm" in problem and "nki_rmsnorm" not in problem.split("choose one")[1]
    (problem,) = config_problems(["nki_swiglu"], "tpu")
    assert "nki_swiglu runs on device.type=neuron" in problem and "pallas_swiglu" in problem


def test_every_problem_at_once_and_duplicates() -> None:
    problems = config_problems(["bogus", "pallas_rope", "pallas_rope", "nki_rmsnorm"], "tpu")
    joined = "\n".join(problems)
    assert "unknown kernel 'bogus'" in joined
    assert "both override rope" in joined
    assert "nki_rmsnorm runs on device.type=neuron" in joined


def test_auto_device_checks_names_only() -> None:
    assert config_problems(["bogus"], "auto")[0].startswith("kernels.enabled: unknown kernel")
    assert all("device.type" not in p for p in config_problems(["pallas_rope"], "auto"))
    with pytest.raises(KernelConfigError, match="not 'auto'"):
        resolve(["pallas_rope"], "auto")


def test_missing_package_is_a_problem_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import portatrain.kernels.registry as registry

    real = registry.importlib.util.find_spec
    monkeypatch.setattr(
        registry.importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a)
    )
    (problem,) = config_problems(["pallas_interpret_swiglu"], "cpu")
    assert "needs jax" in problem and "portatrain[pallas]" in problem


def test_kernels_with_tensor_parallel_are_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    from portatrain.validate import config_problems as all_problems
    from tests.conftest import compose_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_config(["device=cpu", "kernels.enabled=[pallas_interpret_rmsnorm]", "parallel.tp=2"])
    assert any("kernel overrides take plain tensors" in p and "parallel.tp=2" in p for p in all_problems(cfg))


def test_resolve_raises_once_with_every_problem() -> None:
    with pytest.raises(KernelConfigError) as err:
        resolve(["bogus", "pallas_swiglu"], "cpu")
    assert "bogus" in str(err.value) and "pallas_swiglu runs on device.type=tpu" in str(err.value)
    from portatrain.errors import UserError

    assert isinstance(err.value, UserError)


# --- apply(): the model contract, on a stand-in with the three slots ---


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.rmsnorm_fn = reference.rmsnorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rmsnorm_fn(x, self.weight, 1e-5)


class _StandIn(nn.Module):
    """The three slots as the model files hold them (RMSNorm, FeedForward, Attention)."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = _Norm(dim)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.swiglu_fn = reference.swiglu
        self.rope_fn = reference.rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm(x)
        q = h.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        q = self.rope_fn(q, cos, sin).transpose(1, 2).reshape(b, s, d)
        return x + self.down(self.swiglu_fn(self.gate(q), self.up(q)))


def _counting(fn):
    calls = []

    def wrapper(*args):
        calls.append(1)
        return fn(*args)

    return wrapper, calls


def test_apply_swaps_every_slot_per_instance() -> None:
    model, other = _StandIn(), _StandIn()
    rms, rms_calls = _counting(reference.rmsnorm)
    swi, swi_calls = _counting(reference.swiglu)
    counts = apply(model, KernelSet({"rmsnorm": rms, "swiglu": swi}, ("a", "b")))
    assert counts == {"rmsnorm": 1, "swiglu": 1}
    x = torch.randn(2, 4, 32)
    cos, sin = torch.ones(4, 16), torch.zeros(4, 16)
    model(x, cos, sin)
    assert len(rms_calls) == 1 and len(swi_calls) == 1
    assert other.norm.rmsnorm_fn is reference.rmsnorm  # another instance is untouched
    assert model.rope_fn is reference.rope


def test_apply_refuses_a_model_without_the_slot() -> None:
    with pytest.raises(KernelConfigError, match="has no module slot for rope"):
        apply(nn.Sequential(nn.Linear(2, 2)), KernelSet({"rope": reference.rope}, ("pallas_rope",)))


# --- custom ops: a torch stand-in kernel through the shared registration ---


def _standin_ops() -> dict[str, object]:
    """Register stand-in "kernels" (the reference math, written out) as custom ops with autograd."""

    # Outputs contiguous, as the custom-op contract (and its fakes) require.
    def rms_fwd(x, w, eps):
        return reference.rmsnorm(x, w, eps).contiguous()

    def rms_bwd(x, w, g, eps):
        # Closed form in fp32 (autograd does not record inside a custom op's implementation).
        xf, wf, gf = x.float(), w.float(), g.float()
        inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        normed, gw = xf * inv_rms, gf * wf
        dx = inv_rms * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        return dx.to(x.dtype).contiguous(), (gf * normed).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)

    def swi_fwd(a, b):
        return reference.swiglu(a, b).contiguous()

    def swi_bwd(a, b, g):
        sig = torch.sigmoid(a)
        return (g * b * sig * (1 + a * (1 - sig))).contiguous(), (g * a * sig).contiguous()

    def rope_fwd(x, cos, sin):
        return reference.rope(x, cos, sin).contiguous()

    def rope_bwd(g, cos, sin):
        return reference.rope(g, cos, -sin).contiguous()

    return {
        "rmsnorm": custom_ops.define("portatrain_test::standin_rmsnorm", "rmsnorm", rms_fwd, rms_bwd),
        "swiglu": custom_ops.define("portatrain_test::standin_swiglu", "swiglu", swi_fwd, swi_bwd),
        "rope": custom_ops.define("portatrain_test::standin_rope", "rope", rope_fwd, rope_bwd),
    }


@pytest.mark.parametrize("operation", ["rmsnorm", "swiglu", "rope"])
def test_custom_op_registration_passes_opcheck_and_parity(operation: str) -> None:
    op = _standin_ops()[operation]
    for case in CASES[operation]:
        result = run_case(f"pallas_interpret_{operation}", op, case)
        assert result.ok, result
        args, needs_grad = case.make(torch.Generator().manual_seed(0), case.dtype)
        args = [a.requires_grad_(g) if isinstance(a, torch.Tensor) else a for a, g in zip(args, needs_grad)]
        # Schema, fake, autograd registration and their consistency with the real implementation.
        torch.library.opcheck(op, tuple(args))


def test_compiled_model_keeps_the_custom_ops_without_graph_breaks() -> None:
    ops = _standin_ops()
    model = _StandIn()
    reference_model = _StandIn()
    reference_model.load_state_dict(model.state_dict())
    apply(model, KernelSet(ops, ("standin",)))
    x = torch.randn(2, 4, 32)
    cos, sin = rope_tables(torch.arange(4), head_dim=16)  # each angle in both halves, as models build them

    # The compiled graph must contain each custom op and nothing must fall out of it.
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    explain = torch._dynamo.explain(model)(x, cos, sin)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out = compiled(x, cos, sin)
    for name in ("standin_rmsnorm", "standin_swiglu", "standin_rope"):
        assert any(name in target for target in seen), (name, seen)

    # Forward and backward through aot_eager match the reference model.
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x, cos, sin)
    ref = reference_model(x, cos, sin)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_kernels_list_names_every_override_and_whether_it_runs_here() -> None:
    text = list_kernels()
    for ov in OVERRIDES.values():
        assert ov.name in text
    assert "reference: portatrain.kernels.reference.rmsnorm" in text
    assert "needs a TPU and torch_tpu" in text
    assert main(["list"]) == 0


def test_importing_kernels_loads_no_jax_or_vendor_stack() -> None:
    code = (
        "import sys, portatrain, portatrain.kernels, portatrain.kernels.cli\n"
        "from portatrain.kernels import resolve, config_problems\n"
        "resolve([], 'cpu'); config_problems(['pallas_rmsnorm', 'nki_rope'], 'cpu')\n"
        "print('LOADED', [m for m in ('jax', 'torch_tpu', 'torch_neuronx', 'nki', 'torch_xla') if m in sys.modules])\n"
    )
    # A new interpreter, not a fork of the fork server: what importing portatrain loads is the point.
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout


def test_portatrain_kernels_subcommand_lists_overrides() -> None:
    out = subprocess.run(
        python("-m", "portatrain", "kernels", "list"),
        env=launch_env(),
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pallas_interpret_rope" in out.stdout and "nki_swiglu" in out.stdout
