"""Fault tolerance without restarts (``portatrain.fault_tolerance``, on torchft).

The slow test runs two replica groups of one process each on CPU/gloo under ``portatrain lighthouse``;
group 1 SIGKILLs itself at a fixed step, twice, and is started again once group 0 has formed a
quorum without it: group 0 keeps stepping alone (no restart), the replacement heals from it (live recovery) and both end with
bitwise-identical weights. The fast tests check the config's validation and the data slices.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest

from portatrain.config import FaultToleranceConfig, ParallelConfig
from portatrain.fault_tolerance import data_slice, fault_tolerance_problems, replica_run_dir
from tests.helpers import ROOT, TINY, compose_config, python, run_cli, train_records


def _problems(parallel: ParallelConfig | None = None, device: str = "cpu", **ft) -> list[str]:
    return fault_tolerance_problems(
        FaultToleranceConfig(enabled=True, **ft), parallel or ParallelConfig(), device
    )


def test_fault_tolerance_config_is_validated_with_the_fix() -> None:
    assert (
        fault_tolerance_problems(FaultToleranceConfig(replica_id=7), ParallelConfig(dp_replicate=2), "tpu")
        == []
    )
    assert _problems(group_size=2, replica_id=1, min_replicas=2) == []
    (problem,) = _problems(group_size=2, replica_id=2)
    assert "fault_tolerance.replica_id=2 must be in 0..1" in problem
    (problem,) = _problems(group_size=2, min_replicas=3)
    assert "fault_tolerance.min_replicas=3" in problem
    (problem,) = _problems(group_size=2, parallel=ParallelConfig(dp_replicate=2))
    assert "set parallel.dp_replicate=1 and fault_tolerance.group_size=2" in problem
    (problem,) = _problems(group_size=2, device="tpu")
    assert "device.type=tpu" in problem and "device=cpu" in problem
    assert len(_problems(group_size=0, timeout_s=0, parallel=ParallelConfig(pp=2))) == 3


def test_a_lighthouse_address_without_a_scheme_is_refused_by_validation() -> None:
    """torchft's client needs ``http://``: without it, it retried for timeout_s (77 s), then failed."""
    (problem,) = _problems(lighthouse="localhost:29537")
    assert problem == (
        "fault_tolerance.lighthouse='localhost:29537' is not an http://HOST:PORT address; "
        "did you mean http://localhost:29537?"
    )
    (problem,) = _problems(lighthouse="http://localhost:port")
    assert "has no valid port" in problem
    assert _problems(lighthouse="http://lighthouse.cluster:29510") == []


def test_an_unreachable_lighthouse_is_one_line_naming_it() -> None:
    pytest.importorskip("torchft")
    import socket

    from portatrain.fault_tolerance import LighthouseError

    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    address = f"http://localhost:{port}"
    with pytest.raises(LighthouseError) as info:
        _one_process_groups(FaultToleranceConfig(enabled=True, lighthouse=address, timeout_s=1.0))
    message = str(info.value)
    assert "\n" not in message and f"fault_tolerance.lighthouse={address}" in message, message
    assert "fault_tolerance.timeout_s=1" in message and f"portatrain lighthouse --port {port}" in message


def _one_process_groups(cfg: FaultToleranceConfig):
    """ReplicaGroups for a one-process replica group with empty state."""
    from portatrain.fault_tolerance import ReplicaGroups

    return ReplicaGroups(
        cfg,
        device_type="cpu",
        rank=0,
        world_size=1,
        state_dict=dict,
        load_state_dict=lambda state: None,
        broadcast=lambda value: value,
    )


@pytest.mark.parametrize("lighthouse_min", [1, 2], ids=["quorum-below-min-replicas", "no-quorum"])
def test_a_survivor_without_the_groups_it_needs_stops_with_one_line(lighthouse_min: int) -> None:
    """A group left alone where a step needs two: a lighthouse that forms a quorum of one fails every
    commit vote (torchft retried the step for ever, silently: a hang), and one that waits for two
    never answers (torchft's TimeoutError traceback). Either way, one line within quorum_timeout_s."""
    pytest.importorskip("torchft")
    import time

    from torchft.coordination import LighthouseServer

    from portatrain.fault_tolerance import QuorumError

    server = LighthouseServer(bind="[::]:0", min_replicas=lighthouse_min, join_timeout_ms=100)
    cfg = FaultToleranceConfig(
        enabled=True, lighthouse=server.address(), group_size=2, min_replicas=2, quorum_timeout_s=1.0
    )
    groups = _one_process_groups(cfg)
    start = time.monotonic()
    try:
        with pytest.raises(QuorumError) as info:
            while time.monotonic() - start < 30:  # the bound this test checks is 1 s
                groups.start_step()
                assert not groups.should_commit()  # one group of the two a step needs
    finally:
        groups.close()
        server.shutdown()
    message = str(info.value)
    assert "\n" not in message and "fault_tolerance.quorum_timeout_s=1" in message, message
    assert ("no quorum" if lighthouse_min == 2 else "set fault_tolerance.min_replicas=1") in message, message


