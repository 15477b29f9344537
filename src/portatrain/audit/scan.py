"""The static scan: parse each file with :mod:`ast` and report what breaks or slows down off NVIDIA.

For each file, :func:`scan_source` builds one :class:`~portatrain.audit.context.FileScan` (the
file's import aliases, its training step, its tensor guesses, see :mod:`~portatrain.audit.names`,
:mod:`~portatrain.audit.step` and :mod:`~portatrain.audit.tensors`), then walks the tree once,
breadth-first (ancestors before descendants, so a broad finding claims its sub-expressions before
narrower rules see them), calling for every node the checks the rule families
(:data:`portatrain.audit.checks.FAMILIES`) registered for its type. At most one finding per rule
and line is kept; inline suppressions are :mod:`~portatrain.audit.suppressions`'.

:func:`audit_paths` expands folders into their ``.py`` files, applies the project config (disabled
rules, severity overrides, exclusions) and sorts what was found.
"""

from __future__ import annotations

import ast
import os
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from portatrain.audit.checks import FAMILIES
from portatrain.audit.config import AuditConfig
from portatrain.audit.context import FileScan
from portatrain.audit.finding import Finding
from portatrain.audit.project import Project, ProjectFile
from portatrain.audit.registry import dispatch_table
from portatrain.audit.rules import RULES, SEVERITIES
from portatrain.errors import UserError

PYTHON_SUFFIXES = (".py", ".pyw", ".pyi")
"""A file named on the command line with one of these suffixes is Python; other files are Python
only when their first line is a ``#!...python`` shebang (a script without a suffix)."""

_SKIP_DIRS = frozenset(
    {"__pycache__", "node_modules", "site-packages", "build", "dist", "venv", ".venv", ".git", ".tox"}
)
_CHECKS = dispatch_table(FAMILIES)


class AuditError(UserError, ValueError):
    """A path or argument the audit cannot use; the message names it and the fix."""


@dataclass
class AuditResult:
    """Everything one audit run found; formats render it, the CLI turns it into an exit code."""

    findings: list[Finding]
    """Active findings (not suppressed, not disabled), sorted by path, line, column."""
    suppressed: list[Finding]
    """Findings silenced by an inline ``# portatrain: ignore``, kept as evidence."""
    files: list[str]
    """Every file scanned, as displayed."""
    paths: list[str]
    """The paths the audit was asked for."""
    config: AuditConfig = field(default_factory=AuditConfig)

    def count(self, severity: str) -> int:
        return sum(f.severity == severity for f in self.findings)

    def fails(self, fail_on: str) -> bool:
        """Whether any finding is at least as severe as ``fail_on`` (``never``: never fails)."""
        if fail_on == "never":
            return False
        worst = SEVERITIES.index(fail_on)
        return any(SEVERITIES.index(f.severity) <= worst for f in self.findings)


def audit_paths(paths: Sequence[str | os.PathLike[str]], config: AuditConfig | None = None) -> AuditResult:
    """Scan every ``.py`` file under ``paths``; a file named in ``paths`` must be Python
    (:data:`PYTHON_SUFFIXES` or a python shebang), else :class:`AuditError`."""
    config = config or AuditConfig()
    files = list(_expand(paths, config))
    findings: list[Finding] = []
    suppressed: list[Finding] = []
    # Several files are one project: calls into each other's CUDA helpers are resolved.
    project = Project.build(paths, [(p, _display(p)) for p in files]) if len(files) > 1 else None
    for path in files:
        display = _display(path)
        for finding in scan_file(path, display=display, project=project):
            if finding.rule in config.disable:
                continue
            if finding.rule in config.severity:
                finding = replace(finding, severity=config.severity[finding.rule])
            (suppressed if finding.justification is not None else findings).append(finding)
    order = lambda f: (f.path, f.line, f.column, f.rule)  # noqa: E731
    return AuditResult(
        findings=sorted(findings, key=order),
        suppressed=sorted(suppressed, key=order),
        files=[_display(p) for p in files],
        paths=[str(p) for p in paths],
        config=config,
    )


def scan_file(
    path: str | os.PathLike[str], *, display: str | None = None, project: Project | None = None
) -> list[Finding]:
    """All findings of one file, suppressed ones included (their ``justification`` is not None);
    ``project`` (the other files audited with it) resolves calls into their CUDA helpers."""
    display = display or str(path)
    try:
        with tokenize.open(path) as handle:  # honours a PEP 263 coding cookie
            source = handle.read()
    except (SyntaxError, UnicodeDecodeError) as exc:
        return [_syntax_finding(display, 1, 1, f"cannot decode the file: {exc}")]
    except OSError as exc:
        raise AuditError(
            f"cannot read {display}: {exc.strerror or exc}; check that it is a readable file"
        ) from exc
    return scan_source(source, display, project=project, file=Path(path))


def scan_source(
    source: str, path: str = "<string>", *, project: Project | None = None, file: Path | None = None
) -> list[Finding]:
    """All findings of one module's source, suppressed ones included."""
    try:
        module = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return [_syntax_finding(path, exc.lineno or 1, exc.offset or 1, f"syntax error: {exc.msg}")]
    view: ProjectFile | None = None
    if project is not None and file is not None:
        view = project.for_file(file, module)
    scan = FileScan(module, source, path, view)
    for node in ast.walk(module):  # breadth-first: ancestors before descendants
        for check in _CHECKS.get(type(node), ()):
            check(scan, node)
    return scan.findings()


def is_python_file(path: Path) -> bool:
    """A ``.py``/``.pyw``/``.pyi`` file, or one whose first line is a ``#!...python`` shebang."""
    if path.suffix in PYTHON_SUFFIXES:
        return True
    try:
        with path.open("rb") as handle:
            first = handle.readline(256)
    except OSError:
        return True  # unreadable: scan_file names the reason
    return first.startswith(b"#!") and b"python" in first


def _syntax_finding(path: str, line: int, column: int, message: str) -> Finding:
    rule = RULES["syntax-error"]
    return Finding(path, line, column, line, column, rule.id, rule.severity, message, rule.replacement)


def _expand(paths: Sequence[str | os.PathLike[str]], config: AuditConfig) -> Iterator[Path]:
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise AuditError(f"no such file or directory: {', '.join(missing)}; pass existing files or folders")
    not_python = [str(p) for p in paths if Path(p).is_file() and not is_python_file(Path(p))]
    if not_python:
        raise AuditError(
            f"not a Python file: {', '.join(not_python)} (the name does not end in "
            f"{'/'.join(PYTHON_SUFFIXES)} and the first line is no python shebang); pass Python files, "
            "or folders (their *.py files are audited)"
        )
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            candidates: Iterable[Path] = [path]  # named explicitly: scanned even if excluded
        else:
            candidates = (
                p
                for p in sorted(path.rglob("*.py"))
                if not any(
                    part in _SKIP_DIRS or part.startswith(".") for part in p.relative_to(path).parts[:-1]
                )
                and not config.excludes(p)
            )
        for candidate in candidates:
            key = candidate.resolve()
            if key not in seen:
                seen.add(key)
                yield candidate


def _display(path: Path) -> str:
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()
