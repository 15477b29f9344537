"""``portatrain eval checkpoint=PATH|auto tasks=[...]``: lm-evaluation-harness tasks on a checkpoint
(``portatrain.evaluation``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

SECTIONS = ("eval",)
EXAMPLE = "portatrain eval checkpoint=runs/debug/demo tasks=portatrain_tiny eval.include_path=[examples/lm_eval_tasks]"
SHORTHANDS = {"checkpoint": "eval.checkpoint", "tasks": "eval.tasks", "out": "eval.out"}
"""``checkpoint`` alone would select a file of the ``checkpoint`` config group."""


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.evaluation.command import eval_command

    eval_command(cfg)
