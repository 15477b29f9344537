"""The launch settings' old spelling, ``parallel.launch.*``, kept working for one release.

The job's hosts and scheduler moved from ``parallel.launch`` to the top-level ``launch`` section: they
are not a parallel layout. The schema keeps ``parallel.launch`` with every key unset
(``portatrain.config.MovedLaunchConfig``), so a recipe, a YAML file or a command line that still sets
``parallel.launch.nodes`` composes as before. :func:`apply_moved_keys` then copies each key that was
set to ``launch`` (``env`` name by name), leaves ``parallel.launch`` null and returns the keys it
moved, for the one warning line :func:`warning` words. A key set under both spellings to different
values is an error: which one was meant cannot be known. A ``launch`` key still at its default counts
as not set (the composed config does not say whether a layer set it to the default).

The CLI applies it to every config it composes (``portatrain.cli``), as does ``compose_config`` in
``tests/helpers.py``.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from portatrain.config import LaunchConfig
from portatrain.errors import ConfigError

OLD, NEW = "parallel.launch", "launch"
REMOVED_IN = "the next release"


def is_moved(key: str) -> bool:
    """Whether dotted ``key`` is spelled the old way (``parallel.launch.nodes``)."""
    return key == OLD or key.startswith(f"{OLD}.")


def apply_moved_keys(cfg: DictConfig) -> list[tuple[str, str]]:
    """Copy every key set under ``parallel.launch`` of ``cfg`` to ``launch`` and null the old section;
    return the ``(old key, new key)`` pairs moved. Raises :class:`ConfigError` (one line) naming each
    key set under both spellings to different values."""
    section = cfg.parallel.launch
    if section is None:
        return []
    target, defaults = cfg.launch, LaunchConfig()
    moved, conflicts = [], []
    for key, value in section.items():
        if isinstance(value, DictConfig):  # an open mapping (env): merged name by name
            keys = [(f"{key}.{k}", v, target[key].get(k), None) for k, v in value.items()]
        else:
            keys = [(key, value, target[key], getattr(defaults, key))]
        for dotted, old_value, new_value, default in keys:
            old_value, new_value = _plain(old_value), _plain(new_value)
            if old_value is None:
                continue
            if new_value not in (default, old_value):
                conflicts.append((f"{OLD}.{dotted}", old_value, f"{NEW}.{dotted}", new_value))
                continue
            OmegaConf.update(target, dotted, old_value, merge=False, force_add=True)
            moved.append((f"{OLD}.{dotted}", f"{NEW}.{dotted}"))
    cfg.parallel.launch = None
    if conflicts:
        both = "; ".join(f"{o}={ov} and {n}={nv} disagree" for o, ov, n, nv in conflicts)
        keys = ", ".join(n for _, _, n, _ in conflicts)
        raise ConfigError(f"{both}: set only {keys} ({_removal(len(conflicts))})")
    return moved


def warning(moved: list[tuple[str, str]]) -> str:
    """The one warning line for the keys :func:`apply_moved_keys` moved."""
    olds, news = ", ".join(o for o, _ in moved), ", ".join(n for _, n in moved)
    verb = "is" if len(moved) == 1 else "are"
    return f"{olds} {verb} deprecated: use {news} ({_removal(len(moved))})"


def _removal(count: int) -> str:
    return f"the old key{'s are' if count > 1 else ' is'} removed in {REMOVED_IN}"


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


__all__ = ["REMOVED_IN", "apply_moved_keys", "is_moved", "warning"]
