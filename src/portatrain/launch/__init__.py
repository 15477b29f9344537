"""Job submission: render the same ``portatrain ...`` command as a multi-host job for a scheduler.

``portatrain render [overrides]`` prints (or writes to ``parallel.launch.output``) a job for
``parallel.launch.scheduler``; ``portatrain submit [overrides]`` writes it into the run directory and
hands it to the scheduler's own CLI (``sbatch`` or ``kubectl apply -f``). Every host runs one
``torchrun`` agent that starts ``procs_per_node`` workers, and the agents meet in a c10d rendezvous
on the first host, keyed by an id all of them share (SLURM's job id, the Kubernetes job name) -- that
id is also torchrun's ``TORCHELASTIC_RUN_ID``, so every rank writes to the same
``runs/<recipe>/<id>/`` (``portatrain.config.run_id``).

* ``slurm`` -- an sbatch script: ``srun`` one ``torchrun`` per node, head node from
  ``scontrol show hostnames $SLURM_JOB_NODELIST``, ``--rdzv-id=$SLURM_JOB_ID`` (``slurm.py``).
* ``jobset`` -- a Kubernetes JobSet for a TPU slice on GKE (``kubernetes.py``).
* ``pytorchjob`` -- a Kubeflow PyTorchJob for GPU (``device=cuda``) or Trainium (``device=neuron``)
  nodes (``kubernetes.py``).

The job's training command carries the user's overrides unchanged, minus the ``parallel.launch.*``
ones that only shape the job. The layout (``dp_replicate x dp_shard x tp``) was validated against
``nodes * procs_per_node`` before anything is rendered.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
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


def job_name(cfg: Any) -> str:
    """``parallel.launch.job_name`` or ``portatrain-<recipe>``, made DNS-safe for Kubernetes."""
    name = cfg.parallel.launch.job_name or f"portatrain-{cfg.recipe}"
    return "".join(c if c.isalnum() or c == "-" else "-" for c in name.lower()).strip("-")[:50]


def describe_job(cfg: Any) -> str:
    """One line for a job file's header: recipe, hosts, processes and the resolved layout."""
    from portatrain.parallel.parallel_dims import ParallelDims

    launch = cfg.parallel.launch
    dims = ParallelDims.from_config(cfg.parallel, world_size=launch.nodes * launch.procs_per_node)
    return (
        f"recipe {cfg.recipe}, {launch.nodes} node(s) x {launch.procs_per_node} process(es), "
        f"{dims.describe()}"
    )


def training_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides the training processes need: all but ``parallel.launch.*`` (job shape only)."""
    kept = []
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if not key.startswith("parallel.launch."):
            kept.append(override)
    return kept


def torchrun_args(*, nnodes: int | str, nproc_per_node: int, rdzv_endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's multi-host arguments: a c10d rendezvous every agent reaches at ``rdzv_endpoint``."""
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]


def launch_problems(cfg: Any) -> list[str]:
    """Scheduler-specific problems of ``cfg`` (the layout itself is checked by ``validate``)."""
    from portatrain.launch import kubernetes

    launch = cfg.parallel.launch
    if launch.scheduler in ("jobset", "pytorchjob"):
        return kubernetes.problems(cfg)
    return []


def render_job(cfg: Any, overrides: Sequence[str]) -> RenderedJob:
    """Render ``cfg``'s job for ``parallel.launch.scheduler``; raise ConfigError listing every problem."""
    from portatrain.launch import kubernetes, slurm

    problems = launch_problems(cfg)
    if problems:
        raise ConfigError("cannot render the job:\n  - " + "\n  - ".join(problems))
    args = training_overrides(overrides)
    scheduler = cfg.parallel.launch.scheduler
    if scheduler == "slurm":
        return RenderedJob(slurm.render_sbatch(cfg, args), "job.sbatch", ("sbatch",))
    if scheduler == "jobset":
        return RenderedJob(kubernetes.render_jobset(cfg, args), "job.yaml", ("kubectl", "apply", "-f"))
    return RenderedJob(kubernetes.render_pytorchjob(cfg, args), "job.yaml", ("kubectl", "apply", "-f"))


def render_command(cfg: Any, overrides: Sequence[str]) -> None:
    """``portatrain render``: print the job, or write it to ``parallel.launch.output``."""
    job = render_job(cfg, overrides)
    if cfg.parallel.launch.output:
        path = Path(cfg.parallel.launch.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(job.text)
        print(f"wrote {path}; submit it with: {shlex.join([*job.submit_command, str(path)])}")
    else:
        print(job.text, end="")


def submit_command(cfg: Any, overrides: Sequence[str]) -> Path:
    """``portatrain submit``: write the job (``parallel.launch.output`` or ``<run_dir>/<file>``) and
    hand it to the scheduler's CLI, which must be on ``PATH``."""
    job = render_job(cfg, overrides)
    tool = job.submit_command[0]
    if shutil.which(tool) is None:
        raise SubmitError(
            f"parallel.launch.scheduler={cfg.parallel.launch.scheduler} submits with `{tool}`, which is not "
            f"on PATH here; run `portatrain render` instead and submit the file where `{tool}` is installed"
        )
    path = Path(cfg.parallel.launch.output or Path(cfg.run_dir) / job.filename)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job.text)
    argv = [*job.submit_command, str(path)]
    print(f"wrote {path}\n$ {shlex.join(argv)}", flush=True)
    result = subprocess.run(argv, text=True, capture_output=True)
    print(result.stdout, end="")
    if result.returncode != 0:
        raise SubmitError(
            f"`{shlex.join(argv)}` failed with exit code {result.returncode}: {result.stderr.strip()}"
        )
    return path


__all__ = [
    "RenderedJob",
    "SubmitError",
    "describe_job",
    "job_name",
    "launch_problems",
    "render_command",
    "render_job",
    "submit_command",
    "torchrun_args",
    "training_overrides",
]
