"""Pipeline parallelism: a decoder split into stages along its blocks, run by a
``torch.distributed.pipelining`` schedule on the outermost mesh dimension (``pp``).

What this file does:

* :data:`SCHEDULES` -- the schedules ``parallel.pp_schedule`` may name, and what each needs
  (several stages per rank, a V-shaped placement, a backward split into input and weight gradients).
* :func:`pipeline_problems` -- the pipeline's part of config validation (``portatrain.validate``): every
  layout, schedule, micro-batch and model combination the pipeline cannot run, each one line with the fix.
* :func:`stage_layers` and :func:`stage_ids` -- which blocks each stage holds (even by default, or
  ``parallel.pp_layers``) and which stages a pipeline rank runs: ``rank + k * pp`` (loop), or ``rank`` and
  ``2 * pp - 1 - rank`` (V, for ``ZBVZeroBubble``).
* :func:`split_model` -- the stages of one rank, cut from the model built on the meta device: the first
  stage keeps the embedding, the last the final norm and the output head (the loss, plain or chunked,
  runs there too), each keeps its own blocks under their unsplit names (``layers.<i>``).
* :class:`Pipeline` -- the stages after parallelization (TP, activation checkpointing, per-block compile
  and FSDP2 inside each stage, as without a pipeline), the schedule, and ``model``: one module that
  holds every parameter of the rank's stages under the unsplit model's names, so the optimizer, the
  gradient norm, DCP checkpoints (which therefore move between pipeline layouts) and export see an
  ordinary model with parts missing.

The pattern is torchtitan's (``torchtitan/distributed/pipeline_parallel.py`` in
https://github.com/pytorch/torchtitan): a model part is a copy of the whole model on the meta device
with the other stages' modules deleted. Schedules: GPipe (Huang et al. 2019,
https://arxiv.org/abs/1811.06965), 1F1B and interleaved 1F1B (Narayanan et al. 2021,
https://arxiv.org/abs/2104.04473), zero bubble (Qi et al. 2024, https://arxiv.org/abs/2401.10241).

Importing this module is cheap: ``torch.distributed.pipelining`` is imported only by :func:`build_pipeline`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from portatrain.config import ParallelConfig
    from portatrain.parallel.parallel_dims import ParallelDims


@dataclass(frozen=True)
class ScheduleKind:
    """What a ``torch.distributed.pipelining`` schedule needs of the layout."""

    multi: bool
    """Runs several stages per rank (``parallel.pp_virtual_stages``)."""
    v_shape: bool = False
    """Places a rank's two stages in a V (rank r: stages r and 2 pp - 1 - r) and needs exactly two."""
    zero_bubble: bool = False
    """Splits backward into input and weight gradients: torch does not support ``torch.compile`` there."""


SCHEDULES: dict[str, ScheduleKind] = {
    "GPipe": ScheduleKind(multi=False),
    "1F1B": ScheduleKind(multi=False),
    "Interleaved1F1B": ScheduleKind(multi=True),
    "InterleavedZeroBubble": ScheduleKind(multi=True, zero_bubble=True),
    "ZBVZeroBubble": ScheduleKind(multi=True, v_shape=True, zero_bubble=True),
}


def num_microbatches(parallel: ParallelConfig) -> int:
    """``parallel.pp_microbatches``, where 0 means ``pp``."""
    return int(parallel.pp_microbatches) or int(parallel.pp)


def num_stages(parallel: ParallelConfig) -> int:
    return int(parallel.pp) * int(parallel.pp_virtual_stages)


