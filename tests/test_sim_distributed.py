"""The debug recipe on the sim device under a real torchrun: FSDP2 with a DCP checkpoint and resume,
and tensor parallelism, each compared with one CPU process training on the same global batch.

Device tensors travel through the sim's own process-group backend (``cpu:gloo,sim:simccl``), so
this exercises the PrivateUse1 collective path FSDP2 and DTensor take on TPU and Trainium.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STEPS = 4
COMMON = [
    "data.num_documents=200",
    "data.seq_len=64",
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "optim.warmup_steps=2",
]
GLOBAL_BATCH = 8


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "SIM_DEVICE_COUNT": "2"}
    env.pop("WORLD_SIZE", None)
    return env


def _run(cmd: list[str], cwd: Path) -> None:
    out = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    assert "terminate called" not in out.stderr


def _portatrain(args: list[str], cwd: Path) -> None:
    _run([sys.executable, "-m", "portatrain", *args], cwd)


def _torchrun(nproc: int, args: list[str], cwd: Path) -> None:
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "portatrain",
            *args,
        ],
        cwd,
    )


def _records(run_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def _assert_close(got: list[tuple[int, float, float]], want: list[tuple[int, float, float]]) -> None:
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (_, loss, norm), (_, loss_ref, norm_ref) in zip(got, want):
        assert loss == pytest.approx(loss_ref, abs=1e-5)
        assert norm == pytest.approx(norm_ref, rel=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float, float]]:
    run_dir = tmp_path_factory.mktemp("cpu")
    _portatrain(
        [
            "device=cpu",
            *COMMON,
            f"data.batch_size={GLOBAL_BATCH}",
            f"run_dir={run_dir}",
            "checkpoint.enabled=false",
        ],
        run_dir,
    )
    return _records(run_dir)


def test_fsdp2_on_sim_matches_cpu_and_resumes_from_dcp(tmp_path: Path, reference: list) -> None:
    full = tmp_path / "full"
    _torchrun(
        2,
        [
            "device=sim",
            *COMMON,
            "parallel.dp_shard=2",
            f"data.batch_size={GLOBAL_BATCH // 2}",
            "checkpoint.every=2",
            f"run_dir={full}",
        ],
        tmp_path,
    )
    _assert_close(_records(full), reference)
    halfway = full / "checkpoints" / "step_0000002"
    assert halfway.is_dir()
    resumed = tmp_path / "resumed"
    _torchrun(
        2,
        [
            "device=sim",
            *COMMON,
            "parallel.dp_shard=2",
            f"data.batch_size={GLOBAL_BATCH // 2}",
            f"checkpoint.resume={halfway}",
            f"run_dir={resumed}",
        ],
        tmp_path,
    )
    _assert_close(_records(resumed), reference[2:])


def test_tensor_parallel_on_sim_matches_cpu(tmp_path: Path, reference: list) -> None:
    _torchrun(
        2,
        [
            "device=sim",
            *COMMON,
            "parallel.tp=2",
            f"data.batch_size={GLOBAL_BATCH}",
            f"run_dir={tmp_path / 'run'}",
            "checkpoint.enabled=false",
        ],
        tmp_path,
    )
    _assert_close(_records(tmp_path / "run"), reference)
