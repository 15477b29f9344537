"""The static audit's own shape: modules with one concern each, imports that point down, and rule
families that register their checks explicitly and together cover the rule table exactly once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from portatrain.audit import RULES, scan_source
from portatrain.audit.checks import FAMILIES
from portatrain.audit.registry import RuleFamily, dispatch_table
from tests.layering import component_graph, find_cycle, layering_violations, module_imports

AUDIT = Path(__file__).resolve().parents[1] / "src" / "portatrain" / "audit"

AUDIT_LAYERS: list[tuple[str, ...]] = [
    ("rules", "tree", "names", "suppressions", "sources", "runtime"),  # leaves of the package
    ("config", "finding", "step", "tensors"),  # the config; a finding; what the checks read
    ("guards",),  # which code only CUDA reaches (reads the tensor inference's assignments)
    ("project",),  # the audited files as one project: their CUDA helpers
    ("context",),  # one file being scanned
    ("registry",),  # how a rule family registers its checks
    ("checks",),  # the rule families
    ("scan",),  # the driver
    ("formats",),
    ("cli",),
    ("__main__", "__init__"),
]


def test_audit_modules_point_down_without_cycles() -> None:
    problems = layering_violations(AUDIT, "portatrain.audit", AUDIT_LAYERS)
    assert not problems, "\n".join(problems)


def test_rule_families_import_each_other_without_cycles() -> None:
    graph = component_graph(
        module_imports(AUDIT / "checks", "portatrain.audit.checks"), "portatrain.audit.checks"
    )
    assert find_cycle(graph) is None
    assert set(graph) == {"__init__", *(family_module for family_module in _family_modules())}


def _family_modules() -> list[str]:
    return [p.stem for p in sorted((AUDIT / "checks").glob("*.py")) if p.stem != "__init__"]


def test_families_cover_every_rule_once() -> None:
    owners: dict[str, list[str]] = {}
    for family in FAMILIES:
        assert family.checks, f"{family.category}: no check registered"
        for rule in family.rules:
            owners.setdefault(rule, []).append(family.category)
    assert {rule: len(categories) for rule, categories in owners.items() if len(categories) != 1} == {}
    assert set(owners) == set(RULES) - {"syntax-error"}  # the driver reports unparsable files
    assert len(FAMILIES) == len(_family_modules())  # every family module is listed, once


def test_a_family_is_a_category_of_the_rule_table() -> None:
    assert RuleFamily("attention").rules == ("manual-attention", "sdpa-backend-pin")
    with pytest.raises(ValueError, match="no rule in the rule table has category 'atention'"):
        RuleFamily("atention")


def test_checks_run_for_their_node_types_in_family_order() -> None:
    first, second = RuleFamily("attention"), RuleFamily("host syncs")
    seen: list[tuple[str, str]] = []

    @first.check(ast.Call, ast.Name)
    def first_check(scan, node) -> None:
        seen.append(("first", type(node).__name__))

    @second.check(ast.Call)
    def second_check(scan, node) -> None:
        seen.append(("second", type(node).__name__))

    table = dispatch_table([first, second])
    assert table == {ast.Call: (first_check, second_check), ast.Name: (first_check,)}
    for node in ast.walk(ast.parse("f(x)")):
        for check in table.get(type(node), ()):
            check(None, node)
    assert seen == [("first", "Call"), ("second", "Call"), ("first", "Name"), ("first", "Name")]


def test_a_claimed_node_is_left_to_the_broader_finding() -> None:
    """The walk is breadth-first: the ``"cuda" if ... else "cpu"`` branch claims its parts, so
    neither the ``"cuda"`` string nor ``torch.cuda.is_available`` is reported again."""
    source = 'import torch\ndevice = torch.device("cuda" if torch.cuda.is_available() else "cpu")\n'
    assert [(f.rule, f.line, f.column) for f in scan_source(source)] == [("cuda-device-branch", 2, 23)]