def test_a_bad_fault_tolerance_value_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = run_cli(
        [
            "fault_tolerance.enabled=true",
            "fault_tolerance.group_size=2",
            "fault_tolerance.replica_id=5",
            *TINY,
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "fault_tolerance.replica_id=5 must be in 0..1" in out.stderr
    assert "Traceback" not in out.stderr


def test_each_replica_group_reads_its_own_slice_of_the_global_batch() -> None:
    ft = FaultToleranceConfig(enabled=True, group_size=3, replica_id=2)
    # dp_shard=2 ranks inside each of 3 groups: 6 slices, group 2 holds the last two.
    assert [data_slice(ft, r, 2) for r in range(2)] == [(4, 6), (5, 6)]
    assert data_slice(FaultToleranceConfig(), 1, 2) == (1, 2)  # disabled: the job's own ranks
    assert replica_run_dir(ft, Path("runs/x")) == Path("runs/x/replica_2")
    assert compose_config(["fault_tolerance.enabled=true"]).fault_tolerance.group_size == 1


KILLER = """
import os, signal, time
from portatrain.cli import main
from portatrain.trainer import Trainer

class Group(Trainer):
    first_step = None

    def on_step_end(self, step, metrics):
        # KILL_AFTER=k: SIGKILL after this process's k-th step (a replacement starts at the step it healed at).
        self.first_step = self.first_step or step
        if step == self.first_step + int(os.environ.get("KILL_AFTER", "0")) - 1 > 0 and "KILL_AFTER" in os.environ:
            os.kill(os.getpid(), signal.SIGKILL)  # no goodbye: the peer finds out mid-step
        time.sleep(float(os.environ["STEP_SECONDS"]))  # the compute of a real step

main(trainer_cls=Group)
"""

STEPS = 180
QUORUM = re.compile(r"quorum of (\d) replica group\(s\) at step (\d+)")
STEP_SECONDS = "0.1"


@pytest.mark.slow
def test_a_killed_replica_group_rejoins_while_the_other_trains_on(tmp_path: Path) -> None:
    script = tmp_path / "group.py"
    script.write_text(textwrap.dedent(KILLER))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    for key in ("WORLD_SIZE", "RANK", "PORTATRAIN_RUN_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    lighthouse = subprocess.Popen(
        python("-m", "portatrain", "lighthouse", "--port", "0", "--heartbeat-timeout-ms", "1000"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    procs: list[subprocess.Popen] = [lighthouse]
    try:
        address = re.search(r"serving at (\S+)", lighthouse.stdout.readline()).group(1)
        run = [
            *TINY,
            f"trainer.steps={STEPS}",
            "trainer.progress=true",
            "checkpoint.enabled=false",
            "checkpoint.resume=auto",  # a replacement continues its group's run directory
            "fault_tolerance.enabled=true",
            "fault_tolerance.group_size=2",
            f"fault_tolerance.lighthouse={address}",
            "fault_tolerance.timeout_s=10",
            f"run_dir={tmp_path / 'run'}",
        ]

        def start(group: int, kill_after: int | None = None) -> subprocess.Popen:
            kill = {"KILL_AFTER": str(kill_after)} if kill_after else {}
            proc = subprocess.Popen(
                python(str(script), *run, f"fault_tolerance.replica_id={group}"),
                env={**env, **kill, "STEP_SECONDS": STEP_SECONDS},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
            )
            procs.append(proc)
            return proc

        # Group 0's output is read as it comes: a replacement starts only once group 0 has formed a
        # quorum without the dead group (a fork starts in well under the lighthouse's 1 s heartbeat
        # timeout; started at once, it rejoined before group 0 noticed, and no outage was seen).
        survivor = start(0)
        survivor_lines: list[str] = []
        seen = threading.Condition()

        def read_survivor() -> None:
            for line in survivor.stdout:
                with seen:
                    survivor_lines.append(line)
                    seen.notify_all()
            with seen:
                seen.notify_all()

        reader = threading.Thread(target=read_survivor, daemon=True)
        reader.start()

        def outages_seen() -> int:
            return sum(int(n) == 1 and int(s) > 0 for n, s in QUORUM.findall("".join(survivor_lines)))

        # Group 1 dies after its 5th step, its replacement 4 steps after it healed, and the second
        # replacement trains to the end.
        doomed = start(1, kill_after=5)
        logs = []
        for outage, kill_after in enumerate((4, None), start=1):
            logs.append(doomed.communicate(timeout=120)[0])
            assert doomed.returncode == -9, logs[-1][-3000:]
            with seen:
                assert seen.wait_for(lambda n=outage: outages_seen() >= n or not reader.is_alive(), 60)
            assert outages_seen() >= outage, "".join(survivor_lines)[-3000:]
            doomed = start(1, kill_after)
        logs.append(doomed.communicate(timeout=180)[0])
        survivor.wait(timeout=60)
        reader.join(timeout=10)
        survivor_log = "".join(survivor_lines)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert survivor.returncode == 0 and doomed.returncode == 0, survivor_log[-3000:] + logs[-1][-3000:]

    # Group 0 never restarted: it trained alone through each outage, its step advancing.
    quorums = [(int(n), int(s)) for n, s in QUORUM.findall(survivor_log)]
    outages = [step for n, step in quorums if n == 1 and step > 0]  # (step 0: group 1 still starting)
    assert len(outages) >= 2, quorums
    stepped = [int(s) for s in re.findall(rf"step (\d+)/{STEPS}", survivor_log)]
    # Every step once, no restart (a group that starts after the other heals at once: it may begin later).
    assert stepped == list(range(stepped[0], STEPS + 1)) and stepped[0] < outages[0], (stepped[:20], outages)
    # Each replacement healed from group 0 at a later step than the group it replaced died at.
    died = [int(re.findall(rf"step (\d+)/{STEPS}", log)[-1]) for log in logs[:2]]
    healed = [int(s) for log in logs[1:] for s in re.findall(r"at step (\d+) \(healed", log)]
    assert len(healed) == 2 and died[0] < healed[0] and died[1] < healed[1], (died, healed, logs[1][-2000:])
    # Bitwise-identical weights after recovery.
    digests = [
        re.search(r"step (\d+) weights sha256 (\w+)", log).groups() for log in (survivor_log, logs[-1])
    ]
    assert digests[0] == digests[1] == (str(STEPS), digests[0][1]), digests
    # No noise: torchft's per-step structured records (empty messages: blank lines), on CPU its NCCL
    # flight-recorder warning, and the traceback of an error it handles (when the peer dies during the
    # all-reduce, as it may: "got exception waiting for work ... Connection closed by peer", one line).
    assert "\n\n" not in survivor_log and "flight recorder" not in survivor_log, survivor_log[:3000]
    assert "Traceback" not in survivor_log, survivor_log[survivor_log.find("Traceback") - 1000 :][:3000]
    # Sane losses: finite, falling.
    records = train_records(tmp_path / "run" / "replica_0")
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, (records[0], records[-1])


# -- rendered jobs: each replica group a separately restartable unit, plus the lighthouse --------------
FT_JOB = ["fault_tolerance.enabled=true", "fault_tolerance.group_size=3", "fault_tolerance.min_replicas=2"]


def _render(overrides: list[str]) -> str:
    from portatrain.launch import render_job

    return render_job(compose_config(overrides), overrides).text


def test_slurm_runs_the_lighthouse_and_each_replica_group_as_an_array_task(tmp_path: Path) -> None:
    overrides = ["device=cuda", "parallel.launch.nodes=2", "parallel.launch.procs_per_node=8", *FT_JOB]
    script = _render(overrides)
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", tmp_path / "job.sbatch"], capture_output=True).returncode == 0
    outer, groups = script.split("<<'PORTATRAIN_REPLICA_GROUPS'\n")
    groups = groups.removesuffix("PORTATRAIN_REPLICA_GROUPS\n")
    (tmp_path / "groups.sbatch").write_text(groups)
    assert subprocess.run(["bash", "-n", tmp_path / "groups.sbatch"], capture_output=True).returncode == 0
    # The outer job: one small node serving the lighthouse, waiting for the array it submits.
    assert "#SBATCH --nodes=1\n" in outer and "#SBATCH --array" not in outer and "srun" not in outer
    assert "python -m portatrain lighthouse --port=29510 --min-replicas=2 &\n" in outer
    assert 'export TORCHFT_LIGHTHOUSE="http://$(hostname):29510"\n' in outer
    assert 'export PORTATRAIN_RUN_ID="${PORTATRAIN_RUN_ID:-$SLURM_JOB_ID}"\n' in outer
    assert outer.rstrip().endswith("sbatch --wait --export=ALL")
    # The array: one task per group, each its own allocation, rendezvous and restarts.
    for line in (
        "--array=0-2",
        "--nodes=2",
        "--gpus-per-node=8",
        "--requeue",
        "--output=portatrain-debug-group-%A_%a.out",
    ):
        assert f"#SBATCH {line}\n" in groups
    assert '    --rdzv-id="$SLURM_JOB_ID" \\\n' in groups and "    --max-restarts=3 \\\n" in groups
    assert groups.count("fault_tolerance.replica_id=") == 1
    assert (
        'fault_tolerance.group_size=3 fault_tolerance.min_replicas=2 checkpoint.resume=auto fault_tolerance.replica_id="$SLURM_ARRAY_TASK_ID" &\n'
        in groups
    )
    assert 'scontrol requeue "$SLURM_JOB_ID"' in groups  # the task's own id: requeued alone
    # A lighthouse of the user's own: the array is the whole job.
    own = _render([*overrides, "fault_tolerance.lighthouse=http://lh:29510"])
    assert (
        own.startswith("#!/bin/bash")
        and "portatrain lighthouse" not in own
        and "#SBATCH --array=0-2\n" in own
    )


def test_kubernetes_runs_a_pytorchjob_per_replica_group_and_a_lighthouse_service() -> None:
    import yaml

    from tests.test_kubernetes import crd_schema, validate

    overrides = [
        "device=cuda",
        "parallel.launch.scheduler=pytorchjob",
        "parallel.launch.nodes=2",
        "parallel.launch.procs_per_node=8",
        "parallel.launch.efa=0",
        "parallel.launch.image=registry/portatrain:1",
        "parallel.launch.volume_claim=runs",
        *FT_JOB,
        "fault_tolerance.replica_id=1",  # ignored: each group gets its own
    ]
    docs = list(yaml.safe_load_all(_render(overrides)))
    assert [d["kind"] for d in docs] == ["Service", "Deployment", "PyTorchJob", "PyTorchJob", "PyTorchJob"]
    service, deployment, *groups = docs
    address = f"http://{service['metadata']['name']}:29510"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()  # the Service reaches the pod
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][-1] == "exec python -m portatrain lighthouse --port=29510 --min-replicas=2"
    run_dirs = set()
    for replica_id, job in enumerate(groups):
        assert validate(job, crd_schema("pytorchjob-v1.9.0.yaml.gz", "v1")) == []
        assert job["metadata"]["name"].endswith(f"-g{replica_id}")
        assert job["spec"]["runPolicy"]["backoffLimit"] == 3  # restarted alone
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
        command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
            "command"
        ][-1]
        assert re.findall(r"fault_tolerance.replica_id=(\d)", command) == [str(replica_id)]
        assert f"fault_tolerance.lighthouse={address}" in command
        assert f"--rdzv-id={job['metadata']['name']} " in command
        run_dirs.add(re.search(r"run_dir=(\S+)", command).group(1))
    assert len(run_dirs) == 1  # one run directory, a replica_<id> inside per group


def test_fault_tolerance_renders_only_pytorchjobs_on_kubernetes() -> None:
    from portatrain.errors import ConfigError
    from portatrain.launch import render_job

    cfg = compose_config(
        [
            "device=cpu",
            "parallel.launch.scheduler=jobset",
            "parallel.launch.image=i",
            "parallel.launch.volume_claim=v",
            *FT_JOB,
        ]
    )
    with pytest.raises(ConfigError, match="set launch.scheduler=pytorchjob device=cuda"):
        render_job(cfg, [])


def test_dpo_with_fault_tolerance_is_refused() -> None:
    from portatrain.validate import config_problems

    problems = config_problems(compose_config(["fault_tolerance.enabled=true", "finetune.method=dpo"]))
    assert any(p.startswith("fault_tolerance.enabled=true with finetune.method=dpo") for p in problems)
