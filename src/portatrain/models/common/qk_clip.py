"""QK-clip (``optim.qk_clip``): MuonClip's cap on attention logits, after each optimizer step.

Kimi K2's report (https://arxiv.org/abs/2507.20534, section 2.1) bounds the logits at their source:
each step, every head ``h`` whose largest logit ``S_max = max scale * q_i . k_j`` passed the threshold
``tau`` gets ``gamma = tau / S_max``, and its query and key projections are scaled by ``sqrt(gamma)``
each, so that logit becomes ``tau``; other heads are untouched. The forward and backward are not
changed, only the weights after the step. What this file does:

* :func:`max_logits` -- each query head's largest logit over the pairs the attention lets see each
  other (causal, packed documents, a sliding window), in chunks of queries under ``no_grad``: never
  the ``S x S`` scores, ``B * H * chunk * S`` at a time;
* :class:`LogitMax` -- what an attention layer holds while QK-clip is on (``layer.qk_clip``; None, the
  default, costs nothing): the running maximum of the training forwards since the last step;
* :class:`QKClipRuntime` -- the post-step hook (:class:`~portatrain.models.spec.ModelRuntime`, around
  the family's other hooks): the maxima reduced with max over the ranks that saw other tokens,
  ``gamma`` per head, the projections' rows scaled on the device (no host read); metrics
  ``max_attn_logit`` and ``qk_clipped_heads`` at logging steps;
* :func:`scale_rows` -- one factor per output row of a weight or bias, on a plain tensor or a
  DTensor (FSDP2's and TP's row shards: each rank scales its rows by their head's factor);
* :func:`qk_clip_problems` -- the runs QK-clip refuses, one line each.

**Grouped-query attention.** A key head serves ``n_rep`` query heads. The key head is scaled by
``sqrt(g)``, ``g`` the smallest ``gamma`` of its group (the group's largest logit), and each query
head ``h`` by ``gamma_h / sqrt(g)``: every head's logits are then scaled by exactly its own
``gamma_h`` -- each clipped head lands on ``tau``, an unclipped head's logits do not move (its query
rows are scaled up by what its key lost). With one query head per key head this is the report's
``sqrt(gamma)`` on each. (Megatron-LM's ``SelfAttention.clip_qk`` instead scales the whole group by
the group's factor, lowering the logits of its unclipped heads too.)

**Latent attention** (DeepSeek's MLA), as the report prescribes: the head's non-rotary query and key
rows (``q_proj``/``q_b_proj`` and ``kv_b_proj``'s key part) by ``sqrt(gamma)``, its rotary query
rows by ``gamma``, the rotary key shared by every head untouched (scaling it would move every head).

**Not here.** Attention that normalizes queries and keys after their projections (``qk_norm``: Qwen 3,
Gemma 3, OLMo 2) undoes any scale of the projections, and QK-norm bounds the logits already;
context parallel attends through a callable that holds the row's keys; under pipeline parallel each
stage would clip its own layers and log only theirs (not done, nor tested, yet); LoRA's adapters add
to frozen projections it would not scale; fault tolerance's replica groups see other tokens and
share no maximum. :func:`qk_clip_problems` refuses each.

The report applies QK-clip with Muon (MuonClip), where it saw logits grow fastest; it rescales
weights after any update, so ``optim.qk_clip`` works with every ``optim.name``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from portatrain.errors import ConfigError
from portatrain.models.common.layers import Attention
from portatrain.models.common.mla import LatentAttention
from portatrain.models.spec import ModelRuntime, NoRuntime

QUERY_CHUNK = 128
"""Queries per chunk of :func:`max_logits`: ``B * H * 128 * S`` fp32 scores at a time (Llama 3 8B at
8,192 positions, one row: 128 MiB), where SDPA's math kernel would hold ``S / 128`` times that."""


@torch.no_grad()
def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None = None,
    chunk: int = QUERY_CHUNK,
) -> torch.Tensor:
    """Each query head's largest ``scale * q . k`` (fp32, ``[H]``) over the batch and the pairs allowed.

    ``q [B, H, S, D]``, ``k [B, H_kv, S, D]`` as attention gets them (query head ``h`` reads key head
    ``h // (H / H_kv)``); ``attn_mask`` None (causal) or bool ``[B or 1, 1, S, S]`` / ``[S, S]``, True
    where a query sees a key, causality included (``portatrain.models.attention``); ``scale`` None:
    ``1 / sqrt(D)``. A head whose queries see no key gets ``-inf``.
    """
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise ValueError("max_logits takes a boolean mask or None, not an attention callable")
    batch, heads, seq_len, dim = q.shape
    kv_heads = k.shape[1]
    n_rep = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    keys = k.float().transpose(-1, -2)  # [B, H_kv, D, S]
    mask = attn_mask[None, None] if attn_mask is not None and attn_mask.dim() == 2 else attn_mask
    key_pos = torch.arange(k.shape[2], device=q.device)
    best = torch.full((kv_heads, n_rep), float("-inf"), device=q.device)
    for start in range(0, seq_len, chunk):
        stop = min(start + chunk, seq_len)
        # A key head's n_rep query heads as rows of one matrix: no repeated keys.
        rows = q[:, :, start:stop].float().reshape(batch, kv_heads, n_rep * (stop - start), dim)
        # Every mask holds causality: keys past the chunk's last query are never seen (half the work).
        scores = (rows @ keys[..., :stop]).view(batch, kv_heads, n_rep, stop - start, stop)
        if mask is None:
            allowed = key_pos[:stop] <= torch.arange(start, stop, device=q.device)[:, None]  # [c, stop]
        else:
            allowed = mask[:, :, None, start:stop, :stop]  # [B or 1, 1, 1, c, stop]
        best = torch.maximum(best, scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 3, 4)))
    # max(scale * x) = scale * max(x) for scale > 0, rounding included (it is monotone).
    return best.view(heads) * scale


