"""The audit's rule table: one entry per rule id, with its severity, checklist level and fix.

Rule ids are part of the public interface (suppressions, config files, SARIF, the report all
name them): never rename one; retire it and add a new id instead. Each rule says what breaks
off NVIDIA and what to write instead; a finding may carry a more specific replacement (e.g.
``torch.cuda.synchronize()`` -> ``torch.accelerator.synchronize()``).

Severities:

* ``error``   -- fails or silently runs on the wrong device off NVIDIA.
* ``warning`` -- runs, but is slow, recompiles, syncs the host or is unsafe.
* ``info``    -- worth a look; never gates CI by default.

``level`` is the level of the portability checklist that ``portatrain report`` fills
(:mod:`portatrain.report`) the rule gives evidence for: 1 device & API, 2 operator & library
coverage, 4 compilation & shape stability, 5 performance (host round-trips); 0 is outside the
checklist (checkpoint safety).
"""

from __future__ import annotations

from dataclasses import dataclass

SEVERITIES: tuple[str, ...] = ("error", "warning", "info")
"""Most to least severe; ``--fail-on`` and severity overrides take one of these."""


@dataclass(frozen=True)
class Rule:
    id: str
    """Stable kebab-case id, used in suppressions, config and output."""
    severity: str
    """Default severity, one of :data:`SEVERITIES` (a project config may override it)."""
    level: int
    """Portability-checklist level this rule gives evidence for (0: none)."""
    category: str
    """Group shown by ``--list-rules``."""
    summary: str
    """One line: what the rule finds and why it matters off NVIDIA."""
    replacement: str
    """The portable replacement, when the finding has no more specific one."""


