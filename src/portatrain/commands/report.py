"""``portatrain report recipe=... device=... [paths=[FILE,...]] [out=FILE.md]``: the six-level
portability checklist filled from evidence -- static audit, runtime audit, parity, bench
(``portatrain.report``). Exit status 1 when a checklist item fails."""

from __future__ import annotations

import sys

from portatrain.commands import CommandContext
from portatrain.config import Config

SHORTHANDS = {"paths": "report.paths", "out": "report.out"}
"""``paths=[examples/cuda_first_train.py]``: extra code to audit; ``out=report.md``: a copy of the report."""

SECTIONS = ("report",)
EXAMPLE = "portatrain report device=sim paths=[examples/cuda_first_train.py]"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.report import report_command

    status = report_command(cfg, ctx.trainer_cls, ctx.overrides)
    if status:
        sys.exit(status)
