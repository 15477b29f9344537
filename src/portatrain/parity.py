"""Numerical parity of a device against an fp32 CPU reference, module by module.

``portatrain parity recipe=... device=...`` (``portatrain.commands.parity``) calls :func:`run_parity`:
two Trainers are built from the same config in one process, one on the target device and one on
the CPU in float32 with no kernel overrides. The target gets the reference's initial weights, both
train on the same batches for ``trainer.steps`` steps, and every step records the loss, each
module's output (forward hooks) and each parameter's gradient on both. Differences are relative
(``max|target - reference| / max|reference|``) and judged against a tolerance for the target's
compute dtype. The first divergence is named: the earliest step, and in it the first module, in
execution order, whose output left the tolerance. Forward hooks fire when a module returns, so
a leaf (``layers.1.input_layernorm``) is named before the block that contains it.

Scope: one process (the reference holds a full copy of the model), eager modules on both sides
(per-module capture needs hooks, which compiled blocks would trace; ``compile.enabled`` is turned
off), debug-to-small models (every activation of a step is kept on the host).

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

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}
"""Largest relative difference accepted per compute dtype: a few ulps of fp32 accumulated over a
small model; about three bf16/fp16 mantissa steps for reduced precision."""


@dataclass
class Difference:
    """One compared tensor: a module output (``kind="activation"``) or a parameter gradient."""

    step: int
    kind: str
    name: str
    rel: float
    """``max|target - reference| / max|reference|`` (inf when shapes differ or values are non-finite)."""


@dataclass
class StepParity:
    step: int
    loss_reference: float
    loss_target: float
    activations: list[Difference] = field(default_factory=list)
    """In execution order (forward hooks fire when a module returns)."""
    gradients: list[Difference] = field(default_factory=list)

    @property
    def loss_rel(self) -> float:
        return _rel_scalar(self.loss_target, self.loss_reference)


@dataclass
class ParityReport:
    device: str
    dtype: torch.dtype
    tolerance: float
    steps: list[StepParity]
    fallbacks: dict[str, int] | None = None
    """On the sim: operator -> calls that fell back to the CPU on the target (None elsewhere)."""
    fallbacks_first: dict[str, str] = field(default_factory=dict)
    """Operator -> ``file:line in function`` of its first fallback."""
    profile: str | None = None
    """The sim's op-coverage profile in force on the target."""

    @property
    def first_divergence(self) -> Difference | None:
        """The first activation over tolerance at the earliest step with one; else the first gradient;
        else a loss difference alone (``name="loss"``)."""
        for step in self.steps:
            for diff in step.activations:
                if diff.rel > self.tolerance:
                    return diff
            over = [d for d in step.gradients if d.rel > self.tolerance]
            if over:
                return over[0]
            if step.loss_rel > self.tolerance:
                return Difference(step.step, "loss", "loss", step.loss_rel)
        return None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def format(self, worst: int = 5) -> str:
        """Per-step losses, the worst modules and gradients of each step, and the verdict."""
        dtype = str(self.dtype).removeprefix("torch.")
        lines = [
            f"parity: {self.device} ({dtype}) vs cpu (float32), tolerance {self.tolerance:g} (relative)",
            f"{'step':>4}  {'loss cpu':>12}  {'loss ' + self.device:>12}  {'rel diff':>9}  worst module",
        ]
        for s in self.steps:
            top = max(s.activations, key=lambda d: d.rel, default=None)
            where = f"{top.name} {top.rel:.2e}" if top else "-"
            lines.append(
                f"{s.step:>4}  {s.loss_reference:>12.6f}  {s.loss_target:>12.6f}  {s.loss_rel:>9.2e}  {where}"
            )
        last = self.steps[-1] if self.steps else None
        if last is not None:
            lines.append(f"largest differences at step {last.step}:")
            for d in sorted(last.activations + last.gradients, key=lambda d: -d.rel)[:worst]:
                lines.append(f"  {d.kind:<10} {d.name:<48} {d.rel:.2e}")
        if self.fallbacks is not None:
            profile = f"op profile {self.profile}" if self.profile else "no op profile (SIM_OP_PROFILE unset)"
            shown = "; ".join(
                f"{op} x{n} at {self.fallbacks_first.get(op, '?')}"
                for op, n in sorted(self.fallbacks.items())
            )
            lines.append(f"CPU fallbacks on {self.device} under {profile}: {shown or 'none'}")
        first = self.first_divergence
        if first is None:
            lines.append("PASS: every loss, module output and gradient is within tolerance")
        else:
            lines.append(
                f"FAIL: first divergence at step {first.step}: {first.kind} of {first.name!r} differs by "
                f"{first.rel:.2e} > {self.tolerance:g}"
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


def run_parity(
    cfg: DictConfig,
    steps: int | None = None,
    *,
    trainer_cls: type | None = None,
    prepare_target: Callable[[nn.Module], None] | None = None,
) -> ParityReport:
    """Train ``steps`` (default ``trainer.steps``) steps on ``cfg.device.type`` and on the fp32 CPU
    reference from the same weights and batches; compare every loss, module output and gradient.

    ``prepare_target(model)`` runs on the target model after it received the reference weights
    (tests plant a bug there). Writes nothing but the two runs' ``config.yaml`` and metrics under
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
            prepare_target(target.model)
        tolerance = TOLERANCES.get(target.dtype, TOLERANCES[torch.float32])
        recorders = {"reference": _Recorder(reference.model), "target": _Recorder(target.model)}
        grads: dict[str, dict[str, torch.Tensor]] = {"reference": {}, "target": {}}
        for side, trainer in (("reference", reference), ("target", target)):
            for name, param in trainer.model.named_parameters():
                param.register_post_accumulate_grad_hook(
                    lambda p, name=name, side=side: grads[side].__setitem__(
                        name, p.grad.detach().to("cpu", torch.float32, copy=True)
                    )
                )
        batches = iter(reference.train_loader)
        results = []
        simulated = counters.active() and sim_installed() == target.accelerator.device_type
        counters.reset()
        for step in range(1, steps + 1):
            micro = [next(batches) for _ in range(max(1, int(cfg.trainer.grad_accum)))]
            for recorder in recorders.values():
                recorder.clear()
            ref_metrics = reference.train_step([dict(b) for b in micro])
            tgt_metrics = target.train_step([dict(b) for b in micro])
            ref_out, tgt_out = recorders["reference"], recorders["target"]
            record = StepParity(step, float(ref_metrics["loss"]), float(tgt_metrics["loss"]))
            for name in ref_out.order:
                if name in tgt_out.outputs:
                    record.activations.append(
                        Difference(
                            step, "activation", name, _rel(tgt_out.outputs[name], ref_out.outputs[name])
                        )
                    )
            for name, ref_grad in grads["reference"].items():
                if name in grads["target"]:
                    record.gradients.append(
                        Difference(step, "gradient", name, _rel(grads["target"][name], ref_grad))
                    )
            results.append(record)
        for recorder in recorders.values():
            recorder.remove()
        report = ParityReport(target_device, target.dtype, tolerance, results)
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
