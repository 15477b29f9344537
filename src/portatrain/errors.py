"""The user-error base class: every error whose fix is the user's (a config value, a path, a missing
device) derives from :class:`UserError`, and the CLI prints it as one line, without a traceback.

Stages define their own subclasses next to the code that raises them (``CheckpointError`` in
``portatrain.checkpoint``, ``DeviceUnavailableError`` in ``portatrain.accelerators``,
``RecompileError`` in ``portatrain.compile``, ``OverlongError`` in ``portatrain.data.collate``...);
the CLI catches only :class:`UserError`, so a new stage adds an error without touching ``cli.py``.
Anything else is a bug and keeps its traceback -- except an ``OSError`` the user fixes (a read-only
or full file system, a file where a directory belongs, a missing parent, no permission), which
:func:`file_system_error` turns into a :class:`FileSystemError` naming the path, what is wrong and
the fix, whichever command and stage raised it.

This module imports nothing of portatrain, so every layer may import it.
"""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """An error the user fixes; the message names the value, the constraint and the fix."""


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message lists every problem with its fix."""


class FileSystemError(UserError, OSError):
    """A path cannot be written or read for a reason of the file system, not of portatrain."""


_FIXES = {
    errno.EROFS: "choose a location on a writable file system",
    errno.ENOSPC: "free space on the device written to, or choose a location on another one",
    errno.EDQUOT: "free space within your quota, or choose a location on another file system",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another path",
    errno.ENOENT: "check the path (or create its parent directory)",
    errno.EEXIST: "something already exists there: choose a new path, or remove it",
    errno.EISDIR: "it is a directory where a file is needed: choose another path",
    errno.EACCES: "choose a location you may write to, or change its permissions",
    errno.EPERM: "choose a location you may write to, or change its permissions",
    errno.ENAMETOOLONG: "choose a shorter path",
}
"""The errors of a path or its file system, with their fixes: what :func:`file_system_error` converts."""


def file_system_error(exc: BaseException) -> FileSystemError | None:
    """``exc`` (or an ``OSError`` it was raised from) as a one-line :class:`FileSystemError` when its
    errno is one of :data:`_FIXES`, else None (then it is not the user's to fix)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__  # `raise ... from err` only: an error merely handled nearby is no cause
    if seen is None or isinstance(seen, FileSystemError):
        return seen
    fix = _FIXES.get(seen.errno) if seen.errno is not None else None
    if fix is None:
        return None
    where = " -> ".join(str(p) for p in (seen.filename, seen.filename2) if p is not None)
    what = seen.strerror or os.strerror(seen.errno)
    if seen.errno == errno.EEXIST and seen.filename is not None and not os.path.isdir(seen.filename):
        what, fix = "a file is there, where a directory belongs", "choose another path"
    name = errno.errorcode.get(seen.errno, str(seen.errno))
    return FileSystemError(f"{where + ': ' if where else ''}{what} ({name}); {fix}")


__all__ = ["ConfigError", "FileSystemError", "UserError", "file_system_error"]
