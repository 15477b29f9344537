"""``portatrain [COMMAND] [args...]``: pick the command, compose and validate the config, run it.

Thin on purpose: the commands live in ``portatrain.commands`` (one module each, see there for how to
add one), validation in ``portatrain.validate``. ``train`` is the default command. Every error the
user must fix derives from :class:`~portatrain.errors.UserError` and is printed as one line.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from portatrain.commands import (
    COMMANDS,
    DEFAULT_COMMAND,
    CommandContext,
    command_overrides,
    load_command,
    shorthands,
    uses_hydra,
)
from portatrain.config import register_configs
from portatrain.errors import UserError


def config_dir() -> str:
    """``conf/`` inside an installed wheel, else the source checkout's top-level ``conf/``."""
    packaged = Path(__file__).parent / "conf"
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf")


def _report_user_errors(command: str, fn: Callable[[], object]) -> object:
    """Run ``fn``; a :class:`UserError` becomes one line on stderr and exit 2 (anything else is a bug
    and keeps its traceback)."""
    try:
        return fn()
    except UserError as exc:
        print(f"portatrain {command}: error: {exc}", file=sys.stderr)
        sys.exit(2)


def _run(command: str, module: ModuleType, cfg: DictConfig, trainer_cls: type | None) -> None:
    from portatrain.validate import validate

    validate(cfg)
    if cfg.run_dir is None:
        with open_dict(cfg):
            cfg.run_dir = HydraConfig.get().runtime.output_dir
    if cfg.dry_run:  # any command with dry_run=true plans instead of running
        module = load_command("plan")
    ctx = CommandContext(trainer_cls=trainer_cls, overrides=list(HydraConfig.get().overrides.task))
    module.run(cfg, ctx)


def _quiet_known_warnings() -> None:
    # torchdata calls a deprecated torch API on every loader; DCP announces single-process saves.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _expand_shorthand(keys: dict[str, str], arg: str) -> str:
    key, sep, value = arg.partition("=")
    return f"{keys[key]}={value}" if sep and key in keys else arg


def main(trainer_cls: type | None = None) -> None:
    """Entry point. Research code passes its ``Trainer`` subclass: ``main(trainer_cls=MyTrainer)``."""
    command = DEFAULT_COMMAND
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        command = sys.argv.pop(1)
    module = load_command(command)
    _quiet_known_warnings()
    if not uses_hydra(module):
        status = _report_user_errors(command, lambda: module.main(sys.argv[1:]))
        sys.exit(status or 0)
    keys = shorthands(module)
    sys.argv[1:] = [*command_overrides(module), *(_expand_shorthand(keys, arg) for arg in sys.argv[1:])]
    register_configs()

    def portatrain(cfg: DictConfig) -> None:  # Hydra names the job after this function
        _report_user_errors(command, lambda: _run(command, module, cfg, trainer_cls))

    hydra.main(config_path=config_dir(), config_name="config", version_base=None)(portatrain)()


if __name__ == "__main__":
    main()
