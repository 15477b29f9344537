"""The training loop, split into small hooks that research code overrides (the table of hooks and their
contracts: docs/trainer.md): ``setup_data``, ``build_model``, ``compute_loss`` (a **sum** over the
micro-batch's target tokens: the trainer divides by the step's count), ``forward_loss``,
``forward_backward``, ``train_step``, ``evaluate``, ``evaluate_tasks``, ``warmup``, ``on_model_ready``,
``on_step_end`` and ``on_eval_end``. Hooks that take a ``batch`` get it on the device with its
``attn_mask`` (packed rows; with ``parallel.cp > 1`` this rank's shard and the callable that attends it
over the whole row), so ``self.model(batch["input_ids"], positions=batch.get("positions"),
attn_mask=batch.get("attn_mask"))`` works in every hook.

Everything else is built by the shared parts of ``portatrain.train`` -- the runtime (device, process
group, mesh), the model stage (the family's runtime hooks, kernels, model converters, the parallel
plan), one optimizer step, the train state a resume restores, and what watches the loop (the
non-finite guard, the logging window and step, compile warm-up) -- one ``_setup_*`` step each.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from portatrain.accelerators import Accelerator
from portatrain.audit.runtime import RuntimeAudit
from portatrain.checkpoint import PreemptionWatcher, load_hf_weights, model_args_dict, sigterm_interrupts
from portatrain.checkpoint.hf import embedding_rows
from portatrain.compile import (
    CompileCache,
    CompileMonitor,
    block_compiler,
    compile_granularity,
    compile_model,
)
from portatrain.config import Config
from portatrain.converters import build_converters
from portatrain.data.pipeline import build_data
from portatrain.evaluation.tasks import task_names
from portatrain.fault_tolerance import ReplicaGroups
from portatrain.kernels import resolve as resolve_kernels
from portatrain.losses import chunked_loss_fn, cross_entropy_sum
from portatrain.metrics import model_flops, resolve_peak_flops
from portatrain.models import build_model, get_spec
from portatrain.optim import build_lr_scheduler, build_optimizer
from portatrain.parallel import parallelize_model, token_all_reduce
from portatrain.profiling import StepProfiler
from portatrain.redact import redacted_yaml
from portatrain.train.build import build_model as build_model_stage
from portatrain.train.build import initialize, runtime_options
from portatrain.train.logwindow import LoggingWindow
from portatrain.train.nonfinite import NONFINITE_MODES, NonFiniteError
from portatrain.train.progress import StepLog
from portatrain.train.rundir import RunDir, open_run_dir
from portatrain.train.runtime import build_runtime, seed_run
from portatrain.train.services import (
    build_checkpointer,
    build_metrics,
    build_nonfinite_guard,
    build_optimizer_step,
)
from portatrain.train.state import TrainState, join_replica_groups
from portatrain.train.warmup import compile_warmup

logger = logging.getLogger(__name__)

__all__ = ["NONFINITE_MODES", "NonFiniteError", "Trainer"]  # the guard's names, where they always were


class Trainer:
    def __init__(self, cfg: Config, accelerator: Accelerator | None = None) -> None:
        self._run_dir: RunDir | None = None
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
        self.spec = get_spec(cfg.model.name)  # the model family: parallel plan, HF mapping, hooks
        # The device, the process group and the layout (checked against the world size first).
        rt = self.runtime = build_runtime(cfg, accelerator)
        self.dist, self.accelerator, self.parallel_dims = rt.dist, rt.accelerator, rt.parallel_dims
        self.device, self.dtype, self.context_parallel = rt.device, rt.dtype, rt.context_parallel
        self.dp_rank, self.dp_world_size = rt.dp_rank, rt.dp_world_size
        # Before anything is built or written: the run directory (exclusive, writable, shared by the
        # ranks) and the checkpoint to resume in it.
        self._run_dir = open_run_dir(cfg, self.dist)
        self.run_dir, self.resume_from = self._run_dir.path, self._run_dir.resume_from
        seed_run(cfg, rt)  # every RNG; trainer.deterministic: deterministic kernels, or why not
        self.setup_data()
        self._setup_model()
        self._setup_optimization()
        self._setup_run_services()
        self._restore()
        # fault_tolerance.enabled: the replica groups, joined at the restored step; the step averages over them.
        groups = join_replica_groups(cfg.fault_tolerance, self.state, rt)
        self.replica_groups = self.optimizer_step.replica_groups = groups

    def setup_data(self) -> None:
        """The data stage (a hook): the tokenizer and the loaders. A prepared corpus streams
        (train_documents stay empty), else the documents are in memory."""
        cfg = self.cfg
        self.data = build_data(
            cfg.data, seed=cfg.trainer.seed, dp_rank=self.dp_rank, dp_world_size=self.dp_world_size
        )
        self.tokenizer = self.data.tokenizer
        self.train_documents, self.eval_documents = self.data.train_documents, self.data.eval_documents
        self.train_loader = self.build_dataloader(self.train_documents, train=True)

    def _setup_model(self) -> None:
        """The model stage (``portatrain.train.build``): meta -> the family's hooks, kernels and model
        converters -> parallelize (or pipeline stages) -> materialize on the device."""
        cfg = self.cfg
        # Before anything compiles: compiled graphs persist under the run dir (compile.cache).
        self.compile_cache = CompileCache.for_run(
            cfg.compile, self.run_dir, self.accelerator, is_main=self.dist.is_main
        )
        if self.compile_cache is not None:
            self.compile_cache.activate()
        self.kernels = resolve_kernels(cfg.kernels.enabled, self.accelerator.device_type)
        self.converters = build_converters(cfg, self.accelerator, self.parallel_dims)
        built = build_model_stage(
            self.runtime,
            self.spec,
            runtime_options(
                cfg.model, self.runtime, grad_accum=cfg.trainer.grad_accum, qk_clip=cfg.optim.qk_clip
            ),
            construct=self.build_model,
            parallelize=self.parallelize,
            materialize=self._materialize,
            converters=self.converters,
            kernels=self.kernels,
            parallel=cfg.parallel,
        )
        self.model, self.pipeline, self.model_hooks = built.model, built.pipeline, built.hooks
        self.flops_per_token = built.flops_per_token  # MFU: FLOPs per real token over the device's peak

    def _setup_optimization(self) -> None:
        """Optimizer, the loss path, the LR schedule and the train state a resume restores."""
        cfg = self.cfg
        self.optimizer = build_optimizer(self.model, cfg.optim, fused=self.accelerator.fused_adamw)
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
        self.state = TrainState(
            self.model, self.optimizer, self.lr_scheduler, self.train_loader, self.accelerator
        )

    def _setup_run_services(self) -> None:
        """What watches the loop: checkpoints, the non-finite guard and the optimizer step it guards,
        stop requests, metrics, the logging window, compilation and the runtime audit."""
        cfg, rt = self.cfg, self.runtime
        self.checkpointer = build_checkpointer(cfg, rt, self.run_dir)
        self.nonfinite = build_nonfinite_guard(cfg, rt, self.checkpointer)
        # e.g. FP8 weight scales for the next all-gather; DeepSeek-V3's router bias
        hooks = [
            lambda ok: self.converters.post_optimizer_step(self.model),
            self.model_hooks.post_optimizer_step,
        ]
        self.optimizer_step = build_optimizer_step(cfg, rt, self.state, self.nonfinite, hooks, self.checkpointer)
        self.preemption = PreemptionWatcher()
        self.preempted = False
        self.metrics = build_metrics(cfg, rt, self.run_dir, resumed=self.resume_from is not None)
        self.peak_flops, self.peak_flops_source = resolve_peak_flops(
            self.accelerator, self.dtype, cfg.metrics.peak_tflops
        )
        self.window = LoggingWindow()  # tokens, FLOPs and time since the last logged step
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
        self.on_model_ready()
        # Secrets (tokens, keys, passwords) are redacted in every config written to disk.
        if self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(redacted_yaml(self.cfg))

    # The train state's counters (portatrain.train.state), where subclasses and commands read them.
    step = property(lambda self: self.state.step, lambda self, v: setattr(self.state, "step", v))
    tokens_seen = property(
        lambda self: self.state.tokens_seen, lambda self, v: setattr(self.state, "tokens_seen", v)
    )

    # Steps skipped for a non-finite loss or gradient norm so far (trainer.on_nonfinite=skip_step).
    nonfinite_skipped = property(lambda self: self.nonfinite.skipped)

    # -- hooks -----------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """Construct the model (on the meta device; no initialization here). The embedding has the
        tokenizer's vocabulary unless ``model.vocab_size`` sets a larger one, or ``model.init_from``'s
        rows (checked against both before anything is built)."""
        rows = embedding_rows(self.cfg.model, self.tokenizer.vocab_size, self.tokenizer.name)
        return build_model(self.cfg.model, vocab_size=rows)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply TP -> model converters' ``adapt`` (LoRA) -> activation checkpointing -> compile -> FSDP2
        to the meta model, per the model family's plan (``spec.parallelize``) and ``cfg.parallel`` (one
        process: checkpointing/compile only). With ``compile.granularity=model`` or ``nested`` the whole
        model is compiled last (``portatrain.compile``)."""
        dims = self.parallel_dims
        granularity = compile_granularity(self.cfg.compile, sharded=dims.fsdp_enabled or dims.tp_enabled)
        model = parallelize_model(
            model,
            self.spec.parallelize,
            dims,
            self.cfg.parallel,
            compile_block=block_compiler(self.cfg.compile, self.accelerator, granularity),
            compute_dtype=self.dtype,
            adapt=self.converters.adapter(),
        )
        if self.cfg.compile.enabled and granularity != "block":
            compile_model(model, self.cfg.compile, self.accelerator, granularity)
        return model

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
        chunked = self._loss_chunk_size is not None
        if chunked:
            inputs["output_fn"] = chunked_loss_fn(batch["labels"], self._loss_chunk_size)
        # The family's own loss beside the model's output (e.g. multi-token prediction), a sum too.
        with self._autocast(), self.model_hooks.extra_loss(batch) as extra:
            out = self.model(batch["input_ids"], **inputs)
        return (out if chunked else self.compute_loss(out, batch)) + extra.sum

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
        loss = loss_sum / num_tokens  # this rank's share of the global mean
        grad_norm = self.optimizer_step(self.model, step=self.step + 1, loss=loss)
        if grad_norm is None:  # fault tolerance: a replica group failed during the step; fit() redoes it
            return {"committed": False}
        # Tensors stay on the device; fit() reads them only on logging steps (no per-step host sync).
        # The gradient norm is global (all ranks agree on it); the loss is this rank's.
        return {"loss": loss, "grad_norm": grad_norm, "tokens": local_tokens}

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
        """Run ``trainer.eval_tasks`` with lm-eval on the model as it is (every rank takes part; the
        metrics come back on local rank 0, ``{}`` elsewhere); the random states are left as they were."""
        from portatrain.evaluation.model import evaluate_model_tasks

        args = (self.model, self.tokenizer, self.eval_task_names, self.cfg.eval, self.runtime)
        return evaluate_model_tasks(*args)

    def warmup(self) -> list[dict[str, Any]]:
        """Compile every shape of ``batch_shapes(cfg.data)`` before step 1 and arm the recompile guard
        (``portatrain.train.warmup``); returns per-shape cold-start times."""
        return compile_warmup(self)

    def on_model_ready(self) -> None:
        """Called once the weights are in place (initialized, ``model.init_from`` or a resumed
        checkpoint), before the run's config is written and training starts (default: nothing)."""

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Called after every optimizer step with that step's metrics (device tensors where cheap;
        ``tokens`` and ``flops`` are this rank's real tokens and model FLOPs, host integers)."""

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        """Called after every evaluation."""

    # -- data ------------------------------------------------------------------------------
    def build_dataloader(self, documents: list[list[int]], *, train: bool):  # noqa: ANN201
        """This rank's loader: over ``documents`` in memory, or the prepared corpus's stream."""
        if self.data.streaming:
            return self.data.train_loader() if train else self.data.eval_loader()
        return self.data.memory_loader(documents, train=train)

    # -- loop ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for ``trainer.steps`` optimizer steps; return the last logged metrics."""
        cfg = self.cfg.trainer
        if OmegaConf.is_config(cfg) and OmegaConf.get_type(cfg) is not dict:
            # A plain dataclass copy: the loop reads it every step; a DictConfig read costs ~10 us.
            cfg = OmegaConf.to_object(cfg)
        data_iter = self._data_iter = iter(self.train_loader)
        log = StepLog(self)  # the progress bar, the logging steps
        profiler = StepProfiler(
            self.cfg.profile,
            self.run_dir / "profile",
            first_step=self.step,
            activities=self.accelerator.profiler_activities(),
            worker_name=f"rank{self.dist.rank}",
        )
        last: dict[str, Any] = {}
        self.preemption.install()  # SIGTERM / Ctrl-C: save at the next step boundary, then stop
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
                log.bar.update(self.step - log.bar.n)
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
            last = self._after_step(cfg, metrics, log, stop, last)
            log.bar.update(1)
            if stop:
                self.preempted = True
                logger.warning("stopped at step %d on request; resume with checkpoint.resume=auto", self.step)
        log.bar.close()
        profiler.close()
        self.preemption.uninstall()
        self.checkpointer.wait()  # a stop request or the final save waits for the save in flight
        final = self.cfg.checkpoint.enabled and self.cfg.checkpoint.final and not self.preempted
        if final and self.checkpointer.last_step != self.step:
            self.save_checkpoint()
            self.checkpointer.wait()
        self._close_data_iter()
        log.close()  # the end summary, after the last save
        return last

    def _after_step(self, cfg: Any, metrics: dict, log: StepLog, stop: bool, last: dict) -> dict[str, Any]:
        """What is due after a step: logging, evaluations, a checkpoint (a stop request saves now);
        returns the last logged metrics (``last`` when nothing was logged), evaluations included."""
        at_end = self.step == cfg.steps
        save_now = self.cfg.checkpoint.enabled and (stop or self.checkpointer.due(self.step))
        last = log.log(metrics) if self.step % cfg.log_every == 0 or at_end or save_now else last
        evals = []
        if cfg.eval_every and (self.step % cfg.eval_every == 0 or at_end) and self.data.has_eval:
            evals.append(self.evaluate)
        every = self._eval_tasks_every
        if self.eval_task_names and every and (self.step % every == 0 or at_end):
            evals.append(self.evaluate_tasks)
        for evaluate in evals:
            last.update(log.evaluated(evaluate))
            self.window.restart_clock()  # evaluation time is not training throughput
        if save_now:
            self.save_checkpoint()
            self.window.restart_clock()
        return last

    def save_checkpoint(self) -> Path:
        """Save everything a resume needs (collective; the layout: ``portatrain.checkpoint``). A
        non-finite state is refused (``NonFiniteError``): rotation never replaces the last finite
        checkpoint with a broken one."""
        self.nonfinite.assert_finite_state(self.step, self.model, self.optimizer)
        path = self.checkpointer.save(
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            state={
                **self.state.record(),
                "recipe": self.cfg.recipe,
                "model_name": self.cfg.model.name,  # the family whose spec reads model_args back
                "model_args": model_args_dict(self.model),
                "tokenizer": self.tokenizer.name,  # absolute path: export copies its files
                "dp_world_size": self.dp_world_size,
                **self.converters.record(),  # e.g. LoRA's adapted layers, for export
            },
            dataloader_state=self.train_loader.state_dict(),
            rng_state=self.accelerator.get_rng_state(),
            config_yaml=redacted_yaml(self.cfg),
            init_from=self.cfg.model.init_from or None,  # a frozen base loaded from there is referenced
        )
        if self.dist.is_main and self.checkpointer.async_mode != "none":
            logger.info("staged checkpoint %s; writing it in the background", path)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, LR schedule, data position, RNG and counters from ``path``
        (``TrainState.load``: checksummed, finite; ``checkpoint.resume=auto`` falls back to the newest
        usable one before it). Optimizer hyper-parameters and the LR schedule's peak come from the
        current config (a change is applied and logged)."""
        self.resume_from = path = self.state.load(
            self.checkpointer,
            path,
            auto=str(self.cfg.checkpoint.resume) == "auto",
            recipe=self.cfg.recipe,
            restore_data=self.cfg.checkpoint.restore_data,
        )
        if self.dist.is_main:
            logger.info("resumed from %s at step %d", path, self.step)

    def close(self) -> None:
        """Finish the run's services (the process group is the command's: ``portatrain.cli``)."""
        if self.replica_groups is not None:
            self.replica_groups.close(self.model)  # logs the weights digest, leaves the quorum
            self.replica_groups = self.optimizer_step.replica_groups = None
        self.checkpointer.close()
        self.runtime_audit.close()
        self.compile_monitor.close()
        self.preemption.uninstall()
        self.metrics.close()
        self._release_run_dir()
        self._close_data_iter()

    # -- internals -------------------------------------------------------------------------
    def _close_data_iter(self) -> None:
        """Stop and join the loader's prefetch thread now, not at interpreter exit (where a thread
        inside a torch op aborts the process: ``portatrain.data.stream._prefetched``)."""
        close = getattr(self._data_iter, "close", None)
        self._data_iter = None
        if close is not None:
            close()

    def _release_run_dir(self) -> None:
        if self._run_dir is not None:
            self._run_dir.release()

    def _materialize(self, model: nn.Module) -> nn.Module:
        """Allocate the meta model on the device and initialize it (``portatrain.train.build``)."""
        return initialize(model, self.runtime, self.cfg, self.converters)

    def _autocast(self):  # noqa: ANN202 (a context manager)
        return self.runtime.autocast()

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The family's own inputs first: context parallel then shards them with the rest.
        return self.runtime.to_device(self.model_hooks.prepare_batch(batch))

    def _all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (tp ranks of one dp group hold the same value)."""
        return self.runtime.all_reduce_sum(value)