_RULES: tuple[Rule, ...] = (
    # -- device placement (level 1) -----------------------------------------------------------
    Rule(
        "cuda-call",
        "error",
        1,
        "device placement",
        "`.cuda()` moves to an NVIDIA GPU; it raises on TPU/Trainium/CPU-only hosts",
        "`.to(device)` with `device` from the accelerator adapter (portatrain: `trainer.device`)",
    ),
    Rule(
        "cuda-device-string",
        "error",
        1,
        "device placement",
        'a hard-coded "cuda" device string (`device="cuda"`, `f"cuda:{rank}"`, `torch.device("cuda")`)',
        "take the device from the adapter: `torch.accelerator.current_accelerator()` or `trainer.device`",
    ),
    Rule(
        "cuda-device-branch",
        "error",
        1,
        "device placement",
        'device chosen by `torch.cuda.is_available()` ("cuda" if ... else "cpu"): off NVIDIA it silently trains on the CPU',
        "`torch.accelerator.current_accelerator()` (None -> CPU), or portatrain's `device=auto` discovery",
    ),
    Rule(
        "cuda-set-device",
        "error",
        1,
        "device placement",
        "`torch.cuda.set_device` exists only for CUDA",
        "portatrain's adapter `set_device()`: it picks the index from what the process sees (TorchTPU binds each worker to `tpu:0`; elsewhere `torch.accelerator.set_device_index(local_rank)`)",
    ),
    Rule(
        "ddp-device-ids",
        "error",
        1,
        "device placement",
        "`DistributedDataParallel(device_ids=...)`/`output_device=` name CUDA device indices",
        "omit `device_ids` for non-CUDA devices, or shard with FSDP2 `fully_shard` on a DeviceMesh",
    ),
    # -- CUDA-only APIs (level 1) -------------------------------------------------------------
    Rule(
        "cuda-api",
        "error",
        1,
        "CUDA-only API",
        "`torch.cuda.*` (synchronize, Event, Stream, memory stats, seeding, ...) raises or lies off NVIDIA",
        "the device-generic `torch.accelerator.*`, `torch.Event`/`torch.Stream`, or the adapter's method",
    ),
    Rule(
        "cuda-amp",
        "error",
        1,
        "CUDA-only API",
        "`torch.cuda.amp` autocast/GradScaler are CUDA-only (and deprecated)",
        "`torch.autocast(device_type, dtype=torch.bfloat16)`; bf16 needs no GradScaler "
        "(fp16: `torch.amp.GradScaler(device_type)`)",
    ),
    Rule(
        "cuda-backend-flag",
        "warning",
        1,
        "CUDA-only API",
        "`torch.backends.cuda`/`cudnn` flags do nothing off NVIDIA, so numerics and speed silently differ",
        '`torch.set_float32_matmul_precision("high")` for TF32; `torch.use_deterministic_algorithms(True)` '
        "for determinism",
    ),
    Rule(
        "pin-memory-cuda",
        "warning",
        1,
        "CUDA-only API",
        '`pin_memory` switched on for CUDA (`True`, `torch.cuda.is_available()`, `pin_memory_device="cuda"`)',
        "leave it off, or make it a per-device setting that the device adapter owns (it helps host-to-GPU copies only)",
    ),
    Rule(
        "nccl-backend",
        "error",
        1,
        "CUDA-only API",
        '`"nccl"` hard-coded as the process-group backend: NCCL exists only for NVIDIA GPUs',
        "`dist.init_process_group()` without `backend` (torch picks the device's), or "
        "`dist.get_default_backend_for_device(device)`",
    ),
    Rule(
        "nccl-backend-map",
        "error",
        1,
        "CUDA-only API",
        'a per-device backend table that gives CUDA `"nccl"` and every other device a fallback '
        '(`{"cuda": "nccl", "cpu": "gloo"}`, `"nccl" if device_type == "cuda" else "gloo"`): '
        "TPU and Trainium get no backend of their own",
        "`dist.get_default_backend_for_device(device)` (torch knows each device's backend), or "
        "`dist.init_process_group()` without `backend`",
    ),
    Rule(
        "cuda-only-fast-path",
        "warning",
        1,
        "CUDA-only API",
        "a portable speed-up (`fused=` optimizer, `non_blocking=` copies) switched on only when the "
        'device is CUDA (`device_type == "cuda"`): every other accelerator silently takes the slow path',
        "switch it on for every device that supports it: a per-device setting the device adapter owns, "
        'not a test of `device_type == "cuda"`',
    ),
    Rule(
        "cuda-default-device",
        "error",
        1,
        "CUDA-only API",
        "a device left to a default that is CUDA (`GradScaler()`, `ShardedGradScaler()` without a device) "
        "or given as a bare index (`.to(local_rank)`): off NVIDIA it raises or picks the wrong device",
        "pass the device explicitly: `torch.amp.GradScaler(device.type)`, `.to(device)` with `device` from "
        "the adapter (portatrain: `trainer.device`)",
    ),
    Rule(
        "nccl-setting",
        "warning",
        1,
        "CUDA-only API",
        'an NCCL tuning (`os.environ["NCCL_..."]`, `torch.cuda.nccl`): NCCL exists only for NVIDIA GPUs, '
        "so off NVIDIA the setting does nothing or the import fails",
        "let the device adapter own communication settings per backend; set NCCL variables in the "
        "CUDA launcher's environment, not in the training code",
    ),
    Rule(
        "cuda-profiler",
        "warning",
        1,
        "CUDA-only API",
        'a profiler set up for CUDA (`ProfilerActivity.CUDA`, `sort_by="cuda_time_total"`): off NVIDIA it '
        "records no device activity, or the sort key is missing",
        "`torch.profiler.supported_activities()` for the activities, and the `device_time_total`/"
        "`self_device_time_total` sort keys",
    ),
    Rule(
        "cuda-helper",
        "error",
        1,
        "CUDA-only API",
        "a call into a helper of the same project whose body calls CUDA-only code (found across the "
        "audited modules)",
        "make the helper device-generic (`torch.accelerator.*`, the adapter's method); the reason names "
        "the CUDA line inside it",
    ),
    # -- kernels and libraries (level 2) ------------------------------------------------------
    Rule(
        "cuda-library",
        "error",
        2,
        "kernels and libraries",
        "a CUDA-only kernel library (flash_attn, xformers, apex, bitsandbytes, triton, ...)",
        "the PyTorch op it wraps (SDPA, `torch.optim.AdamW(fused=...)`, `nn.RMSNorm`), "
        "or a named opt-in kernel with a pure-PyTorch reference",
    ),
    Rule(
        "cuda-extension",
        "error",
        2,
        "kernels and libraries",
        "a custom C++/CUDA extension (`torch.utils.cpp_extension`, `.cu` sources) builds only for NVIDIA",
        "a pure-PyTorch implementation (let `torch.compile` fuse it), or a kernel per backend behind one op",
    ),
    Rule(
        "sync-batchnorm",
        "warning",
        2,
        "kernels and libraries",
        "`nn.SyncBatchNorm` synchronizes statistics only on CUDA, XPU, HPU and PrivateUse1 devices; "
        "on XLA (and the CPU) its forward raises once a process group is up",
        "`nn.GroupNorm`/`nn.LayerNorm` (no cross-device statistics), or per-replica `nn.BatchNorm2d`",
    ),
    Rule(
        "feature-probe",
        "warning",
        2,
        "kernels and libraries",
        'a probe for a torch feature every supported torch has (`hasattr(F, "scaled_dot_product_attention")`): '
        "the fallback it keeps is dead code that still has to be ported and tested",
        "use the feature unconditionally and delete the fallback path",
    ),
    # -- attention (level 2) ------------------------------------------------------------------
    Rule(
        "manual-attention",
        "warning",
        2,
        "attention",
        "attention written as softmax(QK^T): O(n^2) memory and no fused kernel on any backend",
        "`F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...)`",
    ),
    Rule(
        "sdpa-backend-pin",
        "error",
        2,
        "attention",
        "SDPA pinned to a CUDA kernel (`sdpa_kernel`, `sdp_kernel`, `enable_flash=`): no such kernel elsewhere",
        "call `F.scaled_dot_product_attention` unpinned and let each backend choose its kernel",
    ),
    # -- host syncs in the training step (level 5) --------------------------------------------
    Rule(
        "host-sync",
        "warning",
        5,
        "host syncs",
        "the training step waits on the device (`.item()`, `.tolist()`, `.cpu()`, `print(tensor)`, `float(t)`)",
        "keep the value on the device and read it only on logging steps (`if step % log_every == 0:`)",
    ),
    Rule(
        "data-dependent-shape",
        "warning",
        5,
        "host syncs",
        "a shape that depends on tensor values (`nonzero`, boolean-mask indexing, `unique`) syncs and recompiles",
        "a fixed-shape form: `torch.where(mask, x, 0)`, multiply by the mask, or `masked_fill`",
    ),
    Rule(
        "tensor-control-flow",
        "warning",
        5,
        "host syncs",
        "Python `if`/`while` on a tensor value in the training step: a host sync and a graph break",
        "`torch.where`, or do the check on logging steps only",
    ),
    Rule(
        "eval-host-copy",
        "warning",
        5,
        "host syncs",
        "each evaluation batch's outputs copied to the host (`.cpu()`, `.numpy()`, `.tolist()`): "
        "the device waits for every copy",
        "keep the outputs on the device (`torch.cat` them after the loop, or sum metrics as tensors) "
        "and copy them to the host once",
    ),
    # -- dynamic shapes (level 4) -------------------------------------------------------------
    Rule(
        "pad-to-batch-max",
        "warning",
        4,
        "dynamic shapes",
        "batches padded to their own longest sequence: a new shape (and a recompile) per length",
        "pad to a fixed length or to bucket edges (portatrain: `data.collator=bucket|packing|pad_to_max`)",
    ),
    Rule(
        "pad-sequence-unbucketed",
        "warning",
        4,
        "dynamic shapes",
        "`pad_sequence` pads to the batch's longest sequence; without length buckets every batch is a new shape",
        "bucket lengths (length-grouped sampler + pad to the bucket edge), or pad to a fixed `max_len`",
    ),
    # -- checkpoints (outside the checklist) --------------------------------------------------
    Rule(
        "torch-load-unsafe",
        "error",
        0,
        "unsafe checkpoints",
        "`torch.load(weights_only=False)` unpickles arbitrary code from the checkpoint file",
        "`torch.load(path, weights_only=True)`; store configs as YAML/JSON, weights as safetensors or DCP",
    ),
    Rule(
        "torch-load-implicit",
        "warning",
        0,
        "unsafe checkpoints",
        "`torch.load` without `weights_only=`: unsafe on torch < 2.6, where the default was False",
        "pass `weights_only=True` explicitly",
    ),
    Rule(
        "pickle-load",
        "error",
        0,
        "unsafe checkpoints",
        "`pickle.load`/`loads` (or dill, cloudpickle, joblib) executes code from the file it reads",
        "YAML/JSON for configs (`OmegaConf.save`/`load`), safetensors or DCP for tensors",
    ),
    Rule(
        "pickle-dump",
        "warning",
        0,
        "unsafe checkpoints",
        "a pickled config or state: readable only by unpickling (unsafe) and tied to class paths",
        "YAML/JSON for configs (`OmegaConf.save`), safetensors or DCP for tensors",
    ),
    # -- input ----------------------------------------------------------------------------------
    Rule(
        "syntax-error",
        "error",
        0,
        "input",
        "the file does not parse as Python, so nothing in it was audited",
        "fix the syntax error (or exclude the file in the audit config)",
    ),
)

RULES: dict[str, Rule] = {rule.id: rule for rule in _RULES}
"""Rule id -> rule, in the order ``--list-rules`` prints them."""
