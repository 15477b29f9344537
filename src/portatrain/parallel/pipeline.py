"""Pipeline parallelism: a decoder split into stages along its blocks, run by a
``torch.distributed.pipelining`` schedule on the outermost mesh dimension (``pp``).

What this file does (the schedules, validation and layout arithmetic are in
``pipeline_schedules.py``, re-exported here):

* :func:`split_model` -- the stages of one rank, cut from the model built on the meta device: the first
  stage keeps the embedding, the last the final norm, the output head (the loss, plain or chunked,
  runs there too) and multi-token prediction's depths, each keeps its own blocks under their unsplit
  names (``layers.<i>``).
* The embedding on two stages: a tied output head and multi-token prediction's depths (which embed the
  tokens read ahead) need the embedding matrix on the last stage too. As Megatron-LM's "embedding group"
  (``megatron/core/distributed/finalize_model_grads.py``, ``_allreduce_word_embedding_grads``, in
  https://github.com/NVIDIA/Megatron-LM) the last stage holds a copy, set to the first stage's values
  when built; :func:`sum_shared_grads` adds the two copies' gradients (for each data- and tensor-parallel
  coordinate) before clipping, so both take the same optimizer step; the gradient norm counts the
  matrix once (``clip_grad_norm_`` skips the copy); a checkpoint holds ``embed_tokens.weight`` once
  and both stages load it.
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
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from portatrain.parallel.pipeline_schedules import (
    SCHEDULES,
    ScheduleKind,
    bubble_fraction,
    describe_stages,
    in_flight,
    num_microbatches,
    num_stages,
    pipeline_problems,
    stage_ids,
    stage_layers,
)
from portatrain.parallel.utils import PIPELINE_COPY

if TYPE_CHECKING:
    from portatrain.config import ParallelConfig
    from portatrain.parallel.parallel_dims import ParallelDims

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "ScheduleKind",
    "bubble_fraction",
    "build_pipeline",
    "describe_stages",
    "in_flight",
    "num_microbatches",
    "num_stages",
    "pipeline_problems",
    "split_model",
    "stage_all_reduce",
    "stage_ids",
    "stage_layers",
    "sum_shared_grads",
]

SHARED_GROUP = "_pipeline_shared_group"
"""The attribute naming the process group a parameter held by two stages (the embedding) is summed over."""


def embedding_on_last_stage(args: Any) -> bool:
    """Whether the last stage reads the embedding matrix too: a tied output head, or multi-token
    prediction's depths (they embed the tokens they read ahead)."""
    return bool(args.tie_embeddings or getattr(args, "mtp_layers", 0))


def split_model(model: nn.Module, layers: Sequence[Sequence[int]], ids: Sequence[int]) -> list[nn.Module]:
    """One copy of ``model`` (on the meta device: nothing is allocated) per stage in ``ids``, each with
    every module of the other stages deleted. ``layers[s]`` are stage ``s``'s block indices.

    Where the last stage reads the embedding (:func:`embedding_on_last_stage`) it gets a matrix of its
    own (see :func:`_add_embedding_copy`), whose values :func:`build_pipeline` sets to the first stage's."""
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
            if getattr(part, "mtp", None) is not None:
                part.mtp = None
        elif stage != 0 and embedding_on_last_stage(part.args):
            _add_embedding_copy(part)
        parts.append(part)
    return parts


def _add_embedding_copy(part: nn.Module) -> None:
    """Give the last stage ``part`` its copy of the embedding matrix, on meta like the rest.

    Tied: the copy is the output head (``lm_head``, the matrix the tied model reads at its output).
    Otherwise it is ``embedding_copy``, a module the decoder does not know (its forward takes hidden
    states here, not token ids). Multi-token prediction reads the copy through a pre-hook that hands
    it to the depths in place of the stage's absent ``embed_tokens``.
    """
    args = part.args
    with torch.device("meta"):
        if args.tie_embeddings:
            part.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        else:
            part.embedding_copy = nn.Embedding(args.vocab_size, args.dim)
    if getattr(part, "mtp", None) is None:
        return
    owner = part.lm_head if args.tie_embeddings else part.embedding_copy

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, owner.weight)  # read at the call: FSDP2's gathered matrix

    # The decoder calls mtp(hidden, embed_tokens, head, cos, sin, attn_mask).
    part.mtp.register_forward_pre_hook(lambda module, args: (args[0], embed, *args[2:]))


