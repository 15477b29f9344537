"""The converter protocol and what a converter is built from (beside the registry, which imports the
converters: they import this)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import nn

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator
    from portatrain.parallel import ParallelDims


class ModelConverter(Protocol):
    """Changes a model in place before it is parallelized; may act after each optimizer step."""

    def convert(self, model: nn.Module) -> None:
        """Rewrite ``model`` (the single-device model, on the meta device: swap module classes or
        parameters; allocate nothing). Parameter names must stay as they were: checkpoints, the
        Hugging Face mapping and export read them."""
        ...

    def post_optimizer_step(self, model: nn.Module) -> None:
        """After every optimizer step, on the parallelized model (nothing to do for most)."""
        ...


@dataclass(frozen=True)
class BuildContext:
    """What a converter may need to know of the run it is built for."""

    accelerator: Accelerator
    parallel_dims: ParallelDims
