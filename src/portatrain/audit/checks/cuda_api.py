"""CUDA-only APIs: ``torch.cuda.*`` (amp included), ``torch.backends.cuda``/``cudnn`` switches,
``pin_memory`` tied to CUDA, ``"nccl"`` hard-coded as the process-group backend or as the CUDA
entry of a per-device backend table, and portable speed-ups switched on for CUDA only.

A ``torch.cuda`` call that only CUDA reaches (``if device.type == "cuda":``, see
:mod:`portatrain.audit.guards`) is device-specific code in its place, not a finding; ``torch.cuda.amp``
is reported anyway (deprecated on CUDA too).

CUDA also hides in defaults and settings: a ``GradScaler()``/``ShardedGradScaler()`` without a
device (both default to ``"cuda"``), ``.to(local_rank)`` (a bare index means a CUDA device),
``NCCL_*`` environment variables and ``torch.cuda.nccl``, a profiler that records
``ProfilerActivity.CUDA`` or sorts by a ``cuda_time`` key. When a folder is audited, a call into a
helper of another audited module whose body calls CUDA-only code is reported at the call site, with
the helper's CUDA line as its reason (:mod:`portatrain.audit.project`).

Rules: ``cuda-api``, ``cuda-amp``, ``cuda-backend-flag``, ``pin-memory-cuda``, ``nccl-backend``,
``nccl-backend-map``, ``cuda-only-fast-path``, ``cuda-default-device``, ``nccl-setting``,
``cuda-profiler``, ``cuda-helper``.
"""

from __future__ import annotations

import ast
import re

from portatrain.audit.checks.device_placement import is_cuda_string
from portatrain.audit.context import FileScan
from portatrain.audit.registry import RuleFamily
from portatrain.audit.tree import terminal_name

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
    elif (
        parts[0] == "torch" and parts[-2:] == ["ProfilerActivity", "CUDA"] and not scan.guards.cuda_only(node)
    ):
        scan.report(
            "cuda-profiler",
            node,
            f"`{scan.text(node)}` records CUDA kernels only: off NVIDIA the profile has no device activity",
            "`activities=torch.profiler.supported_activities()` (the CPU plus whatever device is present)",
        )


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


# torch.autograd.profiler_util.FunctionEventAvg: the cuda_* keys are CUDA's names for the device_*
# ones (torch >= 2.4), which every backend's profiler fills.
_CUDA_SORT_KEYS = frozenset(
    {"cuda_time", "cuda_time_total", "self_cuda_time_total", "cuda_memory_usage", "self_cuda_memory_usage"}
)
_NCCL_VARIABLE = re.compile(r"^(TORCH_)?NCCL_[A-Z0-9_]+$")
_ENV_CALLS = frozenset(
    {"os.environ.setdefault", "os.environ.get", "os.environ.pop", "os.getenv", "os.putenv", "os.unsetenv"}
)


@FAMILY.check(ast.Constant)
def cuda_profiler_sort_key(scan: FileScan, node: ast.Constant) -> None:
    """``prof.key_averages().table(sort_by="self_cuda_time_total")``."""
    if not isinstance(node.value, str) or node.value not in _CUDA_SORT_KEYS:
        return
    if _is_value_position(node, scan.tree.parent(node)) and not scan.guards.cuda_only(node):
        key = node.value.replace("cuda", "device")
        scan.report(
            "cuda-profiler",
            node,
            f'`"{node.value}"` is a CUDA profiler key: off NVIDIA the column is empty or missing',
            f'`sort_by="{key}"` (filled by every backend\'s profiler)',
        )