def _embedding_copy(part: nn.Module) -> nn.Module | None:
    """The last stage's copy of the embedding (:func:`_add_embedding_copy`), or None."""
    if part.embed_tokens is not None or part.norm is None:
        return None
    return part.lm_head if part.args.tie_embeddings else getattr(part, "embedding_copy", None)


def _rank_model(shell: nn.Module, parts: Sequence[nn.Module]) -> nn.Module:
    """``shell`` (the unsplit meta model, emptied) holding the modules of this rank's ``parts``.

    It owns no tensor of its own and is never called: its parameters are the parts' (after
    parallelization), under the unsplit model's names.
    """
    last = next((p for p in parts if p.norm is not None), None)
    # The last stage's copy of the embedding goes by the embedding's own name (a checkpoint holds it once).
    last_copy = None if last is None else _embedding_copy(last)
    shell.embed_tokens = next((p.embed_tokens for p in parts if p.embed_tokens is not None), last_copy)
    blocks = {name: block for part in parts for name, block in part.layers.items()}
    shell.layers = nn.ModuleDict({name: blocks[name] for name in sorted(blocks, key=int)})
    shell.norm = None if last is None else last.norm
    shell.lm_head = None if last is None or shell.args.tie_embeddings else last.lm_head
    if getattr(shell, "mtp", None) is not None:
        shell.mtp = None if last is None else last.mtp
    shell._buffers.clear()  # the RoPE tables: each part has its own
    return shell


def _embedding_group(parallel_dims: ParallelDims) -> Any:
    """The process group of this rank's first and last pipeline stage (for its data- and tensor-parallel
    coordinate), or None where this rank holds neither. Collective: every rank creates every group."""
    if parallel_dims.pp == 2:
        return parallel_dims.pp_mesh.get_group()
    ranks = parallel_dims.mesh.mesh  # pp outermost
    pairs = [
        list(pair) for pair in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist(), strict=True)
    ]
    group, _ = torch.distributed.new_subgroups_by_enumeration(pairs)
    return group


