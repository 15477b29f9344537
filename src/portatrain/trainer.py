"""The training loop, split into small hooks that research code overrides.

Hooks (override in a subclass; each has one job):

``build_model()``
    Return the model. Called under ``torch.device("meta")``: construct, don't initialize.
    The trainer then parallelizes it, materializes it on the device and calls ``init_weights()``.
``compute_loss(logits, batch)``
    Return the **sum** of per-token losses of one micro-batch over its ``labels != -100``
    positions. The trainer divides by the number of target tokens in the whole optimizer step,
    so gradient accumulation and padding never change the loss scale.
``forward_backward(batch, num_tokens)``
    Forward one micro-batch, ``backward()`` its share of the step loss, return the loss sum (detached).
``train_step(batches)``
    One optimizer step over ``grad_accum`` micro-batches; returns metrics of the step.
``evaluate()``
    Mean loss over ``trainer.eval_batches`` held-out batches.
``on_step_end(step, metrics)`` / ``on_eval_end(step, metrics)``
    Callbacks after each optimizer step / evaluation (default: nothing).

Everything else (data, optimizer, schedule, metrics, checkpoints) is built from the config by
the stages it names; a subclass changes behaviour by overriding a hook, not by copying ``fit``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from tqdm import tqdm

from portatrain.accelerators import Accelerator, resolve_accelerator
from portatrain.checkpoint import Checkpointer
from portatrain.config import Config
from portatrain.data.documents import load_documents
from portatrain.data.loader import build_dataloader
from portatrain.data.tokenizer import build_tokenizer
from portatrain.distributed import destroy_distributed, dist_info_from_env, init_distributed
from portatrain.metrics import MetricsLogger
from portatrain.models import build_model
from portatrain.optim import build_lr_scheduler, build_optimizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Trainer:
    def __init__(self, cfg: Config, accelerator: Accelerator | None = None) -> None:
        self.cfg = cfg
        self.dist = dist_info_from_env()
        index = cfg.device.index if cfg.device.index is not None else self.dist.local_rank
        self.accelerator = accelerator or resolve_accelerator(cfg.device.type, index)
        self.accelerator.set_device()
        init_distributed(self.accelerator, self.dist)
        self.device = self.accelerator.device
        self.dtype = (
            self.accelerator.default_dtype if cfg.trainer.dtype == "auto" else _DTYPES[cfg.trainer.dtype]
        )
        # Data parallelism over all ranks until a mesh says otherwise.
        self.dp_rank, self.dp_world_size = self.dist.rank, self.dist.world_size

        self.run_dir = Path(cfg.run_dir)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

        self.accelerator.manual_seed(cfg.trainer.seed)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True)

        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.train_documents, self.eval_documents = load_documents(
            cfg.data.dataset,
            self.tokenizer,
            num_documents=cfg.data.num_documents,
            eval_fraction=cfg.data.eval_fraction,
            seed=cfg.trainer.seed,
        )
        self.train_loader = self.build_dataloader(self.train_documents, train=True)

        with torch.device("meta"):
            model = self.build_model()
        self.model = self._materialize(self.parallelize(model))
        self.optimizer = build_optimizer(self.model, cfg.optim, fused=self.accelerator.fused_adamw)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.trainer.steps)
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", keep=cfg.checkpoint.keep, is_main=self.dist.is_main
        )
        self.metrics = MetricsLogger(self.run_dir, enabled=self.dist.is_main, jsonl=cfg.metrics.jsonl)
        self.step = 0
        self.tokens_seen = 0

    # -- hooks -----------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """Construct the model (on the meta device; no initialization here)."""
        return build_model(self.cfg.model)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply parallelism and compilation to the meta model (single device: nothing to apply)."""
        return model

    def compute_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of next-token cross-entropy over positions whose label is not -100."""
        return F.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100, reduction="sum"
        )

    def forward_backward(self, batch: dict[str, torch.Tensor], num_tokens: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(
                batch["input_ids"], positions=batch.get("positions"), attn_mask=batch.get("attn_mask")
            )
        loss_sum = self.compute_loss(logits, batch)
        (loss_sum / num_tokens).backward()
        return loss_sum.detach()

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        # Targets are counted on the host-side labels before they move: no device sync.
        local_tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        num_tokens = self._all_reduce_sum(torch.tensor(float(local_tokens), device=self.device))
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches:
            loss_sum += self.forward_backward(self._to_device(batch), num_tokens)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
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
            with self._autocast():
                logits = self.model(
                    batch["input_ids"], positions=batch.get("positions"), attn_mask=batch.get("attn_mask")
                )
            loss_sum += self.compute_loss(logits, batch)
            count += int((batch["labels"] != -100).sum())
        self.model.train()
        loss_sum, count = self._all_reduce_sum(loss_sum), self._all_reduce_sum(torch.tensor(float(count)))
        return {"eval_loss": (loss_sum / count.clamp(min=1)).item()}

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Called after every optimizer step with that step's metrics (device tensors where cheap)."""

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        """Called after every evaluation."""

    # -- data ------------------------------------------------------------------------------
    def build_dataloader(self, documents: list[list[int]], *, train: bool):
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
        data_iter = iter(self.train_loader)
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not (cfg.progress and self.dist.is_main),
            desc=self.cfg.recipe,
            unit="step",
            dynamic_ncols=True,
        )
        last: dict[str, Any] = {}
        window_tokens, window_start = 0, time.perf_counter()
        while self.step < cfg.steps:
            batches = [next(data_iter) for _ in range(cfg.grad_accum)]
            metrics = self.train_step(batches)
            self.step += 1
            window_tokens += metrics["tokens"]
            self.on_step_end(self.step, metrics)
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self.accelerator.synchronize()
                elapsed = time.perf_counter() - window_start
                window_tokens = int(
                    self._all_reduce_sum(torch.tensor(float(window_tokens), device=self.device))
                )
                self.tokens_seen += window_tokens
                last = {
                    "step": self.step,
                    "loss": float(self._all_reduce_mean(metrics["loss"])),
                    "grad_norm": float(metrics["grad_norm"]),
                    "lr": self.lr_scheduler.get_last_lr()[0],
                    "tokens_per_s": window_tokens / elapsed,
                    "tokens_seen": self.tokens_seen,
                }
                self.metrics.log(last)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:,.0f}")
                window_tokens, window_start = 0, time.perf_counter()
            if (
                cfg.eval_every
                and (self.step % cfg.eval_every == 0 or self.step == cfg.steps)
                and self.eval_documents
            ):
                eval_metrics = self.evaluate()
                self.metrics.log({"step": self.step, **eval_metrics})
                last.update(eval_metrics)
                self.on_eval_end(self.step, eval_metrics)
                window_start = time.perf_counter()  # evaluation time is not training throughput
            bar.update(1)
        bar.close()
        if self.cfg.checkpoint.enabled and self.cfg.checkpoint.final:
            self.save_checkpoint()
        return last

    def save_checkpoint(self) -> Path:
        extra = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": self.train_loader.state_dict(),
        }
        path = self.checkpointer.save(self.step, self.model, self.optimizer, extra)
        logger.info("saved checkpoint %s", path)
        return path

    def close(self) -> None:
        self.metrics.close()
        destroy_distributed()

    # -- internals -------------------------------------------------------------------------
    def _materialize(self, model: nn.Module) -> nn.Module:
        """Allocate the meta model on the device and initialize it (same seed on every rank)."""
        model.to_empty(device=self.device)
        torch.manual_seed(self.cfg.trainer.seed)
        with torch.no_grad():
            model.init_weights(self.cfg.model.init_std)
        return model.train()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device_type, dtype=self.dtype)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def _all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def _clip_gradients(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
