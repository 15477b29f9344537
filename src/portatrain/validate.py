"""Check a composed config as a whole, before anything is built; raise once with every problem.

:func:`validate` asks each stage for the problems of its part of the config -- the stage owns the
allowed values and the rules -- and adds the few checks that span two stages (the longest data row
against the model's RoPE table; tensor parallel against the model's heads and the rows' lengths).
Each problem names the key, the value, the constraint and the fix. The CLI calls this for every
command that composes a config.
"""

from __future__ import annotations

from portatrain.accelerators import ACCELERATORS
from portatrain.audit.runtime import runtime_audit_problems
from portatrain.bench import bench_problems
from portatrain.checkpoint.staging import ASYNC_MODES
from portatrain.compile import compile_problems
from portatrain.config import CheckpointConfig, Config, DataConfig, TrainerConfig
from portatrain.converters import converter_problems
from portatrain.data.config import config_problems as data_problems
from portatrain.dtypes import dtype_problem
from portatrain.errors import ConfigError
from portatrain.evaluation.tasks import eval_problems
from portatrain.export import export_problems
from portatrain.fault_tolerance import fault_tolerance_problems
from portatrain.finetune import finetune_problems
from portatrain.generate import generate_problems
from portatrain.kernels import config_problems as kernel_problems
from portatrain.launch import shape_problems
from portatrain.losses import loss_problems
from portatrain.metrics import metrics_problems
from portatrain.models import get_spec, model_args, model_problems
from portatrain.models.common.qk_clip import qk_clip_problems
from portatrain.optim import optim_problems
from portatrain.parallel.activation_checkpoint import AC_MODES
from portatrain.parallel.parallel_dims import expected_world_size, parallel_problems
from portatrain.parallel.pipeline import pipeline_problems
from portatrain.profiling import profile_problems
from portatrain.report import report_problems


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` listing every problem of ``cfg``; return None when it can run."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def config_problems(cfg: Config) -> list[str]:
    """Every problem of ``cfg``, each with its fix (empty when it can run)."""
    return _stage_problems(cfg) + _cross_stage_problems(cfg)


def _stage_problems(cfg: Config) -> list[str]:
    """Each stage's problems with its own section (and the few sections it reads beside it)."""
    problems = device_problems(cfg.device.type)
    if cfg.device.memory_gib is not None and not cfg.device.memory_gib > 0:
        problems.append(
            f"device.memory_gib={cfg.device.memory_gib} must be positive (GiB per device), or null"
        )
    problems += data_problems(cfg.data)
    problems += model_problems(cfg.model)
    problems += optim_problems(cfg.optim)
    problems += trainer_problems(cfg.trainer)
    problems += finetune_problems(cfg.finetune, cfg.model, cfg.data, cfg.compile)
    problems += checkpoint_problems(cfg.checkpoint)
    problems += fault_tolerance_problems(cfg.fault_tolerance, cfg.parallel, cfg.device.type)
    if cfg.finetune.method == "dpo":
        problems += _dpo_step_problems(cfg)
    problems += compile_problems(cfg.compile)
    problems += kernel_problems(list(cfg.kernels.enabled), cfg.device.type)
    if cfg.kernels.enabled and cfg.parallel.tp > 1:
        # The overrides are custom ops on plain tensors; tensor parallel feeds the blocks DTensors.
        problems.append(
            f"kernels.enabled={list(cfg.kernels.enabled)} with parallel.tp={cfg.parallel.tp}: kernel "
            "overrides take plain tensors, not tensor-parallel DTensors; set parallel.tp=1 or kernels.enabled=[]"
        )
    problems += converter_problems(cfg)  # quantize.linear, with the layout and data it meets
    problems += metrics_problems(cfg.metrics)
    problems += profile_problems(cfg.profile)
    problems += bench_problems(cfg.bench)
    problems += runtime_audit_problems(cfg.audit, cfg.compile)
    problems += report_problems(cfg.report)
    problems += export_problems(cfg.export)
    problems += eval_problems(cfg.eval, cfg.trainer, cfg.compile)
    problems += generate_problems(cfg.generate)
    if cfg.parallel.activation_checkpointing not in AC_MODES:
        problems.append(
            f"parallel.activation_checkpointing={cfg.parallel.activation_checkpointing!r} is not one of "
            f"{', '.join(AC_MODES)}"
        )
    return problems


def _cross_stage_problems(cfg: Config) -> list[str]:
    """Problems between stages: the rows against the model, the layout against the job and the
    model. They need a valid model; an invalid one is :func:`_stage_problems`' to report."""
    problems = []
    args = None
    if not model_problems(cfg.model):
        args = model_args(cfg.model)
    lengths, row_key = _row_lengths(cfg.data)
    if args is not None and lengths and max(lengths) > args.max_seq_len:
        problems.append(
            f"the longest row ({max(lengths)} positions, from {row_key}) exceeds the model's RoPE table "
            f"({args.max_seq_len}); set model.max_seq_len>={max(lengths)} or shorten the data"
        )
    # The adapter says whether its compiler wants static shapes (device=auto: assume it does).
    adapter = ACCELERATORS.get(cfg.device.type)
    static_shapes = adapter.static_shapes if adapter is not None else True
    static_dispatch = cfg.model.moe_dispatch == "capacity" or (
        cfg.model.moe_dispatch == "auto" and static_shapes
    )
    if cfg.parallel.ep > 1 and static_dispatch and len(set(lengths)) > 1:
        # Capacity dispatch sizes each rank's slot buffer from its tokens; expert parallel exchanges
        # those buffers in equal splits, so every rank must run the same row length in a step.
        problems.append(
            f"parallel.ep={cfg.parallel.ep} with {row_key}={lengths}: ranks may run different row lengths in "
            f"one step, and capacity dispatch (model.moe_dispatch={cfg.model.moe_dispatch}) exchanges "
            "equal-size expert buffers between them; use one row length (data.collator=packing or "
            "pad_to_max) or model.moe_dispatch=dropless"
        )
    from portatrain.train.spike import rewind_problems  # the spike guard goes back to a checkpoint

    problems += rewind_problems(cfg.trainer.spike_guard, cfg.checkpoint)
    shape = shape_problems(cfg.launch)
    problems += shape
    if not shape:  # the layout is checked against the job's nodes * procs_per_node processes
        problems += parallel_problems(
            cfg.parallel,
            world_size=expected_world_size(cfg.parallel, cfg.launch, dry_run=bool(cfg.dry_run)),
            model_args=args,
            row_lengths=lengths,
            row_key=row_key,
            model_name=f"{cfg.model.name} flavour {cfg.model.flavor!r}",
        )
    if args is not None:  # the layouts the family's parallel plan cannot apply
        problems += get_spec(cfg.model.name).parallel_problems(cfg.parallel, args)
    lora = cfg.finetune.method == "lora" or (cfg.finetune.method == "dpo" and cfg.finetune.dpo.lora)
    problems += qk_clip_problems(
        cfg.optim.qk_clip, cfg.parallel, args, lora=lora, replica_groups=cfg.fault_tolerance.enabled
    )
    problems += pipeline_problems(
        cfg.parallel,
        n_layers=None if args is None else args.n_layers,
        tie_embeddings=args is not None and args.tie_embeddings,
        mtp_layers=0 if args is None else args.mtp_layers,
        aux_loss=args is not None
        and getattr(args, "aux_loss_coef", 0) > 0
        and any(args.is_sparse(i) for i in range(args.n_layers)),
        batch_size=cfg.data.batch_size,
        collator=cfg.data.collator,
        compile_enabled=cfg.compile.enabled,
        compile_granularity=cfg.compile.granularity,
        evaluates=cfg.trainer.eval_every > 0,
    )
    return problems


def _dpo_step_problems(cfg: Config) -> list[str]:
    """What DPO's own step (``portatrain.dpo_trainer``) does not do: it runs the whole model on whole
    rows and scores each response from the full logits; FSDP2 (``parallel.dp_shard``) is its tested layout."""
    problems = []
    if cfg.fault_tolerance.enabled:
        # No replica-group all-reduce or commit vote in DPO's train_step.
        problems.append(
            "fault_tolerance.enabled=true with finetune.method=dpo: DPO's step does not average gradients "
            "across replica groups; set fault_tolerance.enabled=false (or use parallel.dp_shard for data parallel)"
        )
    if cfg.trainer.loss == "chunked":
        problems.append(
            f"trainer.loss={cfg.trainer.loss} with finetune.method=dpo: DPO scores each response's "
            "log-probability from the full logits, which the chunked loss never makes; set trainer.loss=plain"
        )
    for axis, what in (("pp", "pipeline stages"), ("cp", "context-parallel shards of each row")):
        degree = getattr(cfg.parallel, axis)
        if degree > 1:
            problems.append(
                f"parallel.{axis}={degree} with finetune.method=dpo: DPO's step runs the whole model on "
                f"whole rows, not {what}; set parallel.{axis}=1 (parallel.dp_shard spreads DPO over "
                "more devices)"
            )
    return problems


def device_problems(device_type: str) -> list[str]:
    """``device.type`` must name an adapter of ``portatrain.accelerators`` (or ``auto``)."""
    choices = ("auto", *ACCELERATORS)
    if device_type in choices:
        return []
    return [f"device.type={device_type!r} is not one of {', '.join(choices)}"]


def trainer_problems(trainer: TrainerConfig) -> list[str]:
    problems = dtype_problem("trainer.dtype", trainer.dtype, allow=("auto",))
    for key in ("steps", "grad_accum", "log_every"):
        if getattr(trainer, key) <= 0:
            problems.append(f"trainer.{key}={getattr(trainer, key)} must be positive")
    problems += _trainer_run_problems(trainer)
    problems += loss_problems(trainer.loss, trainer.loss_chunk_size)
    return problems


def _trainer_run_problems(trainer: TrainerConfig) -> list[str]:
    """What trainer_problems adds for reliability: meaningless eval settings, the non-finite policy."""
    from portatrain.train.spike import spike_guard_problems
    from portatrain.trainer import NONFINITE_MODES  # the stage that acts on it owns the choices

    problems = []
    if trainer.eval_every < 0:
        problems.append(f"trainer.eval_every={trainer.eval_every} must be >= 0 (0 disables evaluation)")
    if trainer.eval_every and trainer.eval_batches <= 0:
        problems.append(
            f"trainer.eval_batches={trainer.eval_batches} must be positive when trainer.eval_every="
            f"{trainer.eval_every} (set trainer.eval_every=0 to disable evaluation)"
        )
    if trainer.on_nonfinite not in NONFINITE_MODES:
        problems.append(
            f"trainer.on_nonfinite={trainer.on_nonfinite!r} is not one of {', '.join(NONFINITE_MODES)}"
        )
    problems += spike_guard_problems(trainer.spike_guard)
    return problems


def checkpoint_problems(checkpoint: CheckpointConfig) -> list[str]:
    problems = []
    if checkpoint.every < 0:
        problems.append(f"checkpoint.every={checkpoint.every} must be >= 0 (0 saves only at the end)")
    if checkpoint.keep < 0:
        problems.append(f"checkpoint.keep={checkpoint.keep} must be >= 0 (0 keeps every checkpoint)")
    if checkpoint.async_mode not in ASYNC_MODES:
        problems.append(
            f"checkpoint.async_mode={checkpoint.async_mode!r} is not one of {', '.join(ASYNC_MODES)}"
        )
    return problems


def _row_lengths(data: DataConfig) -> tuple[list[int], str]:
    """Every row length the loader emits, and the key they come from."""
    if data.collator == "bucket":
        return [int(b) for b in data.buckets if b > 0], "data.buckets"
    return ([int(data.seq_len)] if data.seq_len > 0 else []), "data.seq_len"


__all__ = ["config_problems", "validate"]
