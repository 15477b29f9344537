"""``torch.compile`` for portatrain: per-block compilation, shape warm-up and the recompile guard.

Graph compilers (XLA on TPU, the Neuron compiler, inductor with ``dynamic=False``) build one graph
per input shape. The data stage keeps the shapes to a short list (``data.loader.batch_shapes``);
this module makes that list pay off and proves it held:

- :func:`compile_options` -- the backend and ``dynamic`` flag: the accelerator adapter's compiler
  (inductor on cpu/cuda, the vendor's on tpu/neuron), ``dynamic=False`` where the adapter wants
  static shapes; ``compile.backend`` / ``compile.dynamic`` override either.
- :func:`block_compiler` -- the ``compile_block`` callable a model family's ``parallelize.py``
  receives (``None`` when compilation is off): it compiles one transformer block in place, as
  torchtitan does, between activation checkpointing and FSDP2. Identical blocks share one graph per
  shape, while the embedding, the output head and the loss stay eager. Models never import this
  module. :func:`compile_blocks` applies it to every block of ``model.layers``.
- :func:`warmup_batches` -- one synthetic batch per shape the loader can emit, built by the loader's
  own collate function (handed over by the trainer) so its keys, dtypes and masks are exactly those
  of real batches.
- :class:`CompileMonitor` -- counts graphs, times the warm-up per shape, then arms the guard:
  after warm-up any recompilation is unexpected; ``compile.on_recompile=error`` stops with a
  :class:`RecompileError` naming the batch shape and the dynamo guard that failed (through
  ``torch.compiler.set_stance("fail_on_recompile")``, so nothing is compiled first),
  ``compile.on_recompile=warn`` logs the same and carries on.

Counting uses dynamo's process-wide records (``torch._dynamo.utils.counters`` and
``guard_failures``), taken as differences from the monitor's creation, so other compiled code in
the same process shows up in the count too. Dynamo caches compiled code per Python code object:
a second model of the same class in one process reuses the first one's graphs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from portatrain.config import CompileConfig
from portatrain.errors import UserError

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

# The text dynamo's "fail_on_recompile" stance raises with (a plain RuntimeError in torch 2.13).
_FAIL_ON_RECOMPILE = "fail_on_recompile"


ON_RECOMPILE = ("error", "warn")
"""Allowed values of ``compile.on_recompile``."""


def compile_problems(compile_cfg: CompileConfig) -> list[str]:
    """Every problem of the ``compile`` group (the validator's compile-stage check)."""
    problems = []
    if compile_cfg.on_recompile not in ON_RECOMPILE:
        problems.append(
            f"compile.on_recompile={compile_cfg.on_recompile!r} is not one of {', '.join(ON_RECOMPILE)}"
        )
    if compile_cfg.warmup and not compile_cfg.enabled:
        problems.append("compile.warmup=true needs compile.enabled=true (nothing to warm up otherwise)")
    return problems


class RecompileError(UserError, RuntimeError):
    """A graph was recompiled after warm-up while ``compile.on_recompile=error``."""


def compile_options(compile_cfg: CompileConfig, accelerator: Accelerator) -> tuple[str, bool | None]:
    """``(backend, dynamic)`` for ``torch.compile``: the adapter's choice unless the config overrides.

    ``dynamic=None`` (torch's default: static first, then dynamic after a shape changes) where the
    adapter does not ask for static shapes; ``False`` where it does (one graph per shape, TPU/Neuron).
    """
    backend = compile_cfg.backend or accelerator.compile_backend
    if compile_cfg.dynamic is not None:
        return backend, bool(compile_cfg.dynamic)
    return backend, (False if accelerator.static_shapes else None)


def block_compiler(
    compile_cfg: CompileConfig, accelerator: Accelerator
) -> Callable[[nn.Module], nn.Module] | None:
    """The ``compile_block`` a parallelizer receives: compiles one block in place; None when disabled.

    In place (``Module.compile``) rather than wrapping, so parameter names -- and with them
    checkpoints and Hugging Face weight maps -- do not gain an ``_orig_mod.`` prefix. ``fullgraph``:
    a graph break inside a block would split it into several graphs per shape; fail loudly instead.
    Works on the meta device (compilation happens at the first call) and on blocks already wrapped
    for activation checkpointing. FSDP2 is applied afterwards; its hooks stay outside the graphs.
    """
    if not compile_cfg.enabled:
        return None
    return _block_compiler(*compile_options(compile_cfg, accelerator))


def _block_compiler(backend: str, dynamic: bool | None) -> Callable[[nn.Module], nn.Module]:
    def compile_block(block: nn.Module) -> nn.Module:
        block.compile(backend=backend, dynamic=dynamic, fullgraph=True)
        return block

    logger.info("compiling transformer blocks with backend=%s dynamic=%s", backend, dynamic)
    return compile_block


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


def warmup_batches(
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    shapes: Sequence[tuple[int, int]],
    *,
    packed: bool,
    vocab_size: int,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """One host batch per ``(batch, seq)`` of ``shapes``, every position carrying a label.

    ``collate`` is the loader's own collate function and ``shapes`` its
    ``portatrain.data.loader.batch_shapes``; ``packed`` says whether it collates packed rows (lists of
    documents) rather than documents. Each row is one random document exactly as long as the row,
    passed through ``collate``, so a bucket batch has no padding and a packing batch has the (plain
    causal) mask a real one carries. Token ids come from a private generator: the global RNG is not
    touched.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for batch_size, seq_len in shapes:
        docs = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator).tolist()
        rows = [[doc] for doc in docs] if packed else docs
        batches.append(collate(rows))
    return batches


def dynamo_graph_count() -> int:
    """Graphs dynamo has compiled in this process (all functions, all backends)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _guard_failure_counts() -> dict[Any, int]:
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def _new_guard_failures(before: dict[Any, int]) -> list[str]:
    from torch._dynamo.utils import guard_failures

    return [r for code, reasons in guard_failures.items() for r in reasons[before.get(code, 0) :]]


def _guard_lines(message: str) -> list[str]:
    """The ``- 0/1: tensor 'x' size mismatch ...`` lines of dynamo's recompile message."""
    return [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]


def _shape_list(shapes: Sequence[Shape]) -> str:
    return ", ".join(str(tuple(s)) for s in shapes) or "none"


class CompileMonitor:
    """Graph counts, per-shape warm-up timings and the post-warm-up recompile guard.

    A disabled monitor (``compile.enabled=false``) does nothing and reports no metrics, so the
    trainer calls it unconditionally. Life cycle: :meth:`warm_up` compiles every shape and arms the
    guard; :meth:`watch` wraps each step (and evaluation); :meth:`close` restores dynamo's default
    stance, which is process-wide.
    """

    def __init__(self, compile_cfg: CompileConfig) -> None:
        self.enabled = bool(compile_cfg.enabled)
        self.on_recompile = compile_cfg.on_recompile
        self.warmed_shapes: list[Shape] = []
        self.armed = False
        self._graphs_at_start = dynamo_graph_count()
        self._graphs_at_arm = 0

    @property
    def graphs(self) -> int:
        """Graphs compiled since this monitor was created."""
        return dynamo_graph_count() - self._graphs_at_start

    @property
    def recompiles(self) -> int:
        """Graphs compiled after warm-up (0 before it)."""
        return dynamo_graph_count() - self._graphs_at_arm if self.armed else 0

    def metrics(self) -> dict[str, int]:
        """``compile_graphs`` and, once warm-up armed the guard, ``compile_recompiles``."""
        if not self.enabled:
            return {}
        out = {"compile_graphs": self.graphs}
        if self.armed:
            out["compile_recompiles"] = self.recompiles
        return out

    def warm_up(
        self,
        batches: Sequence[dict[str, torch.Tensor]],
        *,
        train: Callable[[dict[str, torch.Tensor]], Any],
        evaluate: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        synchronize: Callable[[], None] = lambda: None,
    ) -> list[dict[str, Any]]:
        """Run ``train`` (and ``evaluate``) once per batch, time each, then arm the guard.

        ``train`` must compile what a training step compiles (forward + backward), ``evaluate``
        what evaluation does (typically a ``no_grad`` forward in eval mode: grad mode is part of
        dynamo's guards, so it is a graph of its own). Side effects on gradients, RNG or the model's
        mode are the caller's to undo. Returns one record per shape: ``shape``, ``train_s``,
        ``eval_s`` (when evaluated) and ``graphs`` (graphs compiled for that shape; a time is the
        cold start: compilation plus one execution).
        """
        shapes = [tuple(b["input_ids"].shape) for b in batches]
        # Dynamo stops compiling a function after `recompile_limit` graphs (8 by default) and runs
        # it eagerly from then on -- silently slower, and the graphs would be missing from the count.
        modes = 2 if evaluate is not None else 1
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, modes * len(shapes))
        records = []
        for shape, batch in zip(shapes, batches, strict=True):
            graphs = dynamo_graph_count()
            record: dict[str, Any] = {"shape": list(shape)}
            for name, fn in (("train_s", train), ("eval_s", evaluate)):
                if fn is None:
                    continue
                start = time.perf_counter()
                fn(batch)
                synchronize()
                record[name] = round(time.perf_counter() - start, 3)
            record["graphs"] = dynamo_graph_count() - graphs
            logger.info(
                "compile warm-up: shape %s compiled in %s (%d graph%s)",
                shape,
                ", ".join(f"{k[:-2]} {record[k]:.1f}s" for k in ("train_s", "eval_s") if k in record),
                record["graphs"],
                "" if record["graphs"] == 1 else "s",
            )
            records.append(record)
        self.arm(shapes)
        return records

    def arm(self, shapes: Sequence[Shape]) -> None:
        """From now on every new graph is a recompile; under ``error``, dynamo refuses to compile."""
        if not self.enabled:
            return
        self.warmed_shapes = [tuple(s) for s in shapes]
        self._graphs_at_arm = dynamo_graph_count()
        self.armed = True
        if self.on_recompile == "error":
            torch.compiler.set_stance(_FAIL_ON_RECOMPILE)

    def close(self) -> None:
        """Disarm: restore dynamo's default stance for the rest of the process."""
        if self.armed and self.on_recompile == "error":
            torch.compiler.set_stance("default")
        self.armed = False

    @contextlib.contextmanager
    def watch(
        self, batches: Sequence[dict[str, torch.Tensor]] | None = None, *, what: str = "step"
    ) -> Iterator[None]:
        """Run a training step (or evaluation, ``batches=None``) under the guard.

        ``error``: translate dynamo's refusal into :class:`RecompileError`. ``warn``: log any graph
        compiled inside the block with its shapes and guard failures, and go on.
        """
        if not self.armed:
            yield
            return
        graphs, failures = dynamo_graph_count(), _guard_failure_counts()
        try:
            yield
        except RuntimeError as exc:
            if self.on_recompile == "error" and _FAIL_ON_RECOMPILE in str(exc):
                raise RecompileError(self._message(batches, what, _guard_lines(str(exc)))) from exc
            raise
        new = dynamo_graph_count() - graphs
        if new:
            logger.warning(
                "%s (%d new graph%s; compile.on_recompile=warn, continuing)",
                self._message(batches, what, _new_guard_failures(failures)),
                new,
                "" if new == 1 else "s",
            )

    def _message(
        self, batches: Sequence[dict[str, torch.Tensor]] | None, what: str, guards: list[str]
    ) -> str:
        if batches is None:
            where = f"during {what}"
        else:
            shapes = [tuple(b["input_ids"].shape) for b in batches]
            unseen = [s for s in dict.fromkeys(shapes) if s not in self.warmed_shapes]
            where = f"in a {what} with batch shape {_shape_list(unseen or shapes)} (batch, seq)"
            if unseen:
                where += ", a shape the warm-up did not compile"
        guard = "; ".join(guards) or "no guard failure recorded"
        return (
            f"unexpected recompile after compile warm-up {where}. Warmed-up shapes: "
            f"{_shape_list(self.warmed_shapes)}. Dynamo guard that failed: {guard}. Fix: keep every "
            "batch at a configured shape (data.collator=bucket|packing|pad_to_max, data.buckets, "
            "data.seq_len, data.batch_size), or set compile.on_recompile=warn to recompile and go on"
        )
