"""Host syncs in the training step: reading a tensor's value on the host (``.item()``, ``print``,
``float(t)``, an f-string), shapes that depend on values, and ``if``/``while`` on a tensor; and
each evaluation batch's outputs copied to the host.

The step checks fire only in code that runs on every training step
(:meth:`~portatrain.audit.context.FileScan.in_step`), which includes a logging gate whose interval
defaults to 1; see :mod:`portatrain.audit.step`. A metrics sink (``wandb.log({"loss": loss})``,
``writer.add_scalar``) handed a tensor converts it on the host, so it is a read like ``.item()``.
In an evaluation loop a scalar read (``val_loss.append(loss.item())``, ``float(torch.exp(loss))``)
waits on the device once per batch and is reported too; a progress line is left alone, and so is
a copy of each batch's outputs, which ``eval-host-copy`` reports. A value read from a tensor still
on the host (``torch.tensor(lengths).sum().item()``, see :mod:`portatrain.audit.tensors`) waits on
nothing and is never reported.

Rules: ``host-sync``, ``data-dependent-shape``, ``tensor-control-flow``, ``eval-host-copy``.
"""

from __future__ import annotations

import ast

from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily
from portatrain.audit.tree import terminal_name

FAMILY = RuleFamily("host syncs")

_HOST_SYNC_METHODS = frozenset({"item", "tolist", "numpy", "cpu"})
_DYNAMIC_SHAPE_METHODS = frozenset({"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"})


_EVAL_COPY_METHODS = frozenset({"cpu", "numpy", "tolist"})
_EVERY_STEP_FIX = (
    "give the logging interval a default above 1 (e.g. 10): values are then read on logging steps only"
)


@FAMILY.check(ast.Call)
def evaluation_copy(scan: FileScan, node: ast.Call) -> None:
    method = scan.names.method(node)
    to_cpu = (
        method == "to"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "cpu"
    )
    if not (method in _EVAL_COPY_METHODS or to_cpu) or _shown(scan, node):
        return
    if scan.step.in_evaluation_loop(node):
        scan.report_method(
            "eval-host-copy",
            node,
            f"`{scan.text(node)}` copies every evaluation batch's outputs to the host",
        )


def _shown(scan: FileScan, node: ast.AST) -> bool:
    """Whether ``node`` is (inside) an argument of ``print``/a logging call: a progress line."""
    current = scan.tree.parent(node)
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.Call) and terminal_name(current.func) in ("print", "info", "log", "write"):
            return True
        current = scan.tree.parent(current)
    return False


_EVAL_READ_FIX = (
    "accumulate on the device (`total = total + loss.detach()`, `torch.stack` the values) and read "
    "once after the loop"
)


@FAMILY.check(ast.Call)
def evaluation_read(scan: FileScan, node: ast.Call) -> None:
    """``val_loss.append(loss.item())``, ``float(torch.exp(loss))`` once per evaluation batch."""
    method = scan.names.method(node)
    builtin = scan.names.builtin(node)
    if method == "item":
        value = node.func.value  # type: ignore[attr-defined]
        shown = f"`{scan.text(node, 40)}`"
    elif builtin in ("float", "int") and len(node.args) == 1 and scan.tensors.is_tensor(node.args[0]):
        value = node.args[0]
        shown = f"`{scan.text(node, 40)}`"
    else:
        return
    if scan.tensors.on_host(value) or _shown(scan, node) or not scan.step.in_evaluation_loop(node):
        return
    scan.report(
        "host-sync",
        node,
        f"{shown} reads a tensor on the host once per evaluation batch: the device waits for each batch",
        _EVAL_READ_FIX,
    )


_SINK_METHODS = frozenset({"log", "log_metrics", "log_dict", "add_scalar", "add_scalars"})
_SINK_OWNERS = ("wandb", "run", "tracker", "writer", "summary", "tb", "mlflow", "experiment", "accelerator")


@FAMILY.check(ast.Call)
def logging_sink(scan: FileScan, node: ast.Call) -> None:
    """``wandb.log({"train/loss": loss.detach().float()})`` on every step: the sink converts the
    tensor to a Python number, which waits for the device."""
    qualname = scan.names.qualname(node.func)
    method = scan.names.method(node)
    owner = terminal_name(node.func.value).lower() if isinstance(node.func, ast.Attribute) else ""
    sink = (qualname or "").split(".")[0] in ("wandb", "mlflow") and (qualname or "").split(".")[-1] in (
        "log",
        "log_metric",
        "log_metrics",
    )
    sink = sink or (method in _SINK_METHODS and any(o in owner for o in _SINK_OWNERS))
    if not sink or not scan.in_step(node):
        return
    values = [*node.args, *(k.value for k in node.keywords)]
    values += [v for d in values if isinstance(d, ast.Dict) for v in d.values]
    tensors = [v for v in values if scan.tensors.is_tensor(v) and not scan.tensors.on_host(v)]
    if tensors:
        gate = scan.step.every_step_gate(node)
        when = f"on every step (`{gate}` defaults to 1)" if gate else "on every step"
        scan.report(
            "host-sync",
            node,
            f"`{scan.text(node.func)}` converts the tensor `{scan.text(tensors[0], 40)}` to a number {when}: "
            "the host waits for the device",
            _EVERY_STEP_FIX
            if gate
            else "log on logging steps only (`if step % log_every == 0:`), with the "
            "values read in one `torch.stack([...]).tolist()`",
        )


