"""``portatrain export checkpoint=PATH|auto out=DIR``: a checkpoint -> a Hugging Face directory (``portatrain.export``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

SHORTHANDS = {"checkpoint": "export.checkpoint", "out": "export.out", "merge_lora": "export.merge_lora"}
"""``checkpoint`` alone would select a file of the ``checkpoint`` config group."""

SECTIONS = ("export",)
EXAMPLE = "portatrain export checkpoint=auto run_dir=runs/debug/demo out=hf/demo"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.export import export_command

    export_command(cfg.export, cfg.run_dir)
