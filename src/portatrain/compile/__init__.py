"""``torch.compile`` for portatrain: per-block or whole-model graphs, shape warm-up and the recompile guard.

Graph compilers (XLA on TPU, the Neuron compiler, inductor with ``dynamic=False``) build one graph
per input shape. The data stage keeps the shapes to a short list (``data.loader.batch_shapes``);
this package makes that list pay off and proves it held. One module per concern:

- :mod:`.stage` -- the compile stage. :func:`compile_options`: the backend and ``dynamic`` flag
  (the accelerator adapter's compiler, ``dynamic=False`` where it wants static shapes;
  ``compile.backend`` / ``compile.dynamic`` override either). :func:`compile_granularity`: what one
  compiled graph spans (``compile.granularity``).
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
  :func:`block_compiler`: the ``compile_block`` callable a model family's ``parallelize.py``
  receives (``None`` when compilation is off or the granularity is ``model``): it compiles one
  block in place (``block``) or marks it as a nested region (``nested``). Models never import this
  package. :func:`compile_blocks` applies it to every block of ``model.layers`` (for
  ``Trainer.parallelize`` overrides).
- :mod:`.cache` -- :class:`CompileCache`, compiled artifacts that outlive the process
  (``compile.cache``): inductor's on-disk caches and PyTorch's portable cache artifacts, plus the
  vendor compiler's own cache where the accelerator adapter names one.
- :mod:`.monitor` -- :func:`warmup_batches`, one synthetic batch per shape the loader can emit,
  built by the loader's own collate function (handed over by the trainer) so its keys, dtypes and
  masks are exactly those of real batches; :class:`CompileMonitor`, which counts graphs, times the
  warm-up per shape, then arms the guard (``compile.on_recompile=error`` stops with a
  :class:`RecompileError` naming the batch shape and the dynamo guard that failed; ``warn`` logs
  the same and carries on).
- :mod:`.dynamo` -- dynamo's process-wide records (graphs compiled, guard failures), read as
  differences, so other compiled code in the same process shows up in the counts too.
"""

from __future__ import annotations

from portatrain.compile.cache import CACHE_DIR_ENV, CompileCache
from portatrain.compile.dynamo import dynamo_graph_count
from portatrain.compile.monitor import CompileMonitor, RecompileError, Shape, warmup_batches
from portatrain.compile.stage import (
    GRANULARITIES,
    ON_RECOMPILE,
    block_compiler,
    compile_blocks,
    compile_granularity,
    compile_model,
    compile_options,
    compile_problems,
    nested_region,
)

__all__ = [
    "CACHE_DIR_ENV",
    "GRANULARITIES",
    "ON_RECOMPILE",
    "CompileCache",
    "CompileMonitor",
    "RecompileError",
    "Shape",
    "block_compiler",
    "compile_blocks",
    "compile_granularity",
    "compile_model",
    "compile_options",
    "compile_problems",
    "dynamo_graph_count",
    "nested_region",
    "warmup_batches",
]