@FAMILY.check(ast.Call)
def step_call(scan: FileScan, node: ast.Call) -> None:
    if not scan.in_step(node):
        return
    if isinstance(node.func, ast.Attribute) and scan.tensors.on_host(node.func.value):
        return  # `torch.tensor(lengths).sum().item()`: a host tensor, nothing to wait for
    if scan.names.builtin(node) in ("float", "int", "bool") and any(
        scan.tensors.on_host(a) for a in node.args
    ):
        return
    gate = scan.step.every_step_gate(node)
    if gate is not None:
        method = scan.names.method(node)
        if method in _HOST_SYNC_METHODS:
            scan.report_method(
                "host-sync",
                node,
                f"`.{method}()` on a logging step, but `{gate}` defaults to 1: it runs on every step",
                _EVERY_STEP_FIX,
            )
            return
    qualname = scan.names.qualname(node.func)
    method = scan.names.method(node)
    builtin = scan.names.builtin(node)
    if method in _HOST_SYNC_METHODS:
        scan.report_method(
            "host-sync", node, f"`.{method}()` in the training step waits for the device to finish"
        )
    elif (
        method == "to"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "cpu"
    ):
        scan.report_method("host-sync", node, '`.to("cpu")` in the training step waits for the device')
    elif builtin == "print" and any(scan.tensors.is_tensor(arg) for arg in node.args):
        scan.report("host-sync", node, "`print(tensor)` in the training step copies the tensor to the host")
    elif builtin in ("float", "int", "bool") and len(node.args) == 1 and scan.tensors.is_tensor(node.args[0]):
        scan.report(
            "host-sync",
            node,
            f"`{builtin}({scan.text(node.args[0], 40)})` of a tensor in the training step waits on the device",
        )
    if method in _DYNAMIC_SHAPE_METHODS:
        scan.report_method(
            "data-dependent-shape", node, f"`.{method}()` returns a shape that depends on the values"
        )
    elif qualname is not None and qualname.split(".")[0] == "torch":
        name = qualname.split(".")[-1]
        if name in _DYNAMIC_SHAPE_METHODS or (name == "where" and len(node.args) == 1 and not node.keywords):
            scan.report(
                "data-dependent-shape",
                node,
                f"`{qualname}(...)` returns a shape that depends on the values",
            )


@FAMILY.check(ast.JoinedStr)
def formatted_tensor(scan: FileScan, node: ast.JoinedStr) -> None:
    if not scan.in_step(node):
        return
    for part in node.values:
        if isinstance(part, ast.FormattedValue) and scan.tensors.is_tensor(part.value):
            scan.report(
                "host-sync",
                part,
                f"formatting the tensor `{scan.text(part.value)}` in the training step waits on the device",
            )


@FAMILY.check(ast.Subscript)
def boolean_mask_index(scan: FileScan, node: ast.Subscript) -> None:
    if isinstance(node.ctx, ast.Load) and _is_boolean_index(scan, node.slice) and scan.in_step(node):
        scan.report(
            "data-dependent-shape",
            node,
            f"boolean-mask indexing `{scan.text(node)}`: its shape depends on the mask's values",
        )


def _is_boolean_index(scan: FileScan, index: ast.expr, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if isinstance(index, ast.Compare):
        return True
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.Invert):
        return _is_boolean_index(scan, index.operand, depth + 1)
    if isinstance(index, ast.BinOp) and isinstance(index.op, ast.BitAnd | ast.BitOr):
        return _is_boolean_index(scan, index.left, depth + 1) or _is_boolean_index(
            scan, index.right, depth + 1
        )
    if isinstance(index, ast.Call) and isinstance(index.func, ast.Attribute) and index.func.attr == "bool":
        return True
    if isinstance(index, ast.Name | ast.Attribute) and "mask" in terminal_name(index).lower():
        return True
    if isinstance(index, ast.Name):
        value = scan.tensors.resolve(index)
        return value is not None and _is_boolean_index(scan, value, depth + 1)
    return False


_KEYWORDS = {ast.If: "if", ast.While: "while", ast.Assert: "assert"}


@FAMILY.check(ast.If, ast.While, ast.Assert)
def tensor_condition(scan: FileScan, node: ast.If | ast.While | ast.Assert) -> None:
    runs_per_step = scan.in_step(node) or scan.step.is_training_loop(node)
    if runs_per_step and scan.tensors.truth_read(node.test):
        scan.report(
            "tensor-control-flow",
            node.test,
            f"`{_KEYWORDS[type(node)]} {scan.text(node.test)}` reads a tensor's value on the host every step",
        )
