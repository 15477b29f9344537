"""Model converters: what changes the single-device model between its build on meta and its parallelization.

A converter rewrites modules of the model in place -- the linear layers that multiply in FP8 or MXFP8
(``quantize.linear``, :mod:`portatrain.converters.quantize`), LoRA's adapters (``finetune.method=lora``,
:mod:`portatrain.converters.lora`) -- and may act after every optimizer step
(float8's weight scales for the next FSDP2 all-gather). Features of this kind enter here, not through
the Trainer's loop: the build stage applies the list once (``portatrain.train.build``), the optimizer
step calls its one hook. The shape is torchtitan's: the ``ModelConverter`` protocol and its sequential
container (pytorch/torchtitan ``torchtitan/protocols/model_converter.py``, as of commit 1ea5d511, before
#3127 moved conversion onto the model config) and its quantization converters
(``torchtitan/components/quantization/float8.py``, ``mx.py``).

* :class:`ModelConverter` -- the protocol: ``convert(model)`` on meta, ``post_optimizer_step(model)``;
* :data:`CONVERTERS` -- the registry: a name, the builder that makes the converter from the config and
  the run (``None`` when the config asks for nothing) and the config's problems;
* :func:`build_converters` -- the converters a config asks for, as one :class:`ModelConverters`;
* :func:`converter_problems` -- every registered converter's config problems, for ``portatrain.validate``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from portatrain.config import Config
from portatrain.converters import lora, quantize
from portatrain.converters.base import BuildContext, Converter, ModelConverter

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator
    from portatrain.parallel import ParallelDims


@dataclass(frozen=True)
class Registered:
    """A registry entry: the builder (None when the config asks for nothing) and the config's problems."""

    build: Callable[[Config, BuildContext], ModelConverter | None]
    problems: Callable[[Config], list[str]]


CONVERTERS: dict[str, Registered] = {
    "quantize": Registered(quantize.build, quantize.problems),
    "lora": Registered(lora.build, lora.problems),
}
"""Every converter, applied in this order."""


class ModelConverters:
    """The converters of one run, applied in registry order (torchtitan's ``ModelConvertersContainer``)."""

    def __init__(self, converters: list[ModelConverter]) -> None:
        self.converters = converters

    def __iter__(self) -> Iterator[ModelConverter]:
        return iter(self.converters)

    def __len__(self) -> int:
        return len(self.converters)

    def convert(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.convert(model)

    def adapt(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.adapt(model)

    def adapter(self) -> Callable[[nn.Module], None] | None:
        """:meth:`adapt` when a converter adds modules inside the parallel plan, else None (a
        family's plan is not handed an ``adapt`` it has nothing to do with)."""
        adapts = any(type(c).adapt is not Converter.adapt for c in self.converters)
        return self.adapt if adapts else None

    def init_weights(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.init_weights(model)

    def post_optimizer_step(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.post_optimizer_step(model)

    def record(self) -> dict[str, Any]:
        """Every converter's record for a checkpoint's ``trainer_state.json``."""
        return {key: value for converter in self.converters for key, value in converter.record().items()}

    def flops_per_token(self, flops_per_token: Callable[[int], int] | None) -> Callable[[int], int] | None:
        """The architecture's FLOPs per token as the converted model executes them (None stays None)."""
        for converter in self.converters:
            if flops_per_token is not None:
                flops_per_token = converter.flops_per_token(flops_per_token)
        return flops_per_token


def build_converters(cfg: Config, accelerator: Accelerator, parallel_dims: ParallelDims) -> ModelConverters:
    """The converters ``cfg`` asks for (none by default), each checked against the device and the
    layout (a :class:`~portatrain.errors.UserError` names what cannot run and the fix)."""
    context = BuildContext(accelerator, parallel_dims)
    built = (entry.build(cfg, context) for entry in CONVERTERS.values())
    return ModelConverters([converter for converter in built if converter is not None])


def converter_problems(cfg: Config) -> list[str]:
    """Every registered converter's problems with ``cfg``, each with its fix."""
    return [problem for entry in CONVERTERS.values() for problem in entry.problems(cfg)]


__all__ = [
    "CONVERTERS",
    "BuildContext",
    "Converter",
    "ModelConverter",
    "ModelConverters",
    "build_converters",
    "converter_problems",
]
