"""Dynamic shapes: batches padded to their own longest sequence, a new shape (and a recompile)
per length, unless the code around it bounds the lengths (buckets, ``pad_to_multiple_of``).

Rules: ``pad-to-batch-max``, ``pad-sequence-unbucketed``.
"""

from __future__ import annotations

import ast

from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily
from portatrain.audit.tree import terminal_name, walk_scope

FAMILY = RuleFamily("dynamic shapes")

_PAD_SINKS = frozenset(
    {"full", "zeros", "ones", "empty", "pad", "new_full", "new_zeros", "new_ones", "new_empty"}
)


@FAMILY.check(ast.Call)
def pad_sequence(scan: FileScan, node: ast.Call) -> None:
    if scan.names.qualname(node.func) == "torch.nn.utils.rnn.pad_sequence" and not _mentions_buckets(
        scan, node
    ):
        scan.report("pad-sequence-unbucketed", node, "`pad_sequence` pads to this batch's longest sequence")


@FAMILY.check(ast.Call)
def batch_max(scan: FileScan, node: ast.Call) -> None:
    """``max_len = max(len(x) for x in batch)`` feeding a pad or a tensor constructor."""
    method = scan.names.method(node)
    if not (scan.names.builtin(node) == "max" or method == "max"):
        return
    source = node.func.value if method == "max" else node  # type: ignore[union-attr]
    if not _is_length_expr(source):
        return
    if not (_feeds_padding(scan, node) or _assigned_name_feeds_padding(scan, node)):
        return
    if _mentions_buckets(scan, node):
        return
    scan.report("pad-to-batch-max", node, f"`{scan.text(node)}`: padding to this batch's longest sequence")


@FAMILY.check(ast.keyword)
def tokenizer_padding(scan: FileScan, node: ast.keyword) -> None:
    """``tokenizer(..., padding=True)`` / ``padding="longest"`` without ``pad_to_multiple_of=``."""
    value = node.value
    # `value.value in (True, "longest")` would take `padding=1` (a convolution's) for True.
    if node.arg != "padding" or not (
        isinstance(value, ast.Constant) and (value.value is True or value.value == "longest")
    ):
        return
    call = scan.tree.parent(node)
    bucketed = isinstance(call, ast.Call) and any(k.arg == "pad_to_multiple_of" for k in call.keywords)
    if not bucketed:
        scan.report(
            "pad-to-batch-max",
            node,
            f"`padding={scan.text(value)}` pads each batch to its own longest sequence",
            '`padding="max_length", max_length=N`, or `pad_to_multiple_of=` a bucket width',
        )


def _mentions_buckets(scan: FileScan, node: ast.AST) -> bool:
    """Whether the enclosing function (or class) talks about buckets or multiples (then the
    padding is presumably bounded: a length-grouped sampler, ``pad_to_multiple_of``)."""
    current = scan.tree.parent(node)
    while current is not None and not isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef):
        current = scan.tree.parent(current)
    scopes = [current] if current is not None else [scan.tree.module]
    owner = scan.tree.parent(current) if current is not None else None
    if isinstance(owner, ast.ClassDef):
        scopes.append(owner)
    for scope in scopes:
        for sub in ast.walk(scope):
            if isinstance(sub, ast.arg | ast.keyword):
                name = (sub.arg or "").lower()
            else:
                name = terminal_name(sub).lower()
            if "bucket" in name or "multiple" in name:
                return True
    return False


def _is_length_expr(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and (sub.id == "len" or "len" in sub.id.lower()):
            return True
        if isinstance(sub, ast.Attribute) and (sub.attr in ("shape",) or "len" in sub.attr.lower()):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "size":
            return True
    return False


def _feeds_padding(scan: FileScan, node: ast.AST) -> bool:
    child, current = node, scan.tree.parent(node)
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.BinOp) and isinstance(current.op, ast.Sub) and current.left is child:
            return True  # max_len - len(seq): the amount of padding
        if isinstance(current, ast.Call) and terminal_name(current.func) in _PAD_SINKS:
            return True
        child, current = current, scan.tree.parent(current)
    return False


def _assigned_name_feeds_padding(scan: FileScan, node: ast.AST) -> bool:
    statement = scan.tree.parent(node)
    if not (isinstance(statement, ast.Assign) and statement.value is node and len(statement.targets) == 1):
        return False
    target = statement.targets[0]
    if not isinstance(target, ast.Name):
        return False
    scope = scan.tree.scope(statement)
    return any(
        isinstance(sub, ast.Name)
        and sub.id == target.id
        and isinstance(sub.ctx, ast.Load)
        and sub.lineno >= statement.lineno
        and _feeds_padding(scan, sub)
        for sub in walk_scope(scope)
    )
