"""Pipeline schedules and layouts, in arithmetic only (nothing built, no ``torch.distributed``).

* :data:`SCHEDULES` -- the schedules ``parallel.pp_schedule`` may name, and what each needs
  (several stages per rank, a V-shaped placement, a backward split into input and weight gradients).
* :func:`pipeline_problems` -- the pipeline's part of config validation (``portatrain.validate``): every
  layout, schedule, micro-batch and model combination the pipeline cannot run, each one line with the fix.
* :func:`stage_layers` and :func:`stage_ids` -- which blocks each stage holds (even by default, or
  ``parallel.pp_layers``) and which stages a pipeline rank runs: ``rank + k * pp`` (loop), or ``rank`` and
  ``2 * pp - 1 - rank`` (V, for ``ZBVZeroBubble``).
* :func:`bubble_fraction`, :func:`in_flight` and :func:`describe_stages` -- a schedule's idle share,
  the micro-batches a rank holds at its peak, and the dry run's per-rank table.

The stages themselves, and the schedule that runs them, are ``portatrain.parallel.pipeline``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portatrain.config import ParallelConfig


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
    mtp_layers: int = 0,
    aux_loss: bool = False,
    batch_size: int,
    collator: str,
    compile_enabled: bool,
    compile_granularity: str,
    evaluates: bool = False,
) -> list[str]:
    """Every reason the pipeline settings of ``parallel`` cannot run, each with the fix (empty with pp=1).

    ``n_layers``, ``tie_embeddings``, ``mtp_layers`` (multi-token prediction's depths) and ``aux_loss``
    (a mixture of experts balanced by an auxiliary loss) describe the model (``n_layers`` None when the
    model is itself invalid); ``batch_size`` is ``data.batch_size``, the rows
    one data-parallel rank feeds a schedule step; ``evaluates`` says the run evaluates (``trainer.eval_every``).
    """
    pp, virtual = int(parallel.pp), int(parallel.pp_virtual_stages)
    name = parallel.pp_schedule
    if pp <= 1:
        return []
    kind = SCHEDULES.get(name)
    if kind is None:
        return [f"parallel.pp_schedule={name!r} is not one of {', '.join(SCHEDULES)}"]
    if virtual < 1:
        return [f"parallel.pp_virtual_stages={virtual} must be >= 1"]
    problems = _stage_problems(parallel, kind, n_layers=n_layers)
    m = int(parallel.pp_microbatches) or pp
    if m < 1:
        problems.append(f"parallel.pp_microbatches={parallel.pp_microbatches} must be >= 1 (0 means pp)")
        return problems
    problems += _microbatch_problems(parallel, kind, m, batch_size=batch_size)
    return problems + _combination_problems(
        parallel,
        kind,
        tie_embeddings=tie_embeddings,
        mtp_layers=mtp_layers,
        aux_loss=aux_loss,
        collator=collator,
        compile_enabled=compile_enabled,
        compile_granularity=compile_granularity,
        evaluates=evaluates,
    )


def _stage_problems(parallel: ParallelConfig, kind: ScheduleKind, *, n_layers: int | None) -> list[str]:
    """Stages per rank the schedule allows, and blocks enough for every stage (``pp_layers``)."""
    pp, virtual, name = int(parallel.pp), int(parallel.pp_virtual_stages), parallel.pp_schedule
    problems = []
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
    return problems


def _microbatch_problems(
    parallel: ParallelConfig, kind: ScheduleKind, m: int, *, batch_size: int
) -> list[str]:
    """``m`` micro-batches: they split the batch evenly and fill the schedule."""
    pp, name = int(parallel.pp), parallel.pp_schedule
    problems = []
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
    return problems


def _combination_problems(
    parallel: ParallelConfig,
    kind: ScheduleKind,
    *,
    tie_embeddings: bool,
    mtp_layers: int,
    aux_loss: bool,
    collator: str,
    compile_enabled: bool,
    compile_granularity: str,
    evaluates: bool,
) -> list[str]:
    """The model, data, compile and schedule settings a pipeline cannot run with."""
    pp, name = int(parallel.pp), parallel.pp_schedule
    problems = []
    if kind.v_shape and (tie_embeddings or mtp_layers):
        what = "tied embeddings" if tie_embeddings else f"model.mtp_layers={mtp_layers}"
        problems.append(
            f"parallel.pp_schedule={name} with {what}: the last stage's copy of the embedding is summed with "
            "the first stage's across pipeline ranks, and a V places both stages on rank 0; use "
            "parallel.pp_schedule=Interleaved1F1B (or InterleavedZeroBubble)"
        )
    if aux_loss:
        problems.append(
            f"parallel.pp={pp}: this mixture of experts is balanced by an auxiliary loss (aux_loss_coef>0), "
            "which a pipeline would take over each micro-batch, not the step's batch; set parallel.pp=1 "
            "(a bias-balanced router, as DeepSeek-V3's, trains under a pipeline)"
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
    norm, the head and multi-token prediction's depths on the last, which holds a copy of the embedding
    where it reads it too: a tied head, the depths) at the estimate's bytes per parameter; its activations are one
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
    # The last stage's own: the final norm, the head (tied: the embedding's copy), the depths and, for
    # them, the embedding's copy when the head is not it.
    depths = (
        args.num_params() - dataclasses.replace(args, mtp_layers=0).num_params() if args.mtp_layers else 0
    )
    last_only = args.dim + embedding + depths + (embedding if depths and not args.tie_embeddings else 0)
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
        n += last_only if last else 0
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
