"""What a parity run found: each compared tensor (:class:`Difference`), each step
(:class:`StepParity`), and the report that names the first divergence and prints it (:class:`ParityReport`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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


def relative_difference(target: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|target - reference| / max|reference|``; inf when the shapes differ, or when non-finite
    values do not match."""
    if target.shape != reference.shape:
        return math.inf
    target, reference = target.double(), reference.double()
    if not (torch.isfinite(target).all() and torch.isfinite(reference).all()):
        return 0.0 if torch.equal(target.nan_to_num(), reference.nan_to_num()) else math.inf
    scale = reference.abs().max().item() if reference.numel() else 0.0
    diff = (target - reference).abs().max().item() if reference.numel() else 0.0
    return diff / max(scale, 1e-12)
