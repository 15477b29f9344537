"""Job submission: render the same ``portatrain ...`` command as a multi-host job for a scheduler.

``portatrain render [overrides]`` prints (or writes to ``launch.output``) a job for
``launch.scheduler`` and writes nothing else; ``portatrain submit [overrides]`` hands it to
the scheduler's own CLI (``sbatch``, ``kubectl create -f``) and prints the job's id, the run
directory it will write and the command that follows its log. Every host runs one ``torchrun``
agent that starts ``procs_per_node`` workers.

* ``slurm`` -- an sbatch script: ``srun`` one ``torchrun`` per node, head node from
  ``scontrol show hostnames $SLURM_JOB_NODELIST``, ``--rdzv-id=$SLURM_JOB_ID``, so every rank writes
  to the same ``runs/<recipe>/<job id>/`` (``portatrain.config.run_id``) (``slurm.py``).
* ``jobset`` -- a Kubernetes JobSet for a TPU slice on GKE (``kubernetes.py``).
* ``pytorchjob`` -- a Kubeflow PyTorchJob for GPU (``device=cuda``) or Trainium (``device=neuron``)
  nodes (``kubernetes.py``).

A scheduler-launched run continues after preemption: the job's command carries
``checkpoint.resume=auto`` (unless the overrides name another ``checkpoint.resume``), and its run
directory is the job's own (named after the SLURM job id or the Kubernetes job name), so a requeued
or restarted job finds its own newest checkpoint and nothing else.

The job's training command carries the user's overrides unchanged, minus the ``launch.*``
ones that only shape the job. The layout (``dp_replicate x dp_shard x tp``) was validated against
``nodes * procs_per_node`` before anything is rendered.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from portatrain.config import LaunchConfig
from portatrain.errors import ConfigError
from portatrain.launch.job import (
    RenderedJob,
    SubmitError,
    SubmittedJob,
    describe_job,
    job_name,
    job_overrides,
    override_value,
    torchrun_args,
    training_overrides,
)
from portatrain.redact import find_secrets, is_secret

SCHEDULERS = ("slurm", "jobset", "pytorchjob")
"""What ``launch.scheduler`` may name: the job kinds ``portatrain render`` writes."""


def shape_problems(launch: LaunchConfig) -> list[str]:
    """The job shape's problems, checked for every command (``portatrain.validate``): the parallel
    layout is checked against ``nodes * procs_per_node`` processes, so these come first."""
    found = []
    if launch.scheduler not in SCHEDULERS:
        found.append(f"launch.scheduler={launch.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    for name in ("nodes", "procs_per_node"):
        if getattr(launch, name) < 1:
            found.append(f"launch.{name}={getattr(launch, name)} must be >= 1")
    return found


def launch_problems(cfg: Any) -> list[str]:
    """Scheduler-specific problems of ``cfg`` (the layout itself is checked by ``validate``)."""
    from portatrain.launch import kubernetes, slurm

    launch = cfg.launch
    found = []
    grace = launch.save_grace
    if not isinstance(grace, int) or grace < 1:
        found.append(
            f"launch.save_grace={grace!r} must be a whole number of seconds >= 1 (the time a "
            "checkpoint save needs; e.g. launch.save_grace=180)"
        )
    if launch.scheduler == "slurm":
        found += slurm.problems(cfg)
    if launch.scheduler in ("jobset", "pytorchjob"):
        found += kubernetes.problems(cfg)
    return found


def render_job(cfg: Any, overrides: Sequence[str]) -> RenderedJob:
    """Render ``cfg``'s job for ``launch.scheduler``; raise ConfigError listing every problem."""
    from portatrain.launch import kubernetes, slurm

    problems = launch_problems(cfg)
    if problems:
        raise ConfigError("cannot render the job:\n  - " + "\n  - ".join(problems))
    scheduler = cfg.launch.scheduler
    if scheduler == "slurm":
        text = slurm.render_sbatch(cfg, job_overrides(overrides))
        job = RenderedJob(text, "job.sbatch", ("sbatch",), name=job_name(cfg))
    else:
        job = kubernetes.render(cfg, overrides)
    # launch.env secrets stay out of the file (see slurm/kubernetes); a credential anywhere
    # else (an override, a setup line) would be written into it: refuse, say where secrets belong.
    leaked = find_secrets(job.text)
    if leaked:
        raise ConfigError(
            f"the rendered {scheduler} job would hold {len(leaked)} credential(s) (a token, key or "
            "password) from the overrides or launch.setup; pass a secret as "
            "+launch.env.NAME=VALUE instead: the job reads it from the submitting environment "
            "(or a Kubernetes Secret), never from the file"
        )
    return job


