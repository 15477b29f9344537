"""Kernels and libraries that exist only for NVIDIA: CUDA kernel packages (flash_attn, apex,
triton, ...), custom C++/CUDA extensions and ``.cu`` sources, ``attn_implementation="flash_attention_2"``;
and probes for torch features that every supported torch has (``hasattr(F,
"scaled_dot_product_attention")``, ``"fused" in inspect.signature(torch.optim.AdamW).parameters``),
which keep a fallback path (hand-written attention, an unfused optimizer) alive for no torch that
runs. A probe is judged against the torch the audit runs with, which the project requires anyway.

``nn.SyncBatchNorm``, whose forward refuses devices without its kernels, is reported here too, and
bitsandbytes reached through transformers (``BitsAndBytesConfig(...)``, ``load_in_4bit=True``).

Rules: ``cuda-library``, ``cuda-extension``, ``sync-batchnorm``, ``feature-probe``.
"""

from __future__ import annotations

import ast
import inspect
import re

from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily
from portatrain.audit.tree import show, terminal_name

FAMILY = RuleFamily("kernels and libraries")

CUDA_LIBRARIES: dict[str, str] = {
    "flash_attn": "`F.scaled_dot_product_attention` (each backend picks its fused kernel)",
    "flash_attn_interface": "`F.scaled_dot_product_attention` (each backend picks its fused kernel)",
    "xformers": "`F.scaled_dot_product_attention` (each backend picks its fused kernel)",
    "apex": "`torch.optim.AdamW(fused=...)`, `nn.LayerNorm`/`nn.RMSNorm`, `torch.autocast`",
    "bitsandbytes": "`torch.optim.AdamW`, or torchao's optimizers/quantization where the backend supports them",
    "triton": "a pure-PyTorch op that `torch.compile` fuses, or a named kernel with a PyTorch reference",
    "transformer_engine": "`torch.autocast(device_type, dtype=torch.bfloat16)` and plain `nn.Linear`",
    "liger_kernel": "the plain PyTorch loss/norm ops (`torch.compile` fuses them)",
    "mamba_ssm": "a pure-PyTorch selective scan (or a backend's own kernel behind one op)",
    "causal_conv1d": "`nn.Conv1d` with left padding",
    "cupy": "torch tensor ops on the device",
    "pycuda": "torch tensor ops on the device",
}
"""Top-level module -> portable replacement for CUDA-only kernel libraries."""

_BNB_FIX = "bf16 weights, or a quantization the backend supports (torchao's, portatrain's `quantize.linear`)"
_BNB_KEYWORDS = frozenset({"load_in_4bit", "load_in_8bit"})

_CUDA_SOURCE = re.compile(r"^[\w./-]*\w\.cuh?$")  # kernel.cu, csrc/attn.cuh (not the bare suffix)


@FAMILY.check(ast.Import)
def imported_module(scan: FileScan, node: ast.Import) -> None:
    for alias in node.names:
        _module(scan, node, alias.name)


@FAMILY.check(ast.ImportFrom)
def imported_from_module(scan: FileScan, node: ast.ImportFrom) -> None:
    if node.level or not node.module:
        return
    if node.module == "torch.utils" and any(a.name == "cpp_extension" for a in node.names):
        _module(scan, node, "torch.utils.cpp_extension")
    if node.module == "numba" and any(a.name == "cuda" for a in node.names):
        _module(scan, node, "numba.cuda")
    _module(scan, node, node.module)


def _module(scan: FileScan, node: ast.stmt, module: str) -> None:
    top = module.split(".")[0]
    if top in CUDA_LIBRARIES:
        scan.report("cuda-library", node, f"`{top}` is a CUDA-only kernel library", CUDA_LIBRARIES[top])
    elif module == "numba.cuda" or module.startswith("numba.cuda."):
        scan.report(
            "cuda-library", node, "`numba.cuda` kernels run only on NVIDIA GPUs", CUDA_LIBRARIES["cupy"]
        )
    elif module == "torch.utils.cpp_extension" or module.startswith("torch.utils.cpp_extension."):
        scan.report("cuda-extension", node, "`torch.utils.cpp_extension` builds a custom C++/CUDA extension")


@FAMILY.check(ast.Name, ast.Attribute)
def custom_op_library(scan: FileScan, node: ast.Name | ast.Attribute) -> None:
    qualname = scan.reference(node)
    if qualname == "torch.ops.load_library":
        scan.report("cuda-extension", node, "`torch.ops.load_library` loads a compiled custom-op library")
    elif (
        qualname is not None
        and qualname.startswith(("torch.nn.SyncBatchNorm", "torch.nn.modules.batchnorm.SyncBatchNorm"))
        and not scan.guards.cuda_only(node)
    ):
        # The device list is SyncBatchNorm.forward's own check (torch/nn/modules/batchnorm.py).
        scan.report("sync-batchnorm", node, f"`{scan.text(node)}` needs a device with sync-BN kernels")


