"""The data stage's user error: bad data or a bad data setting, reported in one message.

A :class:`DataError` names the file (and line or row where there is one), what is wrong and how to
fix it. The CLI prints it without a traceback and exits non-zero.
"""

from __future__ import annotations

from portatrain.errors import UserError


class DataError(UserError, ValueError):
    """Bad input data or data configuration; the message names the file/value and the fix."""