@FAMILY.check(ast.Constant)
def nccl_environment(scan: FileScan, node: ast.Constant) -> None:
    """``os.environ["NCCL_ASYNC_ERROR_HANDLING"] = "1"``, ``os.environ.setdefault("NCCL_DEBUG", ...)``,
    ``env={"NCCL_IB_DISABLE": "1"}``."""
    if not isinstance(node.value, str) or not _NCCL_VARIABLE.match(node.value):
        return
    parent = scan.tree.parent(node)
    environ = (
        isinstance(parent, ast.Subscript)
        and parent.slice is node
        and scan.names.qualname(parent.value) == "os.environ"
    )
    call = isinstance(parent, ast.Call) and scan.names.qualname(parent.func) in _ENV_CALLS
    entry = isinstance(parent, ast.Dict) and any(k is node for k in parent.keys)
    if (environ or call or entry) and not scan.guards.cuda_only(node):
        scan.report("nccl-setting", node, f"`{node.value}` tunes NCCL, which exists only for NVIDIA GPUs")


@FAMILY.check(ast.Import, ast.ImportFrom)
def nccl_module(scan: FileScan, node: ast.Import | ast.ImportFrom) -> None:
    """``import torch.cuda.nccl as nccl``, ``from torch.cuda import nccl``."""
    if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
    elif node.level == 0 and node.module:
        modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        return
    if any(m == "torch.cuda.nccl" or m.startswith("torch.cuda.nccl.") for m in modules):
        scan.report(
            "nccl-setting", node, "`torch.cuda.nccl` binds NCCL directly: the import fails off NVIDIA"
        )


_DEFAULT_CUDA_SCALERS = frozenset({"GradScaler", "ShardedGradScaler"})
"""``torch.amp.GradScaler(device="cuda")`` and FSDP's ``ShardedGradScaler(device="cuda")``: the
device is the first parameter and defaults to CUDA (``torch.cuda.amp`` is ``cuda-amp``'s)."""
_DEVICE_INDEX = re.compile(r"(^|_)(rank|gpu|gpu_id|gpu_idx|gpu_index|device_id|device_idx|device_index)$")
"""Names that hold an integer device index (``local_rank``, ``args.gpu``, ``device_id``)."""


@FAMILY.check(ast.Call)
def cuda_by_default(scan: FileScan, node: ast.Call) -> None:
    qualname = scan.names.qualname(node.func)
    if (
        qualname is not None
        and qualname.startswith("torch.")
        and not qualname.startswith("torch.cuda.")
        and qualname.split(".")[-1] in _DEFAULT_CUDA_SCALERS
        and not node.args
        and not any(k.arg in ("device", None) for k in node.keywords)
        and not scan.guards.cuda_only(node)
    ):
        name = qualname.split(".")[-1]
        scan.report(
            "cuda-default-device",
            node,
            f'`{name}()` without a device defaults to "cuda": off NVIDIA it warns and scales nothing, or raises',
            f"`{name}(device.type)` with the device from the adapter (bf16 needs no scaler at all)",
        )
        return
    method = scan.names.method(node)
    if method == "to":
        index = (
            node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "device"), None)
        )
        if index is not None and _is_device_index(scan, index) and not scan.guards.cuda_only(node):
            scan.report_method(
                "cuda-default-device",
                node,
                f"`.to({scan.text(index, 30)})` moves to device index {scan.text(index, 30)} of the current "
                "accelerator type, CUDA's: on TPU each worker sees one device and the index is out of range",
            )


def _is_device_index(scan: FileScan, node: ast.expr) -> bool:
    """``local_rank``, ``args.gpu``, ``int(os.environ["LOCAL_RANK"])``, ``0``."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Call):
        return scan.names.builtin(node) == "int"
    if isinstance(node, ast.Name):
        value = scan.tensors.resolve(node)
        if isinstance(value, ast.Call | ast.Constant) and _is_device_index(scan, value):
            return True
    if isinstance(node, ast.Name | ast.Attribute):
        return bool(_DEVICE_INDEX.search(terminal_name(node).lower()))
    return False


@FAMILY.check(ast.Call)
def cuda_helper_call(scan: FileScan, node: ast.Call) -> None:
    """``gc_cuda()`` where ``gc_cuda`` is defined in another audited module and calls ``torch.cuda``."""
    if scan.project is None:
        return
    found = scan.project.helper(scan.names, node.func)
    if found is not None and not scan.guards.cuda_only(node):
        name, reason = found
        scan.report("cuda-helper", node, f"`{name}()` {reason}")
