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

**Fault tolerance** (``fault_tolerance.enabled=true``, ``portatrain.fault_tolerance``): the rendered
script is a small job that serves torchft's lighthouse (``portatrain lighthouse``) and submits the
replica groups as a job array (``sbatch --wait --array=0-<group_size - 1>``): each group is an array
task of ``nodes`` hosts with an allocation of its own, its own torchrun rendezvous
(``<array job id>_<task id>``) and ``fault_tolerance.replica_id=$SLURM_ARRAY_TASK_ID``. A group is a
separately restartable unit: its torchrun restarts its workers (``--max-restarts``), SLURM requeues
its task alone after a preemption, node failure or time-limit warning, and meanwhile the other groups
train on; the replacement heals from a healthy group. All groups write under one run directory
(``runs/<recipe>/<lighthouse job id>/replica_<id>``). With ``fault_tolerance.lighthouse`` set, the
script is the array alone and uses that lighthouse.

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
    """The sbatch script running ``portatrain <overrides>`` on ``launch.nodes`` hosts (with
    fault tolerance: the lighthouse job that submits the replica groups, see the module docstring)."""
    workdir = workdir or os.getcwd()
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return _render_job(cfg, overrides, workdir=workdir)
    groups = _render_job(cfg, overrides, workdir=workdir, replica_groups=ft.group_size)
    if ft.lighthouse:  # the user's own lighthouse: the replica groups' array is the whole job
        return groups
    return _render_lighthouse_job(cfg, groups, workdir=workdir)


def _render_lighthouse_job(cfg: Any, groups: str, *, workdir: str) -> str:
    """A one-node job serving torchft's lighthouse while the replica groups' array runs."""
    from portatrain.fault_tolerance import LIGHTHOUSE_PORT

    launch, ft = cfg.launch, cfg.fault_tolerance
    name = job_name(cfg)
    directives = [
        f"--job-name={name}",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=2",
        f"--chdir={workdir}",
        f"--output={log_file(name)}",
        "--open-mode=append",
    ]
    directives += _optional_directives(launch)
    lines = [
        "#!/bin/bash",
        f"# portatrain fault-tolerant job: {describe_job(cfg)}, as {ft.group_size} replica groups.",
        "# Rendered by `portatrain render`; submit with `sbatch FILE`. This job serves torchft's lighthouse and",
        f"# submits the replica groups as a job array of {ft.group_size} task(s), each its own allocation:",
        "# a group that fails is restarted (torchrun) or requeued (SLURM) alone while the others train on,",
        "# and rejoins by live recovery from a healthy group.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        *launch.setup,
        "",
        "# Every replica group writes under runs/<recipe>/<this job's id>/replica_<id>.",
        'export PORTATRAIN_RUN_ID="${PORTATRAIN_RUN_ID:-$SLURM_JOB_ID}"',
        f"python -m portatrain lighthouse --port={LIGHTHOUSE_PORT} --min-replicas={ft.min_replicas} &",
        "lighthouse=$!",
        "trap 'kill \"$lighthouse\" 2>/dev/null || true' EXIT",
        f'export TORCHFT_LIGHTHOUSE="http://$(hostname):{LIGHTHOUSE_PORT}"',
        "",
        "# The replica groups (the quoted here-document is their script, expanded by each task).",
        "sbatch --wait --export=ALL <<'PORTATRAIN_REPLICA_GROUPS'",
        groups.rstrip("\n"),
        "PORTATRAIN_REPLICA_GROUPS",
    ]
    return "\n".join(lines) + "\n"


def _optional_directives(launch: Any) -> list[str]:
    """``--partition``, ``--account`` and ``--time``, where the config sets them."""
    return [
        f"--{key}={getattr(launch, key)}" for key in ("partition", "account", "time") if getattr(launch, key)
    ]


