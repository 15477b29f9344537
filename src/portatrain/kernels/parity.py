"""Parity of every override with its reference: cases, tolerances, and where each check can run.

A check builds the override's differentiable callable through its parity bridge, runs each case
forward and backward through it and through the PyTorch reference (same inputs, same output
gradient), and compares the output and every input gradient with
``|kernel - reference| <= atol + rtol * |reference|`` (``torch.testing.assert_close``'s rule).

Where each override's check runs (:data:`CHECKS`):

* ``pallas_*`` -- TorchTPU's bridge on a TPU (``torch.tpu`` loaded): the deployed path.
* ``pallas_interpret_*`` -- the same Pallas kernels in JAX's CPU interpreter: runs wherever jax is
  installed, so the Pallas kernel code is checked on every CI machine.
* ``nki_*`` -- the NKI kernels in ``nki.simulate`` (CPU, NumPy) through the same custom-op
  registration; needs the real ``nki`` package (AWS's Neuron pip repository; PyPI's ``nki`` is
  an empty placeholder).

Tolerances (:data:`TOLERANCES`): kernels compute in fp32 and round once, the reference rounds after
each op in the input dtype, so bf16 cases allow a couple of bf16 ulps (2^-8 relative each).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from portatrain.kernels.registry import OPERATIONS, OVERRIDES, Override


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-4),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}
"""Allowed deviation from the reference, per input dtype (outputs and gradients alike)."""


@dataclass(frozen=True)
class Case:
    """One input configuration of an operation."""

    label: str
    dtype: torch.dtype
    make: Callable[[torch.Generator, torch.dtype], tuple[list[object], list[bool]]]
    """``(generator, dtype) -> (arguments, which arguments get a gradient)``."""


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _rmsnorm_case(*shape: int) -> Callable[[torch.Generator, torch.dtype], tuple[list[object], list[bool]]]:
    def make(gen: torch.Generator, dtype: torch.dtype) -> tuple[list[object], list[bool]]:
        x = _randn(gen, *shape, dtype=dtype) * 3
        weight = 1 + 0.1 * _randn(gen, shape[-1], dtype=dtype)
        return [x, weight, 1e-5], [True, True, False]

    return make


def _swiglu_case(*shape: int) -> Callable[[torch.Generator, torch.dtype], tuple[list[object], list[bool]]]:
    def make(gen: torch.Generator, dtype: torch.dtype) -> tuple[list[object], list[bool]]:
        return [_randn(gen, *shape, dtype=dtype) * 2, _randn(gen, *shape, dtype=dtype)], [True, True]

    return make


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables for integer ``positions`` (any shape), each angle repeated in both halves
    like the models' tables."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rope_case(
    batch: int, heads: int, seq: int, head_dim: int, per_row: bool
) -> Callable[[torch.Generator, torch.dtype], tuple[list[object], list[bool]]]:
    def make(gen: torch.Generator, dtype: torch.dtype) -> tuple[list[object], list[bool]]:
        x = _randn(gen, batch, heads, seq, head_dim, dtype=dtype)
        if per_row:  # packed rows: positions restart at each document, tables [B, 1, S, D]
            positions = torch.randint(0, 4 * seq, (batch, seq), generator=gen)
            cos, sin = rope_tables(positions, head_dim)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        else:  # [S, D], shared by every row
            cos, sin = rope_tables(torch.arange(seq), head_dim)
        return [x, cos, sin], [True, False, False]

    return make


CASES: dict[str, tuple[Case, ...]] = {
    "rmsnorm": (
        Case("x[2,16,64]", torch.float32, _rmsnorm_case(2, 16, 64)),
        Case("x[3,5,128] (15 rows)", torch.float32, _rmsnorm_case(3, 5, 128)),
        Case("x[4,8,128]", torch.bfloat16, _rmsnorm_case(4, 8, 128)),
    ),
    "swiglu": (
        Case("[2,16,384]", torch.float32, _swiglu_case(2, 16, 384)),
        Case("[7,300]", torch.float32, _swiglu_case(7, 300)),
        Case("[4,256]", torch.bfloat16, _swiglu_case(4, 256)),
    ),
    "rope": (
        Case("x[2,4,16,32], tables[S,D]", torch.float32, _rope_case(2, 4, 16, 32, per_row=False)),
        Case("x[2,2,12,16], tables[B,1,S,D]", torch.float32, _rope_case(2, 2, 12, 16, per_row=True)),
        Case("x[1,2,8,64], tables[S,D]", torch.bfloat16, _rope_case(1, 2, 8, 64, per_row=False)),
    ),
}
"""Parity cases per operation: several shapes (odd row counts, both RoPE table layouts), fp32 and
a small bf16 case."""


@dataclass(frozen=True)
class ParityCheck:
    """How an override's kernel is compared with its reference."""

    how: str
    """Where the check runs, for ``kernels list``."""
    device: str
    """Device the case tensors are moved to."""
    builder: str
    """``module:function`` returning the differentiable callable for an operation name."""
    dtypes: tuple[torch.dtype, ...]
    """Case dtypes this check runs (the NKI simulator gets NumPy arrays: no bf16)."""
    unavailable: Callable[[], str | None]
    """None when the check can run in this process, else the reason it cannot."""