@torch.no_grad()
def _share_embedding(model: nn.Module, group: Any, *, is_copy: bool) -> None:
    """Mark this rank's embedding matrix (``is_copy``: the last stage's) as summed over ``group`` and give
    the copy the first stage's values (zeroed, then summed: Megatron-LM's start, which holds for any
    initialization)."""
    weight = model.embed_tokens.weight
    setattr(weight, SHARED_GROUP, group)
    if is_copy:
        setattr(weight, PIPELINE_COPY, True)
        weight.zero_()
    torch.distributed.all_reduce(_local(weight), group=group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def stage_all_reduce(value: torch.Tensor, parallel_dims: ParallelDims) -> torch.Tensor:
    """The sum of ``value`` over the pipeline ranks (a statistic of the layers each holds)."""
    out = value.detach().clone()
    torch.distributed.all_reduce(out, group=parallel_dims.pp_mesh.get_group())
    return out


@torch.no_grad()
def sum_shared_grads(parameters: Iterable[torch.Tensor]) -> None:
    """Add the gradients of a parameter two pipeline stages hold (the embedding and its copy on the last
    stage) across them, so both take the same step; call after the step's backward passes, before
    clipping. No-op without such parameters (no pipeline, or one that shares nothing)."""
    for param in parameters:
        group = getattr(param, SHARED_GROUP, None)
        if group is None:
            continue
        if param.grad is None:  # both ranks join the collective
            param.grad = torch.zeros_like(param)
        elif isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            # Laid out as the parameter, so the two stages' local shards are the same rows (a tensor-
            # parallel embedding's gradient can come back whole where its matrix is vocabulary-sharded).
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        torch.distributed.all_reduce(_local(param.grad), group=group)


class Pipeline:
    """This rank's pipeline stages and their schedule; the Trainer calls :meth:`forward_backward` and
    :meth:`forward_loss` in place of the model's forward.

    Losses: the last stage computes each micro-batch's loss sum (``compute_loss`` on its logits, or the
    chunked loss inside its forward, plus multi-token prediction's when the model has depths) and
    backpropagates it divided by the step's target-token count, the same scale as without a pipeline,
    so gradients equal one process's. The schedule does not scale them again (``scale_grads=False``).
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
        # Multi-token prediction's depths (on the last stage): the batch entries they read, per micro-batch.
        self._mtp = next((p.mtp for p in parts if getattr(p, "mtp", None) is not None), None)
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
        from torch.distributed.pipelining.schedules import get_schedule_class

        self._compute_loss, self._chunk_size = compute_loss, chunk_size

        def labels_to_output_fn(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            # Every stage is handed the micro-batch's labels; the last one turns them into the
            # chunked loss its forward ends in, the others drop them.
            labels = kwargs.pop("labels", None)
            if module.norm is not None and labels is not None:
                kwargs["output_fn"] = chunked_loss_fn(labels, chunk_size)
            return args, kwargs

        mtp_keys = () if self._mtp is None else self._mtp.batch_keys

        def targets_to_mtp(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            # The depths' read-ahead tokens and targets reach this rank's stages; the last one's depths
            # take them for this micro-batch (none in evaluation), the others drop them.
            targets = tuple(kwargs.pop(key, None) for key in mtp_keys)
            if getattr(module, "mtp", None) is not None:
                module.mtp.targets = None if targets[0] is None else targets
            return args, kwargs

        stage_cls, stages = _stage_class(), []
        for part, stage in zip(self.parts, self.stage_ids, strict=True):
            if chunk_size is not None:
                part.register_forward_pre_hook(labels_to_output_fn, with_kwargs=True)
            if mtp_keys:
                part.register_forward_pre_hook(targets_to_mtp, with_kwargs=True)
            stages.append(stage_cls(part, stage, self.num_stages, self.device, group=self._pp_group))
        cls = get_schedule_class(self.schedule_name)
        first = stages if SCHEDULES[self.schedule_name].multi else stages[0]
        self.schedule = cls(first, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum = output if self._chunk_size is not None else self._compute_loss(output, {"labels": labels})
        if self._mtp is not None and self._mtp.loss_sum is not None:  # the same micro-batch's forward
            loss_sum, self._mtp.loss_sum = loss_sum + self._mtp.loss_sum, None
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
        if self._mtp is not None:  # training batches only (the family's prepare_batch adds them)
            kwargs.update({key: batch[key] for key in self._mtp.batch_keys if key in batch})
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


def _stage_class() -> type:
    """``PipelineStage`` whose shape inference leaves no trace in the model's statistics.

    On its first step (and the first after evaluation) a schedule runs each stage's forward once more
    to infer the shapes it exchanges (torch 2.13: ``_prepare_forward_infra``), later stages on empty
    tensors. That forward would count in the buffers a training forward updates: a balanced router's
    expert loads (the bias moves by them), the routing statistics, multi-token prediction's metric.
    Their values are put back after it.
    """
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            saved = [(buffer, buffer.clone()) for buffer in self.submod.buffers()]
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for buffer, value in saved:
                        buffer.copy_(value)

    return Stage


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
    shell = _rank_model(model, parts)
    if embedding_on_last_stage(model.args):
        group = _embedding_group(parallel_dims)
        if shell.embed_tokens is not None:
            _share_embedding(shell, group, is_copy=0 not in ids)
    return Pipeline(
        shell,
        parts,
        ids,
        schedule=parallel.pp_schedule,
        stages=stages,
        microbatches=num_microbatches(parallel),
        parallel_dims=parallel_dims,
        device=device,
        autocast=autocast,
    )
