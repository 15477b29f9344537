"""CUDA-only APIs: ``torch.cuda.*`` (amp included), ``torch.backends.cuda``/``cudnn`` switches,
``pin_memory`` tied to CUDA, ``"nccl"`` hard-coded as the process-group backend or as the CUDA
entry of a per-device backend table, and portable speed-ups switched on for CUDA only.

A ``torch.cuda`` call that only CUDA reaches (``if device.type == "cuda":``, see
:mod:`portatrain.audit.guards`) is device-specific code in its place, not a finding; ``torch.cuda.amp``
is reported anyway (deprecated on CUDA too).

Rules: ``cuda-api``, ``cuda-amp``, ``cuda-backend-flag``, ``pin-memory-cuda``, ``nccl-backend``,
``nccl-backend-map``, ``cuda-only-fast-path``.
"""

from __future__ import annotations

import ast

from portatrain.audit.checks.device_placement import is_cuda_string
from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily

FAMILY = RuleFamily("CUDA-only API")

SDP_FLAGS = frozenset(
    [
        "sdp_kernel",
        "enable_flash_sdp",
        "enable_mem_efficient_sdp",
        "enable_math_sdp",
        "enable_cudnn_sdp",
        "flash_sdp_enabled",
        "mem_efficient_sdp_enabled",
    ]
)
"""``torch.backends.cuda`` switches that pin SDPA to a kernel (the attention family's)."""

_CUDA_API_REPLACEMENTS: dict[str, str] = {
    "synchronize": "`torch.accelerator.synchronize()`",
    "Event": "`torch.Event(enable_timing=True)` (device-generic)",
    "Stream": "`torch.Stream()` (device-generic)",
    "current_stream": "`torch.accelerator.current_stream()`",
    "set_stream": "`torch.accelerator.set_stream(stream)`",
    "device_count": "`torch.accelerator.device_count()`",
    "current_device": "`torch.accelerator.current_device_index()`",
    "empty_cache": "`torch.accelerator.empty_cache()`",
    "memory_allocated": "`torch.accelerator.memory_allocated()`",
    "max_memory_allocated": "`torch.accelerator.max_memory_allocated()`",
    "memory_reserved": "`torch.accelerator.memory_reserved()`",
    "max_memory_reserved": "`torch.accelerator.max_memory_reserved()`",
    "memory_stats": "`torch.accelerator.memory_stats()`",
    "reset_peak_memory_stats": "`torch.accelerator.reset_peak_memory_stats()`",
    "mem_get_info": "`torch.accelerator.get_memory_info()`",
    "get_device_capability": "`torch.accelerator.get_device_capability()`",
    "manual_seed": "`torch.manual_seed(seed)` (seeds every device)",
    "manual_seed_all": "`torch.manual_seed(seed)` (seeds every device)",
    "get_rng_state": "`torch.get_rng_state()` plus the adapter's device RNG state",
    "set_rng_state": "`torch.set_rng_state()` plus the adapter's device RNG state",
    "nvtx": "`torch.profiler.record_function(name)`",
    "CUDAGraph": "`torch.accelerator.Graph`, or let torch.compile capture graphs per backend",
    "graph": "`torch.accelerator.Graph`, or let torch.compile capture graphs per backend",
    "is_bf16_supported": "the adapter's default dtype (portatrain: trainer.dtype=auto)",
    "get_device_name": "the adapter's device_name()",
}
_BACKEND_FLAG_REPLACEMENTS: dict[str, str] = {
    "allow_tf32": '`torch.set_float32_matmul_precision("high")`',
    "allow_fp16_reduced_precision_reduction": "bf16 autocast: `torch.autocast(device_type, dtype=torch.bfloat16)`",
    "allow_bf16_reduced_precision_reduction": "bf16 autocast: `torch.autocast(device_type, dtype=torch.bfloat16)`",
    "deterministic": "`torch.use_deterministic_algorithms(True)`",
    "benchmark": "drop it (cuDNN autotuning; other backends' compilers tune per static shape)",
}
_DEVICE_CHOICE = ("set_device", "is_available")  # torch.cuda.* that the device-placement family reports


def is_cuda_backend(parts: list[str]) -> bool:
    """``torch.backends.cuda.*`` or ``torch.backends.cudnn.*``, split on dots."""
    return parts[:2] == ["torch", "backends"] and len(parts) > 2 and parts[2] in ("cuda", "cudnn")


@FAMILY.check(ast.Name, ast.Attribute)
def cuda_only_reference(scan: FileScan, node: ast.Name | ast.Attribute) -> None:
    qualname = scan.reference(node)
    if qualname is None:
        return
    parts = qualname.split(".")
    if parts[:2] == ["torch", "cuda"]:
        head = parts[2] if len(parts) > 2 else ""
        if head == "amp":
            scan.report("cuda-amp", node, f"`{qualname}` is CUDA-only (and deprecated)")
        elif head not in _DEVICE_CHOICE and not scan.guards.cuda_only(node):
            scan.report("cuda-api", node, f"`{qualname}` is CUDA-only", _CUDA_API_REPLACEMENTS.get(head))
    elif is_cuda_backend(parts):
        if parts[-1] not in SDP_FLAGS:
            scan.report(
                "cuda-backend-flag",
                node,
                f"`{qualname}` is a CUDA-only switch: off NVIDIA it does nothing",
                _BACKEND_FLAG_REPLACEMENTS.get(parts[-1]),
            )
    elif qualname.endswith("Backend.NCCL") and parts[0] == "torch":
        scan.report("nccl-backend", node, f"`{qualname}` hard-codes the NCCL backend")


