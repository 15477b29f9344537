"""The debug recipe on the sim device under a real torchrun: FSDP2 with a DCP checkpoint and resume,
and tensor parallelism, each compared with one CPU process training on the same global batch.

Device tensors travel through the sim's own process-group backend (``cpu:gloo,sim:simccl``), so
this exercises the PrivateUse1 collective path FSDP2 and DTensor take on TPU and Trainium. The three
sim runs (FSDP2, its resume from the step-2 checkpoint, TP) train in the session's two-process launch
on the sim device (``tests/shared_launch.py``); the CPU reference trains in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import shared_launch
from tests.helpers import fit, train_records

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


def _records(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(run_dir)]


def _assert_close(got: list[tuple[int, float, float]], want: list[tuple[int, float, float]]) -> None:
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (_, loss, norm), (_, loss_ref, norm_ref) in zip(got, want):
        assert loss == pytest.approx(loss_ref, abs=1e-5)
        assert norm == pytest.approx(norm_ref, rel=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float, float]]:
    run_dir = tmp_path_factory.mktemp("cpu")
    fit(["device=cpu", *COMMON, f"data.batch_size={GLOBAL_BATCH}", "checkpoint.enabled=false"], run_dir)
    return _records(run_dir)


# FSDP2 saving at step 2, FSDP2 resumed from that checkpoint, and TP: in that order.
FSDP2 = ["device=sim", *COMMON, "parallel.dp_shard=2", f"data.batch_size={GLOBAL_BATCH // 2}"]
sim_runs = shared_launch.declare(
    "sim_runs",
    2,
    {
        "full": [*FSDP2, "checkpoint.every=2"],
        "resumed": [
            *FSDP2,
            f"checkpoint.resume={shared_launch.module_path('full', 'checkpoints', 'step_0000002')}",
        ],
        "tp": [
            "device=sim",
            *COMMON,
            "parallel.tp=2",
            f"data.batch_size={GLOBAL_BATCH}",
            "checkpoint.enabled=false",
        ],
    },
    env={"SIM_DEVICE_COUNT": "2"},
)


def test_fsdp2_on_sim_matches_cpu_and_resumes_from_dcp(sim_runs: dict[str, Path], reference: list) -> None:
    _assert_close(_records(sim_runs["full"]), reference)
    assert (sim_runs["full"] / "checkpoints" / "step_0000002").is_dir()
    _assert_close(_records(sim_runs["resumed"]), reference[2:])
    assert "terminate called" not in sim_runs.launch_stderr  # the sim backend's teardown at exit


def test_tensor_parallel_on_sim_matches_cpu(sim_runs: dict[str, Path], reference: list) -> None:
    _assert_close(_records(sim_runs["tp"]), reference)
