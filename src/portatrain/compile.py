"""``torch.compile`` for portatrain: per-block or whole-model graphs, shape warm-up and the recompile guard.

Graph compilers (XLA on TPU, the Neuron compiler, inductor with ``dynamic=False``) build one graph
per input shape. The data stage keeps the shapes to a short list (``data.loader.batch_shapes``);
this module makes that list pay off and proves it held:

- :func:`compile_options` -- the backend and ``dynamic`` flag: the accelerator adapter's compiler
  (inductor on cpu/cuda, the vendor's on tpu/neuron), ``dynamic=False`` where the adapter wants
  static shapes; ``compile.backend`` / ``compile.dynamic`` override either.
- :func:`compile_granularity` -- what one compiled graph spans (``compile.granularity``).
  ``block`` (the default) compiles each transformer block in place, as torchtitan does, between
  activation checkpointing and FSDP2: identical blocks share one graph per shape, so the cold start
  does not grow with depth, while the embedding, the final norm, the output head and the loss stay
  eager. ``model`` compiles the whole model as one graph (:func:`compile_model`): the stem and head
  are compiled too and one autograd function replaces one per block (5–6% faster steps at the debug
  size on CPU), but every layer is traced and compiled, so the first step grows with depth.
  ``nested`` is hierarchical compilation: the whole model one graph, each block a
  ``torch.compiler.nested_compile_region`` (:func:`nested_region`) traced and compiled once and
  reused per layer -- steps between per-block's and the whole model's (measured), a first step near
  per-block's. It is experimental in torch: in 2.13, inductor's reused regions computed wrong
  gradients unless its buffer reuse is off (``scripts/check_nested_compile.py``), so
  :func:`compile_model` turns that off for this graph. ``model`` and ``nested`` need one unsharded
  model (FSDP2's and TP's per-block hooks and DTensors stay outside graphs).
- :func:`block_compiler` -- the ``compile_block`` callable a model family's ``parallelize.py``
  receives (``None`` when compilation is off or the granularity is ``model``): it compiles one
  block in place (``block``) or marks it as a nested region (``nested``). Models never import this
  module. :func:`compile_blocks` applies it to every block of ``model.layers`` (for
  ``Trainer.parallelize`` overrides).
- :func:`warmup_batches` -- one synthetic batch per shape the loader can emit, built by the loader's
  own collate function (handed over by the trainer) so its keys, dtypes and masks are exactly those
  of real batches.
- :class:`CompileCache` -- compiled artifacts that outlive the process (``compile.cache``): inductor's
  on-disk caches (FX graph cache, AOTAutograd cache) pointed at ``<run_dir>/compile_cache`` (or
  ``compile.cache_dir``) and PyTorch's portable cache artifacts (``torch.compiler.save_cache_artifacts``
  after each step that compiled, ``load_cache_artifacts`` at start-up), plus the vendor compiler's
  own cache where the accelerator adapter names one (``Accelerator.compile_cache_env``). A restart
  after preemption then finds every graph compiled; dynamo still traces each (seconds, not minutes).
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
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from portatrain.config import CompileConfig
from portatrain.errors import ConfigError, UserError

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

# The text dynamo's "fail_on_recompile" stance raises with (a plain RuntimeError in torch 2.13).
_FAIL_ON_RECOMPILE = "fail_on_recompile"


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


CACHE_DIR_ENV = "PORTATRAIN_COMPILE_CACHE_DIR"
"""Default for ``compile.cache_dir`` when it is unset: one cache shared by every run that sees it
(a team's shared location, or a test session)."""


class CompileCache:
    """Where compiled graphs persist across restarts of a run, and the portable artifacts file.

    Layout of the cache directory (``compile.cache_dir``, default ``<run_dir>/compile_cache``)::

        inductor/                      TORCHINDUCTOR_CACHE_DIR: FX graph + AOTAutograd caches
                                       (and the Triton cache on CUDA, which inductor keeps below it)
        portable_artifacts.bin         torch.compiler.save_cache_artifacts() of this run's compilations
        <vendor>/                      the vendor compiler's cache (adapter's compile_cache_env)

    Inductor's on-disk caches are enough on the same machine; the artifacts file is what survives a
    restart on another node with a node-local cache (``compile.cache_dir`` on local disk) and what
    ``load_cache_artifacts`` hot-loads into it. Both are keyed by torch version, graph, shapes and
    config, so a stale entry is never used, only missed. :meth:`activate` must run before the
    process compiles anything; the Trainer calls it before it builds the model.
    """

    ARTIFACTS = "portable_artifacts.bin"

    def __init__(self, directory: Path, *, vendor_env: dict[str, str] | None = None, is_main: bool = True):
        self.directory = Path(directory)
        self.vendor_env = dict(vendor_env or {})
        self.is_main = is_main
        self.loaded: dict[str, int] = {}
        self._graphs_at_save: int | None = None
        self._saved_env: dict[str, str | None] = {}

    @classmethod
    def for_run(
        cls, compile_cfg: CompileConfig, run_dir: Path, accelerator: Accelerator, *, is_main: bool
    ) -> CompileCache | None:
        """The run's cache, or None when compilation or the cache is off."""
        if not (compile_cfg.enabled and compile_cfg.cache):
            return None
        shared = compile_cfg.cache_dir or os.environ.get(CACHE_DIR_ENV)
        directory = Path(shared) if shared else Path(run_dir) / "compile_cache"
        return cls(directory, vendor_env=accelerator.compile_cache_env(directory), is_main=is_main)

    @property
    def artifacts_path(self) -> Path:
        return self.directory / self.ARTIFACTS

    def activate(self) -> None:
        """Point inductor's (and the vendor's) caches here and hot-load saved portable artifacts."""
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        self.directory.mkdir(parents=True, exist_ok=True)
        # Read by inductor at each compilation (cache_dir_utils.cache_dir), so setting it now works
        # as long as nothing was compiled yet; the two switches are read from the environment only
        # when torch is imported, hence set on the config modules too.
        env = {"TORCHINDUCTOR_CACHE_DIR": str((self.directory / "inductor").resolve()), **self.vendor_env}
        self._saved_env = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        inductor_config.fx_graph_cache = True
        functorch_config.enable_autograd_cache = True
        if self.artifacts_path.is_file():
            info = torch.compiler.load_cache_artifacts(self.artifacts_path.read_bytes())
            self.loaded = _artifact_counts(info)
            logger.info(
                "compile cache %s: loaded portable artifacts (%s)",
                self.directory,
                ", ".join(f"{k} {v}" for k, v in self.loaded.items()) or "none",
            )
        else:
            logger.info("compile cache %s: empty, graphs compiled now are kept for restarts", self.directory)
        self._graphs_at_save = dynamo_graph_count()

    def deactivate(self) -> None:
        """Restore the environment variables :meth:`activate` changed (the process, and child
        processes it starts later, go back to their own caches)."""
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = {}

    def save_if_compiled(self) -> bool:
        """Write the portable artifacts (rank 0) when graphs were compiled since the last save."""
        graphs = dynamo_graph_count()
        if self._graphs_at_save is None or graphs == self._graphs_at_save:
            return False
        self._graphs_at_save = graphs
        if not self.is_main:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        artifacts, info = saved
        tmp = self.artifacts_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(artifacts)
        tmp.replace(self.artifacts_path)  # atomic: a restart never reads half a file
        logger.info(
            "compile cache: saved %s (%.1f MB; %s)",
            self.artifacts_path,
            len(artifacts) / 1e6,
            ", ".join(f"{k} {v}" for k, v in _artifact_counts(info).items()),
        )
        return True


def _artifact_counts(info: Any) -> dict[str, int]:
    """``{kind: count}`` of a ``torch.compiler.CacheInfo`` (empty for None)."""
    if info is None:
        return {}
    counts = {}
    for name in dir(info):
        value = getattr(info, name) if name.endswith("_artifacts") else None
        if isinstance(value, list) and value:
            counts[name.removesuffix("_artifacts")] = len(value)
    return counts


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
    passed through ``collate``, so a bucket batch has no padding and a packing batch carries the
    ``document_ids`` a real one carries (one document per row: the Trainer's device-side mask is then
    plain causal, with a real batch's shape and dtype). Token ids come from a private generator: the global RNG is not
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

    def __init__(self, compile_cfg: CompileConfig, cache: CompileCache | None = None) -> None:
        self.cache = cache  # saved after warm-up and after any step that compiled
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
        if self.cache is not None:
            self.cache.save_if_compiled()
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
        """Disarm: restore dynamo's default stance for the rest of the process; put the compile
        cache's environment back."""
        if self.armed and self.on_recompile == "error":
            torch.compiler.set_stance("default")
        self.armed = False
        if self.cache is not None:
            self.cache.deactivate()

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
            if self.cache is not None:
                self.cache.save_if_compiled()  # a counter read per step; writes only after compiling
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
            if self.cache is not None:
                self.cache.save_if_compiled()

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
