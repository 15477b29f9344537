"""The audited files as one project: which of their functions call CUDA-only code.

A file is read alone, so ``gc_cuda()`` looks harmless where it is called when its body -- in
``utils.py`` -- calls ``torch.cuda.empty_cache()``. When several files are audited together,
:meth:`Project.build` names each module by its path below the folder given (``pkg/utils.py`` ->
``utils`` and ``pkg.utils``), finds the module-level functions whose bodies reach CUDA-only code
(a ``torch.cuda.*`` call or ``.cuda()`` outside a branch only CUDA takes, or a call of another such
helper), and resolves each call through the file's imports (absolute and relative) to one of them.
The ``cuda-helper`` rule then reports the call site with the helper's CUDA line as its reason.
"""

from __future__ import annotations

import ast
import os
import tokenize
from collections.abc import Sequence
from pathlib import Path

from portatrain.audit.guards import DeviceGuards
from portatrain.audit.names import Names
from portatrain.audit.tensors import TensorInference
from portatrain.audit.tree import SourceTree


class Project:
    """Dotted helper name -> why it is CUDA-only, and each audited file's module names."""

    def __init__(self) -> None:
        self.helpers: dict[str, str] = {}
        """``pkg.utils.gc_cuda`` -> ``calls `torch.cuda.empty_cache()` at pkg/utils.py:12``."""
        self.modules: dict[Path, list[str]] = {}
        """Resolved file path -> its dotted module names (below the folder given, and with it)."""

    @classmethod
    def build(cls, roots: Sequence[str | os.PathLike[str]], files: Sequence[tuple[Path, str]]) -> Project:
        """``roots``: the paths the audit was given; ``files``: (path, display) of every file."""
        project = cls()
        folders = [Path(r).resolve() for r in roots if Path(r).is_dir()]
        parsed = []  # (module names, display, names, relative aliases, functions, tree)
        for path, display in files:
            resolved = path.resolve()
            project.modules[resolved] = _module_names(resolved, folders)
            try:
                with tokenize.open(path) as handle:
                    source = handle.read()
                module = ast.parse(source)
            except (OSError, SyntaxError, UnicodeDecodeError):
                continue  # the scan itself reports why
            names = Names(module)
            local = relative_aliases(module, project.modules[resolved], path.name == "__init__.py")
            functions = [n for n in module.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            if project.modules[resolved]:  # a helper calling its module's own helper by bare name
                local.update({f.name: f"{project.modules[resolved][0]}.{f.name}" for f in functions})
            tree = SourceTree(module, source)
            parsed.append((project.modules[resolved], display, names, local, functions, tree))
            for function in functions:
                reason = _direct_cuda(function, names, tree, display)
                if reason is not None:
                    for name in project.modules[resolved]:
                        project.helpers[f"{name}.{function.name}"] = reason
        # A helper that calls a helper is one too: a few rounds reach every chain worth reporting.
        for _ in range(3):
            added = False
            for own, display, names, local, functions, tree in parsed:
                for function in functions:
                    keys = [f"{m}.{function.name}" for m in own]
                    if not keys or keys[0] in project.helpers:
                        continue
                    for call in ast.walk(function):
                        if not isinstance(call, ast.Call):
                            continue
                        target = resolve(call.func, names, local)
                        if target in project.helpers:
                            where = f"{display}:{call.lineno}"
                            reason = (
                                f"calls `{tree.text(call, 40)}` at {where}, which {project.helpers[target]}"
                            )
                            for key in keys:
                                project.helpers[key] = reason
                            added = True
                            break
            if not added:
                break
        return project

    def for_file(self, path: Path, module: ast.Module) -> ProjectFile:
        names = self.modules.get(path.resolve(), [])
        return ProjectFile(self, relative_aliases(module, names, path.name == "__init__.py"))


class ProjectFile:
    """One audited file's view of the project: its relative imports resolved."""

    def __init__(self, project: Project, local: dict[str, str]) -> None:
        self.project = project
        self.local = local

    def helper(self, names: Names, func: ast.expr) -> tuple[str, str] | None:
        """(name as called, reason) when ``func`` names a CUDA helper of another audited module."""
        target = resolve(func, names, self.local)
        if target is None or target not in self.project.helpers:
            return None
        return ast.unparse(func), self.project.helpers[target]


def resolve(node: ast.expr, names: Names, local: dict[str, str]) -> str | None:
    """The dotted path a called name stands for, through absolute and relative imports."""
    if isinstance(node, ast.Name):
        return local.get(node.id) or names.aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = resolve(node.value, names, local)
        return f"{base}.{node.attr}" if base else None
    return None


def relative_aliases(module: ast.Module, own: list[str], is_package: bool) -> dict[str, str]:
    """Local name -> dotted path, from the file's relative imports (``from .utils import gc_cuda``),
    resolved against the longest of the file's own module names."""
    if not own:
        return {}
    parts = max(own, key=len).split(".")
    package = parts if is_package else parts[:-1]
    found: dict[str, str] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level - 1 > len(package):
                continue
            base = package[: len(package) - (node.level - 1)]
            prefix = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                if alias.name != "*":
                    found[alias.asname or alias.name] = f"{prefix}.{alias.name}" if prefix else alias.name
    return found


def _module_names(path: Path, folders: list[Path]) -> list[str]:
    """``root/pkg/utils.py`` audited as ``root`` -> ``pkg.utils`` and ``root.pkg.utils``."""
    stem = [] if path.name == "__init__.py" else [path.stem]
    for folder in folders:
        if folder in path.parents:
            inner = [*path.parent.relative_to(folder).parts, *stem]
            return [n for n in (".".join(inner), ".".join([folder.name, *inner])) if n]
    return [".".join(stem)] if stem else []


def _direct_cuda(
    function: ast.FunctionDef | ast.AsyncFunctionDef, names: Names, tree: SourceTree, display: str
) -> str | None:
    """``calls `torch.cuda.empty_cache()` at utils.py:12`` for the first CUDA-only call in the body."""
    guards = DeviceGuards(tree, names, TensorInference(tree, names))
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        qualname = names.qualname(func)
        cuda = (qualname or "").startswith("torch.cuda.") or (
            isinstance(func, ast.Attribute) and qualname is None and func.attr == "cuda"
        )
        if cuda and not guards.cuda_only(node):
            return f"calls `{tree.text(node, 50)}` at {display}:{node.lineno}"
    return None
