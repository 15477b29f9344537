"""``portatrain [train] [overrides]``: build the Trainer from the config, fit, close."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.trainer import Trainer

    trainer = (ctx.trainer_cls or Trainer)(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
