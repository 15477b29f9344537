"""``dry_run=true``: report a model's size and per-device memory, in closed form.

Nothing is allocated: the parameter count is the architecture's own formula
(``args.num_params()``, held to the built model's for every family by ``tests/test_conformance.py``)
and the memory figures come from the model family's estimate (``spec.estimate_memory``) for the
configured precision and layout (with LoRA, the adapters counted on the model built on the meta
device). So a plan takes milliseconds (Llama 3.1 70B: 520 ms -> 5 ms);
building, even on the meta device, cost ~2.5 ms a block (``model.n_layers=100000``: minutes and
gigabytes; sizes that large are refused by ``DecoderArgs.size_bounds`` now).
"""

from __future__ import annotations

from typing import Any

import torch

from portatrain.accelerators import ACCELERATORS, resolve_accelerator
from portatrain.config import Config
from portatrain.data.loader import has_attention_mask
from portatrain.dtypes import dtype_from_name
from portatrain.finetune import uses_lora
from portatrain.finetune.lora import apply_lora
from portatrain.models import ARCH_OVERRIDES, get_spec, model_args, moe_dispatch
from portatrain.models.memory import format_memory_report
from portatrain.parallel.context import context_activation_bytes
from portatrain.parallel.parallel_dims import ParallelDims, expected_world_size
from portatrain.parallel.pipeline import describe_stages


def training_dtype(dtype_name: str, device_type: str) -> torch.dtype:
    """The precision a real run would use. An explicitly named device is not probed: a plan for
    Trainium can be made on a laptop."""
    if dtype_name != "auto":
        return dtype_from_name(dtype_name)
    if device_type == "auto":
        return resolve_accelerator("auto").default_dtype
    return ACCELERATORS[device_type]().default_dtype  # an instance: the sim's follows its impersonation


def static_shapes(device_type: str) -> bool:
    """Whether the device's compiler wants static shapes (decides ``model.moe_dispatch=auto``); an
    explicitly named device is not probed."""
    if device_type == "auto":
        return resolve_accelerator("auto").static_shapes
    return ACCELERATORS[device_type].static_shapes


def estimate_for_config(
    cfg: Config, *, world_size: int | None = None, args: Any = None, batch_size: int | None = None
) -> dict[str, int]:
    """The per-device memory estimate the dry run reports for ``cfg`` (bytes per component).

    ``world_size``: the real world (a running job); default the world the layout names. Also used
    by ``scripts/bench_memory.py`` and the test that holds the estimate to a measured peak.
    ``args`` and ``batch_size`` replace the model's arguments and ``data.batch_size`` (a pipeline
    stage's blocks, a micro-batch).
    """
    spec = get_spec(cfg.model.name)
    args = model_args(cfg.model) if args is None else args
    par = cfg.parallel
    # Planned for the world the layout names (dp_shard=8 tp=8: 64 devices), nothing launched.
    world = world_size if world_size is not None else expected_world_size(par, cfg.launch, dry_run=True)
    dims = ParallelDims.from_config(par, world_size=world)
    mixed = training_dtype(cfg.trainer.dtype, cfg.device.type) == torch.bfloat16
    dispatch = moe_dispatch(cfg.model, static_shapes=static_shapes(cfg.device.type))
    # FSDP2 mixed precision keeps fp32 sharded parameters, gradients and AdamW moments and
    # computes (all-gathers, activations) in bf16. Context parallel: each device holds 1/cp of the
    # row and FSDP2 shards over dp_shard x cp; the gathered k/v come on top.
    estimate = spec.estimate_memory(
        args,
        batch_size=cfg.data.batch_size if batch_size is None else batch_size,
        seq_len=cfg.data.seq_len // par.cp,
        param_dtype_bytes=4,
        grad_dtype_bytes=4,
        optim_state_bytes_per_param=8,
        shard_degree=dims.dp_shard * par.cp,
        tp_degree=par.tp,
        activation_checkpointing=par.activation_checkpointing,
        activation_dtype_bytes=2 if mixed else 4,
        loss_chunk_size=cfg.trainer.loss_chunk_size if cfg.trainer.loss == "chunked" else None,
        attn_mask=has_attention_mask(cfg.data) and par.cp == 1,
        capacity_factor=cfg.model.capacity_factor if dispatch == "capacity" else None,
        ep_degree=par.ep,
        lora_params=lora_parameters(cfg, args),
    )
    if par.cp > 1:
        extra = context_activation_bytes(
            batch=cfg.data.batch_size,
            seq_len=cfg.data.seq_len,
            cp=par.cp,
            n_layers=args.n_layers,
            q_dim=args.n_heads * args.head_dim // par.tp,
            kv_dim=args.n_kv_heads * args.head_dim // par.tp,
            act_bytes=2 if mixed else 4,
            repeated=cfg.device.type != "cpu",
            documents=has_attention_mask(cfg.data),
            activation_checkpointing=par.activation_checkpointing,
        )
        estimate["activations"] += extra
        estimate["total"] += extra
    return estimate


