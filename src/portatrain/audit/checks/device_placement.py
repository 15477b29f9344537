"""Device placement: ``.cuda()``, hard-coded ``"cuda"`` device strings, ``"cuda" if ... else
"cpu"`` branches, ``torch.cuda.set_device`` and ``DistributedDataParallel(device_ids=...)``.

In a branch only CUDA takes (:mod:`portatrain.audit.guards`) these are CUDA's own settings, not
findings: the test that opens the branch is where portability is decided (and reported, when it
is ``torch.cuda.is_available()`` or a ``"cuda" if ... else "cpu"`` choice).

A ``"cuda"`` that is the default of a device (a ``device="cuda"`` parameter, ``getattr(args,
"device", "cuda")``, ``add_argument("--device", default="cuda")``) is a hard-coded device too:
every run that does not override it asks for CUDA.

Rules: ``cuda-call``, ``cuda-device-string``, ``cuda-device-branch``, ``cuda-set-device``,
``ddp-device-ids``.
"""

from __future__ import annotations

import ast
import re

from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily
from portatrain.audit.tree import is_none, terminal_name

FAMILY = RuleFamily("device placement")

DEVICE_STRING = re.compile(r"^cuda(:\d+)?$")
"""``"cuda"`` or ``"cuda:3"``."""
_DEVICE_KWARGS = frozenset({"device", "device_type", "map_location", "device_map", "pin_memory_device"})
_DEVICE_CALLS = frozenset(
    {
        "torch.device",
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.GradScaler",
        "torch.Generator",
        "torch.set_default_device",
        "torch.get_device_module",
    }
)


