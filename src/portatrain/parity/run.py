"""The parity run: the target and the fp32 CPU reference built from one config, trained on the same
batches from the same weights, with every module output, gradient and optimizer update captured and
compared (:func:`run_parity`; the method is ``portatrain.parity``'s docstring).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from portatrain.accelerators.sim import counters
from portatrain.accelerators.sim.settings import installed as sim_installed
from portatrain.audit.runtime import first_location
from portatrain.errors import UserError
from portatrain.parity.report import Difference, ParityReport, StepParity, relative_difference
from portatrain.parity.tolerances import (
    TAIL,
    UPDATE_ROUNDINGS,
    adam_update_bound,
    step_tolerance,
    unit_roundoff,
)


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
    steps = int(steps if steps is not None else cfg.trainer.steps)
    if steps < 1:
        raise UserError(f"parity needs at least one step, got trainer.steps={steps}")
    reference, target = _build_pair(cfg, trainer_cls or Trainer)
    try:
        # The target starts from the reference's weights, whatever its own initialization drew.
        target.model.load_state_dict(reference.model.state_dict())
        if prepare_target is not None:
            prepare_target(target)
        return _compare(
            reference, target, steps, device=str(cfg.device.type), grad_accum=int(cfg.trainer.grad_accum)
        )
    finally:
        target.close()
        reference.close()


def _build_pair(cfg: DictConfig, trainer_cls: type) -> tuple[Any, Any]:
    """The reference and target Trainers, under ``<run_dir>/parity/``; nothing left there when the
    target cannot be built."""
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
    return reference, target


def _gradients(trainers: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Each side's parameter gradients, copied to the host as each finishes accumulating."""
    grads: dict[str, dict[str, torch.Tensor]] = {side: {} for side in trainers}
    for side, trainer in trainers.items():
        for name, param in trainer.model.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name, side=side: grads[side].__setitem__(
                    name, p.grad.detach().to("cpu", torch.float32, copy=True)
                )
            )
    return grads


def _compare(reference: Any, target: Any, steps: int, *, device: str, grad_accum: int) -> ParityReport:
    """Train both sides ``steps`` steps on the reference's batches and judge every step (the target
    on ``device``)."""
    recorders = {"reference": _Recorder(reference.model), "target": _Recorder(target.model)}
    grads = _gradients({"reference": reference, "target": target})
    updates = _UpdateCheck(target.optimizer, {id(p): n for n, p in target.model.named_parameters()})
    batches = iter(reference.train_loader)
    results = []
    simulated = counters.active() and sim_installed() == target.accelerator.device_type
    counters.reset()
    tolerance, derivation = math.inf, ""
    for step in range(1, steps + 1):
        micro = [next(batches) for _ in range(max(1, grad_accum))]
        for recorder in recorders.values():
            recorder.clear()
        distance, weights = _weight_distance(target.model, reference.model)
        updates.expect(reference.optimizer)
        ref_loss = float(reference.train_step([dict(b) for b in micro])["loss"])
        tgt_loss = float(target.train_step([dict(b) for b in micro])["loss"])
        if step == 1:
            modules = len(recorders["reference"].order)
            tolerance, derivation = _step1_tolerance(target.dtype, reference.model, micro, modules)
        # First order, the loss moves by grad . dW: Cauchy-Schwarz bounds it by |grad| |dW|.
        drift = _norm(grads["reference"].values()) * distance / max(abs(ref_loss), 1e-12)
        record = StepParity(
            step,
            ref_loss,
            tgt_loss,
            loss_tolerance=tolerance + drift,
            weight_distance=distance / max(weights, 1e-12),
        )
        _add_differences(record, recorders, grads, tolerance if step == 1 else None)
        record.updates = updates.take(step)
        results.append(record)
    for recorder in recorders.values():
        recorder.remove()
    updates.remove()
    report = ParityReport(
        device,
        target.dtype,
        tolerance,
        results,
        derivation=derivation,
        update_tolerance=UPDATE_ROUNDINGS * unit_roundoff(torch.float32) if updates.checked else None,
        optimizer=type(target.optimizer).__name__,
    )
    if simulated:
        _add_fallbacks(report)
    return report


def _add_differences(
    record: StepParity,
    recorders: dict[str, _Recorder],
    grads: dict[str, dict[str, torch.Tensor]],
    judged: float | None,
) -> None:
    """The step's module outputs (in execution order) and gradients, judged against ``judged``
    (None: shown only)."""
    ref_out, tgt_out = recorders["reference"], recorders["target"]
    for name in ref_out.order:
        if name in tgt_out.outputs:
            rel = relative_difference(tgt_out.outputs[name], ref_out.outputs[name])
            record.activations.append(Difference(record.step, "activation", name, rel, judged))
    for name, ref_grad in grads["reference"].items():
        if name in grads["target"]:
            rel = relative_difference(grads["target"][name], ref_grad)
            record.gradients.append(Difference(record.step, "gradient", name, rel, judged))


def _add_fallbacks(report: ParityReport) -> None:
    """On the sim: the operators that fell back to the CPU on the target, and where each did first."""
    counts = counters.take()
    report.fallbacks = dict(counts.fallbacks)
    report.fallbacks_first = {
        op: first_location(counts.first_stacks[f"fallback:{op}"])
        for op in counts.fallbacks
        if f"fallback:{op}" in counts.first_stacks
    }
    profile = counters.active_profile()
    report.profile = profile.name if profile is not None else None
