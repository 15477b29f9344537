"""Keep secrets out of files and logs: values whose keys look like tokens, keys or passwords are redacted.

A run's config is written to ``<run_dir>/config.yaml`` and into every checkpoint, and launch
templates render it into job files -- all readable by whoever can read the run directory. Secrets
do reach the config (``+parallel.launch.env.HF_TOKEN=...``, a W&B key), so everything that writes a
config to disk or to a log goes through :func:`redact` / :func:`redacted_yaml`: the value of each
key that names a secret becomes ``"***"``; the structure and every other value stay as they are.

A key names a secret when one of its ``_``/``-``/``.``-separated words (or a camelCase word) is a
secret word (``token``, ``secret``, ``password``, ``passwd``, ``pwd``, ``apikey``, ``credential(s)``,
``auth``, ``private``), or it ends in ``key`` with a qualifier (``API_KEY``, ``access_key``,
``SECRET_ACCESS_KEY``; not a bare ``key``, nor ``keep``). ``max_tokens``-like counters are not
secrets: numbers and booleans are never redacted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

_SECRET_WORDS = {
    "token",
    "secret",
    "password",
    "passwd",
    "pwd",
    "apikey",
    "credential",
    "credentials",
    "auth",
    "private",
    "passphrase",
}


def is_secret_key(key: object) -> bool:
    """Whether a config key names a secret (see the module docstring)."""
    if not isinstance(key, str):
        return False
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)  # camelCase -> camel_Case
    words = [w for w in re.split(r"[_\-.\s]+", spaced.lower()) if w]
    if any(w in _SECRET_WORDS for w in words):
        return True
    return len(words) >= 2 and words[-1] in ("key", "keys")


def redact(value: Any) -> Any:
    """A copy of ``value`` (nested dicts/lists, or a DictConfig) with secret values replaced by ``***``."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    return _redact(value)


def _redact(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: (REDACTED if is_secret_key(k) and _is_text(v) else _redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v) for v in value]
    return value


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def redacted_yaml(cfg: Any) -> str:
    """``cfg`` as YAML (resolved), secrets redacted: what portatrain writes to ``config.yaml`` files."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(redact(cfg)))


__all__ = ["REDACTED", "is_secret_key", "redact", "redacted_yaml"]
