"""The runtime audit: what a training run does that a TPU or Trainium punishes, measured as it runs.

Two opt-in modes of the ``audit`` config section (:class:`~portatrain.config.RuntimeAuditConfig`),
both off by default and free when off:

``audit.runtime=true``
    Every logged step's record in ``metrics.jsonl`` gets the counts of the steps since the previous
    log -- the *window*, which excludes the logging, evaluation and checkpoint code between windows,
    where syncing is expected:

    ==========================  ==================================================================
    ``audit_steps``             optimizer steps in the window
    ``audit_host_syncs``        host synchronizations (``.item()``, device-to-host copies, data-
                                dependent shapes, explicit synchronize); null where not measurable
    ``audit_cpu_fallbacks``     ops the backend ran on the host CPU; null where not reported
    ``audit_mixed_device``      ops mixing device and CPU tensors; null where not measurable
    ``audit_graph_breaks``      ``torch.compile`` graph breaks (dynamo's counter)
    ``audit_recompiles``        graphs compiled again after a guard failed (a new shape, ...)
    ``audit_graphs``            graphs compiled in the window (first compilations included)
    ``audit_offences``          ``{"sync:item": 2, "fallback:aten::foo.out": 1, ...}`` by kind
    ``audit_first``             kind -> ``file:line in function`` of its first occurrence
    ==========================  ==================================================================

    Host syncs, fallbacks and mixed-device ops come from the sim device's counters
    (:mod:`portatrain.accelerators.sim.counters`, also when it impersonates ``tpu``/``neuron``);
    on other devices fallbacks come from the adapter's
    :meth:`~portatrain.accelerators.base.Accelerator.take_fallback_report` where the vendor reports
    them, and null ("not available") elsewhere -- never a 0 that was not measured. Graph breaks and
    recompiles are dynamo's process-wide records, read as differences, on any device. The first
    occurrence of each kind is also logged once, with its Python stack.

    On the sim the audit also takes an op census: every operator that reached the device in the
    windows, with its first location (:meth:`RuntimeAudit.summary`'s ``ops`` and ``ops_first``). With
    an op-coverage profile in force (``SIM_OP_PROFILE``, :mod:`portatrain.accelerators.sim.op_profiles`;
    the summary's ``profile``) the operators outside it are the ``fallback:<op>`` offences.

``audit.nonfinite=true``
    A debugging mode: a forward hook on every module checks its outputs and a gradient hook every
    parameter's accumulated gradient, and the first NaN/inf stops the run with
    :class:`NonFiniteValueError` naming the step, the module, the tensor and whether the module's
    inputs were still finite (so the module made it) or not (the code between modules did). Each
    check syncs with the host, once per module; the sim's counters do not count those syncs. It
    needs ``compile.enabled=false``: a hook that reads values would break every compiled block.
    Under several processes the rank that finds a value keeps its finding and finishes the step (its
    peers are in the same collectives); after the step (or the evaluation) the ranks agree, and every
    rank stops with the first finding's message, naming its rank.

The Trainer calls five small hooks: :meth:`RuntimeAudit.step_begin` before each step,
:meth:`RuntimeAudit.step_end` after it, :meth:`RuntimeAudit.window_end` first thing on a logging
step (its dict goes into the record),
:meth:`RuntimeAudit.paused` around evaluation, and :meth:`RuntimeAudit.close`. ``portatrain report`` reads :meth:`RuntimeAudit.summary`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from portatrain.accelerators.sim import counters
from portatrain.config import CompileConfig, RuntimeAuditConfig
from portatrain.errors import UserError

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator

logger = logging.getLogger(__name__)

NOT_AVAILABLE = None
"""What a count is where nothing measured it (JSON null), as opposed to a measured 0."""


def runtime_audit_problems(audit_cfg: RuntimeAuditConfig, compile_cfg: CompileConfig) -> list[str]:
    """Every problem of the ``audit`` section (the validator's runtime-audit check)."""
    if audit_cfg.nonfinite and compile_cfg.enabled:
        return [
            "audit.nonfinite=true reads every module's output on the host, which would break each "
            "compiled block's graph; set compile.enabled=false for the debugging run"
        ]
    return []


class NonFiniteValueError(UserError, FloatingPointError):
    """``audit.nonfinite=true`` found a NaN/inf; the message names the step, module and tensor
    (and the rank, under several processes: every rank raises the same message)."""

    same_on_every_rank = True


# -- locations and dynamo's records ----------------------------------------------------------------
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')
_TORCH_DIR = str(Path(torch.__file__).parent)


def first_location(stack: str) -> str:
    """``file:line in function`` of the innermost frame of ``stack`` outside torch itself (the
    caller's line, not torch's), with the path relative to the working directory where below it."""
    frames = [m for m in _FRAME.finditer(stack) if not m.group("file").startswith(_TORCH_DIR)]
    if not frames:
        return stack.strip().splitlines()[0] if stack.strip() else "unknown"
    frame = frames[-1]
    path = Path(frame.group("file"))
    with contextlib.suppress(ValueError):
        path = path.resolve().relative_to(Path.cwd().resolve())
    return f"{path.as_posix()}:{frame.group('line')} in {frame.group('fn')}"


def dynamo_totals() -> tuple[Counter[str], int, int]:
    """(graph-break reason -> count, guard failures, graphs compiled) so far in this process.

    Zero without reading anything when dynamo was never imported: nothing can have been compiled.
    """
    if "torch._dynamo" not in sys.modules:
        return Counter(), 0, 0
    from torch._dynamo.utils import counters as dynamo_counters
    from torch._dynamo.utils import guard_failures

    breaks = Counter({str(k): int(v) for k, v in dynamo_counters["graph_break"].items()})
    failures = sum(len(reasons) for reasons in guard_failures.values())
    return breaks, failures, int(dynamo_counters["stats"]["unique_graphs"])


def _add(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    for key, n in more.items():
        total[key] = total.get(key, 0) + n
    return total


def _reason_line(reason: str) -> str:
    """The first line of a dynamo graph-break reason (they run to a dozen lines of hints)."""
    return reason.strip().splitlines()[0][:200] if reason.strip() else "unknown reason"


# -- the audit -------------------------------------------------------------------------------------
class RuntimeAudit:
    """Per-window counts (``audit.runtime``) and non-finite hooks (``audit.nonfinite``) of one run.

    Disabled (both flags off), every method returns at once and nothing is installed.
    """

    def __init__(self, audit_cfg: RuntimeAuditConfig, accelerator: Accelerator, model: nn.Module) -> None:
        self.enabled = bool(audit_cfg.runtime)
        self.accelerator = accelerator
        self.step = 0
        """The optimizer step running now (set by :meth:`step_begin`; 0 before the first)."""
        self.windows: list[dict[str, Any]] = []
        """Every window's record, in order (what went into ``metrics.jsonl``)."""
        self.first_stacks: dict[str, str] = {}
        """Offence kind -> Python stack of its first occurrence in any window of the run."""
        self._window_open = False
        self._window_steps = 0
        self._dynamo_start: tuple[Counter[str], int, int] = (Counter(), 0, 0)
        self._left_out: tuple[Counter[str], int, int] = (Counter(), 0, 0)  # dynamo records of paused blocks
        self._fallbacks_so_far: dict[str, int] = {}  # the vendor's report, read before a paused block
        self._hooks: list[Any] = []
        self.ops: Counter[str] = Counter()
        """The op census on the sim: operator -> calls in the run's windows."""
        self.ops_first: dict[str, str] = {}
        """Operator -> ``file:line in function`` of its first call in a window."""
        if self.enabled and self.simulated:
            counters.set_census(True)
        self.finding: tuple[int, str] | None = None
        """This rank's first ``audit.nonfinite`` finding, ``(0 forward | 1 backward, message)``, held
        until the ranks agree (several processes)."""
        self._ranks = dist.get_world_size() if dist.is_initialized() else 1
        if audit_cfg.nonfinite:
            self._hooks = _install_nonfinite_hooks(model, self)

    @property
    def simulated(self) -> bool:
        """Whether this run's device is the sim (under its own name or an impersonated one), whose
        counters then count its ops. A CPU run in a process that also installed the sim is not."""
        if not counters.active():
            return False
        from portatrain.accelerators.sim import runtime as sim_runtime

        return sim_runtime.installed() == self.accelerator.device_type

    def step_begin(self, step: int) -> None:
        """Before optimizer step ``step``. Opens a window after a logging step: whatever logging,
        evaluation and checkpointing synced in between is forgotten, as it should be."""
        self.step = step
        if not self.enabled:
            return
        if not self._window_open:
            counters.reset()
            self.accelerator.take_fallback_report()
            self._dynamo_start = dynamo_totals()
            self._left_out, self._fallbacks_so_far = (Counter(), 0, 0), {}
            self._window_open, self._window_steps = True, 0
        self._window_steps += 1

    def step_end(self) -> None:
        """After each optimizer step: with ``audit.nonfinite`` under several processes, the ranks
        agree on a finding (one object all-gather) and all raise the first one's message."""
        if not self._hooks or self._ranks == 1:
            return
        findings: list[tuple[int, str] | None] = [None] * self._ranks
        dist.all_gather_object(findings, self.finding)
        found = [(finding[0], rank, finding[1]) for rank, finding in enumerate(findings) if finding]
        if found:
            # A forward finding is where the value was made; a backward one may be its echo (the
            # data-parallel gradient reduction carries one rank's NaN to every rank's shard).
            _, rank, message = min(found)
            raise NonFiniteValueError(f"rank {rank}: {message}")

    def report(self, message: str, *, backward: bool = False) -> None:
        """A non-finite value was found: raise now (one process), else hold it for :meth:`step_end`
        (raising here would leave the other ranks waiting in the step's next collective)."""
        if self._ranks == 1:
            raise NonFiniteValueError(message)
        if self.finding is None:
            self.finding = (int(backward), message)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the block out of the window: evaluation in the middle of one syncs on purpose and
        compiles graphs of its own (no_grad), none of which is the training step's. A non-finite
        value found in it stops every rank after it (:meth:`step_end`)."""
        with self._agreed_after():
            if not self.enabled or not self._window_open:
                yield
                return
            with self._paused():
                yield

    @contextlib.contextmanager
    def _agreed_after(self) -> Iterator[None]:
        yield
        self.step_end()  # not reached when the block raised

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        before = dynamo_totals()
        simulated = self.simulated
        if not simulated:
            _add(self._fallbacks_so_far, self.accelerator.take_fallback_report() or {})
        try:
            with counters.paused() if simulated else contextlib.nullcontext():
                yield
        finally:
            after = dynamo_totals()
            if not simulated:
                self.accelerator.take_fallback_report()  # the block's own: dropped
            breaks, failures, graphs = self._left_out
            self._left_out = (
                breaks + (after[0] - before[0]),
                failures + after[1] - before[1],
                graphs + after[2] - before[2],
            )

    def window_end(self) -> dict[str, Any]:
        """First thing on a logging step: the counts of the steps since the last one, as ``audit_*``
        keys for the metrics record ({} when ``audit.runtime`` is off or no step ran)."""
        if not self.enabled or not self._window_open:
            return {}
        self._window_open = False
        breaks, failures, graphs = dynamo_totals()
        start_breaks, start_failures, start_graphs = self._dynamo_start
        left_breaks, left_failures, left_graphs = self._left_out
        new_breaks = breaks - start_breaks - left_breaks
        record: dict[str, Any] = {"audit_steps": self._window_steps}
        offences: dict[str, int] = {}
        stacks: dict[str, str] = {}
        if self.simulated:
            counts = counters.take()
            offences, stacks = counts.offences(), counts.first_stacks
            self.ops.update(counts.ops)
            for op in counts.ops:
                if op not in self.ops_first and f"op:{op}" in stacks:
                    self.ops_first[op] = first_location(stacks[f"op:{op}"])
            record["audit_host_syncs"] = counts.total_syncs
            record["audit_cpu_fallbacks"] = counts.total_fallbacks
            record["audit_mixed_device"] = sum(counts.mixed_device.values())
        else:
            fallbacks = self.accelerator.take_fallback_report()
            if fallbacks is not None:
                fallbacks = _add(dict(self._fallbacks_so_far), fallbacks)
            record["audit_host_syncs"] = NOT_AVAILABLE
            record["audit_cpu_fallbacks"] = NOT_AVAILABLE if fallbacks is None else sum(fallbacks.values())
            record["audit_mixed_device"] = NOT_AVAILABLE
            offences = {f"fallback:{op}": n for op, n in (fallbacks or {}).items() if n}
        for reason, n in new_breaks.items():
            offences[f"graph_break:{_reason_line(reason)}"] = n
        record["audit_graph_breaks"] = sum(new_breaks.values())
        record["audit_recompiles"] = failures - start_failures - left_failures
        record["audit_graphs"] = graphs - start_graphs - left_graphs
        record["audit_offences"] = dict(sorted(offences.items()))
        record["audit_first"] = {k: first_location(stacks[k]) for k in sorted(offences) if k in stacks}
        for key in sorted(offences):
            if key not in self.first_stacks and key in stacks:
                self.first_stacks[key] = stacks[key]
                logger.warning(
                    "runtime audit: %s in the training step (x%d in steps %d-%d), first at:\n%s",
                    key,
                    offences[key],
                    self.step - self._window_steps + 1,
                    self.step,
                    stacks[key].rstrip(),
                )
        self.windows.append({"step": self.step, **record})
        return record

    def summary(self) -> dict[str, Any]:
        """The whole run's windows added up (what ``portatrain report`` reads)."""

        def total(key: str) -> int | None:
            values = [w[key] for w in self.windows]
            return None if not values or any(v is None for v in values) else sum(values)

        offences: Counter[str] = Counter()
        first: dict[str, str] = {}
        for window in self.windows:
            offences.update(window["audit_offences"])
            for key, where in window["audit_first"].items():
                first.setdefault(key, where)
        return {
            "device": self.accelerator.describe(),
            "device_type": self.accelerator.device_type,
            "simulated": self.simulated,
            "windows": len(self.windows),
            "steps": sum(w["audit_steps"] for w in self.windows),
            "host_syncs": total("audit_host_syncs"),
            "cpu_fallbacks": total("audit_cpu_fallbacks"),
            "mixed_device": total("audit_mixed_device"),
            "graph_breaks": total("audit_graph_breaks"),
            "recompiles": total("audit_recompiles"),
            "graphs": total("audit_graphs"),
            "offences": dict(sorted(offences.items())),
            "first": first,
            "profile": _profile_name() if self.simulated else None,
            "ops": dict(sorted(self.ops.items())),
            "ops_first": dict(sorted(self.ops_first.items())),
            "first_stacks": dict(self.first_stacks),
            "per_window": [
                {
                    k: w[k]
                    for k in (
                        "step",
                        "audit_steps",
                        "audit_host_syncs",
                        "audit_cpu_fallbacks",
                        "audit_mixed_device",
                    )
                }
                for w in self.windows
            ],
        }

    def close(self) -> None:
        """Remove the non-finite hooks (the model outlives the audit in tests and the bench)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.enabled and self.simulated:
            counters.set_census(False)


def _profile_name() -> str | None:
    """The sim's op-coverage profile in force (None: every op native)."""
    profile = counters.active_profile()
    return profile.name if profile is not None else None


# -- audit.nonfinite -------------------------------------------------------------------------------
def _tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating-point tensor in a module's inputs/outputs, with a readable name."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield name, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{name}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}[{key!r}]")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard


def _first_nonfinite(value: Any, name: str) -> tuple[str, torch.Tensor] | None:
    for label, tensor in _tensors(value, name):
        local = _local(tensor.detach())
        if local.numel() and not bool(torch.isfinite(local).all()):
            return label, local
    return None


def _describe(label: str, t: torch.Tensor) -> str:
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    where = tuple(int(i) for i in torch.nonzero(~torch.isfinite(t))[0].tolist())
    return (
        f"{label} (shape {list(t.shape)}, {str(t.dtype).removeprefix('torch.')}, {t.device}) holds "
        f"{nan} NaN and {inf} inf of {t.numel()} values, the first at index {where}"
    )


@contextlib.contextmanager
def _own_syncs() -> Iterator[None]:
    """The checks' own host syncs are the audit's, not the training step's: the sim does not count them."""
    with counters.paused():
        yield


def _install_nonfinite_hooks(model: nn.Module, audit: RuntimeAudit) -> list[Any]:
    names = {module: name for name, module in model.named_modules()}
    parents = {child: name for name, module in model.named_modules() for child in module.children()}

    def forward_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if audit.finding is not None:  # the first one is the one to report; the rest follow from it
            return
        with _own_syncs():
            bad = _first_nonfinite(output, "output")
            if bad is None:
                return
            name = names.get(module) or "(the model)"
            phase = "training forward" if module.training else "evaluation forward"
            bad_input = _first_nonfinite((args, kwargs), "input")
            if bad_input is None:
                cause = "its inputs were all finite, so this module made it"
            else:
                parent = parents.get(module)
                made_by = f"the forward of {parent!r}" if parent else "the caller of the model"
                cause = (
                    f"its {_describe(*bad_input)} was already non-finite: it was made by code between "
                    f"modules, in {made_by}, before this module ran"
                )
            audit.report(
                f"audit.nonfinite: step {audit.step}, {phase}: module {name!r} ({type(module).__name__}) "
                f"returned {_describe(*bad)}; {cause}. Look at that module's arithmetic (division, "
                "log/sqrt/exp of its input, a norm epsilon) and its dtype; then run without "
                "audit.nonfinite (it syncs once per module)"
            )

    def grad_hook(name: str) -> Any:
        def hook(param: torch.Tensor) -> None:
            if param.grad is None or audit.finding is not None:
                return
            with _own_syncs():
                grad = _local(param.grad.detach())
                if grad.numel() and not bool(torch.isfinite(grad).all()):
                    audit.report(
                        f"audit.nonfinite: step {audit.step}, backward: the gradient of parameter "
                        f"{name!r} {_describe('', grad).strip()} while every module's forward output was "
                        "finite; look at the backward of the module owning it (sqrt/pow/norm at 0, a "
                        "division by a value that can be 0)",
                        backward=True,
                    )

        return hook

    handles = [module.register_forward_hook(forward_hook, with_kwargs=True) for module in model.modules()]
    handles += [
        param.register_post_accumulate_grad_hook(grad_hook(name))
        for name, param in model.named_parameters()
        if param.requires_grad
    ]
    return handles


__all__ = [
    "NOT_AVAILABLE",
    "NonFiniteValueError",
    "RuntimeAudit",
    "dynamo_totals",
    "first_location",
    "runtime_audit_problems",
]
