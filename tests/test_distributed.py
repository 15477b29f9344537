"""Real multi-process training on CPU (gloo): FSDP2, TP, FSDP2 x TP, HSDP and two torchrun "nodes".

Every run trains under a real ``torchrun`` and compares its per-step loss and gradient norm with one
process training on the same global batch (N ranks with ``data.batch_size=B`` read exactly the rows
of one rank with ``N * B``). The weights start identical (``parallel.init_full_tensors``), gradients
are the single-device ones (no double division by the dp degree), so the losses agree to fp32
rounding. Tiny model, five steps: each run takes seconds. FSDP2 and the two "nodes" launch the
unchanged ``portatrain`` command (the torchrun contract: run directory, output); the two-process
layouts (TP, HSDP, compiled TP blocks) train in the session's two-process launch
(``tests/shared_launch.py``: its processes import torch and join the group once), and FSDP2 x TP of
Llama and of Qwen 3 in its four-process one.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from portatrain.trainer import Trainer
from tests import shared_launch
from tests.conftest import TINY, compose_config
from tests.helpers import fit, launch_env, python, torchrun, train_records

pytestmark = pytest.mark.slow

STEPS = 5
COMMON = [*TINY, f"trainer.steps={STEPS}"]
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One process, the whole global batch."""
    run_dir = tmp_path_factory.mktemp("single")
    trainer = Trainer(
        compose_config([*COMMON, f"data.batch_size={GLOBAL_BATCH}", "checkpoint.enabled=false"], run_dir)
    )
    trainer.fit()
    trainer.close()
    return train_records(run_dir)


def _failure(out: subprocess.CompletedProcess) -> str:
    return f"exit code {out.returncode}\n--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}"


def _assert_matches(records: list[dict], reference: list[dict], steps: int = STEPS, what: str = "") -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1)), what
    for got, want in zip(records, reference):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (what, got, want)
        # The pre-clip global norm, reduced across the FSDP/TP meshes, is the single-device norm.
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (what, got, want)


def test_fsdp2_two_processes_match_one_and_write_once(tmp_path: Path, reference: list[dict]) -> None:
    """Also the torchrun contract: one run directory shared by all ranks (named by the rendezvous id,
    no ``run_dir`` given), metrics and checkpoint written once, progress on rank 0 only."""
    out = torchrun(
        2,
        [*COMMON, "data.batch_size=4", "trainer.progress=true"],
        cwd=tmp_path,
        torchrun_args=[f"--log-dir={tmp_path / 'logs'}", "--redirects=3"],
    )
    assert out.returncode == 0, _failure(out)
    (run_dir,) = (tmp_path / "runs" / "debug").iterdir()  # both ranks resolved the same directory
    _assert_matches(train_records(run_dir), reference)
    assert (run_dir / "config.yaml").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{STEPS:07d}"]
    rank0, rank1 = (
        "".join(p.read_text() for p in (tmp_path / "logs").glob(f"*/attempt_0/{rank}/std*.log"))
        for rank in (0, 1)
    )
    # Redirected to files (not a terminal): plain progress lines instead of bar frames, rank 0 only.
    assert f"step {STEPS}/{STEPS}" in rank0 and "\r" not in rank0
    assert f"{STEPS}/{STEPS}" not in rank1


TWO_PROCESS_LAYOUTS = {
    "tp2": ["parallel.tp=2", f"data.batch_size={GLOBAL_BATCH}"],
    "hsdp_replicate2": ["parallel.dp_replicate=2", f"data.batch_size={GLOBAL_BATCH // 2}"],
    # TP -> selective AC -> per-block compile: TP is where compiled blocks meet DTensor
    # redistributions (see ``parallelize._detach_view_from_compiled_blocks``). Two steps, since
    # compiling on CPU dominates; the first two learning rates do not depend on ``trainer.steps``.
    "tp2_selective_compiled": [
        "trainer.steps=2",
        "parallel.tp=2",
        "parallel.activation_checkpointing=selective",
        "compile.enabled=true",
        f"data.batch_size={GLOBAL_BATCH}",
    ],
}


two_process_layouts = shared_launch.declare(
    "two_process_layouts",
    2,
    {name: [*COMMON, *layout, "checkpoint.enabled=false"] for name, layout in TWO_PROCESS_LAYOUTS.items()},
)

QWEN3 = ["model=qwen3_debug", "trainer.steps=4"]
FSDP2_X_TP2 = ["parallel.dp_shard=2", "parallel.tp=2", f"data.batch_size={GLOBAL_BATCH // 2}"]
four_processes = shared_launch.declare(
    "four_processes",
    4,
    {
        "llama": [*COMMON, *FSDP2_X_TP2, "checkpoint.enabled=false"],
        "qwen3": [*COMMON, *QWEN3, *FSDP2_X_TP2, "checkpoint.enabled=false"],
    },
)


@pytest.mark.parametrize("layout", ["tp2", "hsdp_replicate2"])
def test_layouts_match_one_process(
    two_process_layouts: dict[str, Path], reference: list[dict], layout: str
) -> None:
    _assert_matches(train_records(two_process_layouts[layout]), reference, what=layout)


def test_fsdp2_x_tp2_on_four_processes_matches_one_process(
    tmp_path: Path, reference: list[dict], four_processes
) -> None:
    """The debug Llama, and Qwen 3's tied debug model (one vocabulary-sharded matrix for both ends,
    q/k norms over TP-sharded heads), in the four-process launch, each against one process."""
    qwen3_single = tmp_path / "qwen3_single"
    fit([*COMMON, *QWEN3, f"data.batch_size={GLOBAL_BATCH}", "checkpoint.enabled=false"], qwen3_single)
    _assert_matches(train_records(four_processes["llama"]), reference, what="llama fsdp2 x tp2")
    qwen3_reference = train_records(qwen3_single)
    qwen3 = train_records(four_processes["qwen3"])
    _assert_matches(qwen3, qwen3_reference, steps=4, what="qwen3 fsdp2 x tp2")


def test_compiled_blocks_with_tp_and_selective_checkpointing_match(
    two_process_layouts: dict[str, Path], reference: list[dict]
) -> None:
    """Inductor (the CPU default) on TP blocks with selective activation checkpointing."""
    records = train_records(two_process_layouts["tp2_selective_compiled"])
    _assert_matches(records, reference[:2], steps=2, what="tp2, selective AC, compiled blocks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_as_two_nodes(tmp_path: Path, reference: list[dict]) -> None:
    """``--nnodes=2``: two agents on this machine meet in a c10d rendezvous on 127.0.0.1, exactly as
    two hosts would (the multi-host command of docs/parallelism/index.md), and the job trains like one process."""
    torchrun_args = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=twonodes",
    ]
    cmd = python("-m", "torch.distributed.run", *torchrun_args, "--no-python", *python(), "-m", "portatrain")
    cmd += [*COMMON, "data.batch_size=4", "checkpoint.enabled=false"]
    agents = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    # The rendezvous id is the run id on both nodes: one directory, written by global rank 0.
    assert [p.name for p in (tmp_path / "runs" / "debug").iterdir()] == ["twonodes"]
    _assert_matches(train_records(tmp_path / "runs" / "debug" / "twonodes"), reference)
