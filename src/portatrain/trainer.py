"""The training loop, split into small hooks that research code overrides.

Hooks (override in a subclass; each has one job):

``build_model()``
    Return the model. Called under ``torch.device("meta")``: construct, don't initialize.
    The trainer then parallelizes it, materializes it on the device and calls ``init_weights()``.
``compute_loss(logits, batch)``
    Return the **sum** of per-token losses of one micro-batch over its ``labels != -100``
    positions. The trainer divides by the number of target tokens in the whole optimizer step,
    so gradient accumulation and padding never change the loss scale.
    With ``trainer.loss=chunked`` (``portatrain.losses``) the loss is taken inside the model's
    forward, chunk by chunk, and no full logits exist: this hook is then not called -- unless a
    subclass overrides it, in which case the plain path runs so the override sees its logits.
``forward_loss(batch)``
    Forward one micro-batch and return its loss sum (the plain or the chunked path above).
``forward_backward(batch, num_tokens)``
    Forward one micro-batch, ``backward()`` its share of the step loss, return the loss sum (detached).
``train_step(batches)``
    One optimizer step over ``grad_accum`` micro-batches; returns metrics of the step (device
    tensors under ``dp_sums``, each rank's share of a global mean, are summed over ranks and logged).
``evaluate()``
    Mean loss over ``trainer.eval_batches`` held-out batches.
``evaluate_tasks()``
    The lm-evaluation-harness tasks of ``trainer.eval_tasks`` (``portatrain.evaluation``), every
    ``trainer.eval_tasks_every`` steps: ``{"eval/<task>/<metric>": value}``.
``warmup()``
    With ``compile.warmup``: compile every batch shape before step 1, then arm the recompile guard.
``on_step_end(step, metrics)`` / ``on_eval_end(step, metrics)``
    Callbacks after each optimizer step / evaluation (default: nothing).

Hooks that take a ``batch`` get it on the device. For packed rows (``data.packing_attention=document``)
the loader sends ``document_ids`` and the Trainer adds ``attn_mask``, built on the device
(``portatrain.data.collate.with_attention_mask``), so ``self.model(batch["input_ids"],
positions=batch.get("positions"), attn_mask=batch.get("attn_mask"))`` works in every hook. With
``parallel.cp > 1`` the batch is already this rank's shard of the rows (``portatrain.parallel.context``)
and ``attn_mask`` the callable that attends it over the whole row.

Everything else (data, optimizer, schedule, metrics, checkpoints) is built from the config by
the stages it names, one ``_setup_*`` step each; a subclass changes behaviour by overriding a hook,
not by copying ``fit``. What watches the loop is an object of its own: the non-finite guard
(``portatrain.nonfinite``: ``trainer.on_nonfinite``, the finiteness check before a save), the logging
window (``portatrain.logwindow``: tokens, FLOPs and time between logging steps), the compile monitor
(``portatrain.compile``), the stop-request watcher (``portatrain.checkpoint``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from tqdm import tqdm

from portatrain.accelerators import Accelerator, resolve_accelerator
from portatrain.audit.runtime import RuntimeAudit
from portatrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    DamagedCheckpointError,
    PreemptionWatcher,
    load_dataloader_state,
    load_hf_weights,
    model_args_dict,
    newest_usable,
    read_trainer_state,
    resolve_resume,
    sigterm_interrupts,
)
from portatrain.checkpoint.common import broadcast_from_main
from portatrain.compile import (
    CompileCache,
    CompileMonitor,
    block_compiler,
    compile_granularity,
    compile_model,
    warmup_batches,
)
from portatrain.config import Config
from portatrain.converters import build_converters
from portatrain.data.collate import with_attention_mask
from portatrain.data.loader import batch_shapes, build_collator, build_dataloader
from portatrain.data.pipeline import build_data
from portatrain.distributed import destroy_distributed, dist_info_from_env, init_distributed
from portatrain.dtypes import dtype_from_name
from portatrain.evaluation.tasks import task_names
from portatrain.fault_tolerance import (
    ReplicaGroups,
    data_slice,
    load_module_state,
    load_optimizer_state,
    module_state,
    optimizer_state,
    replica_run_dir,
)
from portatrain.finetune import uses_lora
from portatrain.finetune.lora import apply_lora, init_lora, lora_state
from portatrain.kernels import apply as apply_kernels
from portatrain.kernels import resolve as resolve_kernels
from portatrain.logwindow import LoggingWindow
from portatrain.losses import chunked_loss_fn, cross_entropy_sum
from portatrain.metrics import (
    MetricsLogger,
    checkpoint_metrics,
    memory_metrics,
    model_flops,
    peak_covering,
    progress_postfix,
    resolve_peak_flops,
    throughput_metrics,
)
from portatrain.models import build_model, get_spec, moe_dispatch
from portatrain.models.common.moe import balanced_routers, configure_moe, routing_stats, update_expert_bias
from portatrain.nonfinite import NONFINITE_MODES, NonFiniteError, NonFiniteGuard
from portatrain.optim import build_lr_scheduler, build_optimizer
from portatrain.parallel import (
    ParallelDims,
    build_pipeline,
    clip_grad_norm_,
    dp_all_reduce,
    full_tensor_init,
    parallelize_model,
    token_all_reduce,
)
from portatrain.parallel.context import ContextParallel
from portatrain.profiling import StepProfiler
from portatrain.redact import redacted_yaml
from portatrain.rundir import (
    RunDirLock,
    RunDirLockedError,
    RunDirNotWritableError,
    check_shared_run_dir,
    lock_run_dir,
)

logger = logging.getLogger(__name__)

__all__ = ["NONFINITE_MODES", "NonFiniteError", "Trainer"]  # the guard's names, where they always were


class _StopDuringWarmup(Exception):
    """A stop request (SIGTERM/SIGINT) arrived between compile warm-up shapes."""


class Trainer:
    def __init__(self, cfg: Config, accelerator: Accelerator | None = None) -> None:
        self._run_dir_lock: RunDirLock | None = None
        self._data_iter: Any = None  # fit()'s batch iterator, closed by close() (its prefetch thread)
        self.replica_groups: ReplicaGroups | None = None  # fault_tolerance.enabled: set up last
        try:
            # SIGTERM while building (data, compile, a checkpoint load) stops as Ctrl-C does; from
            # fit() on, PreemptionWatcher saves and stops at a step boundary.
            with sigterm_interrupts():
                self._setup(cfg, accelerator)
        except BaseException:
            self._release_run_dir()  # a run that failed to start leaves the directory free
            raise

    def _setup(self, cfg: Config, accelerator: Accelerator | None) -> None:
        """Build every stage the config names, in order; each step below is one stage."""
        self.cfg = cfg
        self.spec = get_spec(cfg.model.name)  # the model family: parallel plan, HF mapping
        self._setup_distributed(accelerator)
        self._setup_run_dir()
        self.accelerator.manual_seed(cfg.trainer.seed)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True)
        self._setup_data()
        self._setup_model()
        self._setup_optimization()
        self._setup_run_services()
        self._restore()
        self._setup_replica_groups()

    def _setup_distributed(self, accelerator: Accelerator | None) -> None:
        """The device, the process group and the parallel layout (checked against the world size
        before anything is built: ``ConfigError``)."""
        cfg = self.cfg
        self.dist = dist_info_from_env()
        index = cfg.device.index if cfg.device.index is not None else self.dist.local_rank
        self.accelerator = accelerator or resolve_accelerator(cfg.device.type, index)
        self.accelerator.set_device()
        self.parallel_dims = ParallelDims.from_config(cfg.parallel, world_size=self.dist.world_size)
        init_distributed(self.accelerator, self.dist)
        self.device = self.accelerator.device
        self.dtype = (
            self.accelerator.default_dtype
            if cfg.trainer.dtype == "auto"
            else dtype_from_name(cfg.trainer.dtype)
        )
        self.parallel_dims.build_mesh(self.accelerator.device_type)
        # The ranks that read different rows: this job's, or with fault tolerance every replica group's.
        self.dp_rank, self.dp_world_size = data_slice(
            cfg.fault_tolerance, self.parallel_dims.dp_rank, self.parallel_dims.dp
        )
        # parallel.cp > 1: full-length rows from the loader, cut into this rank's shard on the device.
        dims = self.parallel_dims
        self.context_parallel = ContextParallel.from_mesh(dims.cp_mesh) if dims.cp_enabled else None

    def _setup_run_dir(self) -> None:
        """Before anything is built or written: take the run directory (exclusive, and writable), find
        the checkpoint to resume, refuse another run's directory."""
        cfg = self.cfg
        self.run_dir = replica_run_dir(cfg.fault_tolerance, Path(cfg.run_dir))  # one per replica group
        self._run_dir_lock = self._lock_run_dir()
        # Every rank sees rank 0's run directory, or all stop here (a first save would hang).
        check_shared_run_dir(self.run_dir)
        self.resume_from = resolve_resume(
            cfg.checkpoint.resume, self.run_dir / "checkpoints", recipe=cfg.recipe
        )
        if self.resume_from is not None:
            saved_step = int(read_trainer_state(self.resume_from)["step"])
            if saved_step > cfg.trainer.steps:
                raise CheckpointError(
                    f"checkpoint {self.resume_from} is at step {saved_step}, past trainer.steps="
                    f"{cfg.trainer.steps}: there is nothing left to train. Set trainer.steps>{saved_step} "
                    "to train on (the LR schedule is recomputed for the new length), or resume from an "
                    "earlier step_* directory"
                )

    def _setup_data(self) -> None:
        """The data stage: a prepared corpus streams (train_documents stay empty), else in memory."""
        cfg = self.cfg
        self.data = build_data(
            cfg.data, seed=cfg.trainer.seed, dp_rank=self.dp_rank, dp_world_size=self.dp_world_size
        )
        self.tokenizer = self.data.tokenizer
        self.train_documents, self.eval_documents = self.data.train_documents, self.data.eval_documents
        self.train_loader = self.build_dataloader(self.train_documents, train=True)

    def _setup_model(self) -> None:
        """Build the model on meta, swap in kernels, parallelize, materialize on the device."""
        cfg = self.cfg
        # Before anything compiles: compiled graphs persist under the run dir (compile.cache).
        self.compile_cache = CompileCache.for_run(
            cfg.compile, self.run_dir, self.accelerator, is_main=self.dist.is_main
        )
        if self.compile_cache is not None:
            self.compile_cache.activate()
        with torch.device("meta"):
            model = self.build_model()
        # Mixture-of-experts layers (none in a dense model): the dispatch the device wants
        # (model.moe_dispatch=auto: fixed-capacity slots where the compiler wants static shapes) and
        # the load-balancing loss over the global batch (statistics summed over the data-parallel
        # ranks), a mean over the step's micro-batches.
        configure_moe(
            model,
            dispatch=moe_dispatch(cfg.model, static_shapes=self.accelerator.static_shapes),
            capacity_factor=cfg.model.capacity_factor,
            aux_loss_scale=1.0 / cfg.trainer.grad_accum,
            reduce_stats=partial(token_all_reduce, parallel_dims=self.parallel_dims)
            if self.parallel_dims.dp > 1 or self.context_parallel is not None
            else None,
            supports_grouped_mm=self.accelerator.supports_grouped_mm,
        )
        # Routers balanced by a bias moved after each optimizer step (DeepSeek-V3), if any.
        self._balanced_routers = balanced_routers(model)
        # Kernel overrides (kernels.enabled), resolved once and swapped into the model's op slots
        # before parallelize, so compiled blocks trace each kernel as one custom op.
        self.kernels = resolve_kernels(cfg.kernels.enabled, self.accelerator.device_type)
        apply_kernels(model, self.kernels)
        # Model converters (portatrain.converters: quantize.linear), on meta, before parallelize.
        self.converters = build_converters(cfg, self.accelerator, self.parallel_dims)
        self.converters.convert(model)
        # finetune.method=lora (or dpo with lora): the layers LoRA adapts, set while parallelizing.
        self.lora_modules: list[str] = []
        # Pipeline parallel (parallel.pp > 1): this rank's stages, each parallelized and materialized as
        # a whole model is; self.model then holds their parameters under the unsplit model's names.
        self.pipeline = None
        if self.parallel_dims.pp_enabled:
            self.pipeline = build_pipeline(
                model,
                self.parallel_dims,
                cfg.parallel,
                device=self.device,
                prepare=lambda part: self._materialize(self.parallelize(part)),
                autocast=self._autocast,
            )
            self.model = self.pipeline.model
        else:
            self.model = self._materialize(self.parallelize(model))
        # MFU = the architecture's FLOPs per real token over the device's peak (CPU: measured, cached).
        self.flops_per_token = getattr(model, "flops_per_token", None)

    def _setup_optimization(self) -> None:
        """Optimizer, gradient clipping, the loss path and the LR schedule."""
        cfg = self.cfg
        self.optimizer = build_optimizer(self.model, cfg.optim, fused=self.accelerator.fused_adamw)
        # Read here, not per step: a DictConfig attribute read costs ~10 us.
        self._max_grad_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        # trainer.loss=chunked: positions per chunk, or None for the plain loss. An overridden
        # compute_loss keeps the plain path: its contract hands it the full logits.
        self._loss_chunk_size = (
            int(cfg.trainer.loss_chunk_size)
            if cfg.trainer.loss == "chunked" and type(self).compute_loss is Trainer.compute_loss
            else None
        )
        if self.pipeline is not None:
            self.pipeline.configure_loss(self.compute_loss, self._loss_chunk_size, chunked_loss_fn)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.trainer.steps)

    def _setup_run_services(self) -> None:
        """What watches the loop: checkpoints, the non-finite guard, stop requests, metrics, the
        logging window, compilation and the runtime audit."""
        cfg = self.cfg
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints",
            keep=cfg.checkpoint.keep,
            every=cfg.checkpoint.every,
            is_main=self.dist.is_main,
            async_mode=cfg.checkpoint.async_mode,
            pinned_staging=self.accelerator.synchronize if self.accelerator.pinned_staging else None,
        )
        # Non-finite steps: counted on the device every step, read at the logging sync and before
        # every save (no extra host sync); see portatrain.nonfinite.
        self.nonfinite = NonFiniteGuard(
            cfg.trainer.on_nonfinite,
            device=self.device,
            all_reduce_sum=self._all_reduce_sum,
            dp_world_size=self.parallel_dims.dp,  # the ranks its counts are summed over
            checkpointer=self.checkpointer,
            is_main=self.dist.is_main,
            lr=cfg.optim.lr,
        )
        self.preemption = PreemptionWatcher()
        self.preempted = False
        self.metrics = MetricsLogger(
            self.run_dir,
            enabled=self.dist.is_main,
            jsonl=cfg.metrics.jsonl,
            tensorboard=cfg.metrics.tensorboard,
            wandb=cfg.metrics.wandb,
            mlflow=cfg.metrics.mlflow,
            config=cfg,  # redacted before any tracker sees it
            resumed=self.resume_from is not None,  # continue the trackers' runs too
        )
        self.peak_flops, self.peak_flops_source = resolve_peak_flops(
            self.accelerator, self.dtype, cfg.metrics.peak_tflops
        )
        self.window = LoggingWindow()  # tokens, FLOPs and time since the last logged step
        self.step = 0
        self.tokens_seen = 0
        # graph counts, recompile guard; saves the compile cache after steps that compiled
        self.compile_monitor = CompileMonitor(cfg.compile, cache=self.compile_cache)
        # audit.runtime / audit.nonfinite (portatrain.audit.runtime); off by default, free when off.
        self.runtime_audit = RuntimeAudit(cfg.audit, self.accelerator, self.model)
        # lm-eval tasks between steps (trainer.eval_tasks); lm-eval is imported only when they run.
        self.eval_task_names = task_names(cfg.trainer.eval_tasks)
        self._eval_tasks_every = cfg.trainer.eval_tasks_every or cfg.trainer.eval_every

    def _restore(self) -> None:
        """Load the checkpoint to resume, or the Hugging Face weights of ``model.init_from``; then
        write the run's config (after the load: a resume that fails leaves the directory as it was)."""
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
        elif self.cfg.model.init_from:
            load_hf_weights(self.model, self.cfg.model.init_from, self.spec)
        # Secrets (tokens, keys, passwords) are redacted in every config written to disk.
        if self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(redacted_yaml(self.cfg))

    def _setup_replica_groups(self) -> None:
        """``fault_tolerance.enabled``: join the replica groups (``portatrain.fault_tolerance``), at the
        step restored above; else ``self.replica_groups`` is None."""
        if not self.cfg.fault_tolerance.enabled:
            return
        self.replica_groups = ReplicaGroups(
            self.cfg.fault_tolerance,
            device_type=self.accelerator.device_type,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            state_dict=self._replica_state,
            load_state_dict=self._load_replica_state,
            broadcast=broadcast_from_main,
            step=self.step,
        )

    def _replica_state(self) -> dict[str, Any]:
        """What a healthy replica group sends a recovering one: this rank's shard of everything a
        resume restores (model, optimizer, LR schedule, counters, data position, RNG)."""
        return {
            "model": module_state(self.model),
            "optimizer": optimizer_state(self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.train_loader.state_dict(),
            "rng": self.accelerator.get_rng_state(),
        }

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        """Apply a healthy group's :meth:`_replica_state` (live recovery); ``fit`` then restarts its
        data iterator at the loaded position."""
        load_module_state(self.model, state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        load_dataloader_state(
            self.train_loader, state["data"], Path(f"<a healthy replica group, step {self.step}>")
        )
        self.accelerator.set_rng_state(state["rng"])

    @property
    def nonfinite_skipped(self) -> int:
        """Steps skipped for a non-finite loss or gradient norm so far (``on_nonfinite=skip_step``)."""
        return self.nonfinite.skipped

    # -- hooks -----------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """Construct the model (on the meta device; no initialization here). The embedding has the
        tokenizer's vocabulary unless ``model.vocab_size`` sets a larger one."""
        return build_model(self.cfg.model, vocab_size=self.tokenizer.vocab_size)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply TP -> activation checkpointing -> compile -> FSDP2 to the meta model, per the model
        family's plan (``spec.parallelize``) and ``cfg.parallel`` (one process: checkpointing/compile
        only). With ``compile.granularity=model`` or ``nested`` the whole model is compiled last
        (``portatrain.compile``)."""
        dims = self.parallel_dims
        granularity = compile_granularity(self.cfg.compile, sharded=dims.fsdp_enabled or dims.tp_enabled)
        model = parallelize_model(
            model,
            self.spec.parallelize,
            dims,
            self.cfg.parallel,
            compile_block=block_compiler(self.cfg.compile, self.accelerator, granularity),
            compute_dtype=self.dtype,
            adapt=self._add_lora if uses_lora(self.cfg.finetune) else None,
        )
        if self.cfg.compile.enabled and granularity != "block":
            compile_model(model, self.cfg.compile, self.accelerator, granularity)
        return model

    def _add_lora(self, model: nn.Module) -> None:
        """Freeze the model and add LoRA adapters (``portatrain.finetune.lora``), after tensor parallel."""
        self.lora_modules = apply_lora(model, self.cfg.finetune.lora)

    def compute_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of next-token cross-entropy over positions whose label is not -100."""
        return cross_entropy_sum(logits, batch["labels"])

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss sum of one micro-batch: ``compute_loss(model(...), batch)``, or with
        ``trainer.loss=chunked`` the model's forward ending in the chunked loss (no full logits). With
        pipeline parallel: a forward-only pass through the stages (evaluation)."""
        if self.pipeline is not None:
            return self.pipeline.forward_loss(batch)
        inputs = {"positions": batch.get("positions"), "attn_mask": batch.get("attn_mask")}
        if self._loss_chunk_size is not None:
            with self._autocast():
                return self.model(
                    batch["input_ids"],
                    **inputs,
                    output_fn=chunked_loss_fn(batch["labels"], self._loss_chunk_size),
                )
        with self._autocast():
            logits = self.model(batch["input_ids"], **inputs)
        return self.compute_loss(logits, batch)

    def forward_backward(self, batch: dict[str, torch.Tensor], num_tokens: torch.Tensor) -> torch.Tensor:
        if self.pipeline is not None:  # one schedule step: parallel.pp_microbatches forwards and backwards
            return self.pipeline.forward_backward(batch, num_tokens)
        loss_sum = self.forward_loss(batch)
        (loss_sum / num_tokens).backward()
        return loss_sum.detach()

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        # Targets are counted on the host-side labels before they move: no device sync.
        local_tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        num_tokens = self._all_reduce_sum(torch.tensor(float(local_tokens), device=self.device))
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches:
            loss_sum += self.forward_backward(self._to_device(batch), num_tokens)
        if self.replica_groups is not None:  # fault tolerance: averaged over the replica groups too
            self.replica_groups.average_gradients(self.model.parameters())
        grad_norm = self._clip_gradients()
        if self.replica_groups is not None and not self.replica_groups.should_commit():
            # A replica group failed during the step, or too few took part: nothing is applied, and
            # fit() redoes the step with the next batches.
            self.optimizer.zero_grad(set_to_none=True)
            return {"committed": False}
        # The gradient norm is global (all ranks agree on it); the loss is this rank's.
        grad_ok = torch.isfinite(grad_norm)  # the same on every rank: skipping stays in lockstep
        self.nonfinite.optimizer_step(self.optimizer, grad_ok)
        self.converters.post_optimizer_step(self.model)  # e.g. FP8 weight scales for the next all-gather
        update_expert_bias(self._balanced_routers, grad_ok)
        self.nonfinite.count(self.step + 1, grad_ok, torch.isfinite(loss_sum))  # before self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        # Tensors stay on the device; fit() reads them only on logging steps (no per-step host sync).
        return {"loss": loss_sum / num_tokens, "grad_norm": grad_norm, "tokens": local_tokens}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        count = 0
        loader = self.build_dataloader(self.eval_documents, train=False)
        for i, batch in enumerate(loader):
            if i >= self.cfg.trainer.eval_batches:
                break
            batch = self._to_device(batch)
            loss_sum += self.forward_loss(batch)
            count += int((batch["labels"] != -100).sum())
        self.model.train()
        loss_sum = token_all_reduce(loss_sum, self.parallel_dims)
        count = token_all_reduce(torch.tensor(float(count), device=self.device), self.parallel_dims)
        return {"eval_loss": (loss_sum / count.clamp(min=1)).item()}

    def evaluate_tasks(self) -> dict[str, float]:
        """Run ``trainer.eval_tasks`` with lm-eval on the model as it is (every rank takes part, each
        over every request; the metrics come back on local rank 0, ``{}`` elsewhere); the random
        states are left as they were."""
        from portatrain.evaluation import flat_metrics, run_tasks
        from portatrain.evaluation.model import eval_mode, harness_lm

        lm = harness_lm(
            self.model,
            self.tokenizer,
            self.cfg.eval,
            device=self.device,
            dtype=self.dtype,
            tp=self.parallel_dims.tp,
            progress=False,
        )
        rng = self.accelerator.get_rng_state()
        with eval_mode(self.model):
            results = run_tasks(lm, self.eval_task_names, self.cfg.eval, bootstrap_iters=0, quiet=True)
        self.accelerator.set_rng_state(rng)
        metrics = flat_metrics(results)
        if self.dist.is_main:
            logger.info("step %d: %s", self.step, "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        return metrics

    def warmup(self) -> list[dict[str, Any]]:
        """Compile every shape of ``batch_shapes(cfg.data)`` before step 1 and arm the recompile guard.

        Runs :meth:`forward_backward` (and, when evaluation is on, an eval-mode ``no_grad`` forward)
        on a synthetic batch of each shape whose every label is valid. The optimizer does not step,
        gradients are cleared and the RNG state restored: training then sees the same weights, data
        and randomness as without warm-up. Returns per-shape cold-start times (logged and written
        to the metrics). See ``portatrain.compile``.
        """
        rng, start = self.accelerator.get_rng_state(), time.perf_counter()
        batches = warmup_batches(
            build_collator(self.cfg.data, pad_id=self.tokenizer.pad_id),  # the loader's collator
            batch_shapes(self.cfg.data),
            packed=self.cfg.data.collator == "packing",
            vocab_size=self.tokenizer.vocab_size,
        )

        def train(batch: dict[str, torch.Tensor]) -> None:
            # Compiling one shape can take tens of seconds: look for a stop request (SIGTERM, Ctrl-C)
            # before each, so a preempted job saves within the scheduler's grace period.
            if self.preemption.should_stop():
                raise _StopDuringWarmup
            self.forward_backward(batch, (batch["labels"] != -100).sum().float())

        @torch.no_grad()
        def evaluate(batch: dict[str, torch.Tensor]) -> None:
            self.model.eval()
            if self.pipeline is not None:  # the schedule's forward-only pass
                self.forward_loss(batch)
            else:
                with self._autocast():
                    self.model(
                        batch["input_ids"], positions=batch.get("positions"), attn_mask=batch.get("attn_mask")
                    )
            self.model.train()

        try:
            records = self.compile_monitor.warm_up(
                [self._to_device(b) for b in batches],
                train=train,
                evaluate=evaluate if self.cfg.trainer.eval_every and self.data.has_eval else None,
                synchronize=self.accelerator.synchronize,
            )
        except _StopDuringWarmup:
            self.preempted = True  # agreed by every rank (should_stop); fit() trains no step
            self.optimizer.zero_grad(set_to_none=True)
            self.accelerator.set_rng_state(rng)
            logger.warning(
                "stop requested during compile warm-up (after %.1f s)", time.perf_counter() - start
            )
            return []
        self.optimizer.zero_grad(set_to_none=True)
        # Forget the synthetic batches' expert assignments (as a skipped step would: bias unchanged).
        update_expert_bias(self._balanced_routers, torch.zeros((), dtype=torch.bool, device=self.device))
        self.accelerator.set_rng_state(rng)
        total = round(time.perf_counter() - start, 3)
        logger.info("compile warm-up: %d shape(s) in %.1f s", len(records), total)
        self.metrics.log(
            {
                "step": self.step,
                "compile_warmup": records,
                "compile_warmup_s": total,
                **self.compile_monitor.metrics(),
            }
        )
        return records

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Called after every optimizer step with that step's metrics (device tensors where cheap;
        ``tokens`` and ``flops`` are this rank's real tokens and model FLOPs, host integers)."""

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        """Called after every evaluation."""

    # -- data ------------------------------------------------------------------------------
    def build_dataloader(self, documents: list[list[int]], *, train: bool):
        """This rank's loader: over ``documents`` in memory, or the prepared corpus's stream."""
        if self.data.streaming:
            return self.data.train_loader() if train else self.data.eval_loader()
        data_cfg = self.cfg.data
        if not train:
            data_cfg = OmegaConf.merge(data_cfg, {"sampler": "sequential", "last_batch": "pad"})
        return build_dataloader(
            data_cfg,
            documents,
            pad_id=self.tokenizer.pad_id,
            seed=self.cfg.trainer.seed,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            infinite=train,
        )

    # -- loop ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for ``trainer.steps`` optimizer steps; return the last logged metrics."""
        cfg = self.cfg.trainer
        if OmegaConf.is_config(cfg) and OmegaConf.get_type(cfg) is not dict:
            # A plain dataclass copy: the loop reads it every step; a DictConfig read costs ~10 us.
            cfg = OmegaConf.to_object(cfg)
        data_iter = self._data_iter = iter(self.train_loader)
        bar = self._progress_bar(cfg)
        profiler = StepProfiler(
            self.cfg.profile,
            self.run_dir / "profile",
            first_step=self.step,
            activities=self.accelerator.profiler_activities(),
            worker_name=f"rank{self.dist.rank}",
        )
        checkpointing = self.cfg.checkpoint.enabled  # read once, not per step
        last: dict[str, Any] = {}
        # SIGTERM / Ctrl-C: save at the next step boundary (when checkpointing), then stop.
        self.preemption.install()
        self._fit_started = time.perf_counter()  # checkpoint_blocked_frac's wall time
        self.window.reset()
        if self.cfg.compile.enabled and self.cfg.compile.warmup and self.step < cfg.steps:
            self.warmup()
            self.window.restart_clock()  # compilation is reported apart from throughput
            if self.preempted:  # stopped between warm-up shapes: nothing trained, nothing to save
                logger.warning("stopped during compile warm-up at step %d on request", self.step)
        while self.step < cfg.steps and not self.preempted:
            if self.replica_groups is not None and self.replica_groups.start_step():
                # Healed from a healthy replica group: its step, data position and RNG are ours now.
                self._close_data_iter()
                data_iter = self._data_iter = iter(self.train_loader)
                bar.update(self.step - bar.n)
                if self.step >= cfg.steps:
                    break
            self.runtime_audit.step_begin(self.step + 1)
            batches = [next(data_iter) for _ in range(cfg.grad_accum)]
            with self.compile_monitor.watch(batches):
                metrics = self.train_step(batches)
            self.runtime_audit.step_end()  # audit.nonfinite: the ranks agree on a finding
            if metrics.get("committed") is False:  # fault tolerance: the step is redone
                continue
            self.step += 1
            metrics.setdefault("flops", model_flops(batches, self.flops_per_token))  # host-side count
            self.window.add(metrics["tokens"], metrics["flops"])
            self.on_step_end(self.step, metrics)
            profiler.step()
            stop = self.preemption.should_stop()  # agreed by all ranks
            save_now = checkpointing and (stop or self.checkpointer.due(self.step))
            if self.step % cfg.log_every == 0 or self.step == cfg.steps or save_now:
                last = self._log_step(metrics, bar)
            if (
                cfg.eval_every
                and (self.step % cfg.eval_every == 0 or self.step == cfg.steps)
                and self.data.has_eval
            ):
                last.update(self._evaluate_and_log())
                self.window.restart_clock()  # evaluation time is not training throughput
            every = self._eval_tasks_every
            if self.eval_task_names and every and (self.step % every == 0 or self.step == cfg.steps):
                last.update(self._evaluate_and_log(self.evaluate_tasks))
                self.window.restart_clock()
            if save_now:
                self.save_checkpoint()
                self.window.restart_clock()
            bar.update(1)
            if stop:
                self.preempted = True
                logger.warning("stopped at step %d on request; resume with checkpoint.resume=auto", self.step)
                break
        bar.close()
        profiler.close()
        self.preemption.uninstall()
        self.checkpointer.wait()  # a stop request or the final save waits for the save in flight
        final = self.cfg.checkpoint.enabled and self.cfg.checkpoint.final and not self.preempted
        if final and self.checkpointer.last_step != self.step:
            self.save_checkpoint()
            self.checkpointer.wait()
        self._close_data_iter()
        return last

    def _progress_bar(self, cfg: Any) -> tqdm:
        """A terminal gets a live bar; a log file (SLURM output, CI, ``> file``) one plain line per
        logging step (:meth:`_log_step`) instead of a carriage-return frame per step."""
        interactive = sys.stderr.isatty()
        self._log_lines = cfg.progress and self.dist.is_main and not interactive
        return tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not (cfg.progress and self.dist.is_main and interactive),
            desc=self.cfg.recipe,
            unit="step",
            dynamic_ncols=True,
        )

    def _log_step(self, metrics: dict[str, Any], bar: tqdm) -> dict[str, Any]:
        """A logging step, the loop's one host sync: close the window (one all-reduce, which also
        carries the non-finite counts), act on non-finite steps, log and return the metrics."""
        audit = self.runtime_audit.window_end()  # before this block's own (expected) syncs
        self.accelerator.synchronize()
        totals = self.window.close(self._all_reduce_sum, device=self.device, extra=self.nonfinite.counts)
        bad_steps, bad_losses = totals.extra
        self.nonfinite.check(bad_steps, bad_losses, metrics, self.step)
        self.tokens_seen += totals.tokens
        self.peak_flops, self.peak_flops_source = peak_covering(
            self.peak_flops,
            self.peak_flops_source,
            flops=totals.flops,
            elapsed_s=totals.elapsed_s,
            num_devices=self.dist.world_size,
        )
        last = {
            "step": self.step,
            # Each rank's loss is its token sum over the GLOBAL token count: sum, not mean.
            "loss": float(token_all_reduce(metrics["loss"], self.parallel_dims)),
            "grad_norm": float(metrics["grad_norm"]),
            "lr": self.lr_scheduler.get_last_lr()[0],
            "tokens_seen": self.tokens_seen,
            **throughput_metrics(
                tokens=totals.tokens,
                flops=totals.flops,
                elapsed_s=totals.elapsed_s,
                steps=totals.steps,
                num_devices=self.dist.world_size,
                peak_flops=self.peak_flops,
            ),
            **memory_metrics(self.accelerator.memory_stats()),
            **self.compile_monitor.metrics(),
            **routing_stats(self.model),  # this rank's experts' load, auxiliary loss, drops
            **self._dp_sums(metrics.get("dp_sums")),
            **audit,
        }
        if self.cfg.checkpoint.enabled:
            wall_s = time.perf_counter() - self._fit_started
            last.update(checkpoint_metrics(self.checkpointer.blocked_s, wall_s))
        if self.nonfinite_skipped:
            last["nonfinite_skipped"] = self.nonfinite_skipped
        self.metrics.log(last)
        bar.set_postfix(progress_postfix(last))
        if self._log_lines:
            summary = "  ".join(f"{k} {v}" for k, v in progress_postfix(last).items())
            logger.info("step %d/%d  %s", self.step, self.cfg.trainer.steps, summary)
        self.window.reset()
        return last

    def _lora_record(self) -> dict[str, Any]:
        """LoRA: what export needs to write the adapters in PEFT's format or merge them (else nothing)."""
        if not self.lora_modules:
            return {}
        return {"lora": lora_state(self.cfg.finetune.lora, self.lora_modules)}

    def _dp_sums(self, sums: dict[str, torch.Tensor] | None) -> dict[str, float]:
        """A step's extra metrics (``train_step``'s ``dp_sums``: each rank's share of a global mean),
        summed over the data-parallel ranks in one all-reduce."""
        if not sums:
            return {}
        totals = self._all_reduce_sum(torch.stack([v.detach().float() for v in sums.values()]))
        return dict(zip(sums, totals.tolist(), strict=True))

    def _evaluate_and_log(self, evaluate: Any = None) -> dict[str, float]:
        """:meth:`evaluate` (or ``evaluate``: :meth:`evaluate_tasks`; its compilation watched, the
        runtime audit paused), logged, then :meth:`on_eval_end`."""
        with self.compile_monitor.watch(what="evaluation"), self.runtime_audit.paused():
            eval_metrics = (evaluate or self.evaluate)()
        self.metrics.log({"step": self.step, **eval_metrics})
        self.on_eval_end(self.step, eval_metrics)
        return eval_metrics

    def save_checkpoint(self) -> Path:
        """Save everything a resume needs (collective; see ``portatrain.checkpoint`` for the layout).

        Refuses (``NonFiniteError``) to save a non-finite state (weights or optimizer moments): a
        checkpoint is always finite, so rotation never replaces the last finite checkpoint with a
        broken one.
        """
        self.nonfinite.assert_finite_state(self.step, self.model, self.optimizer)
        path = self.checkpointer.save(
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            state={
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "recipe": self.cfg.recipe,
                "model_name": self.cfg.model.name,  # the family whose spec reads model_args back
                "model_args": model_args_dict(self.model),
                "tokenizer": self.tokenizer.name,  # absolute path: export copies its files
                "dp_world_size": self.dp_world_size,
                **self._lora_record(),
            },
            dataloader_state=self.train_loader.state_dict(),
            rng_state=self.accelerator.get_rng_state(),
            config_yaml=redacted_yaml(self.cfg),
        )
        if self.dist.is_main and self.checkpointer.async_mode != "none":
            logger.info("staged checkpoint %s; writing it in the background", path)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, LR schedule, data position, RNG and counters from ``path``.

        Every load checks the tensors it reads against the checksums written with them, and that they
        are finite. With ``checkpoint.resume=auto``, a checkpoint that fails (unreadable, damaged or
        non-finite: :class:`DamagedCheckpointError`) is skipped with a warning naming it and the one
        before it is loaded; an explicit ``checkpoint.resume=PATH`` to it is that error. Optimizer hyper-parameters and the LR
        schedule's peak come from the current config (a change is applied and logged).
        """
        while True:
            try:
                state, loader_state, rng_state = self.checkpointer.load(
                    path,
                    model=self.model,
                    optimizer=self.optimizer,
                    rng_template=self.accelerator.get_rng_state(),
                    read_loader_state=self.cfg.checkpoint.restore_data,
                )
                break
            except DamagedCheckpointError as exc:
                if str(self.cfg.checkpoint.resume) != "auto":
                    raise
                previous = broadcast_from_main(
                    newest_usable(path.parent, self.cfg.recipe, below=int(path.name.split("_")[-1]))
                    if self.dist.is_main
                    else None
                )
                if previous is None:
                    raise
                logger.warning("checkpoint.resume=auto: skipping %s (%s); trying %s", path, exc, previous)
                path = self.resume_from = previous
        base_lrs = list(self.lr_scheduler.base_lrs)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        # The schedule's peak is optim.lr of the current config (the moments come from the checkpoint).
        self.lr_scheduler.base_lrs = base_lrs
        sched = self.lr_scheduler
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.lr_scheduler._last_lr = list(lrs)
        if loader_state is not None and self.cfg.checkpoint.restore_data:
            load_dataloader_state(self.train_loader, loader_state, path)
        if rng_state is not None:
            self.accelerator.set_rng_state(rng_state)
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        if self.dist.is_main:
            logger.info("resumed from %s at step %d", path, self.step)

    def close(self) -> None:
        if self.replica_groups is not None:
            self.replica_groups.close(self.model)  # logs the weights digest, leaves the quorum
            self.replica_groups = None
        self.checkpointer.close()
        self.runtime_audit.close()
        self.compile_monitor.close()
        self.preemption.uninstall()
        self.metrics.close()
        self._release_run_dir()
        self._close_data_iter()
        destroy_distributed()

    # -- internals -------------------------------------------------------------------------
    def _lock_run_dir(self) -> RunDirLock | None:
        """Rank 0 creates the run directory and takes its lock; every rank learns the outcome."""
        lock, error = None, None
        if self.dist.is_main:
            try:
                lock = lock_run_dir(self.run_dir)
            except (RunDirLockedError, RunDirNotWritableError) as exc:
                error = (type(exc).__name__, str(exc))
        error = broadcast_from_main(error)
        if error is not None:
            kind = RunDirLockedError if error[0] == RunDirLockedError.__name__ else RunDirNotWritableError
            raise kind(error[1])
        return lock

    def _close_data_iter(self) -> None:
        """Stop and join the loader's prefetch thread now, not at interpreter exit (where a thread
        inside a torch op aborts the process: ``portatrain.data.stream._prefetched``)."""
        close = getattr(self._data_iter, "close", None)
        self._data_iter = None
        if close is not None:
            close()

    def _release_run_dir(self) -> None:
        if self._run_dir_lock is not None:
            self._run_dir_lock.release()
            self._run_dir_lock = None

    def _materialize(self, model: nn.Module) -> nn.Module:
        """Allocate the meta model on the device and initialize it (same seed on every rank; sharded
        parameters get their slice of the single-device weights, see ``full_tensor_init``)."""
        model.to_empty(device=self.device)
        torch.manual_seed(self.cfg.trainer.seed)
        with torch.no_grad(), full_tensor_init(self.cfg.parallel.init_full_tensors):
            model.init_weights(self.cfg.model.init_std)
            init_lora(model)  # no adapters: nothing to do
        return model.train()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device_type, dtype=self.dtype)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Packed rows come with document ids; their [B, 1, S, S] mask is built here, on the device.
        # With context parallel, this rank's shard of the rows instead, and its attention.
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if self.context_parallel is not None:
            return self.context_parallel.shard_batch(batch)
        return with_attention_mask(batch)

    def _all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (tp ranks of one dp group hold the same value)."""
        return dp_all_reduce(value.to(self.device), self.parallel_dims, "sum")

    def _clip_gradients(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        pp_mesh = self.parallel_dims.pp_mesh if self.parallel_dims.pp_enabled else None
        # one global norm across FSDP/TP meshes and pipeline stages
        return clip_grad_norm_(params, self._max_grad_norm, pp_mesh=pp_mesh)
