"""Job rendering and submission: the sbatch script, the JobSet and the PyTorchJob.

No scheduler runs here (see docs/cluster.md: a SLURM controller needs munge and root-owned daemons), so
the sbatch script is checked three ways: ``bash -n``, its torchrun arguments, and -- slow test -- by
running it under stand-ins for ``srun`` and ``scontrol`` that start one torchrun agent per "node" on
this machine, which then really train.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from portatrain.launch import job_overrides, render_job, training_overrides
from tests.conftest import ROOT, TINY, compose_config
from tests.slurm_cluster import torchrun_shim
from tests.test_command_errors import run
from tests.test_distributed import free_port


def _render(overrides: list[str]) -> str:
    return render_job(compose_config(overrides), overrides).text


@pytest.fixture
def portatrain(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """``portatrain ARGS`` run in this process from ``tmp_path`` (the CLI as the console script runs
    it: ``tests.test_command_errors.run``; a fresh process per command only added its start-up), as a
    CompletedProcess; ``path``: a directory put first on ``PATH`` (stand-ins for the scheduler)."""
    monkeypatch.chdir(tmp_path)

    def call(args: list[str], path: Path | None = None) -> subprocess.CompletedProcess:
        if path is not None:
            monkeypatch.setenv("PATH", f"{path}{os.pathsep}{os.environ['PATH']}")
        status, err = run(args, capsys)
        return subprocess.CompletedProcess(args, status, capsys.readouterr().out, err)

    return call


def _write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_training_overrides_drop_the_job_shape() -> None:
    assert training_overrides(
        ["recipe=llama8b", "parallel.launch.nodes=4", "+parallel.launch.env.X=1", "parallel.tp=8"]
    ) == ["recipe=llama8b", "parallel.tp=8"]


def test_sbatch_script_is_valid_bash_with_the_slurm_rendezvous(tmp_path: Path, portatrain) -> None:
    args = [
        "render",
        "recipe=llama70b",
        "device=cuda",
        "parallel.tp=8",
        "parallel.launch.nodes=8",
        "parallel.launch.procs_per_node=8",
        "parallel.launch.partition=gpu",
        "parallel.launch.time=48:00:00",
        "trainer.steps=10",
        "optim.betas=[0.9,0.99]",
        f"parallel.launch.output={tmp_path / 'job.sbatch'}",
    ]
    out = portatrain(args)
    assert out.returncode == 0, out.stderr
    script = (tmp_path / "job.sbatch").read_text()
    assert subprocess.run(["bash", "-n", tmp_path / "job.sbatch"], capture_output=True).returncode == 0
    for directive in (
        "--nodes=8",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--time=48:00:00",
    ):
        assert f"#SBATCH {directive}\n" in script
    assert 'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))\n' in script
    assert 'head_node=$(scontrol show node "${nodes[0]}" | sed' in script  # its NodeAddr
    assert "srun --kill-on-bad-exit=1 torchrun" in script
    for arg in (
        '--nnodes="$SLURM_JOB_NUM_NODES"',
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$head_node:29500"',
        '--rdzv-id="$SLURM_JOB_ID"',
        "--shutdown-timeout=180",  # torchrun gives its workers the save grace
    ):
        assert f"    {arg} \\\n" in script
    # The same command the user would type, minus the job-shape keys, resuming by default.
    assert (
        "-m portatrain recipe=llama70b device=cuda parallel.tp=8 trainer.steps=10 'optim.betas=[0.9,0.99]' "
        "checkpoint.resume=auto &\n"
    ) in script
    # Preemption: requeue, an early warning to the batch shell, which signals the step and requeues.
    for directive in ("--requeue", "--signal=B:USR1@180", "--open-mode=append", f"--chdir={tmp_path}"):
        assert f"#SBATCH {directive}\n" in script
    assert "set -euo pipefail\n\n# 180 s before the time limit" in script  # the trap comes first
    assert "trap on_time_limit_warning USR1  #" in script
    assert 'scancel --signal=TERM "$SLURM_JOB_ID" || true' in script
    assert 'if ((time_limit_warning)); then\n    scontrol requeue "$SLURM_JOB_ID"\n' in script
    assert "dp_replicate=1 x dp_shard=8 x tp=8 = 64 devices" in script


def test_render_validates_the_layout_against_the_job_shape(portatrain) -> None:
    out = portatrain(
        ["render", "parallel.dp_shard=3", "parallel.launch.nodes=2", "parallel.launch.procs_per_node=2"]
    )
    assert out.returncode == 2
    assert "dp_shard(3) * tp(1) = 3 != world size 4; set parallel.dp_shard=4" in out.stderr


def test_submit_prints_the_job_id_run_dir_and_log_and_leaves_only_the_jobs_run_dir(
    tmp_path: Path, portatrain
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write_executable(
        bin_dir / "sbatch",
        '#!/bin/bash\necho "$@" > "$(dirname "$0")/called"\ncat > "$(dirname "$0")/script"\necho "7"\n',
    )
    out = portatrain(["submit", "trainer.steps=3"], path=bin_dir)
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "runs" / "debug" / "7"  # the job's run directory: named after its id
    assert out.stdout.splitlines() == [
        "submitted job 7",
        f"run directory: {run_dir}",
        f"follow its log: tail -F {tmp_path / 'portatrain-debug-7.out'}",
    ]
    assert (bin_dir / "called").read_text().split() == ["--parsable"]  # the script comes on stdin
    script = (bin_dir / "script").read_text()
    assert "trainer.steps=3 checkpoint.resume=auto &" in script
    assert (run_dir / "job.sbatch").read_text() == script
    assert [p.name for p in (tmp_path / "runs" / "debug").iterdir()] == ["7"]  # no empty Hydra dir


def test_submit_reports_a_rejection_with_the_schedulers_reason(tmp_path: Path, portatrain) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write_executable(
        bin_dir / "sbatch",
        "#!/bin/bash\necho 'sbatch: error: Batch job submission failed: Invalid account or "
        "account/partition combination specified' >&2\nexit 1\n",
    )
    out = portatrain(["submit", "launch.account=nope"], path=bin_dir)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "portatrain submit: error: the scheduler rejected the job (`sbatch --parsable` exited with 1): "
        "Batch job submission failed: Invalid account or account/partition combination specified"
    )
    assert not (tmp_path / "runs").exists()


def test_render_writes_nothing_but_the_job(tmp_path: Path, portatrain) -> None:
    out = portatrain(["render", "trainer.steps=3"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash")
    assert list(tmp_path.iterdir()) == []  # no empty run directory left behind
    out = portatrain(["render", f"parallel.launch.output={tmp_path / 'job.sbatch'}"])
    assert out.returncode == 0, out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["job.sbatch"]


def test_job_overrides_resume_by_default_unless_told_otherwise() -> None:
    assert job_overrides(["trainer.steps=3", "parallel.launch.nodes=2"]) == [
        "trainer.steps=3",
        "checkpoint.resume=auto",
    ]
    assert job_overrides(["checkpoint.resume=runs/x/checkpoints/step_0000010"]) == [
        "checkpoint.resume=runs/x/checkpoints/step_0000010"
    ]
    assert job_overrides([], run_dir="/mnt/runs/debug/j") == [
        "checkpoint.resume=auto",
        "run_dir=/mnt/runs/debug/j",
    ]
    assert job_overrides(["run_dir=/mine"], run_dir="/mnt/x") == ["run_dir=/mine", "checkpoint.resume=auto"]


@pytest.mark.slow
def test_sbatch_script_trains_on_two_fake_slurm_nodes(tmp_path: Path) -> None:
    """The rendered script itself, run by bash with stand-ins for SLURM's ``scontrol`` and ``srun``
    (one torchrun agent per node, all on this machine): the rendezvous it builds from SLURM's
    environment works, and the run directory is named by the job id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write_executable(bin_dir / "scontrol", "#!/bin/bash\nprintf '127.0.0.1\\n127.0.0.1\\n'\n")
    _write_executable(
        bin_dir / "srun",
        "#!/bin/bash\n"
        "# one task per node, as --ntasks-per-node=1 would start them\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        "pids=()\n"
        'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n',
    )
    torchrun_shim(bin_dir)  # its agents and workers forks of the fork server
    overrides = [*TINY, "data.batch_size=4", "checkpoint.enabled=false"]
    cfg = compose_config([*overrides, "parallel.launch.nodes=2", f"parallel.launch.rdzv_port={free_port()}"])
    script = tmp_path / "job.sbatch"
    from portatrain.launch.slurm import render_sbatch

    script.write_text(render_sbatch(cfg, overrides, workdir=str(tmp_path)))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
    }
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "debug" / "4242" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


