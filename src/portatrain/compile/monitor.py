"""Shape warm-up and the recompile guard: :class:`CompileMonitor`, :func:`warmup_batches`.

Graph compilers build one graph per input shape, and the data stage keeps the shapes to a short
list (``data.loader.batch_shapes``). :func:`warmup_batches` builds one synthetic batch per shape;
:meth:`CompileMonitor.warm_up` compiles each (timed) and arms the guard: after warm-up any
recompilation is unexpected; ``compile.on_recompile=error`` stops with a :class:`RecompileError`
naming the batch shape and the dynamo guard that failed (through
``torch.compiler.set_stance("fail_on_recompile")``, so nothing is compiled first),
``compile.on_recompile=warn`` logs the same and carries on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from portatrain.compile.dynamo import (
    dynamo_graph_count,
    guard_failure_counts,
    guard_lines,
    new_guard_failures,
)
from portatrain.config import CompileConfig
from portatrain.errors import UserError

if TYPE_CHECKING:
    from portatrain.compile.cache import CompileCache

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

# The text dynamo's "fail_on_recompile" stance raises with (a plain RuntimeError in torch 2.13).
_FAIL_ON_RECOMPILE = "fail_on_recompile"


class RecompileError(UserError, RuntimeError):
    """A graph was recompiled after warm-up while ``compile.on_recompile=error``."""


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
        graphs, failures = dynamo_graph_count(), guard_failure_counts()
        try:
            yield
        except RuntimeError as exc:
            if self.on_recompile == "error" and _FAIL_ON_RECOMPILE in str(exc):
                raise RecompileError(self._message(batches, what, guard_lines(str(exc)))) from exc
            raise
        new = dynamo_graph_count() - graphs
        if new:
            logger.warning(
                "%s (%d new graph%s; compile.on_recompile=warn, continuing)",
                self._message(batches, what, new_guard_failures(failures)),
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