def _render_job(
    cfg: Any, overrides: Sequence[str], *, workdir: str, replica_groups: int | None = None
) -> str:
    """The training job; with ``replica_groups``, an array of that many replica groups."""
    launch = cfg.launch
    name = job_name(cfg)
    grace = int(launch.save_grace)
    lines = [
        "#!/bin/bash",
        f"# portatrain job: {describe_job(cfg)}.",
        "# Rendered by `portatrain render` from the same config as the training run; submit with `sbatch FILE`.",
        "# Preemption, requeue and the time limit: the run resumes from its newest checkpoint in",
        "# runs/<recipe>/<job id> (checkpoint.resume=auto); see the trap below.",
        *(f"#SBATCH {d}" for d in _job_directives(cfg, name, workdir=workdir, replica_groups=replica_groups)),
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
    if replica_groups is not None:
        lines += [
            "# Every replica group writes under the same run directory (its own replica_<id> inside).",
            'export PORTATRAIN_RUN_ID="${PORTATRAIN_RUN_ID:-$SLURM_ARRAY_JOB_ID}"',
            "",
        ]
    lines += _training_step(cfg, overrides, replica_groups=replica_groups)
    return "\n".join(lines) + "\n"


def _job_directives(cfg: Any, name: str, *, workdir: str, replica_groups: int | None) -> list[str]:
    """The ``#SBATCH`` options of the training job (an array of ``replica_groups`` when given)."""
    launch = cfg.launch
    grace = int(launch.save_grace)
    directives = [
        f"--job-name={name}" if replica_groups is None else f"--job-name={name}-group",
        f"--nodes={launch.nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the workers
        "--exclusive",
        f"--chdir={workdir}",
        f"--output={log_file(name) if replica_groups is None else f'{name}-group-%A_%a.out'}",
        "--open-mode=append",  # a requeued job continues its log instead of truncating it
        "--requeue",
        f"--signal=B:USR1@{grace}",  # to this script, not the step: see the comment above the trap
    ]
    if replica_groups is not None:  # one array task per replica group, each requeued alone
        directives.append(f"--array=0-{replica_groups - 1}")
    if cfg.device.type == "cuda":
        directives.append(f"--gpus-per-node={launch.procs_per_node}")
    return directives + _optional_directives(launch)


def _training_step(cfg: Any, overrides: Sequence[str], *, replica_groups: int | None) -> list[str]:
    """srun of torchrun in the background, then the wait that lets the time-limit trap requeue."""
    launch = cfg.launch
    grace = int(launch.save_grace)
    rdzv = torchrun_args(
        nnodes='"$SLURM_JOB_NUM_NODES"',
        nproc_per_node=launch.procs_per_node,
        rdzv_endpoint=f'"$head_node:{launch.rdzv_port}"',
        # A replica group: a rendezvous of its own (the task's job id), in the array's run directory.
        rdzv_id='"$SLURM_JOB_ID"',
    )
    # torchrun gives its workers this long to save after a SIGTERM before it kills them (default 30 s).
    rdzv.append(f"--shutdown-timeout={grace}")
    if replica_groups is not None:  # each array task is its own replica group
        overrides = [o for o in overrides if not o.lstrip("+~").startswith("fault_tolerance.replica_id=")]
    arguments = ["-m portatrain", *(shlex.quote(o) for o in overrides)]
    if replica_groups is not None:
        # A replica group's failed worker restarts the group alone: its workers heal from a healthy group.
        rdzv.append(f"--max-restarts={launch.max_restarts}")
        arguments.append('fault_tolerance.replica_id="$SLURM_ARRAY_TASK_ID"')
    command = [*rdzv, " ".join(arguments)]
    lines = [
        "# In the background: bash runs a trap only once the foreground command has returned.",
        "srun --kill-on-bad-exit=1 torchrun \\",
    ]
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
    return lines


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
    time = cfg.launch.time
    if not time or _TIME_FORMATS.fullmatch(str(time)) or str(time).upper() in ("UNLIMITED", "INFINITE"):
        return []
    return [
        f"launch.time={time!r} is not a SLURM time limit: use minutes, minutes:seconds, "
        "hours:minutes:seconds, days-hours, days-hours:minutes or days-hours:minutes:seconds "
        "(e.g. launch.time=24:00:00 or 2-00:00:00)"
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
