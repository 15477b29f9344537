"""Muon (``optim.name=muon``): orthogonalized momentum on the hidden matrices, AdamW on the rest, in
one optimizer object.

- :func:`split_params` -- the hidden matrices (2-D and stacked-expert 3-D weights inside the blocks,
  ``model.layers``, routers excepted) and everything else (embeddings, the output head, norms,
  biases, routers);
- :class:`Muon` -- a ``torch.optim.Optimizer`` with two kinds of parameter groups
  (``algorithm="muon"`` / ``"adamw"``): one ``state_dict``, so the checkpointer saves and reshards it
  through DCP's ``get_optimizer_state_dict`` like any optimizer;
- :func:`orthogonalize` -- Newton-Schulz on the last two dimensions (one matrix, or one per expert),
  gathering a DTensor's matrix dimensions first where they are sharded;
- :func:`orthogonalize_round_robin` -- the same for a step's sharded matrices together, each whole on
  one owner rank (:func:`assign_owners`) and back, in two all-to-alls (Muon's default).

The algorithm is ``torch.optim.Muon``'s (``torch/optim/_muon.py`` in PyTorch 2.13): momentum by
``lerp``, Nesterov's look-ahead, five quintic Newton-Schulz steps in bf16 with Keller Jordan's
coefficients (https://kellerjordan.github.io/posts/muon/), decoupled weight decay by the unadjusted
LR, and its LR adjustments: ``original`` (``sqrt(max(1, rows / cols))``, Keller Jordan's) and
``match_rms_adamw`` (``0.2 * sqrt(max(rows, cols))``: the update's RMS matches AdamW's, so AdamW's LR
and weight decay carry over -- Moonlight, "Muon is Scalable for LLM Training",
https://arxiv.org/abs/2502.16982, section 2.2). A one-process step with the same split is
``torch.optim.Muon`` plus ``torch.optim.AdamW`` to the bit (``tests/test_muon.py``).

**Distributed.** Newton-Schulz needs the whole matrix. Shards of a leading dimension (expert
parallel's and FSDP2's ``Shard(0)`` of ``[experts, out, in]``) hold whole matrices and are
orthogonalized where they are. A matrix whose dimension one mesh dimension shards (FSDP2's or TP's
``Shard(0)``, TP's ``Shard(1)``, FSDP2's ``Shard(1)`` of experts split finer than experts) goes round
robin (:func:`orthogonalize_round_robin`, the default): each matrix gets one owner rank of that mesh
dimension (the largest matrices first, each to the least-loaded rank), one all-to-all sends every
shard to its owner, the owner alone orthogonalizes the whole matrix, and a second all-to-all returns
each rank its slice -- the layer sharding of Essential AI (https://essential.ai/blog/muon-layer-sharding)
and microsoft/dion's ``dion/muon.py``. Against the gather (``sharded="gather"``: an all-gather over
the sharding mesh dimensions, every rank orthogonalizing every matrix, Moonlight's "Distributed Muon",
https://arxiv.org/abs/2502.16982 section 2.3) it does ``1 / world`` of the Newton-Schulz work per rank
and moves ``2 / world`` of the bytes, with the same result to the bit (the owner runs the same ops on
the same whole matrix). What round robin does not cover -- a matrix dimension split over two mesh
dimensions (FSDP2 over TP, ``_StridedShard``) -- is gathered. Both move the update in ``ns_dtype``
(Newton-Schulz casts to it first: bf16 halves fp32's bytes, the same result). Pipeline stages each
hold their own parameters: nothing to do. ``scripts/bench_muon.py`` measures both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam

from portatrain.dtypes import dtype_from_name
from portatrain.models.common.moe import Router

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic coefficients (``torch.optim.Muon``'s default): the steepest slope at zero,
at the price of singular values left anywhere in about [0.5, 1.5] after five steps rather than at 1
(``torch/optim/_muon.py``'s docstring: it does not hurt training)."""
ADJUST_LR = ("original", "match_rms_adamw")
"""Allowed values of ``optim.muon.adjust_lr`` (``torch.optim.Muon``'s ``adjust_lr_fn``)."""
SHARDED = ("round_robin", "gather")
"""How :class:`Muon` orthogonalizes a matrix sharded over ranks (see the module docstring); round robin
was the faster in ``scripts/bench_muon.py`` (docs/optimizers.md), the gather stays for comparison."""


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(hidden matrices, the rest)`` of ``model``'s trainable parameters.

    Hidden: the 2-D and 3-D (stacked experts) weights of the blocks, ``model.layers``. The rest -- the
    embedding, the output head, norms, biases and the routers (a router's rows are one vector per
    expert, not a linear map between hidden states) -- go to AdamW, as Keller Jordan's post and
    Moonlight prescribe. A model without ``layers`` has no hidden matrices (all AdamW)."""
    blocks = getattr(model, "layers", None)
    hidden: dict[int, nn.Parameter] = {}
    if isinstance(blocks, nn.Module):
        routers = {id(p) for m in blocks.modules() if isinstance(m, Router) for p in m.parameters()}
        for p in blocks.parameters():
            if p.requires_grad and p.ndim in (2, 3) and id(p) not in routers:
                hidden[id(p)] = p
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden]
    return list(hidden.values()), rest


def _newton_schulz(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` on the last two dimensions (batched over a
    leading experts dimension with ``baddbmm``), in ``dtype`` (torch's: bf16); a 2-D input runs its
    exact ops (``addmm``)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def orthogonalize(
    update: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    *,
    on_receive: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Newton-Schulz of each matrix of ``update`` (its last two dimensions), in ``dtype``; a DTensor comes
    back a DTensor of the same layout, its sharded matrices gathered whole on every rank (see the
    module docstring). ``on_receive(bytes)`` is told what the gather receives on this rank (the
    benchmark counts it)."""
    if not hasattr(update, "to_local"):
        return _newton_schulz(update, coefficients, steps, eps, dtype)
    from torch.distributed.tensor import DTensor, Replicate

    matrix_dims = (update.ndim - 2, update.ndim - 1)
    placements = tuple(update.placements)
    # Shard and _StridedShard (FSDP2's placement over a TP shard of the same dimension; not a Shard
    # subclass) both name the dimension they split.
    whole = tuple(Replicate() if getattr(p, "dim", None) in matrix_dims else p for p in placements)
    if whole == placements:  # every local matrix is whole (expert shards, or no sharding)
        local = _newton_schulz(update.to_local(), coefficients, steps, eps, dtype)
        return DTensor.from_local(
            local, update.device_mesh, placements, run_check=False, shape=update.shape, stride=update.stride()
        )
    # Gather in Newton-Schulz's dtype: it casts to it first anyway, so the result is the same (bf16:
    # half fp32's bytes).
    gathered = update.to(dtype).redistribute(update.device_mesh, whole)
    if on_receive is not None:
        local = gathered.to_local()
        on_receive((local.numel() - update.to_local().numel()) * local.element_size())
    result = _newton_schulz(gathered.to_local(), coefficients, steps, eps, dtype)
    # Replicate -> Shard is a local slice: no communication.
    return DTensor.from_local(result, update.device_mesh, whole, run_check=False).redistribute(
        update.device_mesh, placements
    )


