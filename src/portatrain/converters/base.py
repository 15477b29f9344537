"""The converter protocol and what a converter is built from (beside the registry, which imports the
converters: they import this)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator
    from portatrain.parallel import ParallelDims


class ModelConverter(Protocol):
    """Changes a model in place while it is built; may act after each optimizer step.

    The build stage (``portatrain.train.build``) calls, in this order: :meth:`convert` on the meta
    model, :meth:`adapt` inside the parallel plan (after tensor parallel, before FSDP2),
    :meth:`init_weights` once the model is on the device; the optimizer step calls
    :meth:`post_optimizer_step`; a checkpoint records :meth:`record`. :class:`Converter` gives each a
    no-op default."""

    def convert(self, model: nn.Module) -> None:
        """Rewrite ``model`` (the single-device model, on the meta device: swap module classes or
        parameters; allocate nothing). Parameter names must stay as they were: checkpoints, the
        Hugging Face mapping and export read them."""
        ...

    def adapt(self, model: nn.Module) -> None:
        """Add modules after tensor parallel, before FSDP2 (LoRA's adapters, split as their layer is)."""
        ...

    def init_weights(self, model: nn.Module) -> None:
        """Initialize what :meth:`adapt` added, after the model is allocated on the device."""
        ...

    def post_optimizer_step(self, model: nn.Module) -> None:
        """After every optimizer step, on the parallelized model (nothing to do for most)."""
        ...

    def record(self) -> dict[str, Any]:
        """What a checkpoint's ``trainer_state.json`` keeps of this converter (export reads it)."""
        ...

    def flops_per_token(self, flops_per_token: Callable[[int], int]) -> Callable[[int], int]:
        """The training FLOPs per token the converted model executes, from the architecture's
        (``flops_per_token(seq_len)``, for MFU): a converter that adds or skips matmuls says so here."""
        ...


class Converter:
    """No-op defaults of every :class:`ModelConverter` method: a converter overrides what it does."""

    def convert(self, model: nn.Module) -> None:
        pass

    def adapt(self, model: nn.Module) -> None:
        pass

    def init_weights(self, model: nn.Module) -> None:
        pass

    def post_optimizer_step(self, model: nn.Module) -> None:
        pass

    def record(self) -> dict[str, Any]:
        return {}

    def flops_per_token(self, flops_per_token: Callable[[int], int]) -> Callable[[int], int]:
        return flops_per_token


@dataclass(frozen=True)
class BuildContext:
    """What a converter may need to know of the run it is built for."""

    accelerator: Accelerator
    parallel_dims: ParallelDims
