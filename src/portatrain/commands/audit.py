"""``portatrain audit PATH... [--format text|json|sarif] [--fail-on LEVEL]``: the static portability
scan (``portatrain.audit``). An argument command: plain ``argparse`` options, no Hydra config."""

from __future__ import annotations

HYDRA = False

EXAMPLE = "portatrain audit src/ --fail-on warning"


def main(argv: list[str]) -> int:
    from portatrain.audit.cli import main as audit_main

    return audit_main(argv, prog="portatrain audit")
