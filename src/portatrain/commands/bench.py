"""``portatrain bench recipe=... device=...``: cold start and steady state, measured apart (``portatrain.bench``)."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

SECTIONS = ("bench",)
EXAMPLE = "portatrain bench recipe=debug device=cpu bench.price_per_hour=0.10"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.bench import run_bench

    run_bench(cfg, trainer_cls=ctx.trainer_cls)
