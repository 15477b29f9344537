"""Attention: softmax over a query-key product written by hand, and SDPA pinned to a CUDA kernel.

Rules: ``manual-attention``, ``sdpa-backend-pin``.
"""

from __future__ import annotations

import ast

from portatrain.audit.checks.cuda_api import SDP_FLAGS, is_cuda_backend
from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily
from portatrain.audit.tree import on_self, walk_expr

FAMILY = RuleFamily("attention")

_SDP_KWARGS = frozenset({"enable_flash", "enable_mem_efficient", "enable_math", "enable_cudnn"})
_SOFTMAX = ("torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax")


@FAMILY.check(ast.Call)
def manual_attention(scan: FileScan, node: ast.Call) -> None:
    qualname = scan.names.qualname(node.func)
    if qualname in _SOFTMAX:
        if not node.args:
            return
        scores = node.args[0]
    elif scan.names.method(node) == "softmax":
        scores = node.func.value  # type: ignore[union-attr]
    else:
        return
    if _contains_qk(scan, scores, 0):
        scan.report(
            "manual-attention",
            node,
            f"softmax over a query-key product (`{scan.text(scores)}`): attention outside SDPA",
        )


def _contains_qk(scan: FileScan, node: ast.AST, depth: int) -> bool:
    if depth > 6:
        return False
    for sub in walk_expr(node):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.MatMult):
            if _is_transposed(scan, sub.right, 0):
                return True
        elif isinstance(sub, ast.Call):
            qualname = scan.names.qualname(sub.func)
            if qualname in ("torch.matmul", "torch.bmm", "torch.baddbmm") and len(sub.args) >= 2:
                if _is_transposed(scan, sub.args[-1], 0):
                    return True
            elif scan.names.method(sub) in ("matmul", "bmm") and sub.args:
                if _is_transposed(scan, sub.args[0], 0):
                    return True
            elif qualname == "torch.einsum" and sub.args and _einsum_is_qk(sub.args[0]):
                return True
        elif isinstance(sub, ast.Name):
            value = scan.tensors.resolve(sub)
            if value is not None and _contains_qk(scan, value, depth + 1):
                return True
    return False


def _is_transposed(scan: FileScan, node: ast.AST, depth: int) -> bool:
    if depth > 4:
        return False
    if isinstance(node, ast.Attribute) and node.attr in ("T", "mT", "mH", "H"):
        return not on_self(node.value)  # self.weight.T is a projection, not keys
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr = node.func.attr
        if attr in ("transpose", "permute", "swapaxes", "swapdims", "t"):
            return not on_self(node.func.value)
        if attr in ("contiguous", "float", "to", "type_as", "half", "bfloat16"):
            return _is_transposed(scan, node.func.value, depth + 1)
    if isinstance(node, ast.Name):
        value = scan.tensors.resolve(node)
        return value is not None and _is_transposed(scan, value, depth + 1)
    return False


def _einsum_is_qk(spec: ast.AST) -> bool:
    """``"bhqd,bhkd->bhqk"``: two operands contracted over their shared last index, each keeping one
    free index -- a query-key product."""
    if isinstance(spec, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in spec.values):
        spec = ast.Constant("".join(str(v.value) for v in spec.values))  # f"b h i d, b h j d -> b h i j"
    if not (isinstance(spec, ast.Constant) and isinstance(spec.value, str) and "->" in spec.value):
        return False
    inputs, output = spec.value.replace(" ", "").replace("...", "").split("->", 1)
    operands = inputs.split(",")
    if len(operands) != 2 or not all(operands):
        return False
    left, right = operands
    contracted = (set(left) & set(right)) - set(output)
    return (
        left[-1] == right[-1]
        and left[-1] in contracted
        and bool((set(left) - set(right)) & set(output))
        and bool((set(right) - set(left)) & set(output))
    )


@FAMILY.check(ast.Name, ast.Attribute)
def sdpa_pinned_by_name(scan: FileScan, node: ast.Name | ast.Attribute) -> None:
    qualname = scan.reference(node)
    if qualname is None:
        return
    parts = qualname.split(".")
    if is_cuda_backend(parts) and parts[-1] in SDP_FLAGS:
        scan.report("sdpa-backend-pin", node, f"`{qualname}` pins SDPA to a CUDA kernel")
    elif qualname == "torch.nn.attention.sdpa_kernel":
        scan.report(
            "sdpa-backend-pin", node, "`sdpa_kernel(...)` restricts SDPA to the named (CUDA) backends"
        )


@FAMILY.check(ast.keyword)
def sdpa_pinned_by_keyword(scan: FileScan, node: ast.keyword) -> None:
    if node.arg in _SDP_KWARGS:
        scan.report("sdpa-backend-pin", node, f"`{node.arg}=` selects a CUDA SDPA kernel")
