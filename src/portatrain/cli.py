"""``portatrain [COMMAND] [args...]``: pick the command, compose and validate the config, run it.

Thin on purpose: the commands live in ``portatrain.commands`` (one module each, see there for how to
add one), validation in ``portatrain.validate``. ``train`` is the default command.

One error path for every command (:func:`_report_user_errors`): an error the user must fix -- a
:class:`~portatrain.errors.UserError`, or an ``OSError`` of the file system such as a read-only or
full disk, a file where a directory belongs or a missing parent (``portatrain.errors.file_system_error``)
-- is printed as one line, ``portatrain COMMAND: error: ...``, and the process exits with status 2;
a run directory the command left empty is removed again. Anything else is a bug and keeps its
traceback. A key the typed schema lacks is such an error too, naming the nearest key
(:func:`_checked_override_keys`). Secrets are redacted in the config Hydra prints
(``--cfg job|hydra|all``), as in every config portatrain writes (``portatrain.redact``).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

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
from portatrain.errors import ConfigError, UserError, file_system_error
from portatrain.launch.moved_keys import apply_moved_keys, is_moved
from portatrain.launch.moved_keys import warning as moved_keys_warning
from portatrain.redact import redact, redact_text, redacted_yaml


def config_dir() -> str:
    """``conf/`` inside an installed wheel, else the source checkout's top-level ``conf/``."""
    packaged = Path(__file__).parent / "conf"
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf")


class _Abort(BaseException):
    """A user error raised inside Hydra's own machinery (a callback), which would print any
    ``Exception`` with a traceback: carried out of it to :func:`_report_user_errors`."""

    def __init__(self, error: UserError) -> None:
        super().__init__(str(error))
        self.error = error


