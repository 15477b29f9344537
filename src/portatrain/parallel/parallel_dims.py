"""The parallel layout of a job and the named ``DeviceMesh`` built from it.

What this file does:

* :class:`ParallelDims` -- the degrees ``pp x dp_replicate x dp_shard x cp x tp`` resolved against a
  world size (``dp_shard=-1`` takes whatever the other degrees leave), and the expert-parallel degree
  ``ep`` taken from the ``dp_shard`` ranks, checked before anything is built: every problem is reported
  at once, with the numbers and the fix, as a :class:`~portatrain.errors.ConfigError`.
* :meth:`ParallelDims.build_mesh` -- one mesh ``("dp_replicate", "dp_shard", "cp", "tp")`` on the
  accelerator's device type, with ``"pp"`` outermost when pipeline parallel is on (``parallel.pp > 1``,
  ``portatrain.parallel.pipeline``), plus the flattened ``"dp"`` dimension (``dp_replicate * dp_shard``
  ranks that read different rows) used by the data loader and the token counts; with ``cp > 1``
  (context parallel, ``portatrain.parallel.context``: the ``cp`` ranks split each row's positions)
  also ``"dp_shard_cp"``, the ranks FSDP2 shards parameters over (torchtitan folds cp into FSDP the
  same way), and ``"dp_cp"``, the ranks holding different tokens (loss sums, routing statistics); with
  ``ep > 1`` also the expert mesh ``("dp_replicate", "efsdp", "ep", "tp")``, the same ranks with
  ``dp_shard`` split into ``dp_shard / ep`` x ``ep`` (torchtitan's ``dp_shard_mod_ep`` x
  ``dp_shard_in_ep``, ``torchtitan/distributed/parallel_dims.py``).
* :func:`expected_world_size` -- how many processes a config will run with, for validation before
  launch (under torchrun: ``WORLD_SIZE``; otherwise the job shape in ``launch``; for a dry run
  with an explicit ``dp_shard``: the product of the degrees, so a 64-device plan needs no 64 processes).
* :func:`parallel_problems` -- the parallel stage's part of config validation (``portatrain.validate``):
  dtypes, layout against the world size, the model's heads and the rows' lengths.

Rank order is row-major over ``([pp,] dp_replicate, dp_shard, cp, tp)``: tp is the fastest-varying dimension,
so a tp group is ``tp`` consecutive ranks -- on one host when ``tp <= procs_per_node``, where
tensor-parallel traffic (two collectives per block, forward and backward) stays on the fast links; pp
is the slowest, so consecutive pipeline stages sit ``world / pp`` ranks apart, on different hosts when a
stage fills a host: only one activation per micro-batch crosses the slow links.

Importing this module is cheap: ``torch.distributed`` is imported only by :meth:`build_mesh`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from portatrain.config import LaunchConfig, ParallelConfig
from portatrain.dtypes import dtype_problem
from portatrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
PP_MESH_DIM_NAMES = ("pp", *MESH_DIM_NAMES)
EXPERT_MESH_DIM_NAMES = ("dp_replicate", "efsdp", "ep", "tp")


@dataclass
class ParallelDims:
    """Parallel degrees of one job; ``dp_shard=-1`` is resolved from ``world_size``.

    Construction validates (raises :class:`ConfigError` listing every problem); :meth:`build_mesh`
    then creates the process groups. A ``ParallelDims`` without a mesh is still useful for planning
    (the dry run sizes a 64-device layout on a laptop).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    """Expert-parallel degree, a divisor of ``dp_shard`` (experts split over ``ep`` of its ranks)."""
    cp: int = 1
    """Context-parallel degree: each row's positions are split over ``cp`` ranks."""
    pp: int = 1
    """Pipeline-parallel degree: the outermost mesh dimension, one stage group per ``world / pp`` ranks."""
    mesh: DeviceMesh | None = field(default=None, repr=False)
    """The world mesh, set by :meth:`build_mesh`; None on a single process."""
    expert_mesh: DeviceMesh | None = field(default=None, repr=False)
    """The same ranks as ``("dp_replicate", "efsdp", "ep", "tp")``, set by :meth:`build_mesh` when ``ep > 1``."""
    _dp_mesh: DeviceMesh | None = field(default=None, repr=False)
    _dp_shard_cp_mesh: DeviceMesh | None = field(default=None, repr=False)
    _dp_cp_mesh: DeviceMesh | None = field(default=None, repr=False)
    _efsdp_ep_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        problems = layout_problems(
            self.dp_replicate, self.dp_shard, self.tp, self.world_size, self.ep, cp=self.cp, pp=self.pp
        )
        if problems:
            raise ConfigError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
        if self.dp_shard == -1:
            self.dp_shard = self.world_size // (self.pp * self.dp_replicate * self.cp * self.tp)

    @classmethod
    def from_config(cls, parallel_cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """From ``cfg.parallel`` (``dp_replicate``, ``dp_shard``, ``tp``) and the actual world size."""
        return cls(
            dp_replicate=int(parallel_cfg.dp_replicate),
            dp_shard=int(parallel_cfg.dp_shard),
            tp=int(parallel_cfg.tp),
            world_size=int(world_size),
            ep=int(parallel_cfg.ep),
            cp=int(parallel_cfg.cp),
            pp=int(parallel_cfg.pp),
        )

    # -- degrees ---------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different rows (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 is applied whenever ranks hold different data: sharded over ``dp_shard`` (times
        ``cp``) and, with ``dp_replicate > 1``, replicated over ``dp_replicate`` (HSDP; pure
        replication when ``dp_shard * cp == 1``)."""
        return self.dp_enabled or self.cp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def describe(self) -> str:
        experts = f" (experts over ep={self.ep} of the dp_shard ranks)" if self.ep_enabled else ""
        cp = f" x cp={self.cp}" if self.cp_enabled else ""
        pipeline = f"pp={self.pp} x " if self.pp_enabled else ""
        return (
            f"{pipeline}dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}{cp} x tp={self.tp} "
            f"= {self.world_size} device{'s' if self.world_size != 1 else ''}{experts}"
        )

    # -- mesh ------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the named world mesh on ``device_type`` (None for a single process).

        The default process group must already exist (``portatrain.distributed.init_distributed``
        creates it with the accelerator adapter's backend: gloo on CPU, nccl on CUDA); every
        sub-mesh's group uses that backend. All three dimensions are kept even at size 1, so
        ``mesh["tp"]`` and ``mesh["dp_shard"]`` always exist and code never branches on which
        dimensions happen to be present.
        """
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = (self.dp_replicate, self.dp_shard, self.cp, self.tp), MESH_DIM_NAMES
        if self.pp_enabled:  # outermost: a stage's dp and tp groups are whole sub-meshes of one slice
            shape, names = (self.pp, *shape), PP_MESH_DIM_NAMES
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        # Flatten now, on every rank (creating a group is collective), and keep the handle: torch
        # deprecates slicing a flattened dimension back out of the root mesh.
        self._dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if self.cp_enabled:
            self._dp_shard_cp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            self._dp_cp_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self.mesh = mesh
        if self.ep_enabled:
            # A second mesh over the same ranks, dp_shard split row-major into (efsdp, ep): dp_shard
            # rank d is (d // ep, d % ep), so an ep group is ep consecutive dp_shard ranks. Its own
            # root, because FSDP2 requires an expert parameter's ep mesh and the mesh it shards
            # that parameter over (efsdp) to share one.
            self.expert_mesh = init_device_mesh(
                device_type,
                (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp),
                mesh_dim_names=EXPERT_MESH_DIM_NAMES,
            )
            # An expert weight is sharded over (efsdp, ep), so a reduction over it (the gradient
            # norm) is Partial on both: without a flattened mesh for the pair DTensor runs two
            # all_reduces in a row and warns on every rank that they may round differently there
            # (torch/distributed/tensor/_redistribute.py, _optimize_transform_infos). With it: one.
            self._efsdp_ep_mesh = self.expert_mesh["efsdp", "ep"]._flatten("efsdp_ep")
        return mesh

    def _require_mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not created a mesh (single process?)")
        return self.mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The flattened data-parallel mesh: data loading, token counts, loss and metric reductions."""
        return self._dp_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``dp_shard`` (``dp_shard_cp`` with context parallel), or
        ``(dp_replicate, dp_shard[_cp])`` for HSDP."""
        mesh = self._require_mesh()
        if not self.cp_enabled:
            return mesh["dp_replicate", "dp_shard"] if self.dp_replicate_enabled else mesh["dp_shard"]
        return mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate_enabled else self._dp_shard_cp_mesh

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The ``cp`` ranks that split one row's positions between them."""
        return self._require_mesh()["cp"]

    @property
    def loss_mesh(self) -> DeviceMesh | None:
        """The ranks holding different tokens (``dp`` times ``cp``): loss sums, routing statistics."""
        return self._dp_cp_mesh if self.cp_enabled else self._dp_mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self._require_mesh()["tp"]

    def _require_expert_mesh(self) -> DeviceMesh:
        if self.expert_mesh is None:
            raise RuntimeError("no expert mesh: parallel.ep is 1, or build_mesh() has not run")
        return self.expert_mesh

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ``ep`` ranks that split one set of experts between them (tokens travel among them)."""
        return self._require_expert_mesh()["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards each rank's experts over: the ranks holding the same experts,
        ``efsdp`` (``dp_shard / ep`` of them), or ``(dp_replicate, efsdp)`` for HSDP."""
        mesh = self._require_expert_mesh()
        return mesh["dp_replicate", "efsdp"] if self.dp_replicate_enabled else mesh["efsdp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        """The ``pp`` ranks holding the stages of one pipeline (same data, same tp coordinate)."""
        return self._require_mesh()["pp"]

    @property
    def pp_rank(self) -> int:
        """This rank's index among the ``pp`` pipeline ranks (0 without pipeline parallel)."""
        return self.pp_mesh.get_local_rank() if self.pp_enabled else 0

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ``dp`` data-parallel ranks (0 on a single process)."""
        return 0 if self._dp_mesh is None else self._dp_mesh.get_local_rank()


def layout_problems(
    dp_replicate: int, dp_shard: int, tp: int, world_size: int, ep: int = 1, *, cp: int = 1, pp: int = 1
) -> list[str]:
    """Every reason ``pp x dp_replicate x dp_shard x cp x tp`` (experts over ``ep`` of the ``dp_shard``
    ranks) cannot run on ``world_size`` ranks, each with a fix."""
    problems = []
    for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("ep", ep), ("cp", cp), ("pp", pp)):
        if value < 1:
            problems.append(f"parallel.{name}={value} must be >= 1")
    if dp_shard == 0 or dp_shard < -1:
        problems.append(f"parallel.dp_shard={dp_shard} must be >= 1, or -1 to infer it from the world size")
    if world_size < 1:
        problems.append(f"world size {world_size} must be >= 1")
    if problems:
        return problems  # the arithmetic below needs sane degrees
    if ep > 1 and cp > 1:
        problems.append(
            f"parallel.ep={ep} with parallel.cp={cp}: expert parallel and context parallel do not combine "
            "yet; set parallel.ep=1 (FSDP2 still shards the experts) or parallel.cp=1"
        )

    if pp > 1 and cp > 1:
        problems.append(
            f"parallel.pp={pp} with parallel.cp={cp}: pipeline parallel and context parallel do not combine "
            "yet; set parallel.pp=1 or parallel.cp=1"
        )
    # pp and cp are named only when they are on: a layout without them reads as it always did.
    pp_term, pp_key = (f"pp({pp}) * ", "parallel.pp/") if pp > 1 else ("", "")
    cp_term = f" * cp({cp})" if cp > 1 else ""
    if dp_shard == -1:
        others = pp * dp_replicate * cp * tp
        if world_size % others:
            fits = others * max(1, world_size // others)
            problems.append(
                f"{pp_term}dp_replicate({dp_replicate}){cp_term} * tp({tp}) = {others} does not divide world "
                f"size {world_size}, so parallel.dp_shard=-1 cannot be inferred; launch a multiple of "
                f"{others} processes (e.g. {fits}) or change {pp_key}parallel.dp_replicate/parallel.tp"
                + ("/parallel.cp" if cp > 1 else "")
            )
            return problems
        return problems + _ep_problems(ep, world_size // others, inferred=True)

    product = pp * dp_replicate * dp_shard * cp * tp
    if product != world_size:
        fixes = []
        others = pp * dp_replicate * cp * tp
        if world_size % others == 0:
            fixes.append(f"set parallel.dp_shard={world_size // others} (or -1 to infer it)")
        fixes.append(f"launch {product} processes")
        problems.append(
            f"{pp_term}dp_replicate({dp_replicate}) * dp_shard({dp_shard}){cp_term} * tp({tp}) = {product} != world "
            f"size {world_size}; {' or '.join(fixes)}"
        )
    return problems + _ep_problems(ep, dp_shard, inferred=False)


def _ep_problems(ep: int, dp_shard: int, *, inferred: bool) -> list[str]:
    """Expert parallel takes its ranks from ``dp_shard``: ``ep`` must divide it."""
    if dp_shard % ep == 0:
        return []
    divisors = [d for d in range(1, dp_shard + 1) if dp_shard % d == 0]
    source = "inferred from the world size" if inferred else "parallel.dp_shard"
    return [
        f"parallel.ep={ep} must divide the data-parallel shard ranks dp_shard={dp_shard} ({source}): "
        f"experts are split over ep of them; set parallel.ep in {divisors} or launch a multiple of {ep} "
        "data-parallel ranks"
    ]


def model_problems(tp: int, n_heads: int, n_kv_heads: int, where: str) -> list[str]:
    """Reasons the model cannot be split ``tp`` ways: each rank must hold whole query and kv heads.
    (Tied embeddings are fine: the parallelizer shards the one matrix over the vocabulary for both uses.)

    ``where`` names the model in the message (e.g. ``flavour '8b'``).
    """
    if tp <= 1:
        return []
    problems = []
    if n_heads % tp or n_kv_heads % tp:
        divisors = [d for d in range(1, n_kv_heads + 1) if n_heads % d == 0 and n_kv_heads % d == 0]
        problems.append(
            f"parallel.tp={tp} must divide n_heads({n_heads}) and n_kv_heads({n_kv_heads}) of {where} "
            f"(each rank holds whole heads); choose parallel.tp in {divisors}"
        )
    return problems


def expected_world_size(
    parallel_cfg: ParallelConfig, launch_cfg: LaunchConfig, *, dry_run: bool = False
) -> int:
    """How many processes a run with ``parallel_cfg`` will have, known before any process group exists.

    Under torchrun it is ``WORLD_SIZE``. Otherwise it is the job shape
    ``launch.nodes * launch.procs_per_node`` (1 x 1 by default: a plain ``portatrain`` is one
    process). A dry run plans without launching anything: with an explicit ``dp_shard`` the
    world is the product of the degrees (``dp_shard=8 tp=8`` is a 64-device plan); with
    ``dp_shard=-1`` it is the job shape, or ``dp_replicate * tp`` devices if the job shape is smaller.
    """
    par = parallel_cfg
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    launched = launch_cfg.nodes * launch_cfg.procs_per_node
    if dry_run:
        if par.dp_shard > 0:
            return par.pp * par.dp_replicate * par.dp_shard * par.cp * par.tp
        return max(launched, par.pp * par.dp_replicate * par.cp * par.tp)
    return launched


class ModelShape(Protocol):
    """What the layout check reads of a model family's arguments."""

    n_heads: int
    n_kv_heads: int
    tie_embeddings: bool


def parallel_problems(
    parallel_cfg: ParallelConfig,
    *,
    world_size: int,
    model_args: ModelShape | None = None,
    row_lengths: Sequence[int] = (),
    row_key: str = "data.seq_len",
    model_name: str = "the model",
) -> list[str]:
    """Every problem of the ``parallel`` group for ``world_size`` ranks (called by ``portatrain.validate``).

    ``model_args`` is the model's arguments (None when the model is itself invalid),
    ``row_lengths`` every row length the loader emits (from ``row_key``): with tensor parallel both
    must split evenly over the tp ranks.
    """
    par = parallel_cfg
    problems = []
    if par.param_dtype is not None:
        problems += dtype_problem("parallel.param_dtype", par.param_dtype)
    problems += dtype_problem("parallel.reduce_dtype", par.reduce_dtype)
    if problems:
        return problems
    problems += layout_problems(
        par.dp_replicate, par.dp_shard, par.tp, world_size, par.ep, cp=par.cp, pp=par.pp
    )
    if par.tp > 1:
        if model_args is not None:
            a = model_args
            problems += model_problems(par.tp, a.n_heads, a.n_kv_heads, model_name)
        uneven = [n for n in row_lengths if n % par.tp]
        if uneven:
            problems.append(
                f"{row_key} has row length(s) {uneven} not divisible by parallel.tp={par.tp}; sequence "
                f"parallel splits each row over the tp ranks: use multiples of {par.tp}"
            )
    if par.cp > 1:
        from portatrain.parallel.context import context_problems

        problems += context_problems(par.cp, par.tp, row_lengths, row_key)
    return problems
