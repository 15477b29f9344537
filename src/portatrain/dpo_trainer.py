"""The trainer of ``finetune.method=dpo``: the :class:`~portatrain.trainer.Trainer` with DPO's data,
step and evaluation (the loss and the pairs: ``portatrain.finetune.dpo``).

What changes, hook by hook:

* data -- preference pairs read from ``data.dataset`` (a held-out ``data.eval_fraction`` of them
  evaluated), batched by :class:`~portatrain.finetune.dpo.PairLoader`;
* ``on_model_ready``, after the weights are in place (initialized, ``model.init_from`` or a checkpoint) -- the reference
  log-probabilities of every pair, computed once: with LoRA (``finetune.dpo.lora``) by the model with
  its adapters off, which is the base whatever the step, so a resumed run computes them again; for
  full DPO by the model as it starts, kept in ``<run_dir>/dpo_reference.safetensors`` for resumes,
  with a content checksum (``portatrain.checkpoint.verify``) that a resume checks before it trusts it;
* ``train_step`` -- the DPO loss over the Trainer's optimizer step (``portatrain.train.step``), a mean over the pairs of the global batch (every rank's sum over
  the global pair count, as the language-model loss does with tokens); rewards, margin and accuracy
  logged beside it (``dpo/...``);
* ``evaluate`` -- the same quantities over the held-out pairs (``eval_loss``, ``eval_dpo/...``).

Everything else (parallel plan, LoRA, optimizer, checkpoints, metrics) is the Trainer's.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from portatrain.checkpoint.common import CheckpointError
from portatrain.checkpoint.verify import ALGORITHM, checksums
from portatrain.data.errors import DataError
from portatrain.data.tokenizer import build_tokenizer
from portatrain.finetune import uses_lora
from portatrain.finetune.dpo import PairLoader, dpo_loss, encode_pairs, read_pairs, sequence_logps
from portatrain.finetune.lora import adapters_disabled
from portatrain.trainer import Trainer

logger = logging.getLogger(__name__)

REFERENCE_FILE = "dpo_reference.safetensors"
"""Full DPO's reference log-probabilities, ``[pairs, 2]`` float32 under the key ``reference``, their
checksum in the file's metadata. safetensors, not ``torch.save``: reading it never unpickles."""
LEGACY_REFERENCE_FILE = "dpo_reference.pt"
"""What portatrain wrote before the checksum: a pickle, not read any more."""


class _PairData:
    """What the Trainer asks of its data stage, for preference pairs (in memory, never streamed)."""

    streaming = False

    def __init__(self, has_eval: bool) -> None:
        self.has_eval = has_eval