def _report_user_errors(command: str, fn: Callable[[], object]) -> object:
    """Run ``fn``; a :class:`UserError`, or an ``OSError`` the user fixes (read-only or full file
    system, a file where a directory belongs, a missing parent...), becomes one line on stderr and
    exit 2 (anything else is a bug and keeps its traceback). Ctrl-C outside training (which saves and
    stops on its own) exits 130 without a traceback."""
    try:
        return fn()
    except _Abort as abort:
        error = abort.error
    except UserError as exc:
        error = exc
    except KeyboardInterrupt:
        print(f"portatrain {command}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:
        error = file_system_error(exc)
        if error is None:
            raise
    # Under torchrun every rank validates the same config and agrees on checkpoint errors: print such
    # an error once (rank 0). An error of one rank's own (its device, its disk...) is printed by it.
    if os.environ.get("RANK", "0") == "0" or not _same_on_every_rank(error):
        print(f"portatrain {command}: error: {error}", file=sys.stderr)
    sys.exit(2)


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


class OutputDirectory(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``) for the directories Hydra writes.

    It makes the run (or sweep) directory before Hydra does, so that a path that cannot be made --
    read-only, a file in the way, no permission -- is one line through :func:`_report_user_errors`,
    not Hydra's traceback. And a sweep (``-m``) records its whole config in ``multirun.yaml`` before
    its first job starts: that file is rewritten with secrets redacted as each job starts (they are
    on disk for no longer than Hydra takes to launch a job)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make_directory(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make_directory(config.hydra.sweep.dir)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        record = Path(str(config.hydra.sweep.dir)) / "multirun.yaml"
        if record.is_file():
            text = redacted_yaml(OmegaConf.load(record), resolve=False)
            if text != record.read_text():
                record.write_text(text)


def _make_directory(path: str) -> None:
    try:
        Path(str(path)).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        error = file_system_error(exc)
        if error is None:
            raise
        raise _Abort(error) from None


@contextmanager
def _redacted_config_printing() -> Iterator[None]:
    """Hydra prints ``--cfg job|hydra|all`` (and ``--help``/``--info``) itself, through
    ``Hydra.get_sanitized_cfg``; Hydra 1.3 has no hook there, so that method is wrapped while Hydra
    runs: what it prints hides secrets as ``config.yaml`` does. It is not used to run a job."""
    from hydra._internal.hydra import Hydra

    original = Hydra.get_sanitized_cfg

    def sanitized(self: Hydra, cfg: DictConfig, cfg_type: str) -> DictConfig:
        clean = original(self, cfg, cfg_type)
        return OmegaConf.create(redact(clean, resolve=False), flags={"allow_objects": True})

    Hydra.get_sanitized_cfg = sanitized  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_sanitized_cfg = original  # type: ignore[method-assign]


@contextmanager
def _checked_override_keys(command: str) -> Iterator[None]:
    """A ``KEY=VALUE`` (or ``+KEY=VALUE``) override whose key is not in the typed schema is one line
    naming the nearest key that is, exit 2 -- not Hydra's error, whose hint ("To append to your config
    use +trainer.stepz=50") would add the misspelled key, train with the default and record the typo
    in ``config.yaml``. ``+`` still adds keys where the schema has an open mapping
    (``+launch.env.NAME=VALUE``), and Hydra's own keys (``hydra.*``) are Hydra's business.

    Then the launch settings' old spelling (``parallel.launch.nodes``), from a recipe or the command
    line, is applied as the new one (``launch.nodes``, ``portatrain.launch.moved_keys``), with one
    warning line per run (rank 0's) naming both.

    Hydra 1.3 applies command-line overrides in ``ConfigLoaderImpl._apply_overrides_to_config``
    (hydra/_internal/config_loader_impl.py), the last step of composing, with no hook, so it is
    wrapped while Hydra runs, as :func:`_redacted_config_printing` wraps the printing."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    original = ConfigLoaderImpl._apply_overrides_to_config
    warned = False  # Hydra composes more than once in a sweep (-m): one warning for the whole run

    def checked(overrides: list[Any], cfg: DictConfig) -> None:
        nonlocal warned
        tree = None  # the config's keys, read again only after an override that may add some
        for override in overrides:  # one at a time: an earlier override may add a key a later one sets
            if tree is None:
                # Unresolved: a key whose value is `???` or an interpolation exists all the same.
                tree = OmegaConf.to_container(cfg, resolve=False)
                tree.pop("hydra", None)
            problem = _unknown_key_problem(override, cfg, tree)
            if problem is not None:
                raise _Abort(ConfigError(problem))
            original([override], cfg)
            if override.is_add() or override.is_force_add() or not _is_scalar(override.value()):
                tree = None
        try:
            moved = apply_moved_keys(cfg)
        except ConfigError as exc:
            raise _Abort(exc) from None
        if moved and not warned and os.environ.get("RANK", "0") == "0":
            print(f"portatrain {command}: warning: {moved_keys_warning(moved)}", file=sys.stderr)
            warned = True

    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(checked)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl._apply_overrides_to_config = staticmethod(original)  # type: ignore[method-assign]


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _unknown_key_problem(override: Any, cfg: DictConfig, tree: dict[str, Any]) -> str | None:
    """Why ``override`` sets a key the typed schema lacks (with the nearest key), or None; ``tree``
    is ``cfg`` as plain containers, unresolved, without ``hydra``."""
    key = override.key_or_group
    if override.is_delete() or override.package is not None or key.split(".")[0] == "hydra":
        return None
    if _holds(tree, key):
        return None
    parent_key = key.rpartition(".")[0]
    parent = OmegaConf.select(cfg, parent_key) if _holds(tree, parent_key) else None
    if isinstance(parent, DictConfig) and OmegaConf.get_type(parent) is dict:
        return None  # an open mapping (launch.env): `+` adds there, as Hydra's hint says
    line = redact_text(override.input_line)
    nearest = _nearest_key(tree, key)
    hint = f"did you mean {nearest}?" if nearest else "`portatrain --help` lists every key"
    if override.is_add() or override.is_force_add():
        return (
            f"{line}: {key} is not a key of the config, and `+` adds a key only to an open mapping "
            f"(launch.env), not to the typed schema; {hint}"
        )
    return f"{line}: {key} is not a key of the config; {hint}"


def _holds(tree: Any, key: str) -> bool:
    """Whether the plain config ``tree`` has the dotted ``key`` (list items by index)."""
    for part in key.split(".") if key else []:
        if isinstance(tree, dict) and part in tree:
            tree = tree[part]
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return False
    return True


def _nearest_key(tree: dict[str, Any], key: str) -> str | None:
    """The key ``key`` was most likely meant to be: a close name beside it (``trainer.stepz`` ->
    ``trainer.steps``), the same name in another section (``trainer.lr`` -> ``optim.lr``), else the
    closest dotted key (``trainr.steps`` -> ``trainer.steps``); never a key's old spelling."""
    keys = [k for k in _dotted_keys(tree) if not is_moved(k)]
    parent, _, name = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(name, siblings, n=1)
    if close:
        return f"{parent}.{close[0]}" if parent else close[0]
    same_name = [k for k in keys if k.rpartition(".")[2] == name]
    return (same_name or difflib.get_close_matches(key, keys, n=1) or [None])[0]


def _dotted_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for name, value in tree.items():
        keys.append(f"{prefix}{name}")
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _run(command: str, module: ModuleType, cfg: DictConfig, trainer_cls: type | None) -> None:
    from portatrain.validate import validate

    validate(cfg)
    if cfg.run_dir is None:
        with open_dict(cfg):
            cfg.run_dir = HydraConfig.get().runtime.output_dir
    if cfg.dry_run:  # any command with dry_run=true plans instead of running
        module = load_command("plan")
    ctx = CommandContext(trainer_cls=trainer_cls, overrides=list(HydraConfig.get().overrides.task))
    try:
        module.run(cfg, ctx)
    finally:
        from portatrain.distributed import destroy_distributed

        destroy_distributed()  # the process group a command's runtime started (none: nothing to do)


def _quiet_known_warnings() -> None:
    # torchdata calls a deprecated torch API on every loader; DCP announces single-process saves.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    # `datasets` (lm-eval's, imported by every evaluation) announces at INFO each optional framework
    # it finds when imported (datasets/config.py): "JAX version 0.10.2 available." where JAX is
    # installed, which portatrain never uses.
    logging.getLogger("datasets").addFilter(_not_the_jax_announcement)


def _not_the_jax_announcement(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("JAX version ") and message.endswith(" available."))


def _expand_shorthand(keys: dict[str, str], arg: str) -> str:
    key, sep, value = arg.partition("=")
    return f"{keys[key]}={value}" if sep and key in keys else arg


def main(trainer_cls: type | None = None, argv: list[str] | None = None) -> None:
    """Entry point. Research code passes its ``Trainer`` subclass: ``main(trainer_cls=MyTrainer)``;
    ``argv`` (default ``sys.argv[1:]``) is the command line after ``portatrain``. Exits (``SystemExit``)
    on errors, with status 2 for one the user fixes."""
    if argv is not None:
        sys.argv[1:] = argv  # Hydra reads its command line from sys.argv
    command = DEFAULT_COMMAND
    named = len(sys.argv) > 1 and sys.argv[1] in COMMANDS
    if named:
        command = sys.argv.pop(1)
    asks_help = any(arg in ("--help", "-h") for arg in sys.argv[1:])
    if asks_help and named:  # `portatrain COMMAND --help`: generated from the command and the schema
        from portatrain.commands.usage import usage

        print(usage(command, config_dir()))
        if uses_hydra(load_command(command)):
            sys.exit(0)
    elif asks_help:  # `portatrain --help`: the commands, then Hydra's groups and config
        from portatrain.commands.usage import overview

        print(overview())
    module = load_command(command)
    _quiet_known_warnings()
    if not uses_hydra(module):
        status = _report_user_errors(command, lambda: module.main(sys.argv[1:]))
        sys.exit(status or 0)
    keys = shorthands(module)
    sys.argv[1:] = [*command_overrides(module), *(_expand_shorthand(keys, arg) for arg in sys.argv[1:])]
    from portatrain.models import ModelSchema  # the families' model.* keys (torch: validation needs it)

    register_configs(ModelSchema)

    def portatrain(cfg: DictConfig) -> None:  # Hydra names the job after this function
        try:
            _report_user_errors(command, lambda: _run(command, module, cfg, trainer_cls))
        finally:
            _remove_if_empty(HydraConfig.get().runtime.output_dir)

    app = hydra.main(config_path=config_dir(), config_name="config", version_base=None)(portatrain)
    with _redacted_config_printing(), _checked_override_keys(command), _composed_once():
        _report_user_errors(command, app)


@contextmanager
def _composed_once() -> Iterator[None]:
    """Hydra 1.3 composes the whole config twice per run: ``Hydra.get_mode`` composes it only to
    read ``hydra.mode`` (hydra/_internal/hydra.py), then ``Hydra.run`` composes it again. No
    portatrain config sets ``hydra.mode``, so unless the command line does, the mode is the one
    ``-m``/``--multirun`` asks for -- what Hydra does when ``get_mode`` finds none -- and the first
    composition is skipped (about 0.7 s of every command's start-up on a 2-core machine)."""
    from hydra._internal.hydra import Hydra

    original = Hydra.get_mode

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        if any(o.lstrip("+~").startswith("hydra.mode") for o in overrides):
            return original(self, config_name, overrides)
        return None

    Hydra.get_mode = get_mode  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = original  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
