"""``portatrain generate checkpoint=PATH|auto prompt=TEXT``: continue a prompt with a checkpoint's model,
greedy or sampled, over a static-shape KV cache (``portatrain.generate``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

SECTIONS = ("generate",)
EXAMPLE = 'portatrain generate checkpoint=runs/debug/demo prompt="The red fox" generate.max_new_tokens=32'
SHORTHANDS = {"checkpoint": "generate.checkpoint", "prompt": "generate.prompt"}
"""``checkpoint`` alone would select a file of the ``checkpoint`` config group."""


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.generate import generate_command

    generate_command(cfg)
