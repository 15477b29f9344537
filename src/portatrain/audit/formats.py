"""Render an :class:`~portatrain.audit.scan.AuditResult` as text, JSON or SARIF 2.1.0.

**JSON** (``--format json``) is the machine interface other tools (``portatrain report``, CI
scripts) read. Its shape is versioned by ``schema``; a change that removes or renames a field
bumps the version, adding a field does not::

    {
      "schema": "portatrain.audit/1",
      "tool": {"name": "portatrain audit", "version": "0.1.0"},
      "paths": ["examples/cuda_first_train.py"],     # as asked
      "files": ["examples/cuda_first_train.py"],     # every file scanned (relative to the cwd)
      "config": "pyproject.toml",                    # the config file used (null: none)
      "fail_on": "error",
      "failed": true,                                # whether the exit code is non-zero
      "summary": {
        "error": 14, "warning": 11, "info": 0, "suppressed": 0,
        "by_rule": {"cuda-amp": 2, "cuda-api": 4, ...},
        "by_level": {"0": 2, "1": 17, "2": 2, "4": 1, "5": 3}   # checklist level -> findings
      },
      "findings": [                                  # sorted by path, line, column
        {"path": "examples/cuda_first_train.py",
         "line": 157, "column": 45,                  # 1-based, column in characters
         "end_line": 157, "end_column": 49,
         "rule": "cuda-call", "severity": "error",
         "level": 1, "category": "device placement",
         "message": "`GPT(block_size=args.block_size).cuda()` moves to an NVIDIA GPU",
         "replacement": "`.to(device)` with `device` from the accelerator adapter ..."}
      ],
      "suppressed": [ {... same fields ..., "justification": "why it is fine"} ],
      "rules": {"cuda-call": {"severity": "error", "level": 1, "category": ..., "summary": ...,
                              "replacement": ..., "disabled": false}, ...}
    }

Levels are those of the portability checklist ``portatrain report`` fills: 1 device & API, 2
operator & library coverage, 4 compilation & shape stability, 5 performance; 0 is outside it
(checkpoint safety, unparsable files). ``rules`` lists every rule with the severity in effect
after the config, so a reader can tell "no finding" from "rule disabled".

**SARIF** (``--format sarif``) follows the OASIS SARIF 2.1.0 schema so code hosts can show the
findings inline: one run, the tool's rules under ``tool.driver.rules`` (id, descriptions, help,
default level), each result with ``ruleId``/``ruleIndex``/``level``/``message`` and one physical
location; suppressed findings are kept with an ``inSource`` suppression.
"""

from __future__ import annotations

import json
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from portatrain.audit.finding import Finding
from portatrain.audit.rules import RULES, SEVERITIES
from portatrain.audit.scan import AuditResult

JSON_SCHEMA = "portatrain.audit/1"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_SARIF_LEVELS = {"error": "error", "warning": "warning", "info": "note"}
_HELP_URI = "https://github.com/portatrain/portatrain#portatrain-audit"


def tool_version() -> str:
    try:
        return version("portatrain")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
        return "0.0.0"


def effective_rules(result: AuditResult) -> dict[str, dict[str, Any]]:
    """Every rule, with the severity the config gives it and whether it is disabled."""
    return {
        rule.id: {
            "severity": result.config.severity.get(rule.id, rule.severity),
            "level": rule.level,
            "category": rule.category,
            "summary": rule.summary,
            "replacement": rule.replacement,
            "disabled": rule.id in result.config.disable,
        }
        for rule in RULES.values()
    }


def summary(result: AuditResult) -> dict[str, Any]:
    counts = Counter(f.severity for f in result.findings)
    return {
        **{severity: counts.get(severity, 0) for severity in SEVERITIES},
        "suppressed": len(result.suppressed),
        "by_rule": dict(sorted(Counter(f.rule for f in result.findings).items())),
        "by_level": {str(k): v for k, v in sorted(Counter(f.level for f in result.findings).items())},
    }


def json_document(result: AuditResult, fail_on: str) -> dict[str, Any]:
    """The ``--format json`` document as a dict (for in-process readers such as the report)."""
    return {
        "schema": JSON_SCHEMA,
        "tool": {"name": "portatrain audit", "version": tool_version()},
        "paths": result.paths,
        "files": result.files,
        "config": _relative(result.config.source),
        "fail_on": fail_on,
        "failed": result.fails(fail_on),
        "summary": summary(result),
        "findings": [f.to_dict() for f in result.findings],
        "suppressed": [f.to_dict() for f in result.suppressed],
        "rules": effective_rules(result),
    }


