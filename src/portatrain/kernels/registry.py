"""Which operations can be overridden, by which kernels, on which backend -- and swapping them in.

Vocabulary:

* An **operation** (:data:`OPERATIONS`) is a small numeric function the models call through a
  swappable slot: ``rmsnorm``, ``swiglu``, ``rope``. Its pure-PyTorch reference
  (:mod:`portatrain.kernels.reference`) runs unless an override is enabled.
* An **override** (:data:`OVERRIDES`) is one kernel for one operation on one backend (a
  ``device.type``), named ``<implementation>_<operation>``:

  ==========================  =======  ===============================================
  name                        backend  kernel and bridge
  ==========================  =======  ===============================================
  ``pallas_<op>``             tpu      Pallas, through ``torch.tpu.pallas.jax_op``
  ``pallas_interpret_<op>``   cpu      the same Pallas kernel in JAX's CPU interpreter
                                       (slow; for parity tests and CPU proof runs)
  ``nki_<op>``                neuron   NKI, through ``torch_neuronx.nki_op``
  ==========================  =======  ===============================================

Overrides are opt-in by exact name (``kernels.enabled=[pallas_rmsnorm,pallas_swiglu]``): nothing is
switched on by detecting hardware or packages, and a name for another backend is an error rather
than a silent fallback. The choice is made once, when the model is built:

    kernel_set = resolve(cfg.kernels.enabled, device_type)   # raises KernelConfigError
    apply(model, kernel_set)                                 # before parallelize/compile

**The model contract.** A module offers an operation by holding its callable in an attribute
named after it (:attr:`Operation.slot`) and calling it from ``forward``: ``RMSNorm.rmsnorm_fn``,
``FeedForward.swiglu_fn``, ``Attention.rope_fn``, each initialised to the reference. :func:`apply`
replaces those attributes on every module that has them -- per instance, so two models in one
process do not interfere -- and fails if an enabled operation has no slot in the model.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn

from portatrain.errors import ConfigError
from portatrain.kernels import reference


class KernelConfigError(ConfigError):
    """``kernels.enabled`` names something that cannot run here; the message lists what exists."""


@dataclass(frozen=True)
class Operation:
    """One overridable numeric operation."""

    name: str
    """Key in ``OPERATIONS`` and the suffix of its override names."""
    reference: Callable[..., torch.Tensor]
    """The pure-PyTorch implementation models use by default."""
    signature: str
    """Call signature shared by the reference and every override."""
    slot: str
    """Attribute that model modules hold this operation's callable in."""


@dataclass(frozen=True)
class Override:
    """One kernel for one operation on one backend."""

    name: str
    """What ``kernels.enabled`` lists, ``<implementation>_<operation>``."""
    operation: str
    """The operation it replaces."""
    backend: str
    """The ``device.type`` it runs on."""
    implementation: str
    """``pallas``, ``pallas_interpret`` or ``nki``."""
    builder: str
    """``module:function`` returning the callable, given the operation name; imported lazily so that
    ``import portatrain`` never loads jax or a vendor stack."""
    requires: tuple[str, ...]
    """Top-level modules it imports; checked with ``find_spec`` (nothing is imported)."""
    install_hint: str
    """How to get ``requires`` when one is missing."""

    def build(self) -> Callable[..., torch.Tensor]:
        module_name, function = self.builder.split(":")
        return getattr(importlib.import_module(module_name), function)(self.operation)


OPERATIONS: Mapping[str, Operation] = MappingProxyType(
    {
        op.name: op
        for op in (
            Operation("rmsnorm", reference.rmsnorm, "rmsnorm(x, weight, eps) -> y", "rmsnorm_fn"),
            Operation("swiglu", reference.swiglu, "swiglu(gate, up) -> silu(gate) * up", "swiglu_fn"),
            Operation("rope", reference.rope, "rope(x[B,H,S,D], cos, sin) -> x rotated", "rope_fn"),
        )
    }
)
"""Every overridable operation, by name."""

_PALLAS_HINT = "pip install 'portatrain[pallas]'"
_NKI_HINT = (
    "install torch-neuronx and nki from AWS's Neuron pip repository "
    "(--extra-index-url https://pip.repos.neuron.amazonaws.com) on a Trainium host"
)


def _implementations(operation: str) -> tuple[Override, ...]:
    return (
        Override(
            f"pallas_{operation}",
            operation,
            "tpu",
            "pallas",
            "portatrain.kernels.pallas:build_tpu",
            ("jax", "torch_tpu"),
            _PALLAS_HINT + " on a TPU host with torch_tpu",
        ),
        Override(
            f"pallas_interpret_{operation}",
            operation,
            "cpu",
            "pallas_interpret",
            "portatrain.kernels.pallas:build_interpret",
            ("jax",),
            _PALLAS_HINT,
        ),
        Override(
            f"nki_{operation}",
            operation,
            "neuron",
            "nki",
            "portatrain.kernels.nki:build",
            ("nki", "torch_neuronx"),
            _NKI_HINT,
        ),
    )