_FAST_PATH_KEYWORDS: dict[str, str] = {
    "fused": "`fused=True` for every device whose optimizer kernels support it (CUDA, XPU, MPS, CPU, ...), "
    "a per-device setting of the device adapter",
    "non_blocking": "`non_blocking=True` on every device (asynchronous host-to-device copies are not "
    "CUDA's alone)",
}
"""Keyword -> its fix, for speed-ups other backends have too (``cuda-only-fast-path``)."""


@FAMILY.check(ast.keyword)
def cuda_only_fast_path(scan: FileScan, node: ast.keyword) -> None:
    """``fused=use_fused`` where ``use_fused = ... and device_type == "cuda"``, or
    ``non_blocking=True`` in a branch only CUDA takes."""
    if node.arg not in _FAST_PATH_KEYWORDS:
        return
    value = node.value
    switched_on = isinstance(value, ast.Constant) and value.value is True
    if scan.guards.implies_cuda(value) or (switched_on and scan.guards.cuda_only(node)):
        scan.report(
            "cuda-only-fast-path",
            node,
            f"`{node.arg}={scan.text(value)}` is switched on only when the device is CUDA",
            _FAST_PATH_KEYWORDS[node.arg],
        )


@FAMILY.check(ast.Call)
def pin_memory_call(scan: FileScan, node: ast.Call) -> None:
    if scan.names.method(node) == "pin_memory":
        where = " in a branch only CUDA takes" if scan.guards.cuda_only(node) else ""
        scan.report_method(
            "pin-memory-cuda",
            node,
            f"`{scan.text(node)}` pins host memory for copies to an NVIDIA GPU{where}",
            "let the device adapter decide (`x.to(device, non_blocking=True)` on every device; pin only "
            "where the adapter says it helps)",
        )


@FAMILY.check(ast.keyword)
def pin_memory(scan: FileScan, node: ast.keyword) -> None:
    value = node.value
    if node.arg == "pin_memory":
        cuda_tied = scan.guards.implies_cuda(value) or any(
            scan.names.qualname(n) in ("torch.cuda.is_available",) or is_cuda_string(n)
            for n in ast.walk(value)
            if isinstance(n, ast.Name | ast.Attribute | ast.Constant | ast.JoinedStr)
        )
        if cuda_tied or (isinstance(value, ast.Constant) and value.value is True):
            scan.report("pin-memory-cuda", node, f"`pin_memory={scan.text(value)}` pins host memory for CUDA")
            scan.claim(value)
    elif node.arg == "pin_memory_device" and is_cuda_string(value):
        scan.report("pin-memory-cuda", node, "`pin_memory_device` names CUDA")
        scan.claim(value)


_OWN_BACKEND_DEVICES = frozenset({"xla", "tpu", "neuron", "xpu", "hpu", "mtia"})
"""Device types whose process-group backend is not gloo: a table naming one of them was written
with more than CUDA in mind."""


@FAMILY.check(ast.Dict)
def nccl_backend_table(scan: FileScan, node: ast.Dict) -> None:
    """``{"cuda": "nccl", "cpu": "gloo"}``: every device but CUDA gets gloo (or nothing)."""
    keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    nccl = [
        v
        for k, v in zip(node.keys, node.values)
        if isinstance(k, ast.Constant) and str(k.value).startswith("cuda") and _is_nccl(v)
    ]
    if nccl and not _OWN_BACKEND_DEVICES & {k.split(":")[0] for k in keys}:
        scan.report(
            "nccl-backend-map",
            node,
            f"`{scan.text(node)}` gives only CUDA a backend of its own: TPU and Trainium fall back "
            "(to gloo, or to no entry)",
        )
    for value in nccl:  # reported with the table, or CUDA's entry in a table naming every device
        scan.claim(value)


@FAMILY.check(ast.IfExp)
def nccl_backend_branch(scan: FileScan, node: ast.IfExp) -> None:
    """``"nccl" if device_type == "cuda" else "gloo"``."""
    if scan.claimed(node):
        return
    if _is_nccl(node.body) and scan.guards.implies_cuda(node.test):
        scan.report(
            "nccl-backend-map",
            node,
            f"`{scan.text(node)}`: every device but CUDA falls back to `{scan.text(node.orelse)}`",
        )
        scan.claim(node)


def _is_nccl(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() == "nccl"


@FAMILY.check(ast.Constant)
def nccl_string(scan: FileScan, node: ast.Constant) -> None:
    if not isinstance(node.value, str) or node.value.lower() != "nccl" or scan.claimed(node):
        return
    parent = scan.tree.parent(node)
    if _is_value_position(node, parent):
        scan.report("nccl-backend", node, '`"nccl"` hard-codes the NCCL process-group backend')


def _is_value_position(node: ast.AST, parent: ast.AST | None) -> bool:
    """A string used as a value (argument, assignment, dict value), not compared or a docstring."""
    if isinstance(parent, ast.keyword | ast.Call | ast.Return | ast.IfExp):
        return True
    if isinstance(parent, ast.Assign | ast.AnnAssign):
        return parent.value is node
    if isinstance(parent, ast.Dict):
        return any(v is node for v in parent.values)
    return False
