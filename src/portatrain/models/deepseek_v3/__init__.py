"""The DeepSeek-V3 family: latent attention, dense then mixture-of-experts blocks with shared
experts, bias-balanced group routing (``model.py``), and the Hugging Face mapping (``hf.py``).
``DEEPSEEK_V3`` is what the registry lists."""

from __future__ import annotations

import dataclasses
from typing import Any

from portatrain.models.common import decoder_spec, layout_problems
from portatrain.models.deepseek_v3 import hf
from portatrain.models.deepseek_v3.model import (
    DEEPSEEK_V3_FLAVORS,
    DEEPSEEK_V3_PUBLISHED_PARAMS,
    DeepseekV3,
    DeepseekV3Args,
)


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
)

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V3_FLAVORS", "DeepseekV3", "DeepseekV3Args"]
