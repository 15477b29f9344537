"""Issue 36: no module in ``src/portatrain`` over 500 lines, no function over 80.

A module that grows past 500 lines has taken a second job, a function past 80 a second step; both
are split along those seams (``portatrain.checkpoint``: discovery, rotation, diagnostics, staging).
Lines are counted as ``wc -l`` does for modules, and from ``def`` to the last line of the body for
functions (``end_lineno - lineno + 1`` of every ``def``, nested ones and methods included;
decorators not counted). Sources are read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "portatrain"

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def oversized(root: Path, *, max_module: int, max_function: int) -> dict[str, list[str]]:
    """``relative path -> what is too long in it`` for every ``*.py`` under ``root``."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        problems = []
        lines = text.count("\n")
        if lines > max_module:
            problems.append(f"{lines} lines > {max_module}")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > max_function:
                    problems.append(f"{node.name} (line {node.lineno}) is {length} lines > {max_function}")
        if problems:
            found[path.relative_to(root).as_posix()] = problems
    return found


def test_no_module_over_500_lines_and_no_function_over_80() -> None:
    found = oversized(SRC, max_module=MAX_MODULE_LINES, max_function=MAX_FUNCTION_LINES)
    over = [f"{path}: {'; '.join(problems)}" for path, problems in found.items()]
    assert not over, "split these along their jobs (issue 36):\n" + "\n".join(over)


def test_the_checker_finds_a_long_module_a_long_method_and_a_long_nested_function(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("def f():\n    a = 1\n    b = 2\n    return a + b\n")
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 8)
    body = "".join(f"            y{i} = {i}\n" for i in range(4))
    (tmp_path / "pkg" / "nested.py").write_text(f"class A:\n    def m(self):\n        async def g():\n{body}")
    found = oversized(tmp_path, max_module=7, max_function=4)
    assert found == {
        "pkg/long.py": ["8 lines > 7"],
        "pkg/nested.py": ["m (line 2) is 6 lines > 4", "g (line 3) is 5 lines > 4"],
    }