def _missing_modules(*modules: str) -> str | None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed" if missing else None


def _tpu_unavailable() -> str | None:
    # torch_tpu loads itself with torch on a TPU host; never import it here (it hangs elsewhere).
    if getattr(torch, "tpu", None) is None:
        return "needs a TPU and torch_tpu"
    return _missing_modules("jax")


def _interpret_unavailable() -> str | None:
    reason = _missing_modules("jax")
    return f"{reason} (pip install 'portatrain[pallas]')" if reason else None


def _simulator_unavailable() -> str | None:
    if importlib.util.find_spec("nki") is None:
        return "needs nki (AWS's Neuron pip repository, not PyPI) for nki.simulate"
    if not hasattr(importlib.import_module("nki"), "simulate"):
        return "the installed nki has no simulate (PyPI's nki is a placeholder; install AWS's)"
    return None


CHECKS: dict[str, ParityCheck] = {
    "pallas": ParityCheck(
        "TorchTPU bridge on a TPU",
        "tpu",
        "portatrain.kernels.pallas:build_tpu",
        (torch.float32, torch.bfloat16),
        _tpu_unavailable,
    ),
    "pallas_interpret": ParityCheck(
        "Pallas interpret mode on CPU",
        "cpu",
        "portatrain.kernels.pallas:build_interpret",
        (torch.float32, torch.bfloat16),
        _interpret_unavailable,
    ),
    "nki": ParityCheck(
        "nki.simulate on CPU",
        "cpu",
        "portatrain.kernels.nki:build_simulate",
        (torch.float32,),
        _simulator_unavailable,
    ),
}
"""Parity check per implementation (``Override.implementation``)."""


@dataclass(frozen=True)
class Comparison:
    """One tensor of one case: the output or an input gradient."""

    tensor: str
    max_abs_err: float
    worst: float
    """Largest ``|err| / (atol + rtol * |ref|)``: at most 1 passes."""


@dataclass(frozen=True)
class CaseResult:
    override: str
    case: str
    dtype: torch.dtype
    tolerance: Tolerance
    comparisons: tuple[Comparison, ...]

    @property
    def ok(self) -> bool:
        return all(c.worst <= 1.0 for c in self.comparisons)

    @property
    def max_abs_err(self) -> float:
        return max(c.max_abs_err for c in self.comparisons)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> Comparison:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        return Comparison(f"{name} (shape {tuple(got.shape)} != {tuple(want.shape)})", math.inf, math.inf)
    err = (got - want).abs()
    worst = (err / (tol.atol + tol.rtol * want.abs())).max().item() if err.numel() else 0.0
    return Comparison(name, err.max().item() if err.numel() else 0.0, worst)


def run_case(
    override: str, kernel: Callable[..., torch.Tensor], case: Case, device: str = "cpu", seed: int = 0
) -> CaseResult:
    """Run ``case`` through ``kernel`` and the reference, forward and backward, and compare."""
    operation = OVERRIDES[override].operation
    gen = torch.Generator().manual_seed(seed)
    args, needs_grad = case.make(gen, case.dtype)

    def prepare() -> list[object]:
        out: list[object] = []
        for arg, grad in zip(args, needs_grad):
            if isinstance(arg, torch.Tensor):
                arg = arg.detach().clone().to(device).requires_grad_(grad)
            out.append(arg)
        return out

    ref_args, ker_args = prepare(), prepare()
    ref_out = OPERATIONS[operation].reference(*ref_args)
    grad_out = torch.randn(ref_out.shape, generator=gen).to(ref_out.dtype).to(device)
    ref_out.backward(grad_out)
    ker_out = kernel(*ker_args)
    ker_out.backward(grad_out)

    tol = TOLERANCES[case.dtype]
    comparisons = [_compare("output", ker_out, ref_out, tol)]
    for i, (ref_arg, ker_arg, grad) in enumerate(zip(ref_args, ker_args, needs_grad)):
        if grad:
            assert isinstance(ref_arg, torch.Tensor) and isinstance(ker_arg, torch.Tensor)
            if ker_arg.grad is None:
                comparisons.append(Comparison(f"grad of argument {i} (missing)", math.inf, math.inf))
            else:
                comparisons.append(_compare(f"grad of argument {i}", ker_arg.grad, ref_arg.grad, tol))
    return CaseResult(override, case.label, case.dtype, tol, tuple(comparisons))


def check_for(override: Override) -> ParityCheck:
    """The parity check of ``override``."""
    return CHECKS[override.implementation]


def build_for_check(override: Override) -> Callable[..., torch.Tensor]:
    """The differentiable callable the check of ``override`` runs (imports its stack)."""
    module_name, function = check_for(override).builder.split(":")
    return getattr(importlib.import_module(module_name), function)(override.operation)


def run_check(override: Override) -> list[CaseResult]:
    """Every case of ``override`` 's operation its check supports; raises if the check cannot run."""
    check = check_for(override)
    reason = check.unavailable()
    if reason is not None:
        raise RuntimeError(f"{override.name}: parity check ({check.how}) cannot run here: {reason}")
    kernel = build_for_check(override)
    return [
        run_case(override.name, kernel, case, device=check.device)
        for case in CASES[override.operation]
        if case.dtype in check.dtypes
    ]