def lora_parameters(cfg: Config, args: Any) -> int | None:
    """The adapters' parameters of a LoRA run (``finetune.method=lora``, or DPO's with
    ``finetune.dpo.lora``) for a model of ``args``, None when every weight trains. Counted as the run
    makes them: the model built on the meta device (nothing allocated, milliseconds a block) and
    ``apply_lora`` adding the adapters, whose parameters are the only ones left trainable."""
    if not uses_lora(cfg.finetune):
        return None
    with torch.device("meta"):
        model = get_spec(cfg.model.name).model_cls(args)
    apply_lora(model, cfg.finetune.lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def describe_plan(cfg: Config) -> str:
    """The dry-run report: parameters, precision, layout, FLOPs per token and the memory table."""
    args = model_args(cfg.model)
    n_params = args.num_params()
    active = args.num_params(active=True)  # a mixture of experts' token passes top_k experts only
    experts = moe_dispatch(cfg.model, static_shapes=static_shapes(cfg.device.type))
    if experts == "capacity":
        experts += f" (capacity_factor {cfg.model.capacity_factor})"

    par = cfg.parallel
    dims = ParallelDims.from_config(par, world_size=expected_world_size(par, cfg.launch, dry_run=True))
    mixed = training_dtype(cfg.trainer.dtype, cfg.device.type) == torch.bfloat16
    estimate = estimate_for_config(cfg)
    lora = lora_parameters(cfg, args)
    trains = (
        f"; LoRA: {lora:,} adapter parameters train ({lora / n_params:.2%}), the base is frozen"
        if lora
        else ""
    )
    custom = {k: getattr(cfg.model, k) for k in (*ARCH_OVERRIDES, "vocab_size")}
    custom = {k: v for k, v in custom.items() if v is not None}
    lines = [
        f"recipe {cfg.recipe}: {cfg.model.name} {cfg.model.flavor}"
        + (f" with {', '.join(f'{k}={v}' for k, v in custom.items())}" if custom else ""),
        f"parameters: {n_params:,} ({n_params / 1e9:.2f}B), counted from the architecture, nothing built"
        + (f"; active per token: {active:,} ({active / 1e9:.2f}B)" if active != n_params else ""),
        f"architecture: dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads "
        f"({args.n_kv_heads} kv, head_dim {args.head_dim}), ffn {args.ffn_dim}, vocab {args.vocab_size}",
        f"precision: {'bf16 compute, fp32 master weights/grads/optimizer' if mixed else 'fp32'}" + trains,
        f"layout: {dims.describe()}; "
        f"micro-batch {cfg.data.batch_size} x {cfg.data.seq_len} tokens "
        + (
            f"(split over cp={par.cp}: {cfg.data.seq_len // par.cp} per device)"
            if par.cp > 1
            else "per device"
        )
        + f"; activation checkpointing {par.activation_checkpointing}",
        f"training FLOPs per token: {args.flops_per_token(cfg.data.seq_len) / 1e9:.2f} GFLOP"
        + (f" (active parameters); experts dispatched {experts}" if active != n_params else ""),
        "",
    ]
    if dims.pp_enabled:  # per pipeline rank: the first and last stages differ
        lines.append(
            describe_stages(
                args,
                par,
                batch_size=cfg.data.batch_size,
                estimate=lambda stage, rows: estimate_for_config(cfg, args=stage, batch_size=rows),
            )
        )
    else:
        lines.append(format_memory_report(estimate, title="estimated memory per device"))
        if cfg.device.memory_gib is not None:
            lines.append(fit_verdict(estimate["total"], cfg.device.memory_gib))
    return "\n".join(lines)


def fit_verdict(total_bytes: int, memory_gib: float) -> str:
    """Whether an estimate fits a device of ``memory_gib`` GiB, one line with the margin."""
    need = total_bytes / 1024**3
    if need <= memory_gib:
        return (
            f"fits: {need:.1f} of {memory_gib:g} GiB per device ({1 - need / memory_gib:.0%} free; the estimate "
            "leaves out fragmentation and workspaces, keep 10-20% free)"
        )
    return (
        f"does not fit: {need:.1f} GiB estimated > {memory_gib:g} GiB per device; shard wider (parallel.dp_shard), "
        "checkpoint activations or shorten the micro-batch"
    )
