"""The DeepSeek-V3 family: latent attention, dense then mixture-of-experts blocks with shared
experts, bias-balanced group routing (``model.py``), and the Hugging Face mapping (``hf.py``).
``DEEPSEEK_V3`` is what the registry lists; :class:`DeepseekV3Options` are its own ``model.*`` keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from portatrain.models.common import decoder_spec, layout_problems
from portatrain.models.deepseek_v3 import hf
from portatrain.models.deepseek_v3.model import (
    DEEPSEEK_V3_FLAVORS,
    DEEPSEEK_V3_PUBLISHED_PARAMS,
    DeepseekV3,
    DeepseekV3Args,
)


@dataclass
class DeepseekV3Options:
    """DeepSeek-V3's own ``model.*`` keys (``ModelSpec.options``): each sets the
    :class:`DeepseekV3Args` field of its name; None keeps the flavour's value."""

    n_group: int | None = None
    """Expert groups for group-limited routing."""
    topk_group: int | None = None
    """Groups a token's experts may come from (at most ``n_group``)."""
    bias_update_rate: float | None = None
    """Per-step change of each expert's selection bias toward even load (0 freezes it)."""
    q_lora_rank: int | None = None
    """Width of the query latent of latent attention (a flavour without one keeps none)."""
    kv_lora_rank: int | None = None
    """Width of the key/value latent of latent attention."""
    qk_rope_head_dim: int | None = None
    """Rotary query/key channels per head (even)."""
    mtp_layers: int | None = None
    """Multi-token-prediction depths trained after the main model (0: none; the published model has 1)."""
    mtp_loss_weight: float | None = None
    """Weight of the multi-token-prediction loss (the paper's lambda; default 0.3)."""


def _layout_problems(parallel: Any, args: DeepseekV3Args) -> list[str]:
    """The shared plan's refusals, plus tensor parallel, which has no plan for latent attention yet."""
    problems = layout_problems(parallel, args)
    if parallel.tp > 1 and not any("parallel.tp" in p for p in problems):
        problems.append(
            f"parallel.tp={parallel.tp}: tensor parallel has no plan for latent attention; set parallel.tp=1 "
            "and shard with FSDP2 (parallel.dp_shard) and expert parallel (parallel.ep)"
        )
    return problems


DEEPSEEK_V3 = dataclasses.replace(
    decoder_spec(
        "deepseek_v3",
        DeepseekV3,
        DeepseekV3Args,
        DEEPSEEK_V3_FLAVORS,
        hf,
        published_params=DEEPSEEK_V3_PUBLISHED_PARAMS,
    ),
    layout_problems=_layout_problems,
    options=DeepseekV3Options,
)

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V3_FLAVORS", "DeepseekV3", "DeepseekV3Args", "DeepseekV3Options"]
