"""Numerical parity of a device against an fp32 CPU reference, module by module.

``portatrain parity recipe=... device=...`` (``portatrain.commands.parity``) calls :func:`run_parity`:
two Trainers are built from the same config in one process, one on the target device and one on
the CPU in float32 with no kernel overrides. The target gets the reference's initial weights, both
train on the same batches for ``trainer.steps`` steps, and every step records the loss, each
module's output (forward hooks), each parameter's gradient and the target's optimizer update.
Differences are relative (``max|target - reference| / max|reference|``), each judged against a
tolerance derived from the arithmetic (below), never tuned to one machine's kernels. The first
divergence is named: the earliest step, and in it the first module, in execution order, whose
output left its tolerance. Forward hooks fire when a module returns, so a leaf
(``layers.1.input_layernorm``) is named before the block that contains it.

What is comparable, and its tolerance
-------------------------------------
**Step 1** starts from identical weights and batches, so its module outputs, gradients and loss
differ by rounding alone: two sets of kernels sum in different orders (blocking, vector width,
threads, fused or decomposed attention). Each is judged against

    tol = λ · sqrt(σ_target² + σ_reference²),    σ_side = sqrt(L) · (sqrt(K) · u_fp32 + u_side)

* ``u`` is the unit roundoff of a dtype (fp32 2^-24, bf16 2^-8, fp16 2^-11); ``u_side`` that of the
  side's compute dtype, and reductions accumulate in fp32 on every backend (``u_fp32``).
* ``K`` is the step's longest reduction: the largest dimension of a matrix parameter (a matmul's
  inner dimension either way, the vocabulary a softmax sums over) or the tokens a weight gradient
  sums over. A length-K dot product summed in any order is off by at most γ_K = K·u/(1 - K·u) times
  ``Σ|a_k b_k|`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1); with
  rounding errors independent and of mean zero it grows as sqrt(K)·u instead (Higham & Mary, "A New
  Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019), relative
  to the scale of the result, which is what ``max|reference|`` measures.
* ``L`` counts rounding stages: twice (forward and backward) the modules that ran, each at least
  one rounded result. An error made in one stage reaches the end with a gain of about one (the
  residual stream; normalizations keep relative errors), and independent stages add in
  quadrature, hence sqrt(L).
* ``λ = 8``: a sum of many independent roundings is close to Gaussian, and P(|Z| > 8) ≈ 1.2e-15
  keeps the chance of a false alarm near one in a million over the ~1e9 elements a parity run of a
  small model compares.

On the debug recipe (K = 384, L = 102) that is 1.4e-4 in fp32; the sim and the CPU differ there by
6e-7 at most, on AVX2 and with ``ATEN_CPU_CAPABILITY=default``, one thread or two.

**Later steps** are not compared module by module. AdamW's update ``lr · m̂ / (sqrt(v̂) + ε)`` is
about ``lr · sign(g)`` wherever ``|g| ≫ ε``, so a gradient within rounding of zero, whose sign the
summation order decides, moves its weight by ``±lr`` on either side: a full-size difference, in a
few weights, from a rounding-size one. From step 2 on a correct device's module outputs differ by
far more than rounding (2e-4 for the sim on the debug recipe; 3e-3 with rounding-sized noise on
every gradient) while its losses agree to 1e-7. What stays comparable, at every step:

* the **optimizer update**: the target's step against the same optimizer in float64 on the host,
  with the reference's settings (learning rate, betas, epsilon, weight decay) and the target's own
  weights, gradients and state, so rounding in the gradients cannot move it. Adam's
  elementwise update is about ten fp32 roundings, each at most ``u · (|w| + lr · c_t)``, where
  ``c_t`` bounds ``|m̂| / sqrt(v̂)`` (Cauchy-Schwarz over the betas' weights: 1 at step 1, 1.17 at
  most for betas (0.9, 0.95)); the difference, over ``max|w| + lr · c_t``, is judged against
  ``16 · u`` of the parameter's dtype. Adam and AdamW only; another optimizer's update is shown as
  not checked;
* the **loss**, against ``tol + ||∇L|| · ||W_target - W_reference|| / |L|``: to first order the
  loss moves by ``∇L · ΔW``, which Cauchy-Schwarz bounds, with ``∇L`` the reference's gradient at
  that step and ``ΔW`` the weight difference the two runs had reached before it (zero at step 1).

The module outputs and gradients of later steps are still printed, and so is the norm-relative
weight distance ``||W_target - W_reference|| / ||W_reference||`` at the start of each step.

Scope: one process (the reference holds a full copy of the model), eager modules on both sides
(per-module capture needs hooks, which compiled blocks would trace; ``compile.enabled`` is turned
off), debug-to-small models (every activation of a step is kept on the host, the optimizer check
holds a float64 copy of the parameters and their state).

On the simulated device the report also names the operators that fell back to the CPU on the
target (``SIM_OP_PROFILE``: those outside the op-coverage profile of the impersonated backend, which
really run through the CPU fallback), each with its calls and first location, so a parity pass says
whether it held with the fallbacks a real backend would take.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from portatrain.accelerators.sim import counters
from portatrain.accelerators.sim.settings import installed as sim_installed
from portatrain.audit.runtime import first_location
from portatrain.errors import UserError

TAIL = 8.0
"""λ: standard deviations of the modelled rounding error a difference may reach (module docstring)."""
UPDATE_ROUNDINGS = 16
"""Roundings allowed an optimizer update (Adam's elementwise step is about ten in fp32)."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the gap between 1 and the next representable number (fp32 2^-24, bf16 2^-8)."""
    return torch.finfo(dtype).eps / 2


def step_tolerance(dtype: torch.dtype, *, reduction: int, stages: int) -> float:
    """Relative tolerance of one step's outputs, gradients and loss, computed in ``dtype`` on the
    target and in fp32 on the reference from identical weights: ``λ · sqrt(σ_t² + σ_r²)`` with
    ``σ = sqrt(stages) · (sqrt(reduction) · u_fp32 + u_dtype)`` (module docstring)."""
    accumulate = math.sqrt(max(1, reduction)) * unit_roundoff(torch.float32)

    def sigma(compute: torch.dtype) -> float:
        return math.sqrt(max(1, stages)) * (accumulate + unit_roundoff(compute))

    return TAIL * math.hypot(sigma(dtype), sigma(torch.float32))


def adam_update_bound(betas: tuple[float, float], step: int) -> float:
    """``c_t``, the largest ``|m̂| / sqrt(v̂)`` Adam can reach at ``step`` (1-based), whatever the
    gradients: with ``m̂ = Σ a_j g_j`` and ``v̂ = Σ b_j g_j²`` (the bias-corrected EMA weights),
    Cauchy-Schwarz gives ``|m̂| <= sqrt(Σ a_j² / b_j) · sqrt(v̂)``."""
    beta1, beta2 = betas
    if beta2 == 0.0:  # v̂ is the last gradient squared
        return 1.0 if beta1 == 0.0 else math.inf
    total = sum((beta1 * beta1 / beta2) ** j for j in range(step))
    return math.sqrt((1 - beta1) ** 2 * (1 - beta2**step) / ((1 - beta2) * (1 - beta1**step) ** 2) * total)


@dataclass
class Difference:
    """One compared tensor: a module output (``kind="activation"``), a parameter gradient, a
    parameter's optimizer update (``"update"``) or the loss."""

    step: int
    kind: str
    name: str
    rel: float
    """``max|target - reference| / max|reference|`` (inf when shapes differ or values are non-finite);
    for an update, ``max|target - float64 step| / (max|w| + lr · c_t)``."""
    tolerance: float | None = None
    """What ``rel`` is judged against; None: shown, not judged (module outputs after step 1)."""

    @property
    def over(self) -> bool:
        return self.tolerance is not None and self.rel > self.tolerance


@dataclass
class StepParity:
    step: int
    loss_reference: float
    loss_target: float
    loss_tolerance: float = 0.0
    weight_distance: float = 0.0
    """``||W_target - W_reference|| / ||W_reference||`` at the start of the step."""
    activations: list[Difference] = field(default_factory=list)
    """In execution order (forward hooks fire when a module returns)."""
    gradients: list[Difference] = field(default_factory=list)
    updates: list[Difference] = field(default_factory=list)
    """The target's optimizer update per parameter, against the same step in float64."""

    @property
    def loss_rel(self) -> float:
        return _rel_scalar(self.loss_target, self.loss_reference)

    def judged(self) -> list[Difference]:
        """What this step is judged on, in the order a divergence is named: step 1's module outputs
        and gradients, then the loss, then the optimizer update."""
        modules = [d for d in self.activations + self.gradients if d.tolerance is not None]
        return [
            *modules,
            Difference(self.step, "loss", "loss", self.loss_rel, self.loss_tolerance),
            *self.updates,
        ]


@dataclass
class ParityReport:
    device: str
    dtype: torch.dtype
    tolerance: float
    """Step 1's tolerance (outputs, gradients, loss): :func:`step_tolerance`."""
    steps: list[StepParity]
    derivation: str = ""
    """How ``tolerance`` was derived, with its numbers."""
    update_tolerance: float | None = None
    """The optimizer-update tolerance; None when the target's optimizer is not checked."""
    fallbacks: dict[str, int] | None = None
    """On the sim: operator -> calls that fell back to the CPU on the target (None elsewhere)."""
    fallbacks_first: dict[str, str] = field(default_factory=dict)
    """Operator -> ``file:line in function`` of its first fallback."""
    profile: str | None = None
    """The sim's op-coverage profile in force on the target."""
    optimizer: str = ""
    """The target's optimizer class, as the update check names it."""

    @property
    def first_divergence(self) -> Difference | None:
        """The first difference over its tolerance, at the earliest step with one (:meth:`StepParity.judged`)."""
        for step in self.steps:
            for diff in step.judged():
                if diff.over:
                    return diff
        return None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def format(self, worst: int = 5) -> str:
        """Per-step losses, the worst module of each step, step 1's largest differences, the worst
        optimizer updates, and the verdict."""
        dtype = str(self.dtype).removeprefix("torch.")
        updates = (
            f"every optimizer update within {self.update_tolerance:.2e} of {self.optimizer} in float64"
            if self.update_tolerance is not None
            else f"optimizer updates not checked ({self.optimizer}; the check knows Adam and AdamW)"
        )
        lines = [
            f"parity: {self.device} ({dtype}) vs cpu (float32)",
            f"judged: step 1's module outputs, gradients and loss within {self.tolerance:.2e} ({self.derivation}); "
            f"{updates}; each later loss within {self.tolerance:.2e} + |grad| * |W_{self.device} - W_cpu| / |loss|",
            f"{'step':>4}  {'loss cpu':>12}  {'loss ' + self.device:>12}  {'rel diff':>9}  {'tolerance':>9}  "
            f"{'weights':>8}  worst module",
        ]
        for s in self.steps:
            top = max(s.activations, key=lambda d: d.rel, default=None)
            where = f"{top.name} {top.rel:.2e}" if top else "-"
            if top is not None and top.tolerance is None:
                where += " (not judged)"
            lines.append(
                f"{s.step:>4}  {s.loss_reference:>12.6f}  {s.loss_target:>12.6f}  {s.loss_rel:>9.2e}  "
                f"{s.loss_tolerance:>9.2e}  {s.weight_distance:>8.1e}  {where}"
            )
        if len(self.steps) > 1:
            lines.append(
                "after step 1 module outputs are not judged: AdamW's lr * sign(g) turns rounding in a "
                "near-zero gradient into a full-size weight difference; 'weights' is |dW| / |W| at the step's start"
            )
        if self.steps:
            first = self.steps[0]
            lines.append("largest differences at step 1:")
            for d in sorted(first.activations + first.gradients, key=lambda d: -d.rel)[:worst]:
                lines.append(f"  {d.kind:<10} {d.name:<48} {d.rel:.2e}")
            every_update = [d for s in self.steps for d in s.updates]
            if every_update:
                lines.append("largest optimizer-update differences:")
                for d in sorted(every_update, key=lambda d: -d.rel)[: min(worst, 3)]:
                    lines.append(f"  step {d.step:<5} {d.name:<48} {d.rel:.2e}")
        if self.fallbacks is not None:
            profile = f"op profile {self.profile}" if self.profile else "no op profile (SIM_OP_PROFILE unset)"
            shown = "; ".join(
                f"{op} x{n} at {self.fallbacks_first.get(op, '?')}"
                for op, n in sorted(self.fallbacks.items())
            )
            lines.append(f"CPU fallbacks on {self.device} under {profile}: {shown or 'none'}")
        first_bad = self.first_divergence
        if first_bad is None:
            lines.append(
                "PASS: step 1's module outputs and gradients, and every step's loss and optimizer update, "
                "are within tolerance"
            )
        else:
            lines.append(
                f"FAIL: first divergence at step {first_bad.step}: {first_bad.kind} of {first_bad.name!r} "
                f"differs by {first_bad.rel:.2e} > {first_bad.tolerance:.2g}"
            )
        return "\n".join(lines)


def _rel_scalar(value: float, reference: float) -> float:
    if not (math.isfinite(value) and math.isfinite(reference)):
        return 0.0 if value == reference else math.inf
    return abs(value - reference) / max(abs(reference), 1e-12)


def _rel(target: torch.Tensor, reference: torch.Tensor) -> float:
    if target.shape != reference.shape:
        return math.inf
    target, reference = target.double(), reference.double()
    if not (torch.isfinite(target).all() and torch.isfinite(reference).all()):
        return 0.0 if torch.equal(target.nan_to_num(), reference.nan_to_num()) else math.inf
    scale = reference.abs().max().item() if reference.numel() else 0.0
    diff = (target - reference).abs().max().item() if reference.numel() else 0.0
    return diff / max(scale, 1e-12)


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class _Recorder:
    """Module outputs (in execution order) and accumulated gradients of one model, copied to the host."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            if tensor is not None and tensor.is_floating_point():
                if name not in self.outputs:
                    self.order.append(name)
                # A copy: later in-place ops (residual adds, gradient clipping) must not change it.
                self.outputs[name] = tensor.detach().to("cpu", torch.float32, copy=True)

        return record

    def clear(self) -> None:
        self.outputs.clear()
        self.order.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _UpdateCheck:
    """The target's optimizer step against the same step in float64 on the host, with the
    reference's settings (learning rate, betas, epsilon, weight decay: what the target must match)
    and the target's own parameters, gradients and state just before it (module docstring):
    rounding anywhere upstream cannot move it, a wrong update (a setting, a kernel) does."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.names = names
        self.checked = isinstance(optimizer, torch.optim.Adam)  # AdamW derives from Adam
        self.differences: list[Difference] = []
        self.settings: list[dict[str, Any]] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.handles = (
            [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]
            if self.checked
            else []
        )

    def expect(self, reference: torch.optim.Optimizer) -> None:
        """Take the reference's settings for the coming step (before its scheduler moves them)."""
        self.settings = [{k: v for k, v in g.items() if k != "params"} for g in reference.param_groups]

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._pending = []
        if len(self.settings) != len(optimizer.param_groups):
            self.checked = False  # built differently: nothing to hold the update against
            return
        for group, settings in zip(optimizer.param_groups, self.settings):
            params = [p for p in group["params"] if p.grad is not None]
            if not params or not all(bool(torch.isfinite(p.grad).all()) for p in params):
                continue  # a non-finite step is the loss's divergence, and may be skipped
            lr = float(settings["lr"])
            settings = {**settings, "lr": lr, "foreach": False, "fused": False, "capturable": False}
            settings["differentiable"] = False
            shadows = []
            for p in params:
                shadow = p.detach().to("cpu", torch.float64, copy=True)
                shadow.grad = p.grad.detach().to("cpu", torch.float64, copy=True)
                shadows.append(shadow)
            exact = type(optimizer)([{"params": shadows, **settings}])
            for p, shadow in zip(params, shadows):
                exact.state[shadow] = {
                    k: v.detach().to("cpu", torch.float64, copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state.get(p, {}).items()
                }
            scales = [s.abs().max().item() for s in shadows]
            with torch.no_grad():
                exact.step()
            for p, shadow, scale in zip(params, shadows, scales):
                bound = adam_update_bound(tuple(settings["betas"]), int(exact.state[shadow]["step"]))
                self._pending.append((p, shadow.detach(), scale + lr * bound))

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p, expected, scale in self._pending:
            err = (p.detach().to("cpu", torch.float64) - expected).abs().max().item()
            rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
            tolerance = UPDATE_ROUNDINGS * unit_roundoff(p.dtype)
            self.differences.append(Difference(0, "update", self.names.get(id(p), "?"), rel, tolerance))
        self._pending = []

    def take(self, step: int) -> list[Difference]:
        taken, self.differences = self.differences, []
        for diff in taken:
            diff.step = step
        return taken

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _norm(tensors: Any) -> float:
    return math.sqrt(sum(float(t.to("cpu", torch.float64).square().sum()) for t in tensors))


def _weight_distance(target: nn.Module, reference: nn.Module) -> tuple[float, float]:
    """``||W_target - W_reference||`` and ``||W_reference||`` over every parameter (float64)."""
    ref = _parameters(reference)
    tgt = _parameters(target)
    diff = _norm(tgt[n].to("cpu", torch.float64) - p.to(torch.float64) for n, p in ref.items() if n in tgt)
    return diff, _norm(ref.values())


def _derived(cfg: DictConfig, device: str, run_dir: Path, reference: bool) -> DictConfig:
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(out):
        out.device.type = device
        out.run_dir = str(run_dir)
        out.checkpoint.enabled = False
        out.checkpoint.resume = "none"
        out.compile.enabled = False
        out.trainer.eval_every = 0
        out.trainer.progress = False
        if reference:
            out.trainer.dtype = "float32"
            out.kernels.enabled = []
    return out


def _step1_tolerance(
    dtype: torch.dtype, model: nn.Module, micro: list[dict[str, torch.Tensor]], modules: int
) -> tuple[float, str]:
    """:func:`step_tolerance` for this model and step, and how it was reached: ``K`` the longest
    reduction (a matrix parameter's largest dimension, or the positions a weight gradient sums
    over), ``L`` twice the modules that ran."""
    widest = max((max(p.shape) for p in model.parameters() if p.ndim >= 2), default=1)
    positions = sum(int(b["labels"].numel()) for b in micro)
    reduction, stages = max(widest, positions), 2 * max(1, modules)
    tolerance = step_tolerance(dtype, reduction=reduction, stages=stages)
    return tolerance, f"derived: {TAIL:g} sd of rounding over {stages} stages, longest reduction {reduction}"


def run_parity(
    cfg: DictConfig,
    steps: int | None = None,
    *,
    trainer_cls: type | None = None,
    prepare_target: Callable[[Any], None] | None = None,
) -> ParityReport:
    """Train ``steps`` (default ``trainer.steps``) steps on ``cfg.device.type`` and on the fp32 CPU
    reference from the same weights and batches; compare step 1's module outputs and gradients, and
    every step's loss and optimizer update, each against its derived tolerance (module docstring).

    ``prepare_target(trainer)`` runs on the target Trainer after its model received the reference
    weights (tests plant a bug in its model or optimizer). Writes nothing but the two runs' ``config.yaml`` and metrics under
    ``<run_dir>/parity/``.
    """
    from portatrain.distributed import dist_info_from_env
    from portatrain.trainer import Trainer

    if dist_info_from_env().world_size > 1:
        raise UserError(
            "portatrain parity runs in one process (the CPU reference holds the whole model); "
            "launch it without torchrun"
        )
    trainer_cls = trainer_cls or Trainer
    steps = int(steps if steps is not None else cfg.trainer.steps)
    if steps < 1:
        raise UserError(f"parity needs at least one step, got trainer.steps={steps}")
    root = Path(cfg.run_dir) / "parity"
    target_device = str(cfg.device.type)
    fresh = not root.exists()
    reference = trainer_cls(_derived(cfg, "cpu", root / "cpu", reference=True))
    # Each Trainer locks its run directory: device=cpu (a self-check) gets a directory of its own.
    target_dir = root / (target_device if target_device != "cpu" else "cpu-target")
    try:
        target = trainer_cls(_derived(cfg, target_device, target_dir, reference=False))
    except BaseException:
        # No comparison ran (the device is missing, its config is wrong...): leave nothing behind.
        reference.close()
        if fresh:
            shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        # The target starts from the reference's weights, whatever its own initialization drew.
        target.model.load_state_dict(reference.model.state_dict())
        if prepare_target is not None:
            prepare_target(target)
        recorders = {"reference": _Recorder(reference.model), "target": _Recorder(target.model)}
        grads: dict[str, dict[str, torch.Tensor]] = {"reference": {}, "target": {}}
        for side, trainer in (("reference", reference), ("target", target)):
            for name, param in trainer.model.named_parameters():
                param.register_post_accumulate_grad_hook(
                    lambda p, name=name, side=side: grads[side].__setitem__(
                        name, p.grad.detach().to("cpu", torch.float32, copy=True)
                    )
                )
        updates = _UpdateCheck(target.optimizer, {id(p): n for n, p in target.model.named_parameters()})
        batches = iter(reference.train_loader)
        results = []
        simulated = counters.active() and sim_installed() == target.accelerator.device_type
        counters.reset()
        tolerance, derivation = math.inf, ""
        for step in range(1, steps + 1):
            micro = [next(batches) for _ in range(max(1, int(cfg.trainer.grad_accum)))]
            for recorder in recorders.values():
                recorder.clear()
            distance, weights = _weight_distance(target.model, reference.model)
            updates.expect(reference.optimizer)
            ref_metrics = reference.train_step([dict(b) for b in micro])
            tgt_metrics = target.train_step([dict(b) for b in micro])
            ref_out, tgt_out = recorders["reference"], recorders["target"]
            if step == 1:
                tolerance, derivation = _step1_tolerance(
                    target.dtype, reference.model, micro, len(ref_out.order)
                )
            loss_ref = float(ref_metrics["loss"])
            # First order, the loss moves by grad . dW: Cauchy-Schwarz bounds it by |grad| |dW|.
            drift = _norm(grads["reference"].values()) * distance / max(abs(loss_ref), 1e-12)
            record = StepParity(
                step,
                loss_ref,
                float(tgt_metrics["loss"]),
                loss_tolerance=tolerance + drift,
                weight_distance=distance / max(weights, 1e-12),
            )
            judged = tolerance if step == 1 else None
            for name in ref_out.order:
                if name in tgt_out.outputs:
                    rel = _rel(tgt_out.outputs[name], ref_out.outputs[name])
                    record.activations.append(Difference(step, "activation", name, rel, judged))
            for name, ref_grad in grads["reference"].items():
                if name in grads["target"]:
                    rel = _rel(grads["target"][name], ref_grad)
                    record.gradients.append(Difference(step, "gradient", name, rel, judged))
            record.updates = updates.take(step)
            results.append(record)
        for recorder in recorders.values():
            recorder.remove()
        updates.remove()
        report = ParityReport(
            target_device,
            target.dtype,
            tolerance,
            results,
            derivation=derivation,
            update_tolerance=UPDATE_ROUNDINGS * unit_roundoff(torch.float32) if updates.checked else None,
            optimizer=type(target.optimizer).__name__,
        )
        if simulated:
            counts = counters.take()
            report.fallbacks = dict(counts.fallbacks)
            report.fallbacks_first = {
                op: first_location(counts.first_stacks[f"fallback:{op}"])
                for op in counts.fallbacks
                if f"fallback:{op}" in counts.first_stacks
            }
            profile = counters.active_profile()
            report.profile = profile.name if profile is not None else None
        return report
    finally:
        target.close()
        reference.close()