def _discard_empty_run_dir(cfg: Any, overrides: Sequence[str]) -> None:
    """Remove the run directory the CLI created for this command if it stayed empty.

    ``render`` and ``submit`` do not train, and the job names its own run directory; the CLI made
    ``cfg.run_dir`` (Hydra's output directory) before any command ran. Only empty directories go,
    and only when the user did not name ``run_dir`` (then it is theirs).
    """
    if override_value(overrides, "run_dir") is not None or not cfg.run_dir:
        return
    folder = Path(cfg.run_dir).resolve()
    stop = Path.cwd().resolve()
    # Hydra's default is runs/<recipe>/<run id>: remove upwards while empty, never above the cwd.
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()  # only succeeds when empty
        except OSError:
            return
        folder = folder.parent


def render_command(cfg: Any, overrides: Sequence[str]) -> None:
    """``portatrain render``: print the job, or write it to ``launch.output``; nothing else."""
    job = render_job(cfg, overrides)
    _discard_empty_run_dir(cfg, overrides)
    if cfg.launch.output:
        path = Path(cfg.launch.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(job.text)
        print(f"wrote {path}; submit it with: {shlex.join([*job.submit_command, str(path)])}")
    else:
        print(job.text, end="")


def _scheduler_cli(cfg: Any, tool: str) -> None:
    if shutil.which(tool) is None:
        raise SubmitError(
            f"launch.scheduler={cfg.launch.scheduler} submits with `{tool}`, which is not "
            f"on PATH here; run `portatrain render` instead and submit the file where `{tool}` is installed"
        )


def submit_command(cfg: Any, overrides: Sequence[str]) -> SubmittedJob:
    """``portatrain submit``: hand the job to the scheduler's CLI (which must be on ``PATH``), then
    print the job id, the run directory the job will write and the command that follows its log.

    The job file is written to ``launch.output`` when set, and always copied into the run
    directory (``job.sbatch`` / ``job.yaml``) once that is known. A rejection by the scheduler is one
    :class:`SubmitError` carrying the scheduler's reason.
    """
    job = render_job(cfg, overrides)
    _scheduler_cli(cfg, job.submit_command[0])
    _discard_empty_run_dir(cfg, overrides)
    if cfg.launch.scheduler == "slurm":
        submitted = _submit_slurm(cfg, overrides, job)
    else:
        from portatrain.launch import kubernetes

        submitted = kubernetes.submit(cfg, job)
    print(
        f"submitted job {submitted.job_id}\n"
        f"run directory: {submitted.run_dir}\n"
        f"follow its log: {submitted.follow}",
        flush=True,
    )
    return submitted


def _run_scheduler(
    argv: list[str], *, text_input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, input=text_input, text=True, capture_output=True, env=env)
    if result.returncode != 0:
        from portatrain.launch.slurm import scheduler_reason

        reason = scheduler_reason(result.stderr) if argv[0] == "sbatch" else result.stderr.strip()
        raise SubmitError(
            f"the scheduler rejected the job (`{shlex.join(argv)}` exited with {result.returncode}): "
            f"{reason or 'no reason given'}"
        )
    return result


def _submit_slurm(cfg: Any, overrides: Sequence[str], job: RenderedJob) -> SubmittedJob:
    from portatrain.launch.slurm import log_file, parse_job_id

    argv = ["sbatch", "--parsable"]
    # Secrets in launch.env are not in the script (see slurm._export_line): sbatch hands its
    # own environment to the job, so they travel there, in this process's environment only.
    secrets = {k: str(v) for k, v in cfg.launch.env.items() if is_secret(k, str(v))}
    env = {**os.environ, **secrets} if secrets else None
    if cfg.launch.output:
        path = Path(cfg.launch.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(job.text)
        result = _run_scheduler([*argv, str(path)], env=env)
    else:  # sbatch reads the script from stdin; the copy in the run directory is the record
        result = _run_scheduler(argv, text_input=job.text, env=env)
    try:
        job_id = parse_job_id(result.stdout)
    except ValueError as exc:
        raise SubmitError(f"sbatch accepted the job but {exc}") from None
    # The job's run directory: run_dir when given, else runs/<recipe>/<run id> in the job's working
    # directory (this one), the run id being PORTATRAIN_RUN_ID if exported, else the job id.
    explicit = override_value(overrides, "run_dir")
    run_id = os.environ.get("PORTATRAIN_RUN_ID") or job_id
    run_dir = Path(explicit) if explicit else Path("runs") / cfg.recipe / run_id
    run_dir = run_dir if run_dir.is_absolute() else Path.cwd() / run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / job.filename).write_text(job.text)
    log = Path.cwd() / log_file(job.name).replace("%j", job_id)
    return SubmittedJob(job_id, str(run_dir), f"tail -F {shlex.quote(str(log))}")


__all__ = [
    "SCHEDULERS",
    "RenderedJob",
    "SubmitError",
    "SubmittedJob",
    "describe_job",
    "job_name",
    "job_overrides",
    "launch_problems",
    "override_value",
    "render_command",
    "render_job",
    "shape_problems",
    "submit_command",
    "torchrun_args",
    "training_overrides",
]
