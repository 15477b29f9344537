"""``portatrain submit ...``: write the job into the run directory and hand it to sbatch/kubectl (``portatrain.launch``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.launch import submit_command

    submit_command(cfg, ctx.overrides)
