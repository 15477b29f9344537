"""SLURM: an sbatch script that runs one ``torchrun`` agent per node with ``srun``, and survives
preemption and time limits.

The allocation is ``nodes`` hosts with one task each; each task's torchrun starts
``procs_per_node`` workers. The rendezvous endpoint is the allocation's first host, read from
``scontrol show hostnames "$SLURM_JOB_NODELIST"`` (its ``NodeAddr``) at run time, and its id is ``$SLURM_JOB_ID``: all
agents of the job agree on both without any shared file, and the id becomes the run directory's name
(``runs/<recipe>/<job id>``), which must therefore be on a filesystem every node sees -- the script
``cd``s to the directory ``render`` was called from.

**Preemption and time limits.** The job id survives a requeue, so the run directory does too, and
the command carries ``checkpoint.resume=auto``: every (re)start continues from the newest complete
checkpoint. Two ways a run is interrupted:

* *Preemption or ``scontrol requeue``*: SLURM sends SIGTERM to every process of the job, waits
  ``KillWait`` seconds, then kills, and requeues the job itself (``--requeue``). The workers treat
  SIGTERM as "save at the next step boundary, then stop" (``portatrain.checkpoint.preemption``).
* *The time limit*: ``--signal=B:USR1@<grace>`` asks SLURM for SIGUSR1 ``save_grace`` seconds before
  the limit, sent to the batch script only (``B:``). Not to the job step: between ``srun`` and the
  workers sits ``torchrun``, whose default action for SIGUSR1 would be to die (Lightning's
  ``--signal=SIGUSR1@90`` assumes srun starts the workers directly). The script's trap sends SIGTERM
  to the job's steps (``scancel --signal=TERM``: every process of the step, workers included; never
  ``kill`` srun itself, which turns SIGTERM into a kill), waits for ``srun`` to return -- every rank
  has then saved and exited -- and requeues the job with ``scontrol requeue``, the same call
  Lightning's SLURM connector makes. The next allocation resumes from that checkpoint, so a long run
  proceeds through any number of time-limited allocations. torchrun's ``--shutdown-timeout`` is
  the same grace, so the agent does not kill its workers in the middle of the save.

A crash is not requeued: only the time-limit warning makes the script requeue, and SLURM itself
requeues only on preemption or node failure.

Tested against a real one-node (and two-node) SLURM 22.05 cluster in ``tests/test_slurm.py``.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from typing import Any

from portatrain.launch.job import describe_job, job_name, torchrun_args
from portatrain.redact import is_secret

_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")


def log_file(name: str) -> str:
    """The job's output file, relative to its working directory (``%j``: the job id)."""
    return f"{name}-%j.out"


