"""``portatrain parity recipe=... device=... [trainer.steps=K]``: the device against an fp32 CPU run.

Trains K steps (default 3) on ``device`` and on the CPU in float32 from the same weights and
batches, prints per-step losses and the largest per-module differences, and exits 1 naming the
first module that diverged (see :mod:`portatrain.parity`).
"""

from __future__ import annotations

import sys

from portatrain.commands import CommandContext
from portatrain.config import Config

OVERRIDES = ["trainer.steps=3"]

SECTIONS = ("trainer",)
EXAMPLE = "portatrain parity device=sim trainer.steps=3"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.parity import run_parity

    report = run_parity(cfg, trainer_cls=ctx.trainer_cls)
    print(report.format())
    if not report.ok:
        sys.exit(1)