def render_json(result: AuditResult, fail_on: str) -> str:
    return json.dumps(json_document(result, fail_on), indent=2)


def _relative(path: str | None) -> str | None:
    """A path relative to the working directory where it lies below it (stable across checkouts)."""
    if path is None:
        return None
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path


def render_text(result: AuditResult, fail_on: str) -> str:
    lines: list[str] = []
    for finding in result.findings:
        lines.append(
            f"{finding.path}:{finding.line}:{finding.column}: {finding.severity}[{finding.rule}] {finding.message}"
        )
        lines.append(f"    fix: {finding.replacement}")
    counts = summary(result)
    files = len(result.files)
    total = len(result.findings)
    tally = ", ".join(f"{counts[s]} {s}" for s in SEVERITIES)
    verdict = "FAILED" if result.fails(fail_on) else "ok"
    suppressed = f"; {counts['suppressed']} suppressed" if counts["suppressed"] else ""
    if lines:
        lines.append("")
    lines.append(
        f"{total} finding{'s' * (total != 1)} ({tally}) in {files} file{'s' * (files != 1)}{suppressed}; "
        f"fail-on={fail_on}: {verdict}"
    )
    return "\n".join(lines)


def render_sarif(result: AuditResult, fail_on: str) -> str:
    rules = list(RULES.values())
    index = {rule.id: i for i, rule in enumerate(rules)}
    severities = effective_rules(result)
    driver = {
        "name": "portatrain-audit",
        "fullName": "portatrain audit: static portability scan for CUDA-first PyTorch code",
        "version": tool_version(),
        "informationUri": _HELP_URI,
        "rules": [
            {
                "id": rule.id,
                "name": "".join(part.capitalize() for part in rule.id.split("-")),
                "shortDescription": {"text": rule.summary},
                "fullDescription": {"text": f"{rule.summary}. Portable replacement: {rule.replacement}"},
                "help": {"text": f"Portable replacement: {rule.replacement}"},
                "helpUri": _HELP_URI,
                "defaultConfiguration": {
                    "level": _SARIF_LEVELS[severities[rule.id]["severity"]],
                    "enabled": not severities[rule.id]["disabled"],
                },
                "properties": {"category": rule.category, "checklistLevel": rule.level},
            }
            for rule in rules
        ],
    }

    def sarif_result(finding: Finding) -> dict[str, Any]:
        record: dict[str, Any] = {
            "ruleId": finding.rule,
            "ruleIndex": index[finding.rule],
            "level": _SARIF_LEVELS[finding.severity],
            "message": {"text": f"{finding.message}. Fix: {finding.replacement}"},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": finding.path, "uriBaseId": "%SRCROOT%"},
                        "region": {
                            "startLine": finding.line,
                            "startColumn": finding.column,
                            "endLine": finding.end_line,
                            "endColumn": finding.end_column,
                        },
                    }
                }
            ],
        }
        if finding.justification is not None:
            record["suppressions"] = [{"kind": "inSource", "justification": finding.justification}]
        return record

    document = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": driver},
                "columnKind": "unicodeCodePoints",
                "results": [sarif_result(f) for f in [*result.findings, *result.suppressed]],
                "invocations": [{"executionSuccessful": True, "exitCode": int(result.fails(fail_on))}],
            }
        ],
    }
    return json.dumps(document, indent=2)


RENDERERS = {"text": render_text, "json": render_json, "sarif": render_sarif}
"""``--format`` value -> function of (result, fail_on) returning the document."""


def render_rules(output_format: str) -> str:
    """``--list-rules``: a table (text) or a JSON list."""
    if output_format != "text":
        return json.dumps(
            [
                {
                    "id": r.id,
                    "severity": r.severity,
                    "level": r.level,
                    "category": r.category,
                    "summary": r.summary,
                    "replacement": r.replacement,
                }
                for r in RULES.values()
            ],
            indent=2,
        )
    width = max(len(rule_id) for rule_id in RULES)
    lines = [f"{'rule':<{width}}  severity  level  summary"]
    category = None
    for rule in RULES.values():
        if rule.category != category:
            category = rule.category
            lines.append(f"-- {category}")
        lines.append(f"{rule.id:<{width}}  {rule.severity:<8}  {rule.level or '-':>5}  {rule.summary}")
        lines.append(f"{'':<{width}}  {'':<8}  {'':>5}  fix: {rule.replacement}")
    return "\n".join(lines)