def test_sbatch_script_never_holds_a_secret_and_submit_hands_it_to_sbatch(tmp_path: Path, portatrain) -> None:
    overrides = [
        *TINY,
        "+parallel.launch.env.HF_TOKEN=hf_sekrit_value",
        "+parallel.launch.env.LOG_LEVEL=info",
    ]
    script = _render(overrides)
    assert "hf_sekrit_value" not in script
    assert 'export HF_TOKEN="${HF_TOKEN:?HF_TOKEN is a secret' in script and "export LOG_LEVEL=info" in script
    # The rendered line fails fast without the variable and passes it through with it.
    line = next(x for x in script.splitlines() if x.startswith("export HF_TOKEN="))
    missing = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}
    )
    assert missing.returncode != 0 and "export it in the shell that runs sbatch" in missing.stderr
    given = subprocess.run(
        ["bash", "-c", f'{line}; echo "$HF_TOKEN"'], capture_output=True, text=True, env={"HF_TOKEN": "t0k"}
    )
    assert given.stdout.strip() == "t0k"
    # `portatrain submit` runs sbatch with the secret in its environment (a stand-in sbatch records it).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text('#!/bin/sh\ncat > /dev/null\necho "$HF_TOKEN" > "$(dirname "$0")/seen"\necho 42\n')
    sbatch.chmod(0o755)
    out = portatrain(["submit", *overrides], path=bin_dir)
    assert out.returncode == 0, out.stderr
    assert (bin_dir / "seen").read_text().strip() == "hf_sekrit_value"
    (job_file,) = (tmp_path / "runs").rglob("job.sbatch")
    assert "hf_sekrit_value" not in job_file.read_text()
