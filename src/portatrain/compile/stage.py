"""The compile stage: which backend, what one graph spans, and compiling blocks or the whole model.

- :func:`compile_options` -- the backend and ``dynamic`` flag: the accelerator adapter's compiler
  (inductor on cpu/cuda, the vendor's on tpu/neuron), ``dynamic=False`` where the adapter wants
  static shapes; ``compile.backend`` / ``compile.dynamic`` override either.
- :func:`compile_granularity` -- what one compiled graph spans (``compile.granularity``: ``block``,
  ``model`` or ``nested``; see the package docstring), checked against the run's layout.
- :func:`block_compiler` -- the ``compile_block`` callable a model family's ``parallelize.py``
  receives; :func:`compile_blocks` applies it to every block of ``model.layers``.
- :func:`nested_region` / :func:`compile_model` -- hierarchical and whole-model compilation.
- :func:`compile_problems` -- the ``compile`` group's problems, for the validator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from portatrain.config import CompileConfig
from portatrain.errors import ConfigError

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator

logger = logging.getLogger(__name__)

ON_RECOMPILE = ("error", "warn")
"""Allowed values of ``compile.on_recompile``."""

GRANULARITIES = ("block", "model", "nested")
"""Allowed values of ``compile.granularity``."""


def compile_problems(compile_cfg: CompileConfig) -> list[str]:
    """Every problem of the ``compile`` group (the validator's compile-stage check)."""
    problems = []
    if compile_cfg.on_recompile not in ON_RECOMPILE:
        problems.append(
            f"compile.on_recompile={compile_cfg.on_recompile!r} is not one of {', '.join(ON_RECOMPILE)}"
        )
    if compile_cfg.granularity not in GRANULARITIES:
        problems.append(
            f"compile.granularity={compile_cfg.granularity!r} is not one of {', '.join(GRANULARITIES)}"
        )
    if compile_cfg.warmup and not compile_cfg.enabled:
        problems.append("compile.warmup=true needs compile.enabled=true (nothing to warm up otherwise)")
    return problems


def compile_options(compile_cfg: CompileConfig, accelerator: Accelerator) -> tuple[str, bool | None]:
    """``(backend, dynamic)`` for ``torch.compile``: the adapter's choice unless the config overrides.

    ``dynamic=None`` (torch's default: static first, then dynamic after a shape changes) where the
    adapter does not ask for static shapes; ``False`` where it does (one graph per shape, TPU/Neuron).
    """
    backend = compile_cfg.backend or accelerator.compile_backend
    if compile_cfg.dynamic is not None:
        return backend, bool(compile_cfg.dynamic)
    return backend, (False if accelerator.static_shapes else None)


def compile_granularity(compile_cfg: CompileConfig, *, sharded: bool) -> str:
    """``compile.granularity`` (``"block"`` or ``"model"``), checked against the run's layout.

    ``sharded``: FSDP2 or tensor parallel is applied to the model. Their per-block hooks and DTensors
    stay outside compiled graphs only when each block is its own graph, so ``model`` and ``nested``
    are refused there with the fix (when compilation is on; off, the setting is moot).
    """
    if compile_cfg.enabled and compile_cfg.granularity != "block" and sharded:
        raise ConfigError(
            f"compile.granularity={compile_cfg.granularity} compiles one unsharded model, but this run "
            "shards it (FSDP2 over data-parallel ranks or tensor parallel, parallel.*); use "
            "compile.granularity=block"
        )
    return compile_cfg.granularity


def block_compiler(
    compile_cfg: CompileConfig, accelerator: Accelerator, granularity: str = "block"
) -> Callable[[nn.Module], nn.Module] | None:
    """The ``compile_block`` a parallelizer receives: compiles one block in place (granularity
    ``block``) or marks it as a nested region (``nested``); None when compilation is off or the whole
    model is compiled with plain blocks (``model``).

    In place (``Module.compile``) rather than wrapping, so parameter names -- and with them
    checkpoints and Hugging Face weight maps -- do not gain an ``_orig_mod.`` prefix. ``fullgraph``:
    a graph break inside a block would split it into several graphs per shape; fail loudly instead.
    Works on the meta device (compilation happens at the first call) and on blocks already wrapped
    for activation checkpointing. FSDP2 is applied afterwards; its hooks stay outside the graphs.
    """
    if not compile_cfg.enabled or granularity == "model":
        return None
    if granularity == "nested":
        return nested_region
    return _block_compiler(*compile_options(compile_cfg, accelerator))


def _block_compiler(backend: str, dynamic: bool | None) -> Callable[[nn.Module], nn.Module]:
    def compile_block(block: nn.Module) -> nn.Module:
        block.compile(backend=backend, dynamic=dynamic, fullgraph=True)
        return block

    logger.info("compiling transformer blocks with backend=%s dynamic=%s", backend, dynamic)
    return compile_block


# One subclass per block class whose forward is the marked region: dynamo reuses a region's compiled
# subgraph across calls of the same marked function, so every block must call the same object.
_NESTED_CLASSES: dict[type, type] = {}


def nested_region(block: nn.Module) -> nn.Module:
    """Mark ``block`` as a nested compile region, in place; return it. A no-op in eager mode.

    The block's class is swapped for a subclass whose ``forward`` is
    ``torch.compiler.nested_compile_region(forward)``, as FSDP2's ``fully_shard`` swaps classes:
    ``isinstance``, parameter names and the original class stay as they were, and every block of a
    class shares the one marked function. (Marking each instance's bound ``forward`` instead lost the
    blocks' gradients in torch 2.13.) Inside a compiled model dynamo then traces the first block once
    and reuses its subgraph for every block with matching inputs.
    """
    cls = type(block)
    if cls not in _NESTED_CLASSES.values():
        marked = _NESTED_CLASSES.get(cls)
        if marked is None:
            attrs = {
                "forward": torch.compiler.nested_compile_region(cls.forward),
                "__module__": cls.__module__,
            }
            marked = _NESTED_CLASSES[cls] = type(cls.__name__, (cls,), attrs)
        block.__class__ = marked
    return block


def compile_model(
    model: nn.Module, compile_cfg: CompileConfig, accelerator: Accelerator, granularity: str = "model"
) -> nn.Module:
    """Compile the whole ``model`` in place as one graph (granularity ``model`` or ``nested``).

    ``fullgraph``: a graph break would leave parts eager and multiply the graphs per shape; it fails
    at the first step instead, naming the break. In place, so parameter names stay unprefixed. With
    ``nested`` (blocks marked by :func:`nested_region`), inductor's buffer reuse is off for this graph:
    with it on, torch 2.13 computed wrong gradients for reused regions
    (``scripts/check_nested_compile.py``); buffers are still freed when dead.
    """
    backend, dynamic = compile_options(compile_cfg, accelerator)
    logger.info("compiling the whole model (%s) with backend=%s dynamic=%s", granularity, backend, dynamic)
    options = {"allow_buffer_reuse": False} if granularity == "nested" and backend == "inductor" else None
    model.compile(backend=backend, dynamic=dynamic, fullgraph=True, options=options)
    return model


def compile_blocks(model: nn.Module, accelerator: Accelerator, compile_cfg: CompileConfig) -> nn.Module:
    """Compile each block of ``model.layers`` in place (see :func:`block_compiler`); return the model.

    For code that builds its own model outside a family's parallelizer (a ``Trainer.parallelize``
    override, tests); ``compile_cfg.enabled`` is not consulted here.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise ValueError(
            f"compile.enabled=true compiles each block of model.layers, but {type(model).__name__} has "
            "no ModuleDict/ModuleList named 'layers'; compile the model in your Trainer.parallelize "
            "override, or set compile.enabled=false"
        )
    compile_block = _block_compiler(*compile_options(compile_cfg, accelerator))
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        compile_block(block)
    return model