@FAMILY.check(ast.Constant)
def cuda_source_file(scan: FileScan, node: ast.Constant) -> None:
    if not isinstance(node.value, str) or scan.claimed(node) or not _CUDA_SOURCE.match(node.value):
        return
    if isinstance(scan.tree.parent(node), ast.List | ast.Tuple | ast.Call | ast.keyword):
        scan.report("cuda-extension", node, f'`"{node.value}"` is a CUDA source file built into an extension')


@FAMILY.check(ast.Constant)
def flash_attention_implementation(scan: FileScan, node: ast.Constant) -> None:
    """``attn_implementation="flash_attention_2"`` as a keyword, a dict entry or an assignment."""
    if not (isinstance(node.value, str) and node.value.startswith("flash_attention")):
        return
    parent = scan.tree.parent(node)
    if isinstance(parent, ast.keyword):
        named = parent.arg
    elif isinstance(parent, ast.Dict):
        key = next((k for k, v in zip(parent.keys, parent.values) if v is node), None)
        named = key.value if isinstance(key, ast.Constant) else None
    elif isinstance(parent, ast.Assign) and parent.value is node and len(parent.targets) == 1:
        target = parent.targets[0]
        named = (
            target.slice.value
            if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
            else terminal_name(target)
        )
    else:
        return
    if named in ("attn_implementation", "_attn_implementation"):
        scan.report(
            "cuda-library",
            node if not isinstance(parent, ast.keyword) else parent,
            f"`attn_implementation={show(node)}` needs the CUDA-only flash_attn package",
            '`attn_implementation="sdpa"`',
        )


_PROBE_FIXES: dict[str, str] = {
    "torch.nn.functional.scaled_dot_product_attention": "call `F.scaled_dot_product_attention` "
    "unconditionally (each backend picks its own kernel) and delete the hand-written attention path",
}


@FAMILY.check(ast.Call)
def hasattr_probe(scan: FileScan, node: ast.Call) -> None:
    """``hasattr(torch.nn.functional, "scaled_dot_product_attention")``."""
    if scan.names.builtin(node) != "hasattr" or len(node.args) != 2:
        return
    owner, name = node.args
    qualname = scan.names.qualname(owner)
    if qualname is None or not isinstance(name, ast.Constant) or not isinstance(name.value, str):
        return
    if _torch_object(qualname) is not None and _torch_object(f"{qualname}.{name.value}") is not None:
        _report_probe(scan, node, f"{qualname}.{name.value}")


@FAMILY.check(ast.Compare)
def signature_probe(scan: FileScan, node: ast.Compare) -> None:
    """``"fused" in inspect.signature(torch.optim.AdamW).parameters``."""
    if not (
        len(node.ops) == 1
        and isinstance(node.ops[0], ast.In)
        and isinstance(node.left, ast.Constant)
        and isinstance(node.left.value, str)
    ):
        return
    right = node.comparators[0]
    if not (
        isinstance(right, ast.Attribute) and right.attr == "parameters" and isinstance(right.value, ast.Call)
    ):
        return
    call = right.value
    if scan.names.qualname(call.func) != "inspect.signature" or len(call.args) != 1:
        return
    qualname = scan.names.qualname(call.args[0])
    target = _torch_object(qualname) if qualname else None
    try:
        parameters = inspect.signature(target).parameters if target is not None else {}
    except (TypeError, ValueError):
        return
    if node.left.value in parameters:
        _report_probe(scan, node, f"{qualname}({node.left.value}=...)")


def _report_probe(scan: FileScan, node: ast.AST, feature: str) -> None:
    import torch

    scan.report(
        "feature-probe",
        node,
        f"`{scan.text(node)}` is always true (torch {torch.__version__.split('+')[0]} has `{feature}`): "
        "the path for a torch without it is dead code",
        _PROBE_FIXES.get(feature),
    )


def _torch_object(qualname: str) -> object | None:
    """The object a ``torch.*`` dotted path names in the installed torch (attributes only: nothing
    is imported but torch itself), or None."""
    parts = qualname.split(".")
    if parts[0] != "torch":
        return None
    import torch

    found: object = torch
    for part in parts[1:]:
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


@FAMILY.check(ast.Call)
def bitsandbytes_config(scan: FileScan, node: ast.Call) -> None:
    """``BitsAndBytesConfig(load_in_4bit=True, ...)``: transformers quantizes through bitsandbytes."""
    if terminal_name(node.func) == "BitsAndBytesConfig":
        scan.report(
            "cuda-library",
            node,
            "`BitsAndBytesConfig` quantizes through bitsandbytes, whose kernels are CUDA-only",
            _BNB_FIX,
        )
        scan.claim(node)


@FAMILY.check(ast.keyword)
def bitsandbytes_keyword(scan: FileScan, node: ast.keyword) -> None:
    """``from_pretrained(..., load_in_8bit=True)``: the same, without the config object."""
    value = node.value
    off = isinstance(value, ast.Constant) and value.value in (False, None)
    if node.arg in _BNB_KEYWORDS and not off and not scan.claimed(node):
        scan.report(
            "cuda-library",
            node,
            f"`{node.arg}={scan.text(value, 30)}` quantizes through bitsandbytes, whose kernels are CUDA-only",
            _BNB_FIX,
        )
