"""Multi-token prediction (MTP), as DeepSeek-V3 trains it (https://arxiv.org/abs/2412.19437, section 2.2).

``D`` modules in sequence after the main model. At position ``i``, depth ``k`` (1-based) combines the
previous depth's hidden state ``h[k-1, i]`` (depth 0: the main model's output, after its final norm)
with the embedding of token ``t[i+k]``, each through its own RMSNorm, projects the concatenation back
to the model width, runs one transformer block and predicts ``t[i+k+1]`` through the shared output
head (after the depth's own final norm)::

    h[k, i] = block_k(eh_proj_k([enorm_k(embed(t[i+k])); hnorm_k(h[k-1, i])]))
    loss    = lm_loss + mtp_loss_weight / D * sum_k CE(head(norm_k(h[k])), t[i+k+1])

The concatenation puts the embedding first, as the published checkpoint's ``eh_proj`` expects
(vLLM's and SGLang's ``deepseek_mtp``; the paper writes the two the other way round). The embedding and
the head are the main model's (shared, as in the paper). Attention in a depth's block sees the same
positions and mask as the main blocks: RoPE is relative, so rotating position ``i`` rather than ``i+k``
(Megatron rolls the positions) gives the same scores.

Read-ahead without reading ahead. Position ``i`` needs ``t[i+k]`` and the target ``t[i+k+1]``, which
under context parallel may sit on another rank. :func:`mtp_targets` builds them on the host from the
whole row before the batch is sharded (``[B, S, D]`` entries that context parallel cuts along ``S``
with everything else), so every shard holds the tokens it reads ahead and no collective is needed.
Targets that cross a document boundary of a packed row (or leave the row) are ``-100``: the depth
does not predict the next document. The hidden states of such positions feed later positions'
attention only within their own document (causal, document mask), so no valid target sees them.

Normalization. Each depth's cross-entropy is a sum over its valid targets; the trainer divides the
whole step's loss by the number of main-model targets (counted on the host before the step), one
denominator for every layout, so FSDP, context parallel and one process compute the same loss. A depth
has at most ``k`` fewer targets per document than the main model, so this differs from a per-depth mean
by that fraction of a row (Megatron-LM divides each depth by its own count).

Logged as ``mtp_loss``: the mean over depths of each depth's mean cross-entropy since the last
logging step (this rank's targets). Only training forwards compute it: evaluation measures the main
model alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.models.common.layers import RMSNorm, trunc_normal_
from portatrain.models.spec import ExtraLoss, ModelRuntime, NoRuntime

MTP_TOKENS, MTP_LABELS = "mtp_tokens", "mtp_labels"
"""The batch entries :func:`mtp_targets` adds: ``[B, S, D]`` token ids read ahead and their targets."""

IGNORE_INDEX = -100


def mtp_targets(batch: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """``batch`` plus :data:`MTP_TOKENS` (``[..., k-1]`` = ``t[i+k]``, 0 past the row) and
    :data:`MTP_LABELS` (``[..., k-1]`` = ``labels[i+k]``, -100 past the row or across a document)."""
    ids, labels = batch["input_ids"], batch["labels"]
    documents = batch.get("document_ids")
    rows, seq_len = ids.shape
    tokens = ids.new_zeros(rows, seq_len, depth)
    targets = labels.new_full((rows, seq_len, depth), IGNORE_INDEX)
    for k in range(1, min(depth, seq_len - 1) + 1):
        tokens[:, : seq_len - k, k - 1] = ids[:, k:]
        ahead = labels[:, k:]
        if documents is not None:
            same = documents[:, k:] == documents[:, : seq_len - k]
            ahead = torch.where(same, ahead, IGNORE_INDEX)
        targets[:, : seq_len - k, k - 1] = ahead
    return {**batch, MTP_TOKENS: tokens, MTP_LABELS: targets}


class MTPLayer(nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``eh_proj``, a transformer block and the depth's final ``norm``
    (the checkpoint's ``shared_head.norm``)."""

    def __init__(self, args: object, block: nn.Module) -> None:
        super().__init__()
        dim, eps, offset = args.dim, args.norm_eps, args.norm_unit_offset
        self.enorm = RMSNorm(dim, eps, unit_offset=offset)
        self.hnorm = RMSNorm(dim, eps, unit_offset=offset)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, eps, unit_offset=offset)

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, std)
        self.block.init_weights(std, out_std)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: object,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(x, cos, sin, attn_mask)


