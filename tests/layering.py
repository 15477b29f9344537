"""An import-layering checker for a Python package (used by ``tests/test_layering.py``).

It reads every module's source with ``ast`` (nothing is imported), records every ``import`` of the
package's own modules -- including imports inside functions and under ``TYPE_CHECKING``, which are
dependencies all the same -- and maps each module to its *component*: the first-level
subpackage or module (``portatrain.models.llama.hf`` -> ``models``). Then it checks two rules:

* **layers point down**: a component may import only components of a lower layer (or itself);
  two components of the same layer are independent of each other;
* **no cycles** between components (a cycle would make the layer order meaningless), found even
  for components the layer table does not list, and none between modules either, inside one
  package included (:func:`module_graph`): two modules that import each other, even lazily inside
  functions, share one concern or a part that belongs below both.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from pathlib import Path


def _sources(package_dir: Path, package: str) -> dict[str, tuple[Path, list[str]]]:
    """``module name -> (path, the package parts a relative import is resolved against)``."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = [package, *rel.parts]
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        out[".".join(parts)] = (path, parts if is_init else parts[:-1])
    return out


def _import_statements(path: Path, base: list[str]) -> list[tuple[str, list[str]]]:
    """Every import of ``path`` as ``(module, names)``: ``import a.b`` is ``("a.b", [])``,
    ``from a import b, c`` is ``("a", ["b", "c"])``, relative imports resolved against ``base``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names]))
    return found


def module_imports(package_dir: Path, package: str) -> dict[str, set[str]]:
    """``module name -> names of the package's modules it imports`` for every ``.py`` under ``package_dir``."""
    graph: dict[str, set[str]] = {}
    for module, (path, base) in _sources(package_dir, package).items():
        found: set[str] = set()
        for target, names in _import_statements(path, base):
            if target != package:  # `from pkg import mod` depends on mod, not on pkg/__init__.py
                found.add(target)
            found.update(f"{target}.{name}" for name in names)
        graph[module] = {name for name in found if name == package or name.startswith(package + ".")}
    return graph


def module_graph(package_dir: Path, package: str) -> dict[str, set[str]]:
    """``module -> the package's modules it imports``, each import resolved to the one module it
    runs: ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a`` (``b`` is a
    name defined there). Importing ``a.b`` also runs ``a/__init__.py`` first, but that is Python's
    doing, not the importer's choice, so it is no edge: only a module that imports a *name* from
    its package's ``__init__`` depends on it."""
    sources = _sources(package_dir, package)
    graph: dict[str, set[str]] = {}
    for module, (path, base) in sources.items():
        found: set[str] = set()
        for target, names in _import_statements(path, base):
            if not names:
                found.add(target)
            for name in names:
                found.add(f"{target}.{name}" if f"{target}.{name}" in sources else target)
        graph[module] = {name for name in found if name in sources and name != module}
    return graph


def component(module: str, package: str) -> str:
    """``pkg.models.llama.hf`` -> ``models``; the package's own ``__init__`` is ``__init__``."""
    rest = module.removeprefix(package).lstrip(".")
    return rest.split(".")[0] if rest else "__init__"


def component_graph(imports: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """Edges between components (self-edges dropped); imports of names, not modules, are mapped too."""
    graph: dict[str, set[str]] = {component(m, package): set() for m in imports}
    for module, targets in imports.items():
        src = component(module, package)
        for target in targets:
            dst = component(target, package)
            if dst != src and dst in graph:
                graph[src].add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layering_violations(package_dir: Path, package: str, layers: Sequence[Iterable[str]]) -> list[str]:
    """Every upward import, same-layer import, unlisted component and cycle (between components,
    and between modules, inside a package too), one line each."""
    imports = module_imports(package_dir, package)
    graph = component_graph(imports, package)
    level = {name: i for i, names in enumerate(layers) for name in names}
    problems = [
        f"component {name!r} is not in the layer table; add it to the layer it belongs to"
        for name in sorted(graph)
        if name not in level
    ]
    for module, targets in sorted(imports.items()):
        src = component(module, package)
        for target in sorted(targets):
            dst = component(target, package)
            if dst == src or dst not in graph or src not in level or dst not in level:
                continue
            if level[dst] > level[src]:
                problems.append(
                    f"{module} imports {target}: {src} (layer {level[src]}) may not import "
                    f"{dst} (layer {level[dst]}, higher)"
                )
            elif level[dst] == level[src]:
                problems.append(
                    f"{module} imports {target}: {src} and {dst} share layer {level[src]} "
                    "and must stay independent"
                )
    cycle = find_cycle(graph)
    if cycle:
        problems.append(f"import cycle between components: {' -> '.join(cycle)}")
    cycle = find_cycle(module_graph(package_dir, package))
    if cycle:
        problems.append(f"import cycle between modules: {' -> '.join(cycle)}")
    return problems
