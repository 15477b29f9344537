"""What a model family gives the rest of portatrain: one :class:`ModelSpec` per family.

Generic code (trainer, checkpoints, HF export and import, the dry run, the memory plan) reaches a
family only through its spec, never by importing the family's modules. Adding a family is one
folder under ``portatrain/models/`` that builds a ``ModelSpec``, one line in the registry
(``portatrain/models/__init__.py``) and its ``conf/model/`` files. The pattern is torchtitan's
``TrainSpec`` (``torchtitan/protocols/train_spec.py``).

Families built from the shared parts (``portatrain.models.common``) get their spec from
``decoder_spec``; the contracts every family's model and arguments keep:

* The arguments are a frozen dataclass with ``vocab_size``, ``max_seq_len``, ``tie_embeddings``,
  ``num_params()`` (analytic count), ``flops_per_token(seq_len)`` and ``problems() -> list[str]``
  (every inconsistency, each naming the values and the fix; empty when valid).
* The model is built as ``spec.model_cls(args)`` (on the meta device), keeps ``args`` as
  ``model.args``, its transformer blocks in ``model.layers`` (an ``nn.ModuleDict``), initializes with
  ``init_weights(std)`` and is called as ``model(tokens, positions=None, attn_mask=None)`` returning
  logits ``[B, S, vocab]``. Attention goes through ``F.scaled_dot_product_attention`` only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from portatrain.parallel.parallel_dims import ParallelDims


class CompileBlock(Protocol):
    """Compiles one transformer block in place (given by the compile stage to a parallelizer)."""

    def __call__(self, block: nn.Module) -> nn.Module: ...


class Parallelize(Protocol):
    """A family's ``parallelize.py`` entry point: TP -> activation checkpointing -> compile -> FSDP2.

    ``compile_block`` is None when compilation is off; the parallelizer never imports the compile stage.
    """

    def __call__(
        self,
        model: nn.Module,
        parallel_dims: ParallelDims,
        *,
        activation_checkpointing: str,
        compile_block: CompileBlock | None,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        adapt: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module: ...


@dataclass(frozen=True)
class RuntimeOptions:
    """What a family's runtime hooks may know of the run (given by the build stage, not the config)."""

    moe_dispatch: str
    """``capacity`` or ``dropless`` (``model.moe_dispatch``, ``auto`` already resolved for the device)."""
    capacity_factor: float
    aux_loss_scale: float
    """Weight of an auxiliary loss per forward: ``1 / trainer.grad_accum`` in training, 0 in evaluation."""
    reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Sums statistics over the ranks that see different tokens (data and context parallel), or None."""
    supports_grouped_mm: Callable[[torch.dtype], bool] | None = None
    """The accelerator adapter's answer: whether ``torch._grouped_mm`` runs natively in a dtype."""
    sum_stages: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Sums a statistic over the pipeline ranks (each holds some of the layers), or None without a pipeline."""
    qk_clip: float | None = None
    """``optim.qk_clip``'s threshold in training (None or 0: off)."""
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None
    """The maximum over the ranks that see different tokens (data and context parallel), or None."""