class MultiTokenPrediction(nn.Module):
    """The ``D`` depths (``layers``, keyed ``"0"..``), run by the decoder after its final norm when
    :attr:`targets` is set (by :class:`MTPRuntime` around a training forward, or by a pipeline's last
    stage from the :attr:`batch_keys` of each micro-batch)."""

    batch_keys = (MTP_TOKENS, MTP_LABELS)
    """The batch entries :attr:`targets` holds, in order."""

    def __init__(self, args: object, build_block: Callable[[object, int], nn.Module]) -> None:
        super().__init__()
        depth = args.mtp_layers
        # Block ids after the main model's: DeepSeek-V3's depth is a mixture-of-experts block (layer 61).
        self.layers = nn.ModuleDict(
            {str(k): MTPLayer(args, build_block(args, args.n_layers + k)) for k in range(depth)}
        )
        self.weight = args.mtp_loss_weight / depth
        self.targets: tuple[torch.Tensor, torch.Tensor] | None = None
        self.loss_sum: torch.Tensor | None = None
        # Per depth since the last read (MTPRuntime.metrics): cross-entropy sums and target counts.
        self.register_buffer("ce_sums", torch.zeros(depth), persistent=False)
        self.register_buffer("counts", torch.zeros(depth), persistent=False)

    def init_weights(self, std: float, out_std: float) -> None:
        for layer in self.layers.values():
            layer.init_weights(std, out_std)
        self.ce_sums.zero_()
        self.counts.zero_()

    def forward(
        self,
        hidden: torch.Tensor,
        embed: nn.Module,
        head_weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: object,
        output_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``mtp_loss_weight / D`` times the depths' summed cross-entropy; ``hidden`` is the main model's
        normalized output ``[B, S, dim]``. The depths take the main head's loss: the chunked one
        (never the full logits) when ``output_fn`` offers ``with_labels`` (``portatrain.losses.ChunkedLoss``),
        else cross-entropy on logits."""
        tokens, labels = self.targets
        head_loss = getattr(output_fn, "with_labels", None)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for k, layer in enumerate(self.layers.values()):
            hidden = layer(hidden, embed(tokens[..., k]), cos, sin, attn_mask)
            target = labels[..., k]
            if head_loss is not None:
                ce = head_loss(target)(layer.norm(hidden), head_weight)
            else:
                logits = F.linear(layer.norm(hidden), head_weight).flatten(0, -2).float()
                ce = F.cross_entropy(logits, target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            total = total + ce
            with torch.no_grad():
                self.ce_sums[k] += ce.detach()
                self.counts[k] += (target != IGNORE_INDEX).sum()
        return total * self.weight


class MTPRuntime(NoRuntime):
    """Multi-token prediction's hooks (:class:`~portatrain.models.spec.ModelRuntime`) around another
    runtime's (the mixture of experts'): the read-ahead targets, the loss of each training forward, the
    ``mtp_loss`` metric.

    Under pipeline parallel only the last stage holds the depths (``model.mtp`` is None elsewhere) and
    the pipeline adds their loss per micro-batch; ``sum_stages`` (the sum over the pipeline ranks) brings
    the metric's sums to every rank."""

    def __init__(
        self,
        model: nn.Module,
        inner: ModelRuntime,
        sum_stages: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model, self.mtp, self.inner, self.sum_stages = model, model.mtp, inner, sum_stages
        self.depth = model.args.mtp_layers

    def post_optimizer_step(self, ok: torch.Tensor) -> None:
        self.inner.post_optimizer_step(ok)

    def metrics(self) -> dict[str, float]:
        if self.mtp is None:  # a pipeline rank before the last: nothing of its own
            stats = torch.zeros(2, self.depth, device=next(self.model.parameters()).device)
        else:
            stats = torch.stack([self.mtp.ce_sums, self.mtp.counts])
            self.mtp.ce_sums.zero_()
            self.mtp.counts.zero_()
        if self.sum_stages is not None:
            stats = self.sum_stages(stats)
        sums, counts = stats.tolist()
        means = [s / c for s, c in zip(sums, counts) if c > 0]
        own = {"mtp_loss": sum(means) / len(means)} if means else {}
        return {**self.inner.metrics(), **own}

    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = self.inner.prepare_batch(batch)
        # Training batches of token ids and labels only (a preference pair's batch has neither), where
        # the depths are (not on a pipeline's earlier stages).
        if self.mtp is not None and self.model.training and "input_ids" in batch and "labels" in batch:
            return mtp_targets(batch, self.depth)
        return batch

    @contextlib.contextmanager
    def extra_loss(self, batch: dict[str, torch.Tensor]) -> Iterator[ExtraLoss]:
        with self.inner.extra_loss(batch) as inner:
            extra = ExtraLoss(inner.sum)
            train = self.model.training and torch.is_grad_enabled() and MTP_LABELS in batch
            self.mtp.targets = (batch[MTP_TOKENS], batch[MTP_LABELS]) if train else None
            try:
                yield extra
            finally:
                loss, self.mtp.targets, self.mtp.loss_sum = self.mtp.loss_sum, None, None
        extra.sum = inner.sum + (loss if loss is not None else 0.0)


__all__ = ["MTP_LABELS", "MTP_TOKENS", "MTPLayer", "MTPRuntime", "MultiTokenPrediction", "mtp_targets"]
