"""SLURM: an sbatch script that runs one ``torchrun`` agent per node with ``srun``.

The allocation is ``nodes`` hosts with one task each; each task's torchrun starts
``procs_per_node`` workers. The rendezvous endpoint is the allocation's first host, read from
``scontrol show hostnames "$SLURM_JOB_NODELIST"`` at run time, and its id is ``$SLURM_JOB_ID``: all
agents of the job agree on both without any shared file, and the id becomes the run directory's name
(``runs/<recipe>/<job id>``), which must therefore be on a filesystem every node sees -- the script
``cd``s to the directory ``render`` was called from.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import Any

from portatrain.launch import describe_job, job_name, torchrun_args


def render_sbatch(cfg: Any, overrides: Sequence[str], *, workdir: str | None = None) -> str:
    """The sbatch script running ``portatrain <overrides>`` on ``parallel.launch.nodes`` hosts."""
    launch = cfg.parallel.launch
    name = job_name(cfg)
    workdir = workdir or os.getcwd()
    directives = [
        f"--job-name={name}",
        f"--nodes={launch.nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the workers
        "--exclusive",
        f"--output={name}-%j.out",
    ]
    if cfg.device.type == "cuda":
        directives.append(f"--gpus-per-node={launch.procs_per_node}")
    for key in ("partition", "account", "time"):
        if getattr(launch, key):
            directives.append(f"--{key}={getattr(launch, key)}")

    lines = [
        "#!/bin/bash",
        f"# portatrain job: {describe_job(cfg)}.",
        "# Rendered by `portatrain render` from the same config as the training run; submit with `sbatch FILE`.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        *launch.setup,
        *(f"export {key}={shlex.quote(str(value))}" for key, value in launch.env.items()),
        "",
        "# The first host of the allocation runs the c10d rendezvous; the job id names the rendezvous",
        "# (torchrun's TORCHELASTIC_RUN_ID) and with it the run directory, identical on every rank.",
        # An array, not `| head -n 1`: under pipefail, head closing the pipe while scontrol still
        # writes (SIGPIPE, exit 141) would abort the script.
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "head_node=${nodes[0]}",
        "",
    ]
    rdzv = torchrun_args(
        nnodes='"$SLURM_JOB_NUM_NODES"',
        nproc_per_node=launch.procs_per_node,
        rdzv_endpoint=f'"$head_node:{launch.rdzv_port}"',
        rdzv_id='"$SLURM_JOB_ID"',
    )
    command = [*rdzv, " ".join(["-m portatrain", *(shlex.quote(o) for o in overrides)])]
    lines.append("srun --kill-on-bad-exit=1 torchrun \\")
    lines += [f"    {arg} \\" for arg in command[:-1]]
    lines.append(f"    {command[-1]}")
    return "\n".join(lines) + "\n"
