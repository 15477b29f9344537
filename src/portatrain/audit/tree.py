"""One parsed file as the audit walks it: each node's parent, its statement and scope, its text.

Also the small syntax predicates every part of the scan shares (walking a scope without entering
nested functions, the last name of ``self.optimizer``, ...). Nothing here knows a rule.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.Module
"""What owns a name's assignments: a function, a lambda or the module."""
Loop = ast.For | ast.AsyncFor | ast.While
Function = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


class SourceTree:
    """A module's :mod:`ast` tree with parent links and the source lines it came from."""

    def __init__(self, module: ast.Module, source: str) -> None:
        self.module = module
        # Lines as ast numbers them (\n, \r\n or \r only: str.splitlines also splits on \f and others).
        self.line_bytes = [line.encode("utf-8") for line in re.split(r"\r\n|\r|\n", source)]
        self._parent: dict[int, ast.AST] = {}
        for node in ast.walk(module):
            for child in ast.iter_child_nodes(node):
                self._parent[id(child)] = node

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self._parent.get(id(node))

    def statement(self, node: ast.AST) -> ast.stmt | None:
        """The statement ``node`` is part of (``node`` itself when it is one)."""
        current: ast.AST | None = node
        while current is not None and not isinstance(current, ast.stmt):
            current = self.parent(current)
        return current

    def scope(self, node: ast.AST) -> Scope:
        """The function, lambda or module whose names ``node`` reads."""
        current = self.parent(node)
        while current is not None and not isinstance(current, Scope):
            current = self.parent(current)
        return current or self.module

    def char_column(self, line: int, byte_offset: int) -> int:
        """1-based character column of a byte offset: ast counts UTF-8 bytes; editors and SARIF
        count characters."""
        if 0 < line <= len(self.line_bytes):
            return len(self.line_bytes[line - 1][:byte_offset].decode("utf-8", errors="replace")) + 1
        return byte_offset + 1

    def text(self, node: ast.AST, limit: int = 60) -> str:
        """The expression as written in the file (whitespace collapsed, long ones shortened)."""
        # Not ast.get_source_segment: it splits the whole source on every call (quadratic).
        first, last = node.lineno, node.end_lineno
        start, end = node.col_offset, node.end_col_offset
        if last is None or end is None or not 0 < first <= last <= len(self.line_bytes):
            return _short(ast.unparse(node), limit)
        lines = self.line_bytes[first - 1 : last]
        if first == last:
            segment = lines[0][start:end]
        else:
            segment = b" ".join([lines[0][start:], *lines[1:-1], lines[-1][:end]])
        return _short(" ".join(segment.decode("utf-8", errors="replace").split()), limit)


def walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a scope, not descending into nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def walk_expr(node: ast.AST) -> Iterator[ast.AST]:
    """Nodes of an expression, not descending into lambdas."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if not isinstance(current, ast.Lambda):
            stack.extend(ast.iter_child_nodes(current))


def target_names(target: ast.expr) -> Iterator[str]:
    """The names an assignment target binds (``a, (b, *c) = ...`` -> a, b, c)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from target_names(element)
    elif isinstance(target, ast.Starred):
        yield from target_names(target.value)


def terminal_name(node: ast.AST) -> str:
    """``self.optimizer`` -> ``optimizer``; ``loss_fn`` -> ``loss_fn``; anything else -> ``""``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def on_self(node: ast.AST) -> bool:
    """Whether an attribute chain starts at ``self`` (``self.weight.T``)."""
    while isinstance(node, ast.Attribute):
        node = node.value
        if isinstance(node, ast.Name) and node.id == "self":
            return True
    return False


def is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def show(node: ast.expr) -> str:
    """Source-like text of an expression, strings in double quotes as people write them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return '"' + node.value + '"'
    return ast.unparse(node)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
