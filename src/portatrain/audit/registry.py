"""How a rule family registers its checks: explicitly, per node type.

A *family* is one category of the rule table (:data:`portatrain.audit.rules.RULES`): the rules a
reader looks up together (``device placement``, ``host syncs``, ...). Its module builds one
:class:`RuleFamily` and registers each check with ``@FAMILY.check(ast.Call, ...)``; the scan walks
the tree once and calls, for every node, the checks registered for its type, family after family
in the order of :data:`portatrain.audit.checks.FAMILIES`.

Checks of different nodes never see each other's findings except through
:meth:`~portatrain.audit.context.FileScan.claim`: the walk is breadth-first, so a broad finding
(a ``"cuda" if ... else "cpu"`` branch) claims its sub-expressions before narrower rules reach them.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from typing import Any

from portatrain.audit.context import FileScan
from portatrain.audit.rules import RULES

Check = Callable[[FileScan, Any], None]
"""``check(scan, node)``: report what is wrong with ``node`` through ``scan.report``."""


class RuleFamily:
    """The checks of one rule category, each registered for the node types it inspects."""

    def __init__(self, category: str) -> None:
        self.category = category
        self.rules: tuple[str, ...] = tuple(r.id for r in RULES.values() if r.category == category)
        """The rule ids this family reports: those of its category in the rule table."""
        if not self.rules:
            raise ValueError(f"no rule in the rule table has category {category!r}")
        self.checks: list[tuple[type[ast.AST], Check]] = []
        """(node type, check), in registration order."""

    def check(self, *node_types: type[ast.AST]) -> Callable[[Check], Check]:
        """Decorator: run the function on every node of these types."""

        def register(function: Check) -> Check:
            self.checks.extend((node_type, function) for node_type in node_types)
            return function

        return register


def dispatch_table(families: Iterable[RuleFamily]) -> dict[type[ast.AST], tuple[Check, ...]]:
    """Node type -> its checks, family after family, each family's in registration order."""
    table: dict[type[ast.AST], list[Check]] = {}
    for family in families:
        for node_type, function in family.checks:
            table.setdefault(node_type, []).append(function)
    return {node_type: tuple(checks) for node_type, checks in table.items()}
