"""``portatrain [COMMAND] [args...]``: pick the command, compose and validate the config, run it.

Thin on purpose: the commands live in ``portatrain.commands`` (one module each, see there for how to
add one), validation in ``portatrain.validate``. ``train`` is the default command. Every error the
user must fix derives from :class:`~portatrain.errors.UserError` and is printed as one line.
"""

from __future__ import annotations

import os
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
from portatrain.errors import ConfigError, UserError


def config_dir() -> str:
    """``conf/`` inside an installed wheel, else the source checkout's top-level ``conf/``."""
    packaged = Path(__file__).parent / "conf"
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf")


def _report_user_errors(command: str, fn: Callable[[], object]) -> object:
    """Run ``fn``; a :class:`UserError` becomes one line on stderr and exit 2 (anything else is a bug
    and keeps its traceback). Ctrl-C outside training (which saves and stops on its own) exits 130
    without a traceback."""
    try:
        return fn()
    except UserError as exc:
        # Under torchrun every rank validates the same config and agrees on checkpoint errors: print
        # such an error once (rank 0). An error of one rank's own (its device...) is printed by it.
        if os.environ.get("RANK", "0") == "0" or not _same_on_every_rank(exc):
            print(f"portatrain {command}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"portatrain {command}: interrupted", file=sys.stderr)
        sys.exit(130)


def _same_on_every_rank(exc: UserError) -> bool:
    return isinstance(exc, ConfigError) or bool(getattr(exc, "same_on_every_rank", False))


def _remove_if_empty(run_dir: str) -> None:
    """Hydra creates the run directory before any command runs: remove it again when the command
    left nothing there (a config error, a missing device, a dry run, ``render``), or only the lock
    of a run that failed to start."""
    folder = Path(run_dir)
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return
    if names == [".portatrain.lock"]:
        from portatrain.rundir import remove_unused_lock

        remove_unused_lock(folder)
        names = []
    if names:
        return
    # The folder, and the parents Hydra made for it inside the working directory (runs/<recipe>/),
    # while they are empty.
    cwd = Path.cwd().resolve()
    folder = folder.resolve()
    while folder != cwd and cwd in folder.parents:
        try:
            folder.rmdir()  # only an empty directory
        except OSError:
            return
        folder = folder.parent


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
        try:
            _report_user_errors(command, lambda: _run(command, module, cfg, trainer_cls))
        finally:
            _remove_if_empty(HydraConfig.get().runtime.output_dir)

    hydra.main(config_path=config_dir(), config_name="config", version_base=None)(portatrain)()


if __name__ == "__main__":
    main()
