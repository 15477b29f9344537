"""LoRA as a model converter (``finetune.method=lora``, or ``dpo`` with ``finetune.dpo.lora``).

The adapters are added inside the parallel plan, after tensor parallel and before FSDP2, so each is
split as the layer it adapts (``portatrain.finetune.lora.apply_lora``); they are initialized once the
model is on the device, and a checkpoint records which layers carry them (export writes them in PEFT's
format). The problems of ``finetune.lora`` are the finetune group's (``portatrain.finetune``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from portatrain.config import Config, LoraConfig
from portatrain.converters.base import BuildContext, Converter
from portatrain.finetune import uses_lora
from portatrain.finetune.lora import adapter_params, apply_lora, init_lora, lora_flops_per_token, lora_state


class LoraAdapters(Converter):
    """Freezes the model and adds low-rank adapters to the layers ``finetune.lora.targets`` match."""

    def __init__(self, cfg: LoraConfig) -> None:
        self.cfg = cfg
        self.modules: list[str] = []
        """The adapted layers (every pipeline stage's, in the order the stages were built)."""
        self.adapter_params = 0
        """Parameters of their adapters (whole tensors, however tensor parallel splits them)."""

    def adapt(self, model: nn.Module) -> None:
        added = [name for name in apply_lora(model, self.cfg) if name not in self.modules]
        self.modules += added
        self.adapter_params += adapter_params(model, added)

    def init_weights(self, model: nn.Module) -> None:
        init_lora(model)

    def record(self) -> dict[str, Any]:
        return {"lora": lora_state(self.cfg, self.modules)}

    def flops_per_token(self, flops_per_token: Callable[[int], int]) -> Callable[[int], int]:
        return lora_flops_per_token(flops_per_token, self.adapter_params)


def build(cfg: Config, context: BuildContext) -> LoraAdapters | None:
    return LoraAdapters(cfg.finetune.lora) if uses_lora(cfg.finetune) else None


def problems(cfg: Config) -> list[str]:
    return []  # finetune.lora's problems are checked with the finetune group's
