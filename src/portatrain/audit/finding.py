"""One finding: a rule broken at one place in one file, with its fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from portatrain.audit.rules import RULES


@dataclass(frozen=True)
class Finding:
    """One problem at one place. ``line`` and ``column`` are 1-based (column in characters)."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    rule: str
    severity: str
    message: str
    replacement: str
    justification: str | None = None
    """For a suppressed finding: the text after the suppression comment (why it is fine)."""

    @property
    def level(self) -> int:
        return RULES[self.rule].level

    @property
    def category(self) -> str:
        return RULES[self.rule].category

    def to_dict(self) -> dict[str, Any]:
        record = {
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "rule": self.rule,
            "severity": self.severity,
            "level": self.level,
            "category": self.category,
            "message": self.message,
            "replacement": self.replacement,
        }
        if self.justification is not None:
            record["justification"] = self.justification
        return record
