"""``portatrain audit PATH... [--format text|json|sarif] [--fail-on LEVEL]``: the command line.

Exit codes: 0 -- nothing at or above ``--fail-on``; 1 -- findings at or above it (the CI gate);
2 -- bad arguments, a missing path or a broken config file (one message, no traceback).
"""

from __future__ import annotations

import argparse
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
    if args.list_rules:
        _emit(render_rules(args.format), args.output)
        return 0
    if not args.paths:
        parser.error("give at least one PATH to audit (e.g. `portatrain audit src/`), or --list-rules")
    try:
        config = _config(args)
        result = audit_paths(args.paths, config)
    except (AuditError, AuditConfigError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    fail_on = args.fail_on or config.fail_on or DEFAULT_FAIL_ON
    _emit(RENDERERS[args.format](result, fail_on), args.output)
    return int(result.fails(fail_on))


def _emit(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text + "\n")
    else:
        print(text)
