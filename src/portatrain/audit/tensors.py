"""Which expressions in a file are tensors: inferred, not typed.

A name is a tensor when the assignment that reaches it is a ``torch.*``/``F.*`` call, a
model/criterion/loss call, arithmetic on a tensor, or a parameter annotated ``torch.Tensor``.
That is enough for ``print(loss)`` and ``if loss < best:`` without flagging ``print(step)``.

A tensor is *on the host* when a torch factory made it without a ``device`` (``torch.tensor(lengths)``,
``torch.from_numpy(a)``) and nothing since moved it (``.to(device)``, ``.cuda()``): reading its
value (``.sum().item()``) waits on nothing.
"""

from __future__ import annotations

import ast
import re

from portatrain.audit.names import Names
from portatrain.audit.tree import Scope, SourceTree, target_names, terminal_name, walk_scope

_TORCH_NOT_TENSOR = frozenset(
    [
        "device",
        "dtype",
        "no_grad",
        "enable_grad",
        "inference_mode",
        "set_grad_enabled",
        "is_grad_enabled",
        "is_tensor",
        "is_floating_point",
        "manual_seed",
        "compile",
        "autocast",
        "load",
        "save",
        "get_default_dtype",
        "set_default_dtype",
        "use_deterministic_algorithms",
        "set_float32_matmul_precision",
        "numel",
        "typename",
        "get_rng_state",
        "set_rng_state",
    ]
)
_TORCH_TENSOR_UTILS = frozenset({"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.get_total_norm"})
_NOT_TENSOR_METHODS = frozenset(
    [
        "item",
        "tolist",
        "numpy",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "backward",
        "data_ptr",
        "stride",
        "is_contiguous",
        "get_device",
        "untyped_storage",
        "keys",
        "values",
        "items",
        "append",
        "step",
        "zero_grad",
        "state_dict",
        "parameters",
        "named_parameters",
        "train",
        "eval",
        "format",
        "join",
    ]
)
_NOT_TENSOR_ATTRS = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "names", "layout"}
)
_HOST_FACTORIES = frozenset(
    {
        "torch.tensor",
        "torch.as_tensor",
        "torch.from_numpy",
        "torch.zeros",
        "torch.ones",
        "torch.full",
        "torch.empty",
        "torch.arange",
        "torch.rand",
        "torch.randn",
        "torch.randint",
        "torch.randperm",
    }
)
"""Factories that build on the host unless given ``device=`` (or a default device is set)."""
_MOVES = frozenset({"to", "cuda", "type", "to_device", "pin_memory"})
_MODEL_LIKE = re.compile(r"(^|_)(model|net|network|criterion|module|lm)($|_)|loss")