def is_cuda_string(node: ast.AST) -> bool:
    """``"cuda"``, ``"cuda:0"``, ``f"cuda:{rank}"`` or ``"cuda:" + str(rank)``."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and bool(DEVICE_STRING.match(node.value))
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        return isinstance(first, ast.Constant) and str(first.value).startswith("cuda:")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return isinstance(node.left, ast.Constant) and node.left.value == "cuda:"
    return False


@FAMILY.check(ast.Call)
def cuda_call(scan: FileScan, node: ast.Call) -> None:
    if scan.names.method(node) == "cuda" and not scan.guards.cuda_only(node):
        scan.report_method("cuda-call", node, f"`{scan.text(node)}` moves to an NVIDIA GPU")


@FAMILY.check(ast.Call)
def ddp_device_ids(scan: FileScan, node: ast.Call) -> None:
    qualname = scan.names.qualname(node.func)
    if qualname is not None and qualname.split(".")[-1] == "DistributedDataParallel":
        for keyword in node.keywords:
            value = keyword.value
            if keyword.arg not in ("device_ids", "output_device") or is_none(value):
                continue
            if scan.guards.cuda_only(keyword) or (
                isinstance(value, ast.IfExp)
                and is_none(value.orelse)
                and scan.guards.implies_cuda(value.test)
            ):
                continue  # `device_ids=[rank] if device.type == "cuda" else None`: CUDA's own setting
            scan.report("ddp-device-ids", keyword, f"`{keyword.arg}=` names CUDA device indices")


@FAMILY.check(ast.Name, ast.Attribute)
def cuda_device_choice(scan: FileScan, node: ast.Name | ast.Attribute) -> None:
    """``torch.cuda.set_device`` and ``torch.cuda.is_available`` (the rest of ``torch.cuda`` is
    :mod:`~portatrain.audit.checks.cuda_api`'s)."""
    qualname = scan.reference(node)
    if qualname is None:
        return
    parts = qualname.split(".")
    if parts[:2] != ["torch", "cuda"] or len(parts) < 3:
        return
    if parts[2] == "set_device":
        if scan.guards.cuda_only(node):
            return  # device-specific code in the branch only CUDA takes
        scan.report("cuda-set-device", node, "`torch.cuda.set_device` exists only for CUDA")
    elif parts[2] == "is_available":
        statement = scan.tree.statement(node)
        if statement is not None and scan.guards.cuda_only(statement):
            return  # `if device_type == "cuda": ok = torch.cuda.is_available()`: CUDA's own check
        scan.report(
            "cuda-device-branch",
            node,
            "a branch on `torch.cuda.is_available()`: off NVIDIA the CPU path runs, silently",
        )


@FAMILY.check(ast.IfExp)
def cuda_device_branch(scan: FileScan, node: ast.IfExp) -> None:
    if scan.claimed(node):
        return
    mentions_cuda = any(is_cuda_string(n) for n in (node.body, node.orelse))
    tests_cuda = any(
        isinstance(n, ast.Attribute | ast.Name) and scan.names.qualname(n) == "torch.cuda.is_available"
        for n in ast.walk(node.test)
    )
    if mentions_cuda or tests_cuda:
        message = '`"cuda" if ... else "cpu"`: off NVIDIA this silently picks the CPU'
        if not mentions_cuda:  # a dtype or a backend chosen by the CUDA test
            message = (
                f"`{scan.text(node, 50)}` chooses by `torch.cuda.is_available()`: off NVIDIA it "
                f"silently takes `{scan.text(node.orelse, 30)}`"
            )
        scan.report("cuda-device-branch", node, message)
        scan.claim(node)


@FAMILY.check(ast.Constant)
def cuda_device_constant(scan: FileScan, node: ast.Constant) -> None:
    if not isinstance(node.value, str) or scan.claimed(node) or not DEVICE_STRING.match(node.value):
        return
    parent = scan.tree.parent(node)
    if not isinstance(parent, ast.JoinedStr | ast.BinOp):  # those are judged as a whole
        _device_string(scan, node, parent)


@FAMILY.check(ast.JoinedStr)
def cuda_device_fstring(scan: FileScan, node: ast.JoinedStr) -> None:
    if is_cuda_string(node) and not scan.claimed(node):
        _device_string(scan, node, scan.tree.parent(node))


@FAMILY.check(ast.BinOp)
def cuda_device_concatenation(scan: FileScan, node: ast.BinOp) -> None:
    """``"cuda:" + str(rank)``."""
    if (
        isinstance(node.op, ast.Add)
        and isinstance(node.left, ast.Constant)
        and node.left.value == "cuda:"
        and not scan.claimed(node)
        and not scan.guards.cuda_only(node)
    ):
        scan.report("cuda-device-string", node, f"`{scan.text(node)}` hard-codes the CUDA device")


def _device_default(scan: FileScan, node: ast.expr, parent: ast.AST | None) -> bool:
    """``"cuda"`` as the default of a device: ``def f(device="cuda")``, ``getattr(args, "device",
    "cuda")``, ``cfg.get("device", "cuda")``, ``add_argument("--device", default="cuda")``."""
    if isinstance(parent, ast.arguments):
        args = parent
        positional = [*args.posonlyargs, *args.args]
        pairs = [
            *zip(positional[len(positional) - len(args.defaults) :], args.defaults),
            *zip(args.kwonlyargs, args.kw_defaults),
        ]
        return any(default is node and "device" in arg.arg.lower() for arg, default in pairs)
    if isinstance(parent, ast.Call) and len(parent.args) >= 2 and parent.args[-1] is node:
        key = parent.args[-2]
        getter = scan.names.builtin(parent) == "getattr" or scan.names.method(parent) in ("get", "setdefault")
        return getter and isinstance(key, ast.Constant) and "device" in str(key.value).lower()
    if isinstance(parent, ast.keyword) and parent.arg == "default":
        call = scan.tree.parent(parent)
        return (
            isinstance(call, ast.Call)
            and terminal_name(call.func) == "add_argument"
            and any(isinstance(a, ast.Constant) and "device" in str(a.value).lower() for a in call.args)
        )
    return False


def _device_string(scan: FileScan, node: ast.expr, parent: ast.AST | None) -> None:
    """A ``"cuda..."`` string: reported where it names a device (a device argument or variable),
    and anywhere but a comparison when it names an index (``"cuda:0"``, ``f"cuda:{rank}"``)."""
    if scan.guards.cuda_only(node):
        return  # `if device.type == "cuda": device = torch.device("cuda", rank)`: CUDA's own branch
    text = scan.text(node)
    explicit = not (isinstance(node, ast.Constant) and node.value == "cuda")
    context = False
    if isinstance(parent, ast.keyword):
        context = parent.arg in _DEVICE_KWARGS
    elif isinstance(parent, ast.Call) and parent.args and parent.args[0] is node:
        context = scan.names.qualname(parent.func) in _DEVICE_CALLS or scan.names.method(parent) == "to"
    elif isinstance(parent, ast.Assign | ast.AnnAssign):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        context = any("device" in terminal_name(t).lower() for t in targets)
    else:
        context = _device_default(scan, node, parent)
    if context or (explicit and not isinstance(parent, ast.Compare)):
        scan.report("cuda-device-string", node, f"`{text}` hard-codes the CUDA device")
