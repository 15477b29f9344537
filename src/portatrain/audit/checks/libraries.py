"""Kernels and libraries that exist only for NVIDIA: CUDA kernel packages (flash_attn, apex,
triton, ...), custom C++/CUDA extensions and ``.cu`` sources, ``attn_implementation="flash_attention_2"``.

Rules: ``cuda-library``, ``cuda-extension``.
"""

from __future__ import annotations

import ast
import re

from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily
from portatrain.audit.tree import show

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
    if scan.reference(node) == "torch.ops.load_library":
        scan.report("cuda-extension", node, "`torch.ops.load_library` loads a compiled custom-op library")


@FAMILY.check(ast.Constant)
def cuda_source_file(scan: FileScan, node: ast.Constant) -> None:
    if not isinstance(node.value, str) or scan.claimed(node) or not _CUDA_SOURCE.match(node.value):
        return
    if isinstance(scan.tree.parent(node), ast.List | ast.Tuple | ast.Call | ast.keyword):
        scan.report("cuda-extension", node, f'`"{node.value}"` is a CUDA source file built into an extension')


@FAMILY.check(ast.keyword)
def flash_attention_implementation(scan: FileScan, node: ast.keyword) -> None:
    value = node.value
    if node.arg == "attn_implementation" and str(getattr(value, "value", "")).startswith("flash_attention"):
        scan.report(
            "cuda-library",
            node,
            f"`attn_implementation={show(value)}` needs the CUDA-only flash_attn package",
            '`attn_implementation="sdpa"`',
        )
