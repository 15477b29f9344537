"""``portatrain plan ...`` or ``dry_run=true``: parameters and per-device memory, nothing allocated (``portatrain.plan``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

OVERRIDES = ["dry_run=true"]
"""Composed before the user's overrides: the plan sizes the layout it names, nothing is launched."""

SECTIONS = ("parallel",)
EXAMPLE = "portatrain plan recipe=llama8b device=cuda parallel.dp_shard=8"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.plan import describe_plan

    print(describe_plan(cfg))
