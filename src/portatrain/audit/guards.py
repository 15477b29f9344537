"""Which code runs only on CUDA: branches guarded by the device type.

A *CUDA test* is an expression that can be true only on an NVIDIA device: ``device_type ==
"cuda"``, ``device.type == "cuda"``, ``"cuda" in str(device)``, ``device.startswith("cuda")``,
``x.is_cuda``, ``torch.cuda.is_available()``, a conjunction holding one of them, or a name
assigned one (``use_fused = fused_available and device_type == "cuda"``). Code is *CUDA-only*
when it sits in the branch such a test opens (``if``, ``... if ... else ...``, ``and``), in the
``else`` of its negation, or after an early exit on the negation (``if device.type != "cuda":
return``).

Two rule families read this, in opposite directions: a ``torch.cuda`` call that only CUDA reaches
is correct device-specific code, not a finding; a portable speed-up (``fused=``, ``non_blocking=``,
pinned memory) that only CUDA reaches is one, because every other accelerator silently loses it.
"""

from __future__ import annotations

import ast

from portatrain.audit.names import Names
from portatrain.audit.tensors import TensorInference
from portatrain.audit.tree import Function, SourceTree, terminal_name

_CUDA_FLAGS = frozenset({"is_cuda", "use_cuda", "on_cuda", "cuda_available", "has_cuda"})
"""Names and attributes that say "the device is CUDA" by themselves (``tensor.is_cuda``)."""
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


class DeviceGuards:
    """The CUDA tests of one file and the code they guard."""

    def __init__(self, tree: SourceTree, names: Names, tensors: TensorInference) -> None:
        self.tree = tree
        self.names = names
        self.tensors = tensors

    def implies_cuda(self, test: ast.expr, depth: int = 0) -> bool:
        """Whether ``test`` being true means the device is CUDA."""
        if depth > 6:
            return False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.negation_implies_cuda(test.operand, depth + 1)
        if isinstance(test, ast.BoolOp):
            held = [self.implies_cuda(v, depth + 1) for v in test.values]
            return any(held) if isinstance(test.op, ast.And) else all(held)
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            op, right = test.ops[0], test.comparators[0]
            if isinstance(op, ast.Eq | ast.Is):
                return _is_cuda(test.left) or _is_cuda(right)
            if isinstance(op, ast.In):
                return _is_cuda(test.left) or (
                    isinstance(right, ast.Tuple | ast.List | ast.Set)
                    and bool(right.elts)
                    and all(_is_cuda(e) for e in right.elts)
                )
            return False
        if isinstance(test, ast.Call):
            if self.names.qualname(test.func) == "torch.cuda.is_available":
                return True
            func = test.func
            return (
                isinstance(func, ast.Attribute)
                and func.attr == "startswith"
                and bool(test.args)
                and _is_cuda(test.args[0])
            )
        if isinstance(test, ast.Name | ast.Attribute) and terminal_name(test).lower() in _CUDA_FLAGS:
            return True
        if isinstance(test, ast.Name):
            value = self.tensors.resolve_default(test)
            return value is not None and self.implies_cuda(value, depth + 1)
        return False

    def negation_implies_cuda(self, test: ast.expr, depth: int = 0) -> bool:
        """Whether ``test`` being false means the device is CUDA (``device_type != "cuda"``)."""
        if depth > 6:
            return False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.implies_cuda(test.operand, depth + 1)
        if isinstance(test, ast.BoolOp):
            held = [self.negation_implies_cuda(v, depth + 1) for v in test.values]
            return any(held) if isinstance(test.op, ast.Or) else all(held)
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            op, right = test.ops[0], test.comparators[0]
            if isinstance(op, ast.NotEq | ast.IsNot):
                return _is_cuda(test.left) or _is_cuda(right)
            if isinstance(op, ast.NotIn):
                return _is_cuda(test.left)
            return False
        if isinstance(test, ast.Name):
            value = self.tensors.resolve_default(test)
            return value is not None and self.negation_implies_cuda(value, depth + 1)
        return False

    def cuda_only(self, node: ast.AST) -> bool:
        """Whether ``node`` runs only when the device is CUDA (see the module docstring)."""
        child, current = node, self.tree.parent(node)
        while current is not None:
            if isinstance(current, ast.If | ast.IfExp):
                if _holds(current.body, child) and self.implies_cuda(current.test):
                    return True
                if _holds(current.orelse, child) and self.negation_implies_cuda(current.test):
                    return True
            elif isinstance(current, ast.BoolOp) and isinstance(current.op, ast.And):
                index = next(i for i, v in enumerate(current.values) if v is child)
                if any(self.implies_cuda(v) for v in current.values[:index]):
                    return True
            if isinstance(child, ast.stmt) and self._after_early_exit(current, child):
                return True
            if isinstance(current, Function | ast.ClassDef):
                return False
            child, current = current, self.tree.parent(current)
        return False

    def _after_early_exit(self, owner: ast.AST, statement: ast.stmt) -> bool:
        """``if device.type != "cuda": return`` earlier in the block that holds ``statement``."""
        for field in ("body", "orelse", "finalbody"):
            block = getattr(owner, field, None)
            if not isinstance(block, list) or not any(s is statement for s in block):
                continue
            for earlier in block[: next(i for i, s in enumerate(block) if s is statement)]:
                if (
                    isinstance(earlier, ast.If)
                    and not earlier.orelse
                    and isinstance(earlier.body[-1], _EXITS)
                    and self.negation_implies_cuda(earlier.test)
                ):
                    return True
        return False


def _is_cuda(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("cuda")


def _holds(branch: ast.AST | list[ast.stmt], child: ast.AST) -> bool:
    return any(s is child for s in branch) if isinstance(branch, list) else branch is child