def round_robin_dim(update: torch.Tensor) -> tuple[int, int] | None:
    """``(mesh dimension, tensor dimension)`` where one mesh dimension alone splits one of ``update``'s
    matrix dimensions with a plain ``Shard`` -- what :func:`orthogonalize_round_robin` takes; None for
    anything else (a plain tensor, whole local matrices, a dimension split over two mesh dimensions)."""
    if not hasattr(update, "to_local"):
        return None
    from torch.distributed.tensor import Shard

    matrix_dims = (update.ndim - 2, update.ndim - 1)
    split = [(i, p) for i, p in enumerate(update.placements) if getattr(p, "dim", None) in matrix_dims]
    if len(split) != 1 or type(split[0][1]) is not Shard:  # _StridedShard: FSDP2 over a TP shard
        return None
    mesh_dim, placement = split[0]
    return mesh_dim, placement.dim


def assign_owners(shapes: list[torch.Size], world: int) -> list[int]:
    """The owner rank of each matrix (or stack of experts) of ``shapes``: the costliest Newton-Schulz
    first, each to the least-loaded rank so far (the lowest on a tie) -- greedy longest-processing-time
    scheduling, the same on every rank since it reads shapes only. The cost of one iteration on
    ``[..., m, n]``, ``m <= n``: ``X X^T`` and ``(B) X`` are ``m * m * n`` multiply-adds each and
    ``B = b A + c A A`` is ``m^3``, times the leading dimensions."""
    costs = []
    for shape in shapes:
        small, large = sorted(shape[-2:])
        costs.append(math.prod(shape[:-2]) * (2 * small * small * large + small**3))
    load, owners = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owner = min(range(world), key=load.__getitem__)
        owners[i] = owner
        load[owner] += costs[i]
    return owners


