"""``portatrain audit PATH... [--format text|json|sarif] [--fail-on LEVEL]``: the command line.

Exit codes: 0 -- nothing at or above ``--fail-on``; 1 -- findings at or above it (the CI gate);
2 -- bad arguments, a missing or non-Python path, a broken config file or an ``-o`` file that cannot
be written (one message, no traceback).

``-o FILE`` is written whole or not at all: the report goes to a temporary file beside ``FILE``,
renamed over it once complete, so a full or read-only disk leaves neither a partial report nor a
temporary file (and an existing ``FILE`` keeps its old content).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from portatrain.audit.config import FAIL_ON_CHOICES, AuditConfig, AuditConfigError, find_config, load_config
from portatrain.audit.formats import RENDERERS, render_rules
from portatrain.audit.rules import RULES
from portatrain.audit.scan import AuditError, audit_paths

DEFAULT_FAIL_ON = "error"


def build_parser(prog: str = "portatrain audit") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Static scan of Python code for what breaks or slows down off NVIDIA GPUs.",
        epilog="Suppress one finding with `# portatrain: ignore[rule-id] reason` on its line.",
    )
    parser.add_argument(
        "paths", nargs="*", metavar="PATH", help="files or folders to scan (folders: every *.py)"
    )
    parser.add_argument(
        "--format", choices=sorted(RENDERERS), default="text", help="output format (default: text)"
    )
    parser.add_argument(
        "--fail-on",
        choices=FAIL_ON_CHOICES,
        default=None,
        help=f"exit 1 when a finding is at least this severe (default: the config's fail-on, else {DEFAULT_FAIL_ON})",
    )
    parser.add_argument("--config", metavar="FILE", help="a .portatrain-audit.toml or pyproject.toml to use")
    parser.add_argument("--no-config", action="store_true", help="ignore project config files")
    parser.add_argument("--disable", metavar="RULES", default="", help="comma-separated rule ids to skip")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report here instead of stdout")
    parser.add_argument("--list-rules", action="store_true", help="print every rule and exit")
    return parser


def _config(args: argparse.Namespace) -> AuditConfig:
    if args.no_config:
        config = AuditConfig()
    elif args.config:
        config = load_config(args.config)
    else:
        found = find_config(args.paths[0])
        config = load_config(found) if found else AuditConfig()
    extra = [r.strip() for r in args.disable.split(",") if r.strip()]
    unknown = [r for r in extra if r not in RULES]
    if unknown:
        raise AuditConfigError(
            f"--disable: unknown rule(s) {', '.join(unknown)}; see `portatrain audit --list-rules`"
        )
    if extra:
        config = AuditConfig(
            disable=config.disable | set(extra),
            severity=config.severity,
            exclude=config.exclude,
            fail_on=config.fail_on,
            root=config.root,
            source=config.source,
        )
    return config


def main(argv: list[str] | None = None, prog: str = "portatrain audit") -> int:
    """Run the audit; return the process exit code."""
    parser = build_parser(prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.list_rules and not args.paths:
        parser.error("give at least one PATH to audit (e.g. `portatrain audit src/`), or --list-rules")
    try:
        if args.output:
            _check_destination(Path(args.output))  # before the scan: fail in a second, not after it
        if args.list_rules:
            _emit(render_rules(args.format), args.output)
            return 0
        config = _config(args)
        result = audit_paths(args.paths, config)
        fail_on = args.fail_on or config.fail_on or DEFAULT_FAIL_ON
        _emit(RENDERERS[args.format](result, fail_on), args.output)
    except (AuditError, AuditConfigError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return int(result.fails(fail_on))


def _emit(text: str, output: str | None) -> None:
    if output:
        write_report(Path(output), text + "\n")
    else:
        print(text)


def _check_destination(path: Path) -> None:
    folder = path.parent
    if not folder.exists():
        raise AuditError(
            f"-o {path}: the folder {folder} does not exist; create it first (mkdir -p {folder}), "
            "or write the report elsewhere"
        )
    if not folder.is_dir():
        raise AuditError(f"-o {path}: {folder} is a file, not a folder; name a file inside a folder")
    if path.is_dir():
        raise AuditError(f"-o {path} is a directory; name a file in it (e.g. -o {path / 'audit.sarif'})")


def write_report(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file beside it, then a rename)."""
    _check_destination(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise AuditError(
            f"-o {path}: cannot write the report ({exc.strerror or exc}); choose a writable location "
            "with free space, or leave out -o to print it"
        ) from exc
