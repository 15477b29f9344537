"""The user-error base class: every error whose fix is the user's (a config value, a path, a missing
device) derives from :class:`UserError`, and the CLI prints it as one line, without a traceback.

Stages define their own subclasses next to the code that raises them (``CheckpointError`` in
``portatrain.checkpoint``, ``DeviceUnavailableError`` in ``portatrain.accelerators``,
``RecompileError`` in ``portatrain.compile``, ``OverlongError`` in ``portatrain.data.collate``...);
the CLI catches only :class:`UserError`, so a new stage adds an error without touching ``cli.py``.
Anything else is a bug and keeps its traceback.

This module imports nothing, so every layer may import it.
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user fixes; the message names the value, the constraint and the fix."""


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message lists every problem with its fix."""


__all__ = ["ConfigError", "UserError"]
