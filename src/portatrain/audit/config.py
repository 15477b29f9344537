"""The per-project audit config: disabled rules, severity overrides, excluded paths, fail-on level.

Read from, in this order, the first found walking up from the first audited path:

* ``.portatrain-audit.toml`` -- the keys at top level;
* ``pyproject.toml`` with a ``[tool.portatrain.audit]`` table (a pyproject without one is skipped).

Keys (every problem is reported at once, naming the file and the fix)::

    [tool.portatrain.audit]
    disable = ["pickle-dump"]                  # rule ids never reported
    exclude = ["src/pkg/accelerators/cuda.py"]  # globs, relative to the config file's folder
    fail-on = "warning"                        # default for --fail-on (error | warning | info | never)

    [tool.portatrain.audit.severity]           # per-rule severity overrides
    host-sync = "error"

An ``exclude`` glob matches a file or any folder above it (``tests/fixtures`` excludes everything
below); it applies to folders the audit walks, not to files named on the command line.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

from portatrain.audit.rules import RULES, SEVERITIES
from portatrain.errors import UserError

CONFIG_FILE = ".portatrain-audit.toml"
FAIL_ON_CHOICES: tuple[str, ...] = (*SEVERITIES, "never")
_KEYS = ("disable", "severity", "exclude", "fail-on")


class AuditConfigError(UserError, ValueError):
    """The audit config has problems; the message lists every one of them."""


@dataclass(frozen=True)
class AuditConfig:
    disable: frozenset[str] = frozenset()
    """Rule ids never reported."""
    severity: dict[str, str] = field(default_factory=dict)
    """Rule id -> severity that replaces the rule's default."""
    exclude: tuple[str, ...] = ()
    """Globs (relative to :attr:`root`) of files and folders the directory walk skips."""
    fail_on: str | None = None
    """Default ``--fail-on`` level (None: the CLI's default, ``error``)."""
    root: Path | None = None
    """Folder the ``exclude`` globs are relative to (the config file's folder)."""
    source: str | None = None
    """The file this config came from (None: built-in defaults)."""

    def excludes(self, path: Path) -> bool:
        if not self.exclude or self.root is None:
            return False
        try:
            relative = path.resolve().relative_to(self.root.resolve())
        except ValueError:
            return False
        parts = relative.parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(fnmatch.fnmatchcase(p, pattern.rstrip("/")) for pattern in self.exclude for p in prefixes)


def parse_config(table: dict[str, Any], *, source: str, root: Path | None) -> AuditConfig:
    """Validate one config table; raise :class:`AuditConfigError` listing every problem."""
    problems: list[str] = []
    known = ", ".join(RULES)
    for key in table:
        if key not in _KEYS:
            problems.append(f"unknown key {key!r}; the keys are {', '.join(_KEYS)}")

    disable = table.get("disable", [])
    if not isinstance(disable, list) or not all(isinstance(x, str) for x in disable):
        problems.append(f"disable = {disable!r} must be a list of rule ids")
        disable = []
    problems += [
        f"disable: unknown rule {rule!r}; known rules: {known}" for rule in disable if rule not in RULES
    ]

    severity = table.get("severity", {})
    if not isinstance(severity, dict):
        problems.append(f'severity = {severity!r} must be a table, e.g. severity = {{ host-sync = "error" }}')
        severity = {}
    for rule, level in severity.items():
        if rule not in RULES:
            problems.append(f"severity: unknown rule {rule!r}; known rules: {known}")
        if level not in SEVERITIES:
            problems.append(f"severity.{rule} = {level!r}; use one of {', '.join(SEVERITIES)}")

    exclude = table.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
        problems.append(f"exclude = {exclude!r} must be a list of glob strings")
        exclude = []

    fail_on = table.get("fail-on")
    if fail_on is not None and fail_on not in FAIL_ON_CHOICES:
        problems.append(f"fail-on = {fail_on!r}; use one of {', '.join(FAIL_ON_CHOICES)}")

    if problems:
        raise AuditConfigError(f"{source}: " + "; ".join(problems))
    return AuditConfig(
        disable=frozenset(disable),
        severity=dict(severity),
        exclude=tuple(exclude),
        fail_on=fail_on,
        root=root,
        source=source,
    )


def load_config(path: str | os.PathLike[str]) -> AuditConfig:
    """Read ``path`` (a ``.portatrain-audit.toml`` or a ``pyproject.toml``)."""
    path = Path(path)
    if not path.is_file():
        raise AuditConfigError(f"audit config {path} does not exist; pass an existing file to --config")
    document = _read_toml(path)
    if path.name == "pyproject.toml":
        table = document.get("tool", {}).get("portatrain", {}).get("audit")
        if table is None:
            raise AuditConfigError(f"{path} has no [tool.portatrain.audit] table")
    else:
        table = document
    return parse_config(table, source=str(path), root=path.parent)


def find_config(start: str | os.PathLike[str]) -> Path | None:
    """The nearest ``.portatrain-audit.toml``, or ``pyproject.toml`` with an audit table, at or
    above ``start``."""
    folder = Path(start).resolve()
    if not folder.is_dir():
        folder = folder.parent
    for candidate in [folder, *folder.parents]:
        dedicated = candidate / CONFIG_FILE
        if dedicated.is_file():
            return dedicated
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file() and "audit" in _read_toml(pyproject).get("tool", {}).get("portatrain", {}):
            return pyproject
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    if tomllib is None:
        raise AuditConfigError(
            f"reading {path} needs Python >= 3.11 or the `tomli` package (pip install tomli)"
        )
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise AuditConfigError(f"{path} is not valid TOML: {exc}") from exc