OVERRIDES: Mapping[str, Override] = MappingProxyType(
    {ov.name: ov for op in OPERATIONS for ov in _implementations(op)}
)
"""Every kernel override, by the name ``kernels.enabled`` uses."""


def missing_requirements(override: Override) -> list[str]:
    """Modules ``override`` needs that are not installed (looked up, not imported)."""
    return [m for m in override.requires if importlib.util.find_spec(m) is None]


def _catalogue(device_type: str | None = None) -> str:
    names = [ov.name for ov in OVERRIDES.values() if device_type in (None, ov.backend)]
    return ", ".join(names) if names else "none"


def config_problems(enabled: list[str] | tuple[str, ...], device_type: str) -> list[str]:
    """Every problem with ``kernels.enabled`` for a run on ``device_type``, each with its fix.

    ``device_type`` is the run's ``device.type`` after discovery; with ``"auto"`` (not yet
    resolved) the backend check is left to :func:`resolve` at build time, the rest (names,
    duplicates, installed packages) is checked here.
    """
    problems: list[str] = []
    chosen: dict[str, str] = {}
    for name in enabled:
        override = OVERRIDES.get(name)
        if override is None:
            problems.append(
                f"kernels.enabled: unknown kernel {name!r}; known: {_catalogue()} "
                f"(operations: {', '.join(OPERATIONS)}; see kernels/README.md)"
            )
            continue
        if device_type != "auto" and override.backend != device_type:
            problems.append(
                f"kernels.enabled: {name} runs on device.type={override.backend}, but this run is on "
                f"device.type={device_type}; remove it, or choose one for {device_type}: "
                f"{_catalogue(device_type)}"
            )
            continue
        if override.operation in chosen:
            problems.append(
                f"kernels.enabled: {chosen[override.operation]} and {name} both override "
                f"{override.operation}; keep one"
            )
            continue
        chosen[override.operation] = name
        missing = missing_requirements(override)
        if missing:
            problems.append(
                f"kernels.enabled: {name} needs {', '.join(missing)}, not installed; {override.install_hint}"
            )
    return problems


@dataclass(frozen=True)
class KernelSet:
    """The resolved choice: operation name -> callable, for the enabled overrides only."""

    kernels: Mapping[str, Callable[..., torch.Tensor]] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    """The override names, in ``kernels.enabled`` order (for logs)."""

    def __bool__(self) -> bool:
        return bool(self.kernels)


def resolve(enabled: list[str] | tuple[str, ...], device_type: str) -> KernelSet:
    """Check ``enabled`` for ``device_type`` and build each override's custom op, once.

    Raises :class:`KernelConfigError` listing every problem. This is the only place overrides are
    imported, so the kernels' stacks (jax, torch_tpu, nki) load only when asked for.
    """
    if device_type == "auto":
        raise KernelConfigError("resolve() needs the actual device type, not 'auto'; discover it first")
    problems = config_problems(enabled, device_type)
    if problems:
        raise KernelConfigError("invalid kernels.enabled:\n  - " + "\n  - ".join(problems))
    kernels = {OVERRIDES[name].operation: OVERRIDES[name].build() for name in enabled}
    return KernelSet(MappingProxyType(kernels), tuple(enabled))


def apply(model: nn.Module, kernel_set: KernelSet) -> dict[str, int]:
    """Point every module slot of ``model`` at the chosen kernels; return slots replaced per operation.

    Call it on the freshly built model, before parallelization and compilation, so compiled graphs
    trace the custom op. Raises :class:`KernelConfigError` when an enabled operation has no slot in
    this model (the override would silently do nothing).
    """
    counts = {op: 0 for op in kernel_set.kernels}
    for module in model.modules():
        for op, kernel in kernel_set.kernels.items():
            slot = OPERATIONS[op].slot
            if hasattr(module, slot):
                setattr(module, slot, kernel)
                counts[op] += 1
    unused = [op for op, n in counts.items() if n == 0]
    if unused:
        raise KernelConfigError(
            f"kernels.enabled={list(kernel_set.names)}: {type(model).__name__} has no module slot for "
            f"{', '.join(unused)} (expected attribute(s) "
            f"{', '.join(OPERATIONS[op].slot for op in unused)}); this model cannot use those overrides"
        )
    return counts
