"""``portatrain submit ...``: write the job into the run directory and hand it to sbatch/kubectl (``portatrain.launch``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

SECTIONS = ("launch", "parallel", "fault_tolerance")
EXAMPLE = "portatrain submit device=cpu parallel.dp_shard=2 launch.nodes=1 launch.procs_per_node=2"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.launch import submit_command

    submit_command(cfg, ctx.overrides)