class TensorInference:
    """Assignments per scope (each computed once) and the tensor guess built on them."""

    def __init__(self, tree: SourceTree, names: Names) -> None:
        self.tree = tree
        self.names = names
        self._assignments: dict[int, dict[str, list[tuple[int, ast.expr]]]] = {}
        self._tensor_params: dict[int, dict[str, str]] = {}
        self._dicts: dict[tuple[int, str], bool] = {}

    def assignments(self, scope: Scope) -> dict[str, list[tuple[int, ast.expr]]]:
        """Name -> [(line, assigned expression)] for the scope's own statements, in line order."""
        if id(scope) not in self._assignments:
            table: dict[str, list[tuple[int, ast.expr]]] = {}
            for node in walk_scope(scope):
                targets: list[ast.expr] = []
                value: ast.expr | None = None
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                    targets, value = [node.target], node.value
                if value is None:
                    continue
                for target in targets:
                    for name in target_names(target):
                        table.setdefault(name, []).append((node.lineno, value))
            for entries in table.values():
                entries.sort(key=lambda e: e[0])
            self._assignments[id(scope)] = table
        return self._assignments[id(scope)]

    def resolve(self, name: ast.Name) -> ast.expr | None:
        """The expression last assigned to ``name`` before its line, in its own scope."""
        entries = self.assignments(self.tree.scope(name)).get(name.id, [])
        earlier = [value for line, value in entries if line < name.lineno]
        return earlier[-1] if earlier else None

    def tensor_params(self, scope: Scope) -> dict[str, str]:
        """Parameters annotated with a tensor type: name -> ``tensor`` or ``container``."""
        if id(scope) not in self._tensor_params:
            kinds: dict[str, str] = {}
            if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                args = scope.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    if arg.annotation is not None and "Tensor" in ast.unparse(arg.annotation):
                        container = isinstance(arg.annotation, ast.Subscript)
                        kinds[arg.arg] = "container" if container else "tensor"
            self._tensor_params[id(scope)] = kinds
        return self._tensor_params[id(scope)]

    def resolve_default(self, name: ast.Name) -> ast.expr | None:
        """What ``name`` holds when its code runs with defaults: the last assignment before it in
        its own scope, else its parameter default, else the module's assignment of that name."""
        value = self.resolve(name)
        if value is not None:
            return value
        scope = self.tree.scope(name)
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = scope.args
            positional = [*args.posonlyargs, *args.args]
            for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults):
                if arg.arg == name.id:
                    return default
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if arg.arg == name.id:
                    return default
            if any(arg.arg == name.id for arg in [*positional, *args.kwonlyargs]):
                return None  # a parameter without a default: the caller decides
        entries = self.assignments(self.tree.module).get(name.id, [])
        return entries[0][1] if len(entries) == 1 else None

    def is_dict(self, name: ast.Name) -> bool:
        """Whether ``name`` holds a mapping in its scope: it is read by string key (``out["loss"]``,
        ``out.get("aux")``, ``"loss" in out``) or through ``.keys()``/``.items()``/``.values()``.
        A model that returns a dict of outputs returns no tensor to test for truth."""
        scope = self.tree.scope(name)
        key = (id(scope), name.id)
        if key not in self._dicts:
            self._dicts[key] = any(_reads_as_dict(node, name.id) for node in walk_scope(scope))
        return self._dicts[key]

    def is_tensor(self, node: ast.AST, depth: int = 0) -> bool:
        if depth > 8:
            return False
        if isinstance(node, ast.Name):
            kind = self.tensor_params(self.tree.scope(node)).get(node.id)
            if kind is not None:
                return kind == "tensor"
            if self.is_dict(node):
                return False
            value = self.resolve(node)
            return value is not None and self.is_tensor(value, depth + 1)
        if isinstance(node, ast.Call):
            return self._call_is_tensor(node, depth)
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left, depth + 1) or self.is_tensor(node.right, depth + 1)
        if isinstance(node, ast.UnaryOp):
            return self.is_tensor(node.operand, depth + 1)
        if isinstance(node, ast.Compare):
            return any(self.is_tensor(x, depth + 1) for x in [node.left, *node.comparators])
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Name) and self.tensor_params(self.tree.scope(node)).get(
                node.value.id
            ):
                return True  # an element of a dict[str, Tensor] / list[Tensor] parameter, or a slice
            if _is_str(node.slice) and isinstance(node.value, ast.Name):
                value = self.resolve(node.value)  # out["loss"]: an entry of what the model returned
                return value is not None and self.is_tensor(value, depth + 1)
            return self.is_tensor(node.value, depth + 1)
        if isinstance(node, ast.Attribute):
            if node.attr in _NOT_TENSOR_ATTRS:
                return False
            return node.attr in ("loss", "logits") or self.is_tensor(node.value, depth + 1)
        if isinstance(node, ast.IfExp):
            return self.is_tensor(node.body, depth + 1) or self.is_tensor(node.orelse, depth + 1)
        return False

    def on_host(self, node: ast.AST, depth: int = 0) -> bool:
        """Whether ``node`` is certainly a host tensor (see the module docstring); False when unsure."""
        if depth > 8:
            return False
        if isinstance(node, ast.Name):
            if self.tensor_params(self.tree.scope(node)).get(node.id):
                return False  # a parameter: the caller decides where it lives
            value = self.resolve(node)
            return value is not None and self.on_host(value, depth + 1)
        if isinstance(node, ast.Subscript):
            return self.on_host(node.value, depth + 1)
        if isinstance(node, ast.BinOp):
            sides = (node.left, node.right)
            return any(self.on_host(s, depth + 1) for s in sides) and all(
                isinstance(s, ast.Constant) or self.on_host(s, depth + 1) for s in sides
            )
        if not isinstance(node, ast.Call):
            return False
        qualname = self.names.qualname(node.func)
        if qualname is not None:
            return qualname in _HOST_FACTORIES and all(k.arg not in ("device", None) for k in node.keywords)
        if not isinstance(node.func, ast.Attribute):
            return False
        if node.func.attr == "cpu":
            return True
        if node.func.attr == "to":  # a dtype cast stays where it is; any other argument may move it
            casts = all(
                (self.names.qualname(a) or "").startswith("torch.")
                and self.names.qualname(a) != "torch.device"
                for a in node.args
            )
            if not casts or any(k.arg != "dtype" for k in node.keywords):
                return False
        elif node.func.attr in _MOVES:
            return False
        return self.on_host(node.func.value, depth + 1)

    def _call_is_tensor(self, call: ast.Call, depth: int) -> bool:
        qualname = self.names.qualname(call.func)
        if qualname is not None:
            parts = qualname.split(".")
            if qualname.startswith(("torch.nn.functional.", "torch.linalg.", "torch.special.", "torch.fft.")):
                return True
            if qualname in _TORCH_TENSOR_UTILS:
                return True
            return (
                len(parts) == 2
                and parts[0] == "torch"
                and parts[1][:1].islower()
                and parts[1] not in _TORCH_NOT_TENSOR
            )
        if isinstance(call.func, ast.Attribute):
            if call.func.attr in _NOT_TENSOR_METHODS:
                return False
            if self.is_tensor(call.func.value, depth + 1):
                return True
        return bool(_MODEL_LIKE.search(terminal_name(call.func).lower()))

    def truth_read(self, test: ast.expr) -> bool:
        """Whether evaluating ``test`` for truth reads a tensor's value (``loss < best``, ``x.any()``)."""
        if isinstance(test, ast.BoolOp):
            return any(self.truth_read(v) for v in test.values)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.truth_read(test.operand)
        if isinstance(test, ast.Compare) and all(isinstance(op, ast.Is | ast.IsNot) for op in test.ops):
            return False  # `x is None` never reads the tensor
        if (
            isinstance(test, ast.Compare)
            and all(isinstance(op, ast.In | ast.NotIn) for op in test.ops)
            and _is_str(test.left)
        ):
            return False  # `"logit_bias" in out` tests a mapping's keys, not a tensor's values
        return self.is_tensor(test)


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _reads_as_dict(node: ast.AST, name: str) -> bool:
    """``name["key"]``, ``name.get(...)``/``.keys()``/``.items()``/``.values()``, ``"key" in name``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Name) and node.value.id == name and _is_str(node.slice)
    if isinstance(node, ast.Attribute) and node.attr in ("get", "keys", "items", "values"):
        return isinstance(node.value, ast.Name) and node.value.id == name
    if isinstance(node, ast.Compare) and _is_str(node.left):
        return any(
            isinstance(op, ast.In | ast.NotIn) and isinstance(right, ast.Name) and right.id == name
            for op, right in zip(node.ops, node.comparators)
        )
    return False
