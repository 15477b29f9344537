"""A mixture-of-experts feed-forward shared by the families: router, stacked experts, two dispatch modes.

What is here, top to bottom (the grouped matmuls are ``grouped_mm.py``'s and the routers
``routers.py``'s, re-exported here):

* :func:`grouped_linear` -- ``x[offs[g-1]:offs[g]] @ w[g].T`` for every group ``g``, as custom ops:
  ``torch._grouped_mm`` where the accelerator adapter says it runs in the dtype
  (``Accelerator.supports_grouped_mm``: CPU fp32 and bf16, CUDA bf16 on sm90+; passed down by
  :func:`configure_moe`), a loop over the groups elsewhere. Opaque to ``torch.compile`` (its output
  shape is static), so a compiled block never traces the data-dependent group sizes.
* :class:`Router` -- token-choice top-k over softmax scores, with optional renormalization of the
  top-k weights (Qwen 3 MoE's ``norm_topk_prob``) and an optional bias on the scores (GPT-OSS).
* :class:`BiasedRouter` -- DeepSeek-V3's: sigmoid scores, a per-expert bias added for selection
  only, group-limited top-k and a routed scaling factor; the bias is nudged after each optimizer
  step toward even load (:func:`update_expert_bias`), outside the gradient.
* :class:`GroupedExperts` -- every expert's SwiGLU weights stacked as ``[n_experts, ...]`` tensors,
  in Hugging Face transformers 5's layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
  optionally with biases and another gate (GPT-OSS's :func:`clamped_swiglu`).
* :class:`MoE` -- routes, dispatches, combines; adds the load-balancing loss to the gradient and keeps
  routing statistics in buffers.

Dispatch modes (``MoE.dispatch``; the trainer picks one from the device, a recipe names neither):

* ``dropless`` -- every token reaches its ``top_k`` experts. Assignments are sorted by expert and
  the experts run as one grouped matmul over groups of varying size. Right where shapes may vary
  (CPU, CUDA): nothing is padded or dropped.
* ``capacity`` -- each expert has ``ceil(capacity_factor * tokens * top_k / n_experts)`` slots, a
  static number; assignments beyond an expert's slots are dropped (the token keeps its residual
  and its other experts) and counted. Every tensor has a shape fixed by the batch shape, and no
  value leaves the device: what XLA-style compilers (TPU, Trainium) need to compile once. First
  choices take slots before second choices (GShard, Lepikhin et al. 2020,
  https://arxiv.org/abs/2006.16668), so a token loses its weakest experts first.

Load balance: the auxiliary loss of Switch Transformer (Fedus et al. 2021,
https://arxiv.org/abs/2101.03961) in Qwen 3 MoE's form (transformers'
``load_balancing_loss_func``): ``n_experts * sum_e f_e * P_e`` with ``f_e`` the assignments to
``e`` per token and ``P_e`` the mean router probability of ``e``. It is added to the gradient inside
the layer (:class:`_AddAuxLoss`, as DeepSeek's published modelling code does), scaled by
``aux_loss_coef * aux_loss_scale``; the model's output and the logged language-model loss are
unchanged. Its statistics are the global batch's (summed over the data-parallel ranks by
``MoE.reduce_stats``, which the trainer sets), and the trainer sets ``aux_loss_scale`` to
``1 / micro-batches``, so every layout computes the loss one process would.

Auxiliary-loss-free balance (DeepSeek-V3, https://arxiv.org/abs/2412.19437, section 2.1.2): a
:class:`BiasedRouter` adds ``e_score_correction_bias`` to the scores it selects by (not to the
weights it returns) and, after each optimizer step, moves each expert's bias by
``bias_update_rate`` toward even load -- down if the expert took more than the mean of the step's
global assignments, up if fewer (then centred, as torchtitan's ``_update_expert_bias``, which does not
change any selection). The bias is a persistent buffer: checkpoints keep it and resume it.

Routing statistics accumulate in non-persistent buffers (no host sync); :func:`routing_stats`
reads and resets them at logging steps.

Precision: the router's scores, the routing statistics and the balance loss are fp32 whatever the
compute dtype; tokens go to the experts in the dtype their matmuls run in (:func:`matmul_dtype`: bf16
under autocast) and the experts' outputs are combined back in the activations' dtype.

Expert parallelism is a slot, not a branch on the world: ``MoE.exchange`` is None on one device;
the parallel stage (``portatrain.parallel.expert``) sets it to an object that carries the sorted rows
(dropless) or the slot buffer (capacity) to the ranks holding their experts and back, and passes the
experts' weights, stored as DTensors split over the experts, are read through ``GroupedExperts``'
``weight_view`` slot (identity here; the rank's local shard under expert parallel).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.dtypes import DTYPES
from portatrain.kernels.reference import swiglu
from portatrain.models.common.grouped_mm import grouped_linear as grouped_linear
from portatrain.models.common.grouped_mm import grouped_mm as grouped_mm
from portatrain.models.common.grouped_mm import grouped_outer as grouped_outer
from portatrain.models.common.layers import FeedForward, trunc_normal_
from portatrain.models.common.routers import BiasedRouter as BiasedRouter
from portatrain.models.common.routers import Router as Router
from portatrain.models.spec import NoRuntime

if TYPE_CHECKING:
    from portatrain.models.spec import RuntimeOptions

DISPATCH_MODES: tuple[str, ...] = ("dropless", "capacity")


def _stored(weight: torch.Tensor) -> torch.Tensor:
    return weight


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: autocast's where it is on for ``x``'s device, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert gate: ``(up + 1) * gate * sigmoid(alpha * gate)``, the gate clamped to at most
    ``limit`` and ``up`` to ``[-limit, limit]`` (openai/gpt-oss ``gpt_oss/torch/model.py``, ``swiglu``).
    Not SiLU (``alpha`` 1.702, the sigmoid approximation of GELU), so no kernel slot computes it."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class GroupedExperts(nn.Module):
    """``n_experts`` gated feed-forwards with stacked weights: SwiGLU through the kernel slot
    ``swiglu_fn``, or ``activation(gate, up)`` (no slot). ``bias``: each expert's projections have
    biases (``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``, GPT-OSS)."""

    def __init__(
        self,
        n_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        bias: bool = False,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim)) if bias else None
        self.activation = activation
        if activation is None:  # no slot otherwise: a SwiGLU kernel must not replace another gate
            self.swiglu_fn = swiglu  # silu(gate) * up, unless a kernel override replaces it
        self.weight_view = _stored  # the weights as computed with (expert parallel: the local shard)
        # Dtypes the device runs ``torch._grouped_mm`` in (set by ``configure_moe`` from the
        # accelerator adapter); empty: the loop over the groups, which runs anywhere.
        self.grouped_mm_dtypes: frozenset[torch.dtype] = frozenset()

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.gate_up_proj, std)
        trunc_normal_(self.down_proj, out_std)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.swiglu_fn(gate, up) if self.activation is None else self.activation(gate, up)

    # Both take each row's routing weight and apply it to the SwiGLU activations (width ``hidden``)
    # rather than to the outputs (width ``dim``, larger): the down projection is linear, so the
    # result is the same, with less memory traffic. The fp32 routing weight is cast to the
    # activations' dtype first (as transformers' MoE blocks do), so a bf16 product stays bf16 and
    # the down projection's input is not promoted to fp32.

    # Under expert parallel the weights read through ``weight_view`` hold this rank's experts
    # only (a slice along dim 0), so ``n_experts`` below is however many experts they hold.

    def grouped(self, x: torch.Tensor, offs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows of ``x [N, dim]`` sorted by expert, group ends ``offs``, routing ``weights [N]``:
        ``[N, dim]`` (dropless), in the dtype the matmuls ran in."""
        gate_up_proj, down_proj = self.weight_view(self.gate_up_proj), self.weight_view(self.down_proj)
        # A custom op is opaque to autocast, which would leave these matmuls in fp32 (the weights'
        # dtype) where every nn.Linear runs in bf16: apply autocast's rule for matmuls by hand.
        dtype = matmul_dtype(x)
        x, gate_up_proj, down_proj = x.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)
        native = dtype in self.grouped_mm_dtypes
        gate_up = grouped_linear(x, gate_up_proj, offs, native)
        if self.gate_up_proj_bias is not None:  # each row's expert, from the group ends (no host read)
            expert = torch.searchsorted(
                offs, torch.arange(x.shape[0], device=x.device, dtype=offs.dtype), right=True
            )
            gate_up = gate_up + self.weight_view(self.gate_up_proj_bias).to(dtype)[expert]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self._glu(gate, up) * weights[:, None].to(gate.dtype)
        out = grouped_linear(hidden, down_proj, offs, native)
        if self.down_proj_bias is not None:  # the weight scales the bias too: w * (down(h) + b)
            out = out + self.weight_view(self.down_proj_bias).to(dtype)[expert] * weights[:, None].to(dtype)
        return out

    def batched(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert's slots ``x [n_experts, slots, dim]`` with routing ``weights [n_experts, slots]``:
        ``[n_experts, slots, dim]`` (capacity), in the dtype the matmuls ran in."""
        gate_up_proj, down_proj = self.weight_view(self.gate_up_proj), self.weight_view(self.down_proj)
        # Features first (``weight @ x^T``), so the weights' gradients come back in their stored
        # layout and are not copied into it.
        gate_up = torch.matmul(gate_up_proj, x.transpose(1, 2))  # [E, 2I, slots]
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.weight_view(self.gate_up_proj_bias).to(gate_up.dtype)[:, :, None]
        gate, up = gate_up.chunk(2, dim=1)
        hidden = self._glu(gate, up) * weights[:, None, :].to(gate.dtype)
        out = torch.matmul(down_proj, hidden)  # [E, H, slots]
        if self.down_proj_bias is not None:  # an empty slot's weight is 0: its bias adds nothing
            bias = self.weight_view(self.down_proj_bias).to(out.dtype)
            out = out + bias[:, :, None] * weights[:, None, :].to(out.dtype)
        # Contiguous, not a transposed view: FSDP2 wraps this method (register_fsdp_forward_method)
        # and warns on every rank about a view output (an in-place op on it would skip its
        # pre-backward hook). Free: both callers reshape it at once, which copied it anyway.
        return out.transpose(1, 2).contiguous()


class ExpertExchange(Protocol):
    """What ``MoE.exchange`` holds: the experts run somewhere else (expert parallel). Each method
    returns rows in the order it was given them."""

    def grouped(
        self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Dropless: ``rows [N, dim]`` sorted by expert, ``counts [n_experts]`` rows per expert."""
        ...

    def batched(self, experts: GroupedExperts, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Capacity: every expert's ``slots [n_experts, slots, dim]``, routing ``weights [n_experts, slots]``."""
        ...


class _AddAuxLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward, gives ``aux`` the gradient ``scale`` (so ``scale * aux``
    joins the training loss without changing any value the model returns)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """Routed experts (plus optional always-on shared experts) in place of a block's feed-forward.

    Args:
        dim: model width. hidden_dim: each expert's SwiGLU width. n_experts, top_k: routing.
        norm_topk_prob: renormalize the top-k weights to sum to 1 (Qwen 3 MoE: true).
        n_shared_experts: experts every token passes through, as one SwiGLU ``n_shared * hidden_dim``
            wide (DeepSeek's ``shared_experts``); 0 for none.
        aux_loss_coef: weight of the load-balancing loss (Qwen 3 MoE's ``router_aux_loss_coef``).
        router: the router (e.g. a :class:`BiasedRouter`); default a softmax :class:`Router`.
        experts: the routed experts (e.g. biased, with another gate); default SwiGLU :class:`GroupedExperts`.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        n_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool,
        n_shared_experts: int = 0,
        aux_loss_coef: float = 0.0,
        router: Router | None = None,
        experts: GroupedExperts | None = None,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_coef = aux_loss_coef
        self.gate = Router(dim, n_experts, top_k, norm_topk_prob=norm_topk_prob) if router is None else router
        self.experts = GroupedExperts(n_experts, dim, hidden_dim) if experts is None else experts
        self.shared_experts = FeedForward(dim, hidden_dim * n_shared_experts) if n_shared_experts else None
        # Execution settings the trainer sets (model code never looks at the device).
        self.dispatch = "dropless"
        self.capacity_factor = 1.25
        self.aux_loss_scale = 1.0
        # Sums routing statistics over the data-parallel ranks (set by the trainer), or None.
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Expert-parallel slot (set by portatrain.parallel.expert): None while every expert is here.
        self.exchange: ExpertExchange | None = None
        # Routing statistics since the last read (routing_stats): assignments per expert, dropped
        # assignments, and the auxiliary loss summed over forward passes.
        self.register_buffer("expert_load", torch.zeros(n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("forwards", torch.zeros(()), persistent=False)

    def init_weights(self, std: float, out_std: float) -> None:
        self.gate.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
        self.reset_stats()

    @torch.no_grad()
    def reset_stats(self) -> None:
        for buffer in (self.expert_load, self.dropped, self.aux_loss_sum, self.forwards):
            buffer.zero_()

    def capacity(self, tokens: int) -> int:
        """Slots per expert for ``tokens`` tokens in ``capacity`` mode (at most ``tokens``)."""
        return min(tokens, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, probs = self.gate(x)
        # One row per (choice, token), choice-major: every first choice before any second one.
        flat_experts = experts.t().reshape(-1)
        flat_weights = weights.t().reshape(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat(self.top_k)
        if self.dispatch == "capacity":
            y, dropped = self._capacity(x, flat_experts, flat_weights, token)
        else:
            y, dropped = self._dropless(x, flat_experts, flat_weights, token), None
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        # Statistics in fp32 whatever the compute dtype: counts stay exact (to 2**24 assignments;
        # bf16 stops counting at 256) and sum with the fp32 router probabilities.
        load = torch.zeros(self.n_experts, dtype=torch.float32, device=x.device).index_add_(
            0, flat_experts, torch.ones_like(flat_experts, dtype=torch.float32)
        )
        # The balance loss over the global batch: assignment counts, probability sums and token
        # counts summed over the data-parallel ranks (``reduce_stats``, set by the trainer; identity
        # on one rank). Each rank's gradient is then its own tokens' share of the global loss's, so
        # any layout trains as one process would (and as Qwen's global-batch balancing, Qiu et al.
        # 2025, https://arxiv.org/abs/2501.11873).
        prob_sums = probs.sum(dim=0)
        stats = torch.cat([load, prob_sums.detach(), load.new_full((1,), x.shape[0])])
        if self.reduce_stats is not None:
            stats = self.reduce_stats(stats)
        load_share = stats[: self.n_experts] / stats[-1]  # assignments per token, per expert
        aux = self.n_experts * (load_share * stats[self.n_experts : -1]).sum() / stats[-1]  # its value
        if self.training and self.aux_loss_coef > 0 and torch.is_grad_enabled():
            own = self.n_experts * (load_share * prob_sums).sum() / stats[-1]  # this rank's gradient
            y = _AddAuxLoss.apply(y, own, self.aux_loss_coef * self.aux_loss_scale)
        with torch.no_grad():
            if self.training:
                self.gate.record_load(stats[: self.n_experts])
            self.expert_load.add_(load)
            self.aux_loss_sum.add_(aux.detach())
            self.forwards.add_(1)
            if dropped is not None:
                self.dropped.add_(dropped)
        return y.reshape(shape)

    def _dropless(
        self, x: torch.Tensor, flat_experts: torch.Tensor, flat_weights: torch.Tensor, token: torch.Tensor
    ) -> torch.Tensor:
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.zeros(self.n_experts, dtype=torch.int32, device=x.device).index_add_(
            0, flat_experts, torch.ones_like(flat_experts, dtype=torch.int32)
        )
        # Rows travel in the experts' matmul dtype (bf16 under autocast: half the buffer and the
        # expert-parallel exchange of fp32 rows, which the experts' first matmul would round anyway).
        dtype = matmul_dtype(x)
        rows, row_weights = x[token[order]].to(dtype), flat_weights[order].to(dtype)
        if self.exchange is None:
            out = self.experts.grouped(rows, torch.cumsum(counts, dim=0, dtype=torch.int32), row_weights)
        else:
            out = self.exchange.grouped(self.experts, rows, counts, row_weights)
        # The experts' output is in their matmuls' dtype (bf16 under autocast); the combine sums each
        # token's top_k rows in the activations' dtype (fp32 under autocast), as the residual adds them.
        return torch.zeros_like(x).index_add_(0, token[order], out.to(x.dtype))

    def _capacity(
        self, x: torch.Tensor, flat_experts: torch.Tensor, flat_weights: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.capacity(x.shape[0])
        one_hot = F.one_hot(flat_experts, self.n_experts).to(torch.int32)
        position = (one_hot.cumsum(dim=0) - 1).gather(1, flat_experts[:, None]).squeeze(1)
        kept = position < slots
        trash = self.n_experts * slots  # one extra row that dropped assignments write to, never read
        slot = torch.where(kept, flat_experts * slots + position, trash)
        dtype = matmul_dtype(x)  # the slots in the experts' matmul dtype, as _dropless's rows
        buffer = x.new_zeros(trash + 1, x.shape[1], dtype=dtype).index_put((slot,), x[token].to(dtype))
        slot_weights = x.new_zeros(trash + 1, dtype=dtype).index_put((slot,), (flat_weights * kept).to(dtype))
        expert_slots = buffer[:trash].view(self.n_experts, slots, -1)
        expert_weights = slot_weights[:trash].view(self.n_experts, slots)
        if self.exchange is None:
            out = self.experts.batched(expert_slots, expert_weights)
        else:
            out = self.exchange.batched(self.experts, expert_slots, expert_weights)
        out = out.reshape(trash, -1)
        out = torch.cat([out, out.new_zeros(1, out.shape[1])])[slot]  # a dropped row reads zeros
        y = torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))  # as in _dropless
        return y, (~kept).sum().float()


@torch.no_grad()
def routing_stats(model: nn.Module) -> dict[str, float]:
    """Routing statistics of every :class:`MoE` layer since the last call, then reset (a host sync:
    call at logging steps). Keys: ``moe_load_max_mean`` (the busiest expert's load over the mean,
    the worst layer; 1.0 is perfect balance), ``moe_aux_loss`` (mean over layers and forwards) and,
    in ``capacity`` mode, ``moe_dropped`` (the fraction of assignments dropped). Empty without MoE."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return {}
    # One host read for every layer's figures (a row each: forwards, the busiest expert's load over
    # the mean, the mean aux loss, assignments, drops), not five ``.item()`` per layer.
    rows = torch.stack(
        [
            torch.stack(
                [
                    m.forwards.float(),
                    m.expert_load.max() / m.expert_load.mean().clamp_min(1e-9),
                    m.aux_loss_sum / m.forwards.clamp_min(1),
                    m.expert_load.sum(),
                    m.dropped.float(),
                ]
            ).float()
            for m in layers
        ]
    ).tolist()
    seen = [(m, row) for m, row in zip(layers, rows) if row[0] > 0]
    for m in layers:
        m.reset_stats()
    if not seen:
        return {}
    stats = {
        "moe_load_max_mean": max(row[1] for _, row in seen),
        "moe_aux_loss": sum(row[2] for _, row in seen) / len(seen),
    }
    if any(m.dispatch == "capacity" for m, _ in seen):
        stats["moe_dropped"] = sum(row[4] for _, row in seen) / max(sum(row[3] for _, row in seen), 1.0)
    return stats


def balanced_routers(model: nn.Module) -> list[BiasedRouter]:
    """The routers whose bias :func:`update_expert_bias` moves (those with a positive rate)."""
    return [m for m in model.modules() if isinstance(m, BiasedRouter) and m.bias_update_rate > 0]


@torch.no_grad()
def update_expert_bias(routers: list[BiasedRouter], ok: torch.Tensor | None = None) -> None:
    """After an optimizer step: each router's bias toward even load (``ok`` false: the step was
    skipped, the bias stays). On the device, no host sync; every rank computes the same update
    from the global assignments."""
    for router in routers:
        router.update_bias(ok)


def configure_moe(
    model: nn.Module,
    *,
    dispatch: str,
    capacity_factor: float,
    aux_loss_scale: float,
    reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None,
    supports_grouped_mm: Callable[[torch.dtype], bool] | None = None,
) -> int:
    """Set every :class:`MoE` layer's execution settings; returns how many there are.
    ``supports_grouped_mm``: the accelerator adapter's answer (``Accelerator.supports_grouped_mm``),
    asked once per training dtype here; None: dropless experts loop over the groups."""
    native = frozenset(d for d in DTYPES.values() if supports_grouped_mm and supports_grouped_mm(d))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.dispatch, m.capacity_factor, m.aux_loss_scale = dispatch, capacity_factor, aux_loss_scale
        m.reduce_stats = reduce_stats
        m.experts.grouped_mm_dtypes = native
    return len(layers)


class MoERuntime(NoRuntime):
    """The mixture of experts' hooks around the step (:class:`~portatrain.models.spec.ModelRuntime`):
    every :class:`MoE` layer configured for the run, the balanced routers' bias moved after each
    optimizer step (DeepSeek-V3), the routing statistics at logging steps. No-ops for a dense model."""

    def __init__(self, model: nn.Module, options: RuntimeOptions) -> None:
        self.model = model
        configure_moe(
            model,
            dispatch=options.moe_dispatch,
            capacity_factor=options.capacity_factor,
            aux_loss_scale=options.aux_loss_scale,
            reduce_stats=options.reduce_stats,
            supports_grouped_mm=options.supports_grouped_mm,
        )
        self.routers = balanced_routers(model)

    def post_optimizer_step(self, ok: torch.Tensor) -> None:
        update_expert_bias(self.routers, ok)

    def metrics(self) -> dict[str, float]:
        return routing_stats(self.model)
