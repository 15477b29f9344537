"""What every check of one file shares: the parsed file, what its names stand for, where its
training step is, which expressions are tensors, which code only CUDA reaches, and the findings
so far.

A check reads the file through :class:`FileScan` and reports through :meth:`FileScan.report`,
which keeps at most one finding per rule and line (one is enough to act on) and marks a finding
suppressed when an inline ``# portatrain: ignore`` covers it.
"""

from __future__ import annotations

import ast

from portatrain.audit.finding import Finding
from portatrain.audit.guards import DeviceGuards
from portatrain.audit.names import Names
from portatrain.audit.project import ProjectFile
from portatrain.audit.rules import RULES
from portatrain.audit.step import TrainingStep
from portatrain.audit.suppressions import justification, read_suppressions
from portatrain.audit.tensors import TensorInference
from portatrain.audit.tree import SourceTree


class FileScan:
    """One file being scanned; built once per file and handed to every check."""

    def __init__(
        self, module: ast.Module, source: str, path: str, project: ProjectFile | None = None
    ) -> None:
        self.path = path
        self.project = project
        """The other audited modules' CUDA helpers (None: the file is audited alone)."""
        self.tree = SourceTree(module, source)
        self.names = Names(module)
        self.tensors = TensorInference(self.tree, self.names)
        self.step = TrainingStep(self.tree, self.names, self.tensors.resolve_default)
        self.guards = DeviceGuards(self.tree, self.names, self.tensors)
        self._suppressions = read_suppressions(source)
        self._findings: dict[tuple[str, int], Finding] = {}
        self._claimed: set[int] = set()  # nodes inside a finding that already covers them

    # -- reading ------------------------------------------------------------------------------------
    def text(self, node: ast.AST, limit: int = 60) -> str:
        """The expression as written in the file (whitespace collapsed, long ones shortened)."""
        return self.tree.text(node, limit)

    def reference(self, node: ast.AST) -> str | None:
        """The dotted path a name read or a whole attribute chain stands for (``torch.cuda.amp.GradScaler``
        once, not its prefixes), or None: not rooted in an import, or inside a finding that covers it."""
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                return None
        elif isinstance(node, ast.Attribute):
            parent = self.tree.parent(node)
            if isinstance(parent, ast.Attribute) and parent.value is node:
                return None
        else:
            return None
        if self.claimed(node):
            return None
        return self.names.qualname(node)

    def in_step(self, node: ast.AST) -> bool:
        """Whether ``node`` runs on every training step (outside a logging gate)."""
        return self.step.contains(node)

    # -- reporting ----------------------------------------------------------------------------------
    def claim(self, node: ast.AST) -> None:
        """Mark ``node`` and everything in it as covered by a finding: narrower rules skip them."""
        self._claimed.update(id(n) for n in ast.walk(node))

    def claimed(self, node: ast.AST) -> bool:
        return id(node) in self._claimed

    def report(
        self,
        rule_id: str,
        node: ast.AST,
        message: str | None = None,
        replacement: str | None = None,
        *,
        column: int | None = None,
    ) -> None:
        """A finding of ``rule_id`` at ``node`` (the rule's summary and fix unless given)."""
        rule = RULES[rule_id]
        line = node.lineno
        key = (rule_id, line)
        if key in self._findings:  # one finding per rule and line is enough to act on
            return
        col = self.tree.char_column(line, node.col_offset if column is None else column)
        end_line = node.end_lineno or line
        end_col = self.tree.char_column(end_line, node.end_col_offset or node.col_offset)
        statement = self.tree.statement(node)
        lines = [line] if statement is None else [line, statement.lineno]
        self._findings[key] = Finding(
            path=self.path,
            line=line,
            column=col,
            end_line=end_line,
            end_column=end_col,
            rule=rule_id,
            severity=rule.severity,
            message=message or rule.summary,
            replacement=replacement or rule.replacement,
            justification=justification(self._suppressions, rule_id, lines),
        )

    def report_method(
        self, rule_id: str, call: ast.Call, message: str, replacement: str | None = None
    ) -> None:
        """Point at the method name (``.item`` in ``loss.item()``), not at the receiver."""
        func = call.func
        assert isinstance(func, ast.Attribute)
        column = None
        if func.end_lineno == func.lineno and func.end_col_offset is not None:
            column = func.end_col_offset - len(func.attr.encode("utf-8"))
        self.report(rule_id, call if column is None else func, message, replacement, column=column)

    def findings(self) -> list[Finding]:
        """Every finding so far, suppressed ones included, by line, column and rule."""
        return sorted(self._findings.values(), key=lambda f: (f.line, f.column, f.rule))