def render_sbatch(cfg: Any, overrides: Sequence[str], *, workdir: str | None = None) -> str:
    """The sbatch script running ``portatrain <overrides>`` on ``parallel.launch.nodes`` hosts."""
    launch = cfg.parallel.launch
    name = job_name(cfg)
    grace = int(launch.save_grace)
    workdir = workdir or os.getcwd()
    directives = [
        f"--job-name={name}",
        f"--nodes={launch.nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the workers
        "--exclusive",
        f"--chdir={workdir}",
        f"--output={log_file(name)}",
        "--open-mode=append",  # a requeued job continues its log instead of truncating it
        "--requeue",
        f"--signal=B:USR1@{grace}",  # to this script, not the step: see the comment above the trap
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
        "# Preemption, requeue and the time limit: the run resumes from its newest checkpoint in",
        "# runs/<recipe>/<job id> (checkpoint.resume=auto); see the trap below.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -euo pipefail",
        "",
        f"# {grace} s before the time limit SLURM sends this script SIGUSR1 (--signal=B:USR1@{grace}).",
        "# SIGTERM to every process of the job step makes the workers save a checkpoint at the next",
        "# step boundary and exit (torchrun would die of a SIGUSR1; srun turns its own SIGTERM into a",
        "# kill, so the step is signalled through scancel). Once srun has returned, every rank has",
        "# saved: requeue the job, and the next allocation resumes from that checkpoint.",
        "time_limit_warning=0",
        "on_time_limit_warning() {",
        "    time_limit_warning=1",
        '    echo "portatrain: time-limit warning from SLURM: saving a checkpoint, then requeueing job $SLURM_JOB_ID" >&2',
        '    scancel --signal=TERM "$SLURM_JOB_ID" || true',
        "}",
        "trap on_time_limit_warning USR1  # first, so that no set-up line dies of the warning",
        "",
        f"cd {shlex.quote(workdir)}",
        *launch.setup,
        *(_export_line(key, value) for key, value in launch.env.items()),
        "",
        "# The first host of the allocation runs the c10d rendezvous; the job id names the rendezvous",
        "# (torchrun's TORCHELASTIC_RUN_ID) and with it the run directory, identical on every rank and",
        "# across requeues.",
        # An array, not `| head -n 1`: under pipefail, head closing the pipe while scontrol still
        # writes (SIGPIPE, exit 141) would abort the script.
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "# The address SLURM itself reaches the node at (NodeAddr; the node name where none is set).",
        "head_node=$(scontrol show node \"${nodes[0]}\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "head_node=${head_node:-${nodes[0]}}",
        "",
    ]
    rdzv = torchrun_args(
        nnodes='"$SLURM_JOB_NUM_NODES"',
        nproc_per_node=launch.procs_per_node,
        rdzv_endpoint=f'"$head_node:{launch.rdzv_port}"',
        rdzv_id='"$SLURM_JOB_ID"',
    )
    # torchrun gives its workers this long to save after a SIGTERM before it kills them (default 30 s).
    rdzv.append(f"--shutdown-timeout={grace}")
    command = [*rdzv, " ".join(["-m portatrain", *(shlex.quote(o) for o in overrides)])]
    lines.append("# In the background: bash runs a trap only once the foreground command has returned.")
    lines.append("srun --kill-on-bad-exit=1 torchrun \\")
    lines += [f"    {arg} \\" for arg in command[:-1]]
    lines.append(f"    {command[-1]} &")
    lines += [
        "training=$!",
        "# `wait` returns early when the trap runs; wait again until srun has exited, then take its status.",
        'while kill -0 "$training" 2>/dev/null; do wait "$training" || true; done',
        'status=0; wait "$training" || status=$?',
        "if ((time_limit_warning)); then",
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def parse_job_id(sbatch_stdout: str) -> str:
    """The job id from ``sbatch --parsable``'s output (``ID`` or ``ID;cluster``)."""
    match = _JOB_ID.match(sbatch_stdout.strip())
    if match is None:
        raise ValueError(f"cannot read a job id from sbatch's output {sbatch_stdout.strip()!r}")
    return match.group(1)


_TIME_FORMATS = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}")
"""sbatch's ``--time``: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes
or days-hours:minutes:seconds (https://slurm.schedmd.com/sbatch.html#OPT_time)."""


def problems(cfg: Any) -> list[str]:
    """What keeps ``cfg`` from rendering as an sbatch script, each with its fix."""
    time = cfg.parallel.launch.time
    if not time or _TIME_FORMATS.fullmatch(str(time)) or str(time).upper() in ("UNLIMITED", "INFINITE"):
        return []
    return [
        f"parallel.launch.time={time!r} is not a SLURM time limit: use minutes, minutes:seconds, "
        "hours:minutes:seconds, days-hours, days-hours:minutes or days-hours:minutes:seconds "
        "(e.g. parallel.launch.time=24:00:00 or 2-00:00:00)"
    ]


def scheduler_reason(stderr: str) -> str:
    """sbatch's reason for a rejection, without its ``sbatch: error:`` prefixes."""
    lines = [re.sub(r"^sbatch: error: ", "", line).strip() for line in stderr.strip().splitlines()]
    lines = [line for line in lines if line]
    # "Batch job submission failed: <reason>" is the line that matters; keep any others for context.
    return "; ".join(lines) or "no reason given"


def _export_line(key: str, value: object) -> str:
    """``export KEY=value``; a secret (``HF_TOKEN``, ``*_KEY``, ``*PASSWORD*``, ``GITHUB_PAT``, or a value
    shaped like a token: ``portatrain.redact.is_secret``) is never written into
    the script: it comes from the environment sbatch was called in (sbatch passes it on, and
    ``portatrain submit`` puts it there), and the job stops at once if it is missing."""
    if is_secret(key, str(value)):
        return (
            f'export {key}="${{{key}:?{key} is a secret and is not written into this script: export it in '
            f'the shell that runs sbatch}}"'
        )
    return f"export {key}={shlex.quote(str(value))}"
