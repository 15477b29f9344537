"""The routers of a mixture of experts: which experts each token goes to, and with what weight.

* :class:`Router` -- token-choice top-k over softmax scores, with optional renormalization of the
  top-k weights (Qwen 3 MoE's ``norm_topk_prob``) and an optional bias on the scores (GPT-OSS);
* :class:`BiasedRouter` -- DeepSeek-V3's: sigmoid scores, a per-expert bias added for selection
  only, group-limited top-k and a routed scaling factor; the bias is nudged after each optimizer
  step toward even load (``moe.update_expert_bias``), outside the gradient.

Scores are fp32 whatever the compute dtype (``portatrain.models.common.moe``'s docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.models.common.layers import trunc_normal_


class Router(nn.Module):
    """Token-choice top-k routing: a linear scorer (``weight [n_experts, dim]``, HF's ``mlp.gate``;
    ``bias``: plus ``bias [n_experts]``, GPT-OSS's ``mlp.router``).

    With ``norm_topk_prob`` the weights are the softmax over the chosen experts' logits alone
    (``p_e / sum_topk p``), which is how GPT-OSS writes its router (softmax after top-k).
    """

    def __init__(
        self, dim: int, n_experts: int, top_k: int, *, norm_topk_prob: bool, bias: bool = False
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias else None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Router probabilities ``[T, n_experts]`` in fp32 (softmax over the experts).

        The scoring matmul runs in the compute dtype (bf16 under autocast or a bf16 FSDP2 policy);
        its logits are upcast before the softmax, on purpose: top-k selection, the routing weights
        and the balance statistics are then decided at fp32 resolution (transformers' Qwen3MoE
        softmaxes with ``dtype=torch.float``; torchtitan's ``TokenChoiceTopKRouter`` likewise). The
        weights go back to the activations' dtype only where they scale the experts' activations.
        """
        return F.softmax(F.linear(x, self.weight, self.bias).float(), dim=-1)

    def init_weights(self, std: float) -> None:
        trunc_normal_(self.weight, std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(weights [T, k] fp32, experts [T, k], probs [T, n_experts] fp32)`` for tokens ``x [T, dim]``."""
        probs = self.scores(x)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs

    def record_load(self, load: torch.Tensor) -> None:
        """Called by the layer in each training forward with the global batch's assignments per
        expert; a router that balances itself keeps them (this one does not)."""


class BiasedRouter(Router):
    """DeepSeek-V3's router: sigmoid scores, selection by score plus a per-expert bias, group-limited.

    Selection: each expert's ``sigmoid(x . w_e) + e_score_correction_bias[e]``; experts in
    ``n_group`` equal groups, each group scored by the sum of its two best, and only the
    ``topk_group`` best groups open (node-limited routing: a token's experts span at most that many
    groups, e.g. nodes); the top ``top_k`` of the open experts are chosen. Weights: the chosen
    experts' sigmoid scores without the bias, renormalized to sum to 1 (``norm_topk_prob``), times
    ``routed_scaling_factor``. Same arithmetic as transformers' ``DeepseekV3TopkRouter``.

    ``probs`` (for the optional load-balancing loss) are the scores normalized per token, as
    DeepSeek-V3's sequence-wise balance loss normalizes them.
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        *,
        n_group: int,
        topk_group: int,
        routed_scaling_factor: float,
        norm_topk_prob: bool,
        bias_update_rate: float,
    ) -> None:
        super().__init__(dim, n_experts, top_k, norm_topk_prob=norm_topk_prob)
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.bias_update_rate = bias_update_rate
        # HF's name; a persistent buffer (in checkpoints and exports), not a parameter: no gradient.
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))
        # Global assignments per expert since the last bias update (training forwards only).
        self.register_buffer("load", torch.zeros(n_experts), persistent=False)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        self.e_score_correction_bias.zero_()
        self.load.zero_()

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 sigmoid, as the softmax above: the bias added to select, the group scores and the
        # renormalized weights all live at fp32 resolution.
        return torch.sigmoid(F.linear(x, self.weight).float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.scores(x)
        choice = scores.detach() + self.e_score_correction_bias
        if self.topk_group < self.n_group:
            tokens, per_group = choice.shape[0], choice.shape[1] // self.n_group
            groups = choice.view(tokens, self.n_group, per_group)
            group_scores = groups.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
            best = group_scores.topk(self.topk_group, dim=-1).indices
            open_groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            open_experts = open_groups[:, :, None].expand(-1, -1, per_group).reshape(tokens, -1)
            choice = choice.masked_fill(~open_experts, float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts, scores / scores.sum(dim=-1, keepdim=True)

    def record_load(self, load: torch.Tensor) -> None:
        if self.bias_update_rate > 0:
            self.load.add_(load)

    def update_bias(self, ok: torch.Tensor | None = None) -> None:
        """Move the bias toward even load by the step's assignments, then forget them. ``ok``: a
        device bool, false where the optimizer step was skipped (then the bias stays)."""
        delta = self.bias_update_rate * torch.sign(self.load.mean() - self.load)
        delta = delta - delta.mean()
        if ok is not None:
            delta = delta * ok
        self.e_score_correction_bias.add_(delta)
        self.load.zero_()
