"""What every scheduler's job shares: the records of a rendered and a submitted job, its name, its
header line, the training command's overrides and torchrun's multi-host arguments.

Below both the package (``render_job``, ``submit_command``) and the scheduler modules
(``slurm.py``, ``kubernetes.py``), which take these from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from portatrain.errors import ConfigError


class SubmitError(ConfigError):
    """The scheduler's CLI is missing or refused the job (printed by the CLI without a traceback)."""


@dataclass(frozen=True)
class RenderedJob:
    text: str
    """The job file's content."""
    filename: str
    """Default file name (``job.sbatch``, ``job.yaml``)."""
    submit_command: tuple[str, ...]
    """The scheduler CLI call that takes the file as its last argument."""
    name: str = ""
    """The job's name (Kubernetes: unique per rendering; the run directory follows it)."""
    run_dir: str | None = None
    """The run directory the job writes, where it is known before submission (Kubernetes)."""


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    """The scheduler's id: SLURM's job id, the Kubernetes job name."""
    run_dir: str
    """The run directory the job writes (on storage every node sees)."""
    follow: str
    """A shell command that follows the job's log."""


def job_name(cfg: Any) -> str:
    """``launch.job_name`` or ``portatrain-<recipe>``, lower-case letters, digits and ``-``."""
    name = cfg.launch.job_name or f"portatrain-{cfg.recipe}"
    return "".join(c if c.isalnum() or c == "-" else "-" for c in name.lower()).strip("-")[:50]


def describe_job(cfg: Any) -> str:
    """One line for a job file's header: recipe, hosts, processes and the resolved layout."""
    from portatrain.parallel.parallel_dims import ParallelDims

    launch = cfg.launch
    dims = ParallelDims.from_config(cfg.parallel, world_size=launch.nodes * launch.procs_per_node)
    return (
        f"recipe {cfg.recipe}, {launch.nodes} node(s) x {launch.procs_per_node} process(es), "
        f"{dims.describe()}{placement(dims, launch.procs_per_node)}"
    )


def placement(dims: Any, procs_per_node: int) -> str:
    """Where the pipeline and tensor-parallel groups fall (``""`` without either). torchrun numbers a
    host's processes consecutively and the mesh is row-major with ``tp`` innermost and ``pp`` outermost,
    so a tp group is ``tp`` consecutive ranks (one host when ``tp`` divides ``procs_per_node``) and
    pipeline stage ``s`` is ranks ``[s W/pp, (s+1) W/pp)``: whole hosts when ``W/pp`` is a multiple of
    ``procs_per_node``, so only the stage-to-stage activations cross the network between hosts."""
    parts = []
    if dims.tp > 1:
        inside = procs_per_node % dims.tp == 0
        parts.append(f"tp groups {'inside one host each' if inside else 'spanning hosts'}")
    if dims.pp > 1:
        per_stage = dims.world_size // dims.pp
        if per_stage % procs_per_node == 0:
            parts.append(f"each pipeline stage on {per_stage // procs_per_node} host(s) of its own")
        else:
            parts.append(f"pipeline stages of {per_stage} rank(s) sharing hosts")
    return f" ({'; '.join(parts)})" if parts else ""


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value the command line gives ``key`` (the last one wins, as in Hydra), else None."""
    value = None
    for override in overrides:
        if _key(override) == key and "=" in override:
            value = override.partition("=")[2]
    return value


def training_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides the training processes need: all but ``launch.*`` (job shape only), in either
    spelling (``parallel.launch.*`` is the deprecated one, ``portatrain.launch.moved_keys``)."""
    return [o for o in overrides if not _key(o).startswith(("launch.", "parallel.launch."))]


def job_overrides(overrides: Sequence[str], *, run_dir: str | None = None) -> list[str]:
    """The training command of a scheduler job: ``training_overrides`` plus ``checkpoint.resume=auto``
    (a requeued or restarted job continues from its newest checkpoint; an explicit
    ``checkpoint.resume`` wins) and, where given, the job's ``run_dir``."""
    args = training_overrides(overrides)
    if override_value(args, "checkpoint.resume") is None:
        args.append("checkpoint.resume=auto")
    if run_dir is not None and override_value(args, "run_dir") is None:
        args.append(f"run_dir={run_dir}")
    return args


def torchrun_args(*, nnodes: int | str, nproc_per_node: int, rdzv_endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's multi-host arguments: a c10d rendezvous every agent reaches at ``rdzv_endpoint``."""
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]
