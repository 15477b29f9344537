"""Fine-tuning methods (``finetune.method``): ``full``, ``lora`` and ``dpo``.

* ``portatrain.finetune.lora`` -- low-rank adapters on the transformer blocks' linear layers, saved in
  PEFT's format (``portatrain export``), merged into a plain model with ``merge_lora=true``;
* ``portatrain.finetune.dpo`` -- direct preference optimization: the loss, the preference pairs'
  records and loader; the trainer that runs it is ``portatrain.dpo_trainer.DPOTrainer``.

:func:`finetune_problems` is the group's check for ``portatrain.validate``.
"""

from __future__ import annotations

from portatrain.config import CompileConfig, DataConfig, FinetuneConfig, ModelConfig

METHODS = ("full", "lora", "dpo")
"""Allowed values of ``finetune.method``."""


def uses_lora(finetune: FinetuneConfig) -> bool:
    """Whether the run trains LoRA adapters (``lora``, or ``dpo`` with ``finetune.dpo.lora``)."""
    return finetune.method == "lora" or (finetune.method == "dpo" and bool(finetune.dpo.lora))


def finetune_problems(
    finetune: FinetuneConfig, model: ModelConfig, data: DataConfig, compile: CompileConfig
) -> list[str]:
    """Every problem of the ``finetune`` group, each with its fix (the pairs' records included)."""
    if finetune.method not in METHODS:
        return [f"finetune.method={finetune.method!r} is not one of {', '.join(METHODS)}"]
    problems = []
    if uses_lora(finetune):
        from portatrain.finetune.lora import lora_problems

        problems += lora_problems(finetune.lora, _meta_model(model))
    if finetune.method == "dpo":
        from portatrain.finetune.dpo import dpo_problems

        problems += dpo_problems(finetune.dpo, data, compile)
    return problems


def _meta_model(model: ModelConfig):  # noqa: ANN202 (nn.Module; torch imported lazily)
    """The configured model on the meta device (nothing allocated), or None when the config is invalid."""
    import torch

    from portatrain.models import build_model, model_problems

    if model_problems(model):
        return None  # reported by the model stage
    with torch.device("meta"):
        return build_model(model)