class ModelRuntime(Protocol):
    """A family's hooks around the training step (torchtitan hangs these on its spec, e.g.
    ``post_optimizer_build_fn``); what :attr:`ModelSpec.runtime` attaches to a built model."""

    def post_optimizer_step(self, ok: torch.Tensor) -> None:
        """After each optimizer step; ``ok`` (a device bool, the same on every rank) is false when the
        step was skipped (non-finite) or only rehearsed (compile warm-up): leave the state as it was."""
        ...

    def metrics(self) -> dict[str, float]:
        """The family's figures since the last call, at logging steps (a host read is allowed here)."""
        ...

    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A loader's batch with the family's own per-position inputs added, on the host before it
        moves: context parallel then cuts every ``[B, S, ...]`` entry along ``S`` with the token ids,
        so an input that reads ahead in the row (a later token) is whole on every shard."""
        ...

    def extra_loss(self, batch: dict[str, torch.Tensor]) -> AbstractContextManager[ExtraLoss]:
        """Wraps one forward of the model on ``batch``; on exit, the :class:`ExtraLoss` it yields holds
        the loss *sum* the family adds to the language-model loss (0 when none, e.g. in evaluation).
        The trainer adds it to the micro-batch's loss sum, which it divides by the step's target count."""
        ...


@dataclass
class ExtraLoss:
    """What a forward adds to the training loss (:meth:`ModelRuntime.extra_loss`)."""

    sum: torch.Tensor | float = 0.0


class NoRuntime:
    """The hooks of a family with nothing to do around the step; the defaults other runtimes inherit."""

    def post_optimizer_step(self, ok: torch.Tensor) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch

    @contextlib.contextmanager
    def extra_loss(self, batch: dict[str, torch.Tensor]) -> Iterator[ExtraLoss]:
        yield ExtraLoss()


def no_runtime(model: nn.Module, options: RuntimeOptions) -> ModelRuntime:
    """:attr:`ModelSpec.runtime` of a family without runtime hooks."""
    return NoRuntime()


@dataclass(frozen=True)
class HFMapping:
    """How a family maps onto its Hugging Face ``transformers`` counterpart (no transformers import)."""

    architecture: str
    """``architectures[0]`` of the HF ``config.json``, e.g. ``LlamaForCausalLM``."""
    to_hf: Callable[[Mapping[str, Any]], dict[str, Any]]
    """Our state dict -> HF keys (tensors untouched; a tied model emits no ``lm_head.weight``)."""
    from_hf: Callable[..., dict[str, Any]]
    """HF state dict -> ours: ``from_hf(state_dict, *, tie_embeddings: bool | None)``."""
    config: Callable[..., dict[str, Any]]
    """Our arguments -> HF ``config.json`` dict: ``config(args, *, torch_dtype: str)``."""
    args_from_config: Callable[[Mapping[str, Any]], Any]
    """HF ``config.json`` dict -> our arguments (raises ValueError/KeyError when it is not this family)."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything generic code needs to know about one model family."""

    name: str
    """Registry key and ``model.name`` value, e.g. ``llama3``."""
    model_cls: type[nn.Module]
    """Built as ``model_cls(args)``."""
    args_cls: type
    """The family's frozen arguments dataclass."""
    flavors: Mapping[str, Any]
    """Flavour name -> arguments with the published dimensions."""
    parallelize: Parallelize
    """Applies the parallel plan in place (see :class:`Parallelize`)."""
    hf: HFMapping
    """Hugging Face interop (export, ``model.init_from``, parity tests)."""
    estimate_memory: Callable[..., dict[str, int]]
    """Per-device memory estimate in bytes: ``estimate_memory(args, *, batch_size, seq_len, ...)``,
    keys ``params``, ``grads``, ``optimizer``, ``fsdp_buffers``, ``activations``, ``total``."""
    published_params: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Flavour name -> parameter count of the published checkpoint (the tied matrix once); the
    conformance suite checks the analytic count of every such flavour against it."""
    layout_problems: Callable[[Any, Any], list[str]] = lambda parallel, args: []
    """``layout_problems(parallel, args)``: the parallel layouts this family's plan cannot apply, each
    one line with the fix (see :meth:`parallel_problems`)."""
    config_overrides: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """``model.<key>`` config overrides this family accepts -> the arguments field each sets
    (e.g. ``{"ffn_dim": "ffn_hidden_dim"}``), for custom sizes from the command line. A key not
    listed here that names a field of :attr:`args_cls` sets that field; any other key set in the
    config (e.g. ``model.head_dim`` for Llama, which derives it) is an error naming the choices."""
    options: type | None = None
    """The family's own ``model.*`` keys: a dataclass whose fields (each ``X | None = None``, None
    keeping the flavour's value, with an attribute docstring) join the config schema's ``model``
    section (``portatrain.models.ModelSchema``) and set the arguments field of the same name (or
    :attr:`config_overrides`' one). A new option of one family is a field here, in its folder."""

    runtime: Callable[[nn.Module, RuntimeOptions], ModelRuntime] = no_runtime
    """``runtime(model, options)``: configure the built (meta) model for the run and return its hooks
    around the step (:class:`ModelRuntime`): the shared decoder's are the mixture of experts' (dispatch,
    auxiliary loss, router bias updates, routing statistics) and multi-token prediction's (the read-ahead
    targets, the extra loss, its metric), no-ops for a dense model without it."""

    def args(self, flavor: str, **overrides: Any) -> Any:
        """The flavour's arguments with ``overrides`` (config keys, None = keep) applied.

        Raises ``KeyError`` for an unknown flavour and ``ValueError`` for a key this family does not
        support. The result is not validated: call its ``problems()``.
        """
        if flavor not in self.flavors:
            raise KeyError(
                f"model.flavor={flavor!r} is unknown for {self.name}; choose one of {', '.join(self.flavors)}"
            )
        fields = {f.name for f in dataclasses.fields(self.args_cls)}
        given = {k: v for k, v in overrides.items() if v is not None}
        unsupported = sorted(k for k in given if k not in self.config_overrides and k not in fields)
        if unsupported:
            raise ValueError(
                f"{', '.join(f'model.{k}={given[k]}' for k in unsupported)}: not an option of the {self.name} "
                f"family; unset it, or use one of {', '.join(f'model.{k}' for k in self._config_keys())}"
            )
        changes = {self.config_overrides.get(k, k): v for k, v in given.items()}
        return dataclasses.replace(self.flavors[flavor], **changes)

    def parallel_problems(self, parallel: Any, args: Any) -> list[str]:
        """Why this family cannot run ``parallel`` (a ``ParallelConfig``) with ``args``; empty if it can.

        Asked during config validation, so a layout the family's plan does not support is one clear
        error in ``dry_run=true`` and ``portatrain plan`` too, before any process group starts.
        """
        return list(self.layout_problems(parallel, args))

    def args_from_dict(self, values: Mapping[str, Any]) -> Any:
        """Rebuild the arguments from ``dataclasses.asdict(args)`` (as checkpoints record them).

        Nested dataclass fields (Llama's ``rope_scaling``) are rebuilt from their type hints.
        """
        hints = typing.get_type_hints(self.args_cls)
        kwargs = {}
        for field in dataclasses.fields(self.args_cls):
            if field.name not in values:
                continue
            value = values[field.name]
            if isinstance(value, Mapping):
                nested = [
                    t
                    for t in typing.get_args(hints[field.name]) or (hints[field.name],)
                    if dataclasses.is_dataclass(t)
                ]
                if nested:
                    value = nested[0](**value)
            kwargs[field.name] = value
        return self.args_cls(**kwargs)

    def _config_keys(self) -> list[str]:
        return sorted(self.config_overrides) or sorted(f.name for f in dataclasses.fields(self.args_cls))
