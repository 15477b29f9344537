"""``portatrain render recipe=... launch.*=...``: print (or write) the SLURM/Kubernetes job (``portatrain.launch``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

SECTIONS = ("launch", "parallel", "fault_tolerance")
EXAMPLE = "portatrain render device=cpu parallel.dp_shard=2 launch.nodes=1 launch.procs_per_node=2"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.launch import render_command

    render_command(cfg, ctx.overrides)