class LogitMax:
    """An attention layer's running maximum of :func:`max_logits` over the training forwards since the
    last optimizer step (``layer.qk_clip``); :meth:`take` hands it over and starts afresh."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def observe(self, q: torch.Tensor, k: torch.Tensor, attn_mask: Any, scale: float | None) -> None:
        # Training forwards only: an evaluation's logits (no grad) must not clip the weights. A
        # recomputed forward (activation checkpointing) finds the same maxima: max is idempotent.
        if not torch.is_grad_enabled():
            return
        if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
            raise ConfigError(
                "optim.qk_clip with context parallel: the row's keys are only gathered inside its "
                "attention; set parallel.cp=1 or optim.qk_clip=null"
            )
        found = max_logits(q, k, attn_mask, scale)
        self.value = found if self.value is None else torch.maximum(self.value, found)

    def take(self) -> torch.Tensor | None:
        value, self.value = self.value, None
        return value


def scale_rows(param: torch.Tensor, factor: torch.Tensor) -> None:
    """``param[i] *= factor[i]`` for each output row ``i`` (a weight's first dimension, a bias's only
    one), in place. ``factor`` holds the rows this rank's forward computes: all of them, or with tensor
    parallel its share (the projection column-sharded over the mesh dimension ``tp``). On a DTensor the
    factor takes the weight's layout -- TP's shard as it is, every other dimension (FSDP2's shards,
    strided over TP's too) cut from the whole, a local slice -- and each rank scales its own rows."""
    if not hasattr(param, "to_local"):
        param.mul_(factor.to(param.dtype).view(-1, *[1] * (param.ndim - 1)))
        return
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = param.device_mesh, tuple(param.placements)
    names = mesh.mesh_dim_names or ()
    column = factor.view(-1, *[1] * (param.ndim - 1))
    forward = tuple(
        p if i < len(names) and names[i] == "tp" else Replicate() for i, p in enumerate(placements)
    )
    rows = DTensor.from_local(column, mesh, forward, run_check=False).redistribute(mesh, placements)
    param.to_local().mul_(rows.to_local().to(param.dtype))


def _gqa_factors(gamma: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query heads' and key heads' factors: key head ``sqrt(g)``, ``g`` its group's smallest gamma; query
    head ``gamma_h / sqrt(g)`` (the module docstring)."""
    group = gamma.view(kv_heads, -1)
    key = group.amin(dim=1, keepdim=True).sqrt()
    return (group / key).reshape(-1), key.reshape(-1)


@torch.no_grad()
def clip_attention(layer: nn.Module, gamma: torch.Tensor) -> None:
    """Scale ``layer``'s query and key projections by each query head's ``gamma`` (``[H]`` of the heads
    this rank computes; 1 keeps a head as it is)."""
    if isinstance(layer, LatentAttention):
        _clip_latent(layer, gamma)
        return
    head_dim = layer.head_dim
    kv_heads = layer.k_proj.weight.shape[0] * gamma.numel() // layer.q_proj.weight.shape[0]
    query, key = _gqa_factors(gamma, kv_heads)
    for linear, factor in ((layer.q_proj, query), (layer.k_proj, key)):
        rows = factor.repeat_interleave(head_dim)
        for param in (linear.weight, linear.bias):
            if param is not None:
                scale_rows(param, rows)


def _clip_latent(layer: LatentAttention, gamma: torch.Tensor) -> None:
    root = gamma.sqrt()[:, None]
    nope, rope, value = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    query = torch.cat([root.expand(-1, nope), gamma[:, None].expand(-1, rope)], dim=1).reshape(-1)
    key = torch.cat([root.expand(-1, nope), torch.ones_like(root).expand(-1, value)], dim=1).reshape(-1)
    q_linear = layer.q_proj if hasattr(layer, "q_proj") else layer.q_b_proj
    scale_rows(q_linear.weight, query)
    scale_rows(layer.kv_b_proj.weight, key)


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The layers QK-clip measures and scales: grouped-query and latent attention."""
    return [m for m in model.modules() if isinstance(m, (Attention, LatentAttention))]


class QKClipRuntime(NoRuntime):
    """QK-clip's hooks around another runtime's (:class:`~portatrain.models.spec.ModelRuntime`):
    ``threshold`` is ``tau``; ``reduce_max`` takes the maximum over the ranks that saw other tokens
    (data and context parallel; None on one). Each attention layer of ``model`` gets a
    :class:`LogitMax` (``layer.qk_clip``)."""

    def __init__(
        self,
        model: nn.Module,
        inner: ModelRuntime,
        threshold: float,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.inner, self.threshold, self.reduce_max = inner, float(threshold), reduce_max
        self.layers = attention_layers(model)
        if not self.layers:
            raise ConfigError(
                f"optim.qk_clip={threshold}: {type(model).__name__} has no attention layer QK-clip can "
                "scale; set optim.qk_clip=null"
            )
        for layer in self.layers:
            layer.qk_clip = LogitMax()
        self.window_max: torch.Tensor | None = (
            None  # the largest logit of the applied steps since the last log
        )
        self.window_clipped: torch.Tensor | None = None  # heads clipped since the last log (a head each step)

    def post_optimizer_step(self, ok: torch.Tensor) -> None:
        self.inner.post_optimizer_step(ok)
        found = [(layer, layer.qk_clip.take()) for layer in self.layers]
        found = [(layer, m) for layer, m in found if m is not None]  # layers no forward reached
        if not found:
            return
        sizes = [m.numel() for _, m in found]
        maxima = torch.cat([m for _, m in found])
        if self.reduce_max is not None:
            maxima = self.reduce_max(maxima)
        # ``ok`` false (a skipped or rehearsed step): nothing clipped, nothing counted.
        clipped = ok & (maxima > self.threshold)
        gamma = torch.where(clipped, self.threshold / maxima, torch.ones_like(maxima))
        for (layer, _), part in zip(found, gamma.split(sizes), strict=True):
            clip_attention(layer, part)
        largest = torch.where(ok, maxima.max(), float("-inf"))
        count = clipped.sum()
        if self.window_max is None:
            self.window_max, self.window_clipped = largest, count
        else:
            self.window_max = torch.maximum(self.window_max, largest)
            self.window_clipped = self.window_clipped + count

    def metrics(self) -> dict[str, float]:
        """``max_attn_logit``: the largest logit of the steps since the last call (before clipping);
        ``qk_clipped_heads``: the heads clipped in them, a head once per step. Every rank calls it (a
        collective over the tensor-parallel ranks, which hold different heads)."""
        own = {}
        if self.window_max is not None:
            largest, count = self.window_max.clone(), self.window_clipped.float()
            group = _tp_group(self.layers[0])
            if group is not None:
                import torch.distributed as dist

                dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
            largest, count = torch.stack([largest, count]).tolist()
            if math.isfinite(largest):
                own = {"max_attn_logit": largest, "qk_clipped_heads": int(count)}
            self.window_max = self.window_clipped = None
        return {**self.inner.metrics(), **own}

    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.inner.prepare_batch(batch)

    def extra_loss(self, batch: dict[str, torch.Tensor]) -> Any:
        return self.inner.extra_loss(batch)


def _tp_group(layer: nn.Module) -> Any:
    """The process group of the tensor-parallel ranks that split ``layer``'s heads, or None."""
    linear = next(getattr(layer, n) for n in ("q_proj", "q_b_proj") if hasattr(layer, n))
    mesh = getattr(linear.weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
        return None
    return mesh.get_group("tp")


def qk_clip_problems(
    threshold: float | None, parallel: Any, args: Any, *, lora: bool = False, replica_groups: bool = False
) -> list[str]:
    """Why ``optim.qk_clip=threshold`` cannot run with ``parallel`` (a ``ParallelConfig``), the model
    ``args`` (None: not known), LoRA adapters (``lora``) and fault tolerance's replica groups
    (``replica_groups``); empty when it can or when QK-clip is off."""
    if not threshold or threshold < 0:  # off, or a bad value (``optim_problems`` names it)
        return []
    problems = []
    if lora:
        problems.append(
            f"optim.qk_clip={threshold} with LoRA: the frozen projections' adapters would escape its "
            "scaling; set optim.qk_clip=null or finetune.method=full"
        )
    qk_norm = getattr(args, "qk_norm", "none")
    if qk_norm != "none":
        problems.append(
            f"optim.qk_clip={threshold}: this model normalizes queries and keys after their projections "
            f"(qk_norm={qk_norm}), which undoes QK-clip's scaling and bounds the logits already; set "
            "optim.qk_clip=null"
        )
    if parallel.cp > 1:
        problems.append(
            f"optim.qk_clip={threshold} with parallel.cp={parallel.cp}: the logits of a row are only "
            "complete inside context parallel's attention; set parallel.cp=1 or optim.qk_clip=null"
        )
    if replica_groups:
        problems.append(
            f"optim.qk_clip={threshold} with fault_tolerance.enabled=true: each replica group would clip by "
            "its own logits and the groups' weights would part; set optim.qk_clip=null"
        )
    if parallel.pp > 1:
        problems.append(
            f"optim.qk_clip={threshold} with parallel.pp={parallel.pp}: QK-clip under pipeline stages is "
            "not supported yet; set parallel.pp=1 or optim.qk_clip=null"
        )
    return problems