def _shard_sizes(size: int, world: int) -> list[int]:
    """Each rank's length of a dimension of ``size`` split by ``Shard`` over ``world`` ranks (DTensor
    splits like ``torch.chunk``: ``ceil(size / world)`` each, the last ones short or empty)."""
    chunk = -(-size // world)
    return [max(0, min(size, (rank + 1) * chunk) - rank * chunk) for rank in range(world)]


def _all_to_all(
    send: list[list[torch.Tensor]], receive: list[int], like: torch.Tensor, group: Any
) -> list[torch.Tensor]:
    """``send[rank]``'s tensors, flattened, to each rank; back, what each rank sent here (``receive``:
    its element counts) as one flat tensor a rank."""
    import torch.distributed as dist

    flat = [torch.cat([t.reshape(-1) for t in tensors]) if tensors else like.new_empty(0) for tensors in send]
    out = like.new_empty(sum(receive))
    dist.all_to_all_single(out, torch.cat(flat), receive, [t.numel() for t in flat], group=group)
    return list(out.split(receive))


def orthogonalize_round_robin(
    updates: list[torch.Tensor],
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    *,
    on_receive: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """:func:`orthogonalize` of each of ``updates`` (DTensors that :func:`round_robin_dim` accepts), the
    same result to the bit, each whole matrix orthogonalized on one rank only (see the module
    docstring). Every rank of a sharding group must call it with the same matrices in the same order.
    ``on_receive(bytes)`` is told what the two all-to-alls bring this rank from the others."""
    from torch.distributed.tensor import DTensor

    batches: dict[Any, list[int]] = {}  # matrices sharded over the same process group go together
    for i, update in enumerate(updates):
        mesh_dim, _ = round_robin_dim(update)
        batches.setdefault(update.device_mesh.get_group(mesh_dim), []).append(i)
    results = list(updates)
    for group, indices in batches.items():
        batch = [updates[i] for i in indices]
        locals_ = _round_robin(batch, group, (coefficients, steps, eps, dtype), on_receive)
        for i, update, local in zip(indices, batch, locals_):
            results[i] = DTensor.from_local(
                local,
                update.device_mesh,
                update.placements,
                run_check=False,
                shape=update.shape,
                stride=update.stride(),
            )
    return results


def _round_robin(
    batch: list[torch.Tensor], group: Any, newton_schulz: tuple, on_receive: Callable[[int], None] | None
) -> list[torch.Tensor]:
    """The local slices of the orthogonalized ``batch``, each matrix gathered to and orthogonalized by
    its owner in ``group`` (:func:`orthogonalize_round_robin`)."""
    import torch.distributed as dist

    dtype = newton_schulz[3]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    locals_ = [u.to_local().to(dtype) for u in batch]
    dims = [round_robin_dim(u)[1] for u in batch]
    sizes = [_shard_sizes(u.size(d), world) for u, d in zip(batch, dims)]
    owners = assign_owners([u.shape for u in batch], world)
    mine = [i for i, owner in enumerate(owners) if owner == rank]

    def shape_on(i: int, source: int) -> list[int]:  # matrix i's shard on rank `source`
        shape = list(locals_[i].shape)
        shape[dims[i]] = sizes[i][source]
        return shape

    # 1. Every shard to its matrix's owner.
    send = [[t for t, owner in zip(locals_, owners) if owner == dest] for dest in range(world)]
    receive = [sum(math.prod(shape_on(i, source)) for i in mine) for source in range(world)]
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    for source, flat in enumerate(_all_to_all(send, receive, locals_[0], group)):
        counts = [math.prod(shape_on(i, source)) for i in mine]
        for i, piece in zip(mine, flat.split(counts)):
            pieces[i].append(piece.view(shape_on(i, source)))
    whole = {i: _newton_schulz(torch.cat(pieces[i], dims[i]), *newton_schulz) for i in mine}
    # 2. Each rank its slice of every result (slicing a whole matrix is what a Replicate -> Shard
    # redistribute does too).
    send = [[whole[i].split(sizes[i], dims[i])[dest] for i in mine] for dest in range(world)]
    receive = [sum(locals_[i].numel() for i, owner in enumerate(owners) if owner == o) for o in range(world)]
    back = _all_to_all(send, receive, locals_[0], group)
    out: list[torch.Tensor] = [locals_[0]] * len(batch)
    for owner, flat in enumerate(back):
        owned = [i for i, o in enumerate(owners) if o == owner]
        for i, piece in zip(owned, flat.split([locals_[i].numel() for i in owned])):
            out[i] = piece.view(locals_[i].shape)
    if on_receive is not None:  # what came from the other ranks (a rank's own part never moves)
        from_others = (
            sum(receive)
            - receive[rank]
            + sum(math.prod(shape_on(i, s)) for i in mine for s in range(world) if s != rank)
        )
        on_receive(from_others * locals_[0].element_size())
    return out


def adjusted_lr(lr: float, adjust_lr: str, shape: torch.Size) -> float:
    """``torch.optim._muon._adjust_lr`` on one matrix's ``(rows, cols)`` (the last two dimensions)."""
    rows, cols = shape[-2:]
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``algorithm="muon"``, AdamW (decoupled weight decay) on those with
    ``algorithm="adamw"``. Each group takes its algorithm's keyword defaults below for what it does
    not set; state is ``momentum_buffer`` (Muon) or ``step``/``exp_avg``/``exp_avg_sq`` (AdamW, as
    ``torch.optim.AdamW`` keeps it)."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        ns_eps: float = 1e-7,
        ns_dtype: str = "bfloat16",
        adjust_lr: str = "original",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
        foreach: bool | None = None,
        sharded: str = "round_robin",
    ) -> None:
        if sharded not in SHARDED:
            raise ValueError(f"Muon's sharded={sharded!r} is not one of {', '.join(SHARDED)}")
        self.sharded = sharded
        """How a sharded matrix is orthogonalized (:data:`SHARDED`); not state: a checkpoint resumes
        under either."""
        self._algorithm_defaults = {
            "muon": {
                "momentum": momentum,
                "nesterov": nesterov,
                "ns_coefficients": tuple(ns_coefficients),
                "ns_steps": ns_steps,
                "ns_eps": ns_eps,
                "ns_dtype": ns_dtype,
                "adjust_lr": adjust_lr,
            },
            "adamw": {"betas": tuple(betas), "eps": eps, "fused": fused, "foreach": foreach},
        }
        super().__init__(list(params), {"lr": lr, "weight_decay": weight_decay})
        self.on_receive: Callable[[int], None] | None = None
        """Told the bytes each gather or round robin of sharded matrices brings this rank
        (``scripts/bench_muon.py``)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.get("algorithm")
        if algorithm not in self._algorithm_defaults:
            raise ValueError(f"a Muon parameter group needs algorithm='muon' or 'adamw', got {algorithm!r}")
        for key, value in self._algorithm_defaults[algorithm].items():
            param_group.setdefault(key, value)
        if algorithm == "muon":
            for p in param_group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon takes matrices or stacked matrices; got a {tuple(p.shape)} parameter"
                    )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        newton_schulz = (
            tuple(group["ns_coefficients"]),
            group["ns_steps"],
            group["ns_eps"],
            dtype_from_name(group["ns_dtype"]),  # a name: param groups are saved as JSON
        )

        def apply(p: torch.Tensor, update: torch.Tensor) -> None:
            p.mul_(1 - lr * weight_decay)
            p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))

        round_robin: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            grad, state = p.grad, self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            if self.sharded == "round_robin" and round_robin_dim(update) is not None:
                round_robin.append((p, update))  # after the loop: one pair of all-to-alls for all
            else:
                apply(p, orthogonalize(update, *newton_schulz, on_receive=self.on_receive))
        if round_robin:
            updates = [u for _, u in round_robin]
            for (p, _), update in zip(
                round_robin, orthogonalize_round_robin(updates, *newton_schulz, on_receive=self.on_receive)
            ):
                apply(p, update)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # as torch.optim.AdamW's _init_group: the step count on the host unless fused
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if group["fused"]
                    else torch.tensor(0.0, dtype=torch.float32)
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(  # torch.optim.AdamW's own functional step (decoupled weight decay)
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=group["foreach"],
            fused=group["fused"],
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
