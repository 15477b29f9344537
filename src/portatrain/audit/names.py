"""What a name in a file stands for, from the file's imports.

Every ``import`` in the file (any scope) maps a local name to the dotted path it stands for, so
``th.cuda.synchronize``, ``cuda.synchronize`` (``from torch import cuda``) and ``GradScaler``
(``from torch.cuda.amp import GradScaler``) all read as ``torch.cuda....``. Rules match dotted
paths, never source text.
"""

from __future__ import annotations

import ast


class Names:
    """Import aliases of one module, and the dotted path of a name or attribute chain."""

    def __init__(self, tree: ast.Module) -> None:
        self.aliases = aliases(tree)
        self._qualnames: dict[int, str | None] = {}

    def qualname(self, node: ast.AST) -> str | None:
        """``th.cuda.synchronize`` -> ``torch.cuda.synchronize`` (None unless rooted in an import)."""
        key = id(node)
        if key not in self._qualnames:
            if isinstance(node, ast.Name):
                self._qualnames[key] = self.aliases.get(node.id)
            elif isinstance(node, ast.Attribute):
                base = self.qualname(node.value)
                self._qualnames[key] = f"{base}.{node.attr}" if base else None
            else:
                self._qualnames[key] = None
        return self._qualnames[key]

    def method(self, call: ast.Call) -> str | None:
        """``x.item()`` -> ``item``; None for module functions such as ``torch.cuda.synchronize()``."""
        if isinstance(call.func, ast.Attribute) and self.qualname(call.func) is None:
            return call.func.attr
        return None

    def builtin(self, call: ast.Call) -> str | None:
        """``print(x)`` -> ``print``: a call of a bare name that no import rebinds."""
        if isinstance(call.func, ast.Name) and call.func.id not in self.aliases:
            return call.func.id
        return None


def aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted path, from every absolute import in the file."""
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    found[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    found[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.name != "*":
                    found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return found
