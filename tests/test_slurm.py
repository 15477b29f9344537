"""The rendered sbatch job under a real SLURM (``tests/slurm_cluster.py``): runs to completion,
survives ``scontrol requeue`` and its time limit with the losses of an uninterrupted run, leaves an
intact checkpoint when cancelled, and runs on two nodes.

One two-node cluster (two ``slurmd`` on this host) serves the module; single-node jobs land on
either node. The cluster needs root and ``apt-get`` the first time (the packages are installed by
the fixture); elsewhere these tests skip, saying why (``PORTATRAIN_REQUIRE_SLURM=1``: fail instead).

The interrupted jobs run ``tests/slurm_trainer.py`` (portatrain's CLI with a Trainer that sleeps
after each step in the job's first allocation) instead of ``portatrain``, so that a fast machine
cannot finish before the interruption arrives; everything else is the rendered script.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from portatrain.checkpoint import complete_checkpoints, inspect_checkpoint
from portatrain.launch import job_overrides
from portatrain.launch.slurm import render_sbatch
from tests.conftest import ROOT, TINY, compose_config, run_cli
from tests.slurm_cluster import SlurmCluster, install, torchrun_shim
from tests.test_distributed import free_port

pytestmark = pytest.mark.slow

STEPS = 20
JOB = [o for o in TINY if not o.startswith("trainer.steps=")] + [
    f"trainer.steps={STEPS}",
    "parallel.dp_shard=2",
    "metrics.peak_tflops=1",  # skip measuring the CPU's matmul peak at every start
]
"""The issue's job: ``device=cpu parallel.dp_shard=2``, debug recipe, tiny data, 20 steps."""
ONE_NODE = ["launch.nodes=1", "launch.procs_per_node=2"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    reason = install()
    if reason is not None:
        if os.environ.get("PORTATRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=2).start()
    (cluster.root / "bin").mkdir()
    torchrun_shim(cluster.root / "bin")  # on the jobs' PATH: their torchrun and workers are forks
    try:
        yield cluster
    finally:
        cluster.stop()


def _job_env(slurm: SlurmCluster, step_sleep: float = 0.0) -> dict[str, str]:
    # sbatch exports the submitting environment to the job (--export=ALL, SLURM's default).
    env = {
        **slurm.env,
        "PATH": f"{slurm.root / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
        "PORTATRAIN_TEST_STEP_SLEEP": str(step_sleep),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PORTATRAIN_RUN_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _submit(
    slurm: SlurmCluster,
    workdir: Path,
    overrides: list[str],
    shape: list[str] = ONE_NODE,
    *,
    step_sleep: float | None = None,
    **launch: object,
) -> str:
    """Render the job for ``overrides`` + ``shape`` (+ LaunchConfig ``launch`` values), sbatch it.

    With ``step_sleep``, the job runs ``tests.slurm_trainer`` (see the module docstring)."""
    cfg = compose_config([*overrides, *shape, f"launch.rdzv_port={free_port()}"])
    for key, value in launch.items():
        cfg.launch[key] = value
    script = render_sbatch(cfg, job_overrides(overrides), workdir=str(workdir))
    if step_sleep is not None:
        assert "    -m portatrain " in script
        script = script.replace("    -m portatrain ", "    -m tests.slurm_trainer ")
    path = workdir / "job.sbatch"
    path.write_text(script)
    out = slurm.run("sbatch", "--parsable", str(path), env=_job_env(slurm, step_sleep or 0.0))
    return out.stdout.strip().split(";")[0]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss (a step logged twice, before and after a restart, keeps its last value)."""
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def _wait_for_step(slurm: SlurmCluster, job_id: str, run_dir: Path, step: int, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(_losses(run_dir), default=0) >= step:
            return
        assert slurm.job(job_id).get("JobState") not in DONE, _log(run_dir.parents[2], job_id)
        time.sleep(0.3)
    raise TimeoutError(
        f"job {job_id} did not reach step {step} in {timeout} s\n{_log(run_dir.parents[2], job_id)}"
    )


def _log(workdir: Path, job_id: str) -> str:
    """The job's whole log (both allocations of a requeued job): assertions search all of it."""
    logs = list(workdir.glob(f"*-{job_id}.out"))
    return logs[0].read_text() if logs else "(no job log)"


def _finished(slurm: SlurmCluster, job_id: str, workdir: Path, timeout: float = 180, **kw) -> dict:
    fields = slurm.wait_for(job_id, DONE, timeout, **kw)
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{_log(workdir, job_id)}\n{slurm.logs()}"
    return fields


@pytest.fixture(scope="module")
def reference(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``portatrain submit`` of the issue's job, run to completion: its output, run dir, losses."""
    workdir = tmp_path_factory.mktemp("submit")
    out = run_cli(
        ["submit", *JOB, *ONE_NODE, f"launch.rdzv_port={free_port()}"],
        cwd=workdir,
        env=_job_env(slurm),
    )
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"^submitted job (\d+)$", out.stdout, re.M).group(1)
    fields = _finished(slurm, job_id, workdir)
    run_dir = Path(re.search(r"^run directory: (.+)$", out.stdout, re.M).group(1))
    return {
        "workdir": workdir,
        "stdout": out.stdout,
        "job_id": job_id,
        "run_dir": run_dir,
        "fields": fields,
        "losses": _losses(run_dir),
    }


def test_submit_prints_job_id_run_dir_and_log_command_and_the_job_trains(reference: dict) -> None:
    workdir, job_id, run_dir = reference["workdir"], reference["job_id"], reference["run_dir"]
    assert run_dir == workdir / "runs" / "debug" / job_id  # named after the job id, as documented
    follow = re.search(r"^follow its log: (.+)$", reference["stdout"], re.M).group(1)
    log = workdir / f"portatrain-debug-{job_id}.out"
    assert follow == f"tail -F {log}"
    assert "checkpoint.resume=auto" in log.read_text()  # the first start of a resumable run
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == [f"step_{STEPS:07d}"]
    assert (run_dir / "job.sbatch").read_text().startswith("#!/bin/bash")
    # submit wrote nothing but the job's own run directory and the job's log.
    assert sorted(p.name for p in (workdir / "runs" / "debug").iterdir()) == [job_id]
    assert reference["fields"]["Restarts"] == "0"


def test_a_rejected_submission_is_one_error_with_the_schedulers_reason(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    out = run_cli(["submit", *JOB, *ONE_NODE, "launch.partition=nosuch"], cwd=tmp_path, env=_job_env(slurm))
    assert out.returncode == 2
    assert "the scheduler rejected the job" in out.stderr
    assert "Invalid partition name specified" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_requeue_mid_run_resumes_with_the_uninterrupted_losses(
    slurm: SlurmCluster, reference: dict, tmp_path: Path
) -> None:
    job_id = _submit(slurm, tmp_path, JOB, step_sleep=0.5)
    run_dir = tmp_path / "runs" / "debug" / job_id
    _wait_for_step(slurm, job_id, run_dir, 5)
    slurm.run("scontrol", "requeue", job_id)  # what a preempting scheduler does
    fields = _finished(slurm, job_id, tmp_path)
    assert fields["Restarts"] == "1"
    log = _log(tmp_path, job_id)
    stop = re.search(r"stopped at step (\d+) on request", log)
    assert stop, log
    stopped = int(stop.group(1))
    assert 5 <= stopped < STEPS and f"resumed from {run_dir / 'checkpoints'}/step_{stopped:07d}" in log
    assert _losses(run_dir) == reference["losses"]


def test_time_limit_warning_saves_requeues_and_finishes(
    slurm: SlurmCluster, reference: dict, tmp_path: Path
) -> None:
    # SLURM checks time limits (and sends the early warning) every 30 s, in one pass: a job found
    # past its limit is killed without the warning. The job starts with 5 minutes and a 120 s
    # warning; once it trains, the test shortens its limit to end 65-125 s from now (whole minutes
    # of run time). The warning is then due <= 5 s after the update, so the next check sends it
    # <= 35 s after the update and >= 30 s before the kill (were the limit only 30 s away, the first
    # check could fall past it): the job always has >= 30 s to save. (A 90 s warning came up to 65 s
    # after the update, ~25 s on average; this one ~15 s.) 3 s per step in the
    # first allocation keeps the run going past the warning. The requeued job gets its 5 minutes
    # back while it waits to restart.
    job_id = _submit(slurm, tmp_path, JOB, step_sleep=3.0, time="5", save_grace=120)
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@120\n" in script and "#SBATCH --requeue\n" in script
    _wait_for_step(slurm, job_id, tmp_path / "runs" / "debug" / job_id, 1)
    elapsed = _seconds(slurm.job(job_id)["RunTime"])
    slurm.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={math.ceil((elapsed + 65) / 60)}")
    fields = _finished(slurm, job_id, tmp_path, timeout=240, release=("StartTime=now", "TimeLimit=5"))
    assert fields["Restarts"] == "1"
    log = _log(tmp_path, job_id)
    assert "time-limit warning from SLURM: saving a checkpoint, then requeueing job" in log
    stop = re.search(r"stopped at step (\d+) on request", log)
    assert stop, log
    stopped = int(stop.group(1))
    assert f"resumed from {tmp_path}/runs/debug/{job_id}/checkpoints/step_{stopped:07d}" in log
    assert _losses(tmp_path / "runs" / "debug" / job_id) == reference["losses"]


def _seconds(slurm_duration: str) -> int:
    """``[D-]HH:MM:SS`` or ``MM:SS`` -> seconds."""
    days, _, clock = slurm_duration.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds + 86400 * int(days or 0)


def test_scancel_leaves_the_last_checkpoint_intact(slurm: SlurmCluster, tmp_path: Path) -> None:
    job_id = _submit(slurm, tmp_path, [*JOB, "checkpoint.every=4"], step_sleep=0.5)
    run_dir = tmp_path / "runs" / "debug" / job_id
    _wait_for_step(slurm, job_id, run_dir, 6)
    slurm.run("scancel", job_id)
    fields = slurm.wait_for(job_id, DONE, 120)
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0")  # a cancel is not requeued
    saved = complete_checkpoints(run_dir / "checkpoints")
    assert saved, _log(tmp_path, job_id)
    state, _ = inspect_checkpoint(saved[-1])  # index readable, every data file present and long enough
    assert state["step"] == int(saved[-1].name.split("_")[1]) >= 4
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_two_nodes_on_one_host(slurm: SlurmCluster, reference: dict, tmp_path: Path) -> None:
    """Two slurmd on this host (``NodeName=... Port=...``): one torchrun agent per node."""
    job_id = _submit(slurm, tmp_path, JOB, ["launch.nodes=2", "launch.procs_per_node=1"])
    fields = _finished(slurm, job_id, tmp_path)
    assert fields["NumNodes"] == "2", fields
    losses = _losses(tmp_path / "runs" / "debug" / job_id)
    assert losses.keys() == reference["losses"].keys()
    assert losses == pytest.approx(reference["losses"], rel=1e-5)