class DPOTrainer(Trainer):
    """:class:`~portatrain.trainer.Trainer` for ``finetune.method=dpo`` (see the module docstring)."""

    def setup_data(self) -> None:
        cfg = self.cfg
        chat = cfg.data.format == "chat"
        self.tokenizer = build_tokenizer(str(cfg.data.tokenizer))
        self.pairs = encode_pairs(self.tokenizer, read_pairs(str(cfg.data.dataset), chat=chat), chat=chat)
        order = list(range(len(self.pairs)))
        random.Random(cfg.trainer.seed).shuffle(order)
        n_eval = int(len(order) * float(cfg.data.eval_fraction))
        self.train_pairs, self.eval_pairs = order[n_eval:], order[:n_eval]
        if not self.train_pairs:
            raise DataError(f"data.dataset={cfg.data.dataset}: no preference pair is left for training")
        self.data = _PairData(has_eval=bool(self.eval_pairs))
        self.train_documents, self.eval_documents = [], []
        self.train_loader = self._pair_loader(self.train_pairs, train=True)
        # A resume's saved reference is checked before anything is loaded or written.
        self.beta = float(cfg.finetune.dpo.beta)
        self.reference = self._saved_reference()

    def _pair_loader(self, indices: list[int], *, train: bool) -> PairLoader:
        return PairLoader(
            self.pairs,
            indices,
            batch_size=int(self.cfg.data.batch_size),
            seq_len=int(self.cfg.data.seq_len),
            pad_id=self.tokenizer.pad_id,
            seed=int(self.cfg.trainer.seed),
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            train=train,
        )

    def on_model_ready(self) -> None:
        if self.reference is None:  # a new run, or LoRA's (its reference is the base: scored anew)
            self.reference = self._new_reference()

    # -- the reference -----------------------------------------------------------------------
    def _new_reference(self) -> torch.Tensor:
        """``[pairs, 2]`` log-probabilities of (chosen, rejected) under the reference (module
        docstring); full DPO's are written to ``<run_dir>/dpo_reference.safetensors``."""
        if uses_lora(self.cfg.finetune):
            with adapters_disabled(self.model):
                return self._score_all_pairs()
        reference = self._score_all_pairs()
        checksum = checksums({"reference": reference})["reference"]  # collective: every rank
        if self.dist.is_main:
            from safetensors.torch import save_file

            path = self.run_dir / REFERENCE_FILE
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            metadata = {"checksum_algorithm": ALGORITHM, "checksum": str(checksum)}
            save_file({"reference": reference.cpu().contiguous()}, str(tmp), metadata=metadata)
            tmp.replace(path)  # atomic: a kill mid-write leaves no half-written reference
        return reference

    def _saved_reference(self) -> torch.Tensor | None:
        """Resuming full DPO: the reference of the run's start, read back from its file and checked
        (checksum, finiteness, one row per pair); None when the reference is computed now instead."""
        if uses_lora(self.cfg.finetune) or self.resume_from is None:
            return None
        path = self.run_dir / REFERENCE_FILE
        # The reference is the model as the run started: no later checkpoint can recompute it.
        fix = "start a new run (a new run_dir), or put back a good copy of the file"
        if not path.is_file():
            legacy = self.run_dir / LEGACY_REFERENCE_FILE
            if legacy.is_file():
                raise CheckpointError(
                    f"{legacy} was written by an earlier portatrain as a pickle, without a checksum, and is "
                    "not read any more; start a new run (a new run_dir), or use finetune.dpo.lora=true"
                )
            raise DataError(
                f"resuming full DPO needs the reference log-probabilities of the run's start, "
                f"{path}, which is missing; start a new run (or use finetune.dpo.lora=true)"
            )
        reference = _read_reference(path, fix, self.device)
        if reference.shape != (len(self.pairs), 2):
            raise DataError(
                f"{path} scores {reference.shape[0]} pairs, data.dataset holds {len(self.pairs)}: "
                "the data changed since the run started; start a new run"
            )
        return reference

    @torch.no_grad()
    def _score_all_pairs(self) -> torch.Tensor:
        """Every pair scored once by the model as it is: each data-parallel rank scores its share,
        one all-reduce gathers them (ranks run the same number of batches, the last one padded)."""
        self.model.eval()
        scores = torch.zeros(len(self.pairs), 2, device=self.device)
        loader = self._pair_loader(list(range(len(self.pairs))), train=False)
        for batch in loader:
            batch = self._to_device(batch)
            chosen, rejected = self._policy_logps(batch)
            index = batch["pair_index"]
            keep = index >= 0
            scores[index[keep]] = torch.stack([chosen, rejected], dim=1)[keep]
        self.model.train()
        return self._all_reduce_sum(scores)

    # -- the step --------------------------------------------------------------------------
    def _policy_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of the batch's chosen and rejected responses under the model, ``[B]`` each."""
        with self._autocast():
            logits = self.model(batch["input_ids"])
        logps = sequence_logps(logits, batch["labels"])
        return logps.chunk(2)

    def _pair_terms(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-pair sums over the micro-batch: the loss (differentiable) and the logged quantities."""
        chosen, rejected = self._policy_logps(batch)
        index, valid = batch["pair_index"].clamp(min=0), batch["valid"]
        reference = self.reference[index]
        loss, chosen_reward, rejected_reward = dpo_loss(
            chosen, rejected, reference[:, 0], reference[:, 1], self.beta
        )
        return {
            "loss": (loss * valid).sum(),
            "rewards_chosen": (chosen_reward * valid).sum(),
            "rewards_rejected": (rejected_reward * valid).sum(),
            "margin": ((chosen_reward - rejected_reward) * valid).sum(),
            "accuracy": ((chosen_reward > rejected_reward).float() * valid).sum(),
        }

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        # Every pair of a training batch is real: the global count is static (no sync).
        num_pairs = float(len(batches) * int(self.cfg.data.batch_size) * self.dp_world_size)
        local_tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        sums: dict[str, torch.Tensor] = {}
        for batch in batches:
            terms = self._pair_terms(self._to_device(batch))
            (terms["loss"] / num_pairs).backward()
            for key, value in terms.items():
                sums[key] = sums.get(key, 0.0) + value.detach()
        # The shared step: replica-group averaging, clipping, the non-finite guard, post-step hooks.
        loss = sums.pop("loss") / num_pairs  # this rank's share of the global mean
        grad_norm = self.optimizer_step(self.model, step=self.step + 1, loss=loss)
        if grad_norm is None:  # fault tolerance: a replica group failed during the step; fit() redoes it
            return {"committed": False}
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "tokens": local_tokens,
            "dp_sums": {f"dpo/{key}": value / num_pairs for key, value in sums.items()},
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        totals: dict[str, torch.Tensor] = {}
        count = torch.zeros((), device=self.device)
        for i, batch in enumerate(self._pair_loader(self.eval_pairs, train=False)):
            if i >= self.cfg.trainer.eval_batches:
                break
            batch = self._to_device(batch)
            for key, value in self._pair_terms(batch).items():
                totals[key] = totals.get(key, 0.0) + value
            count += batch["valid"].sum()
        self.model.train()
        keys = list(totals)
        summed = self._all_reduce_sum(torch.stack([*(totals[k] for k in keys), count]))
        means = (summed[:-1] / summed[-1].clamp(min=1)).tolist()
        named = dict(zip(keys, means, strict=True))
        return {"eval_loss": named.pop("loss"), **{f"eval_dpo/{k}": v for k, v in named.items()}}


def _read_reference(path: Path, fix: str, device: torch.device) -> torch.Tensor:
    """The reference tensor of ``path`` on ``device``, after its checksum and finiteness checks
    (collective: the checksum is summed over every rank, on the device the process group serves);
    a :class:`CheckpointError` naming the file and ``fix`` else."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            reference = f.get_tensor("reference")
    except (SafetensorError, OSError) as exc:  # truncated, overwritten, not safetensors at all
        raise CheckpointError(
            f"{path} is unreadable as DPO reference log-probabilities ({exc}); {fix}"
        ) from None
    if metadata.get("checksum_algorithm") != ALGORITHM or "checksum" not in metadata:
        raise CheckpointError(f"{path} carries no {ALGORITHM} checksum, so it cannot be trusted; {fix}")
    if reference.dtype != torch.float32 or reference.dim() != 2 or reference.shape[-1] != 2:
        raise CheckpointError(
            f"{path} holds a {reference.dtype} tensor of shape {list(reference.shape)}, not [pairs, 2] "
            f"float32 log-probabilities; {fix}"
        )
    reference = reference.to(device)
    if str(checksums({"reference": reference})["reference"]) != metadata["checksum"]:
        raise CheckpointError(
            f"{path} is damaged: the content checksum of its log-probabilities does not match the one "
            f"written with it (the file was overwritten or corrupted on disk); {fix}"
        )
    if not torch.isfinite(reference).all():
        raise CheckpointError(f"{path} holds non-finite (NaN/inf) log-probabilities; {fix}")
    return reference