def pipeline_problems(
    parallel: ParallelConfig,
    *,
    n_layers: int | None,
    tie_embeddings: bool = False,
    sparse: bool = False,
    batch_size: int,
    collator: str,
    compile_enabled: bool,
    compile_granularity: str,
    evaluates: bool = False,
) -> list[str]:
    """Every reason the pipeline settings of ``parallel`` cannot run, each with the fix (empty with pp=1).

    ``n_layers``, ``tie_embeddings`` and ``sparse`` (a mixture-of-experts layer) describe the model
    (``n_layers`` None when the model is itself invalid); ``batch_size`` is ``data.batch_size``, the rows
    one data-parallel rank feeds a schedule step; ``evaluates`` says the run evaluates (``trainer.eval_every``).
    """
    pp, virtual = int(parallel.pp), int(parallel.pp_virtual_stages)
    name = parallel.pp_schedule
    if pp <= 1:
        return []
    problems = []
    kind = SCHEDULES.get(name)
    if kind is None:
        return [f"parallel.pp_schedule={name!r} is not one of {', '.join(SCHEDULES)}"]
    if virtual < 1:
        return [f"parallel.pp_virtual_stages={virtual} must be >= 1"]
    if not kind.multi and virtual != 1:
        problems.append(
            f"parallel.pp_virtual_stages={virtual}: {name} runs one stage per rank; set "
            "parallel.pp_virtual_stages=1 or parallel.pp_schedule=Interleaved1F1B (or InterleavedZeroBubble)"
        )
    if kind.v_shape and virtual != 2:
        problems.append(
            f"parallel.pp_virtual_stages={virtual}: {name} places exactly two stages on each rank (a V); "
            "set parallel.pp_virtual_stages=2"
        )
    stages = pp * virtual
    if n_layers is not None:
        if n_layers < stages:
            problems.append(
                f"the model has {n_layers} blocks, fewer than the pp({pp}) * pp_virtual_stages({virtual}) = "
                f"{stages} pipeline stages (each needs at least one); lower parallel.pp or "
                "parallel.pp_virtual_stages, or use a deeper model"
            )
        elif parallel.pp_layers is not None:
            given = [int(n) for n in parallel.pp_layers]
            if len(given) != stages or sum(given) != n_layers or min(given) < 1:
                problems.append(
                    f"parallel.pp_layers={given} must give {stages} stages (pp * pp_virtual_stages) at least one "
                    f"block each, {n_layers} blocks in all (model.n_layers); e.g. "
                    f"parallel.pp_layers=[{','.join(str(len(s)) for s in stage_layers(n_layers, stages))}]"
                )
    m = int(parallel.pp_microbatches) or pp
    if m < 1:
        problems.append(f"parallel.pp_microbatches={parallel.pp_microbatches} must be >= 1 (0 means pp)")
        return problems
    if batch_size % m:
        fits = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        problems.append(
            f"parallel.pp_microbatches={m} must divide data.batch_size={batch_size} (each step's rows are split "
            f"into equal micro-batches); set parallel.pp_microbatches in {fits} or change data.batch_size"
        )
    if name == "1F1B" and m < pp:
        problems.append(
            f"parallel.pp_microbatches={m}: 1F1B needs at least one micro-batch per stage (pp={pp}); "
            f"set parallel.pp_microbatches>={pp}"
        )
    if kind.multi:
        rounds = max(1, m // pp)
        if m % rounds:
            problems.append(
                f"parallel.pp_microbatches={m}: {name} runs them in pp_microbatches // pp({pp}) = {rounds} "
                f"rounds, which must divide them; set parallel.pp_microbatches={pp * rounds}"
            )
    if tie_embeddings:
        problems.append(
            f"parallel.pp={pp} with tied embeddings: the one matrix would be needed on the first and the "
            "last stage; use a model with tie_embeddings=false or parallel.pp=1"
        )
    if sparse:
        problems.append(
            f"parallel.pp={pp}: pipeline stages of a mixture-of-experts model are not supported (its load-"
            "balancing loss and routing statistics are per forward); set parallel.pp=1"
        )
    if int(parallel.ep) > 1:
        problems.append(
            f"parallel.ep={parallel.ep} with parallel.pp={pp} is not supported; set one of them to 1"
        )
    if collator == "bucket":
        problems.append(
            f"parallel.pp={pp} with data.collator=bucket: a schedule's stages exchange activations of one "
            "shape, fixed at the first step; use data.collator=packing (one row length) or parallel.pp=1"
        )
    if compile_enabled and compile_granularity != "block":
        problems.append(
            f"compile.granularity={compile_granularity} with parallel.pp={pp}: a pipeline compiles each stage's "
            "blocks, never the whole model; set compile.granularity=block"
        )
    if kind.zero_bubble and parallel.activation_checkpointing == "selective":
        problems.append(
            f"parallel.pp_schedule={name} with parallel.activation_checkpointing=selective: a zero-bubble "
            "schedule runs each block's backward twice (input, then weight gradients), which selective "
            "checkpointing allows once; use parallel.activation_checkpointing=full (or none), or Interleaved1F1B"
        )
    if kind.v_shape and evaluates:
        problems.append(
            f"parallel.pp_schedule={name} with trainer.eval_every>0: torch's forward-only pass of this schedule "
            "still runs its split backward (torch 2.13); set trainer.eval_every=0, or use InterleavedZeroBubble"
        )
    if compile_enabled and kind.zero_bubble:
        problems.append(
            f"parallel.pp_schedule={name} with compile.enabled=true: torch's zero-bubble schedules split the "
            "backward pass, which compiled blocks do not support; use Interleaved1F1B or compile.enabled=false"
        )
    return problems


def stage_layers(n_layers: int, stages: int, explicit: Sequence[int] | None = None) -> list[list[int]]:
    """The block indices of each stage, first stage first.

    ``explicit`` gives the number of blocks of each stage (``parallel.pp_layers``). Otherwise the split
    is even: stages differ by at most one block, the extra blocks going to the middle stages first
    (the first stage also embeds, the last also normalizes, projects to the vocabulary and takes the loss).
    """
    if explicit is not None:
        counts = [int(n) for n in explicit]
    else:
        counts = [n_layers // stages] * stages
        order = [*range(1, stages - 1), 0, stages - 1] if stages > 1 else [0]
        for i in order[: n_layers % stages]:
            counts[i] += 1
    starts = [sum(counts[:i]) for i in range(stages)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts, strict=True)]


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs: ``pp_rank + k * pp`` (loop), or a V for V schedules."""
    if SCHEDULES[schedule].v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def split_model(model: nn.Module, layers: Sequence[Sequence[int]], ids: Sequence[int]) -> list[nn.Module]:
    """One copy of ``model`` (on the meta device: nothing is allocated) per stage in ``ids``, each with
    every module of the other stages deleted. ``layers[s]`` are stage ``s``'s block indices."""
    last = len(layers) - 1
    parts = []
    for stage in ids:
        part = copy.deepcopy(model)
        keep = {str(i) for i in layers[stage]}
        for name in [n for n in part.layers if n not in keep]:
            del part.layers[name]
        if stage != 0:
            part.embed_tokens = None
        if stage != last:
            part.norm = None
            part.lm_head = None
        parts.append(part)
    return parts


def _rank_model(shell: nn.Module, parts: Sequence[nn.Module]) -> nn.Module:
    """``shell`` (the unsplit meta model, emptied) holding the modules of this rank's ``parts``.

    It owns no tensor of its own and is never called: its parameters are the parts' (after
    parallelization), under the unsplit model's names.
    """
    shell.embed_tokens = next((p.embed_tokens for p in parts if p.embed_tokens is not None), None)
    blocks = {name: block for part in parts for name, block in part.layers.items()}
    shell.layers = nn.ModuleDict({name: blocks[name] for name in sorted(blocks, key=int)})
    last = next((p for p in parts if p.norm is not None), None)
    shell.norm = None if last is None else last.norm
    shell.lm_head = None if last is None else last.lm_head
    shell._buffers.clear()  # the RoPE tables: each part has its own
    return shell


class Pipeline:
    """This rank's pipeline stages and their schedule; the Trainer calls :meth:`forward_backward` and
    :meth:`forward_loss` in place of the model's forward.

    Losses: the last stage computes each micro-batch's loss sum (``compute_loss`` on its logits, or the
    chunked loss inside its forward) and backpropagates it divided by the step's target-token count,
    the same scale as without a pipeline, so gradients equal one process's. The schedule does not
    scale them again (``scale_grads=False``).
    """

    def __init__(
        self,
        model: nn.Module,
        parts: list[nn.Module],
        stage_ids: list[int],
        *,
        schedule: str,
        stages: int,
        microbatches: int,
        parallel_dims: ParallelDims,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> None:
        self.model = model
        self.parts = parts
        self.stage_ids = stage_ids
        self.schedule_name = schedule
        self.num_stages = stages
        self.microbatches = microbatches
        self.parallel_dims = parallel_dims
        self.device = device
        self._autocast = autocast
        self.has_first = 0 in stage_ids
        self.has_last = stages - 1 in stage_ids
        self._pp_group = parallel_dims.pp_mesh.get_group()
        self._compute_loss: Callable[..., torch.Tensor] | None = None
        self._chunk_size: int | None = None
        self._num_tokens: torch.Tensor | None = None
        self._loss_sums: list[torch.Tensor] = []
        self.schedule: Any = None

    def configure_loss(
        self,
        compute_loss: Callable[..., torch.Tensor],
        chunk_size: int | None,
        chunked_loss_fn: Callable[[torch.Tensor, int], Any],
    ) -> None:
        """Build the schedule with the Trainer's loss: ``compute_loss(logits, batch)``, or with ``chunk_size``
        the chunked loss inside the last stage's forward (no full logits): ``chunked_loss_fn(labels,
        chunk_size)``, the trainer's ``output_fn`` factory (``portatrain.losses``, a stage above this one)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self._compute_loss, self._chunk_size = compute_loss, chunk_size

        def labels_to_output_fn(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            # Every stage is handed the micro-batch's labels; the last one turns them into the
            # chunked loss its forward ends in, the others drop them.
            labels = kwargs.pop("labels", None)
            if module.norm is not None and labels is not None:
                kwargs["output_fn"] = chunked_loss_fn(labels, chunk_size)
            return args, kwargs

        stages = []
        for part, stage in zip(self.parts, self.stage_ids, strict=True):
            if chunk_size is not None:
                part.register_forward_pre_hook(labels_to_output_fn, with_kwargs=True)
            stages.append(PipelineStage(part, stage, self.num_stages, self.device, group=self._pp_group))
        cls = get_schedule_class(self.schedule_name)
        first = stages if SCHEDULES[self.schedule_name].multi else stages[0]
        self.schedule = cls(first, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum = output if self._chunk_size is not None else self._compute_loss(output, {"labels": labels})
        self._loss_sums.append(loss_sum.detach())
        return loss_sum if self._num_tokens is None else loss_sum / self._num_tokens

    def _run(self, batch: dict[str, torch.Tensor], *, train: bool) -> torch.Tensor:
        tokens, labels = batch["input_ids"], batch["labels"]
        positions = batch.get("positions")
        if positions is None:
            # Explicit positions: a later stage's input under tensor parallel is a sequence shard, whose
            # length is not the row's (the same RoPE values as the model's default slice).
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        kwargs = {"positions": positions}
        if batch.get("attn_mask") is not None:
            kwargs["attn_mask"] = batch["attn_mask"]
        if self._chunk_size is not None:
            kwargs["labels"] = labels
        args = (tokens,) if self.has_first else ()
        target = labels if self.has_last else None
        self._loss_sums = []
        with self._autocast():
            # The outputs are not merged back into a batch: the loss is all this needs of them.
            run = self.schedule.step if train else self.schedule.eval
            run(*args, target=target, return_outputs=False, **kwargs)
        # The micro-batches' losses are the last ``microbatches`` calls: a stage's first step also calls
        # the loss once to infer the shapes it exchanges (torch's runtime metadata inference).
        sums = self._loss_sums[-self.microbatches :]
        # fp32 whatever the compute dtype: the loss is taken on fp32 logits (``portatrain.losses``).
        loss_sum = torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)
        self._loss_sums = []
        # Only the last stage has the loss: the sum over the pp ranks gives it to every rank.
        torch.distributed.all_reduce(loss_sum, group=self._pp_group)
        return loss_sum

    def forward_backward(self, batch: dict[str, torch.Tensor], num_tokens: torch.Tensor) -> torch.Tensor:
        """One schedule step over ``batch`` (``microbatches`` micro-batches, forward and backward); returns
        its loss sum (detached, on every rank). Gradients accumulate into the parts' parameters."""
        self._num_tokens = num_tokens
        try:
            return self._run(batch, train=True)
        finally:
            self._num_tokens = None

    @torch.no_grad()
    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss sum of ``batch`` through the pipeline, forward only (evaluation), on every rank."""
        return self._run(batch, train=False)


def build_pipeline(
    model: nn.Module,
    parallel_dims: ParallelDims,
    parallel: ParallelConfig,
    *,
    device: torch.device,
    prepare: Callable[[nn.Module], nn.Module],
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> Pipeline:
    """Split ``model`` (built on meta) into this rank's stages, ``prepare`` each (parallelize and
    materialize, as the Trainer does a whole model) and wrap them in a :class:`Pipeline`."""
    stages = num_stages(parallel)
    layers = stage_layers(model.args.n_layers, stages, parallel.pp_layers)
    ids = stage_ids(
        parallel_dims.pp_rank, parallel_dims.pp, int(parallel.pp_virtual_stages), parallel.pp_schedule
    )
    parts = [prepare(part) for part in split_model(model, layers, ids)]
    return Pipeline(
        _rank_model(model, parts),
        parts,
        ids,
        schedule=parallel.pp_schedule,
        stages=stages,
        microbatches=num_microbatches(parallel),
        parallel_dims=parallel_dims,
        device=device,
        autocast=autocast,
    )


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a step each rank spends waiting, in theory (equal stage times, no communication).

    GPipe and 1F1B: ``(p - 1) / (m + p - 1)``; interleaved 1F1B with ``v`` stages per rank:
    ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021, section 2.2). The zero-bubble schedules fill
    most of that with weight-gradient work; the interleaved figure is their upper bound.
    """
    v = virtual if SCHEDULES[schedule].multi else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, pp_rank: int, microbatches: int, virtual: int = 1) -> int:
    """Stage-micro-batches whose activations rank ``pp_rank`` holds at its peak (each one stage's
    blocks for one micro-batch): GPipe runs every forward first (all ``m``); 1F1B starts backward after
    ``pp - rank`` forwards; interleaved schedules warm up with ``(v - 1) pp + 2 (pp - 1 - rank)`` chunks
    before their first backward (Megatron-LM's interleaved schedule)."""
    if schedule == "GPipe":
        return microbatches
    if not SCHEDULES[schedule].multi:
        return min(microbatches, pp - pp_rank)
    return min(microbatches * virtual, (virtual - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def describe_stages(
    args: Any,
    parallel: ParallelConfig,
    *,
    batch_size: int,
    estimate: Callable[[Any, int], dict[str, int]],
) -> str:
    """The dry run's pipeline section: the schedule, its bubble and the memory of each pipeline rank.

    ``estimate(args, rows)`` is the family's per-device estimate (``spec.estimate_memory`` with the
    run's precision and layout) for a model of ``args`` fed ``rows`` rows. A rank's parameters,
    gradients and optimizer state are its stages' parameters (the embedding on the first, the final
    norm and head on the last) at the estimate's bytes per parameter; its activations are one
    micro-batch's per block of its stages, times the micro-batches in flight (:func:`in_flight`), plus
    the output head's on the last stage.
    """
    pp, virtual = int(parallel.pp), int(parallel.pp_virtual_stages)
    name, m = parallel.pp_schedule, num_microbatches(parallel)
    stages = num_stages(parallel)
    layers = stage_layers(args.n_layers, stages, parallel.pp_layers)
    rows = max(1, batch_size // m)
    one, two = (estimate(dataclasses.replace(args, n_layers=n), rows) for n in (1, 2))
    block_acts = two["activations"] - one["activations"]  # one block, one micro-batch
    head_acts = one["activations"] - block_acts  # the output head and loss, one micro-batch
    whole = args.num_params()
    per_param = {
        k: one[k] / dataclasses.replace(args, n_layers=1).num_params()
        for k in ("params", "grads", "optimizer")
    }
    embedding = args.vocab_size * args.dim
    gib = 1024**3
    lines = [
        f"pipeline: {name}, pp={pp} x {virtual} stage(s) a rank, {m} micro-batches of {rows} row(s); "
        f"bubble (p-1)/({'v*' if SCHEDULES[name].multi else ''}m+p-1) = {bubble_fraction(name, pp, m, virtual):.1%}",
        f"{'pp rank':<8}{'stages':<10}{'blocks':<14}{'params':>12}{'in flight':>11}"
        f"{'weights+grads+optim GiB':>26}{'activations GiB':>17}{'total GiB':>11}",
    ]
    for rank in range(pp):
        ids = stage_ids(rank, pp, virtual, name)
        blocks = [i for s in ids for i in layers[s]]
        n = sum(args.attention_params + args.mlp_params(i) for i in blocks)
        n += embedding if 0 in ids else 0
        last = stages - 1 in ids
        n += args.dim + (0 if args.tie_embeddings else embedding) if last else 0
        state = sum(per_param[k] for k in per_param) * n
        chunks = in_flight(name, pp, rank, m, virtual)
        spans = ",".join(f"{layers[s][0]}-{layers[s][-1]}" for s in ids)
        acts = chunks * block_acts * len(blocks) / len(ids) + (head_acts if last else 0)
        lines.append(
            f"{rank:<8}{','.join(map(str, ids)):<10}{spans:<14}{n:>12,}{chunks:>11}"
            f"{state / gib:>26.2f}{acts / gib:>17.2f}{(state + acts + one['fsdp_buffers']) / gib:>11.2f}"
        )
    lines.append(
        f"(of {whole:,} parameters; activations per rank: its stages' blocks for the micro-batches in flight)"
    )
    return "\n".join(lines)
