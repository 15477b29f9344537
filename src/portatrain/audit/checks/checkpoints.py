"""Unsafe checkpoints: ``torch.load`` that may unpickle, and pickle (or dill, cloudpickle, joblib)
used for configs and state.

Rules: ``torch-load-unsafe``, ``torch-load-implicit``, ``pickle-load``, ``pickle-dump``.
"""

from __future__ import annotations

import ast

from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily

FAMILY = RuleFamily("unsafe checkpoints")

_PICKLE_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib"})


@FAMILY.check(ast.Call)
def torch_load(scan: FileScan, node: ast.Call) -> None:
    if scan.names.qualname(node.func) != "torch.load":
        return
    flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
    if flag is None:
        scan.report("torch-load-implicit", node, "`torch.load` without `weights_only=`")
    elif isinstance(flag, ast.Constant) and flag.value is False:
        scan.report("torch-load-unsafe", node, "`torch.load(weights_only=False)` unpickles arbitrary code")
    elif not (isinstance(flag, ast.Constant) and flag.value is True):
        scan.report(
            "torch-load-implicit",
            node,
            f"`torch.load(weights_only={scan.text(flag)})`: not provably True",
        )


@FAMILY.check(ast.Name, ast.Attribute)
def pickle_use(scan: FileScan, node: ast.Name | ast.Attribute) -> None:
    qualname = scan.reference(node)
    if qualname is None:
        return
    parts = qualname.split(".")
    if parts[0] not in _PICKLE_MODULES or len(parts) != 2:
        return
    if parts[1] == "Unpickler" and _is_restricted_unpickler_base(scan, node):
        return  # a subclass whose find_class allow-lists globals is the safe way to unpickle
    if parts[1] in ("load", "loads", "Unpickler"):
        scan.report("pickle-load", node, f"`{qualname}` unpickles, which runs code from the file")
    elif parts[1] in ("dump", "dumps", "Pickler"):
        scan.report("pickle-dump", node, f"`{qualname}` writes a pickle, readable only by unpickling")


def _is_restricted_unpickler_base(scan: FileScan, node: ast.AST) -> bool:
    owner = scan.tree.parent(node)
    return (
        isinstance(owner, ast.ClassDef)
        and any(base is node for base in owner.bases)
        and any(isinstance(item, ast.FunctionDef) and item.name == "find_class" for item in owner.body)
    )
