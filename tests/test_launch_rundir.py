"""The shared-run-directory check (``portatrain.rundir``) under two real torchrun agents.

Two agents with separate working directories stand in for two pods (or two nodes) without shared
storage: the relative run directory resolves to a different folder on each. Before the check, such a
run trained and then hung in its first checkpoint save; with it, every rank stops at start-up with
one message naming the fix.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY
from tests.helpers import python
from tests.test_distributed import free_port

pytestmark = pytest.mark.slow

CHECK = """
import sys
import torch.distributed as dist
from portatrain.rundir import SharedStorageError, check_shared_run_dir

dist.init_process_group("gloo")
try:
    check_shared_run_dir("runs/debug/job", timeout_s=2)
except SharedStorageError as exc:
    print(f"rank {dist.get_rank()}: {exc}", flush=True)
    sys.exit(3)
print(f"rank {dist.get_rank()}: shared", flush=True)
dist.destroy_process_group()
"""


def _two_agents(
    workdirs: list[Path], argv: list[str], timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """One torchrun agent (one worker) per working directory, meeting in a c10d rendezvous."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PORTATRAIN_RUN_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    agents = [
        subprocess.Popen(
            python(
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=rundir-check",
                "--no-python",  # the workers forks too
                *python(),
                *argv,
            ),
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for workdir in workdirs
    ]
    results = []
    for agent in agents:
        try:
            out, err = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise AssertionError("the agents hung instead of stopping at start-up") from None
        results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    return results


def test_separate_run_directories_stop_both_agents_with_the_shared_storage_message(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    pods = [tmp_path / "pod0", tmp_path / "pod1"]
    for pod in pods:
        pod.mkdir()
    results = _two_agents(pods, [str(script)])
    output = "".join(r.stdout for r in results)
    assert all(r.returncode != 0 for r in results), output
    for rank in (0, 1):  # both ranks stop, with the same message
        assert f"rank {rank}: the run directory is not shared by all ranks: rank 0 on " in output
    # Which agent's worker is rank 0 is the rendezvous's choice: it ranks the agents by pid, and forks
    # get theirs in the order the fork server serves the two agents' clients, which race.
    host, dirs = os.uname().nodename, [pod / "runs" / "debug" / "job" for pod in pods]
    main = 0 if f"wrote a marker file into {dirs[0]}," in output else 1
    assert f"rank 0 on {host} wrote a marker file into {dirs[main]}," in output, output
    assert f"rank 1 on {host} looked in {dirs[1 - main]}" in output, output
    assert "launch.volume_claim=CLAIM" in output
    # Rank 0's marker is gone again: the run directory holds nothing of the check.
    assert list(dirs[main].iterdir()) == []


def test_a_shared_run_directory_passes(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    results = _two_agents([tmp_path, tmp_path], [str(script)])
    output = "".join(r.stdout + r.stderr for r in results)
    assert all(r.returncode == 0 for r in results), output
    assert "rank 0: shared" in output and "rank 1: shared" in output
    assert list((tmp_path / "runs" / "debug" / "job").iterdir()) == []


def test_single_process_is_a_no_op(tmp_path: Path) -> None:
    from portatrain.rundir import check_shared_run_dir

    check_shared_run_dir(tmp_path / "never-created")
    assert not (tmp_path / "never-created").exists()


def test_portatrain_under_two_agents_without_shared_storage_stops_at_start_up(tmp_path: Path) -> None:
    """The real trainer: stops before building anything, instead of hanging in its first save."""
    pods = [tmp_path / "pod0", tmp_path / "pod1"]
    for pod in pods:
        pod.mkdir()
    results = _two_agents(pods, ["-m", "portatrain", *TINY, "parallel.dp_shard=2"])
    stderr = "".join(r.stderr for r in results)
    assert all(r.returncode != 0 for r in results), stderr[-3000:]
    assert "the run directory is not shared by all ranks" in stderr, stderr[-3000:]
    for pod in pods:  # nothing trained, nothing saved
        assert not list(pod.rglob("metrics.jsonl")) and not list(pod.rglob("step_*"))
