"""``portatrain [COMMAND] [hydra overrides...]``: compose and validate the config, run one command.

Commands reuse the pipeline's stages; none re-implements them. ``train`` is the default.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from portatrain.accelerators import DeviceUnavailableError
from portatrain.checkpoint import CheckpointError
from portatrain.compile import RecompileError
from portatrain.config import ConfigError, register_configs, validate
from portatrain.data.collate import OverlongError


def _train(cfg: DictConfig, trainer_cls: type | None = None) -> None:
    from portatrain.trainer import Trainer

    trainer = (trainer_cls or Trainer)(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()


def _dry_run(cfg: DictConfig) -> None:
    from portatrain.plan import describe_plan

    print(describe_plan(cfg))


def _bench(cfg: DictConfig) -> None:
    from portatrain.bench import run_bench

    run_bench(cfg)


def _export(cfg: DictConfig) -> None:
    from portatrain.export import export_command

    export_command(cfg)


def _render(cfg: DictConfig) -> None:
    from portatrain.launch import render_command

    render_command(cfg, HydraConfig.get().overrides.task)


def _submit(cfg: DictConfig) -> None:
    from portatrain.launch import submit_command

    submit_command(cfg, HydraConfig.get().overrides.task)


COMMANDS: dict[str, Callable[[DictConfig], None]] = {
    "train": _train,
    "bench": _bench,
    "export": _export,
    "render": _render,  # a SLURM/Kubernetes job for this config (portatrain.launch)
    "submit": _submit,  # ... written to the run directory and handed to sbatch / kubectl
}
"""Subcommand name -> function of the composed config."""

SHORTHANDS: dict[str, dict[str, str]] = {"export": {"checkpoint": "export.checkpoint", "out": "export.out"}}
"""Bare keys a subcommand reads from its own section: ``portatrain export checkpoint=X out=Y``
(``checkpoint`` alone would select a file of the ``checkpoint`` config group)."""

# Errors that are the user's to fix: print one message, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    DeviceUnavailableError,
    FileNotFoundError,
    CheckpointError,
    RecompileError,
    OverlongError,
)


def config_dir() -> str:
    """``conf/`` inside an installed wheel, else the source checkout's top-level ``conf/``."""
    packaged = Path(__file__).parent / "conf"
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf")


def _run(command: str, cfg: DictConfig, trainer_cls: type | None) -> None:
    try:
        validate(cfg)
        if cfg.run_dir is None:
            with open_dict(cfg):
                cfg.run_dir = HydraConfig.get().runtime.output_dir
        if cfg.dry_run:
            _dry_run(cfg)
        elif command == "train":
            _train(cfg, trainer_cls)
        else:
            COMMANDS[command](cfg)
    except USER_ERRORS as exc:
        print(f"portatrain {command}: error: {exc}", file=sys.stderr)
        sys.exit(2)


def _quiet_known_warnings() -> None:
    # torchdata calls a deprecated torch API on every loader; DCP announces single-process saves.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _expand_shorthand(command: str, arg: str) -> str:
    key, sep, value = arg.partition("=")
    return f"{SHORTHANDS[command][key]}={value}" if sep and key in SHORTHANDS.get(command, {}) else arg


def main(trainer_cls: type | None = None) -> None:
    """Entry point. Research code passes its ``Trainer`` subclass: ``main(trainer_cls=MyTrainer)``."""
    command = "train"
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        command = sys.argv.pop(1)
    sys.argv[1:] = [_expand_shorthand(command, arg) for arg in sys.argv[1:]]
    register_configs()
    _quiet_known_warnings()

    def portatrain(cfg: DictConfig) -> None:  # Hydra names the job after this function
        _run(command, cfg, trainer_cls)

    hydra.main(config_path=config_dir(), config_name="config", version_base=None)(portatrain)()


if __name__ == "__main__":
    main()
