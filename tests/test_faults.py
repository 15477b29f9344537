"""Fault injection: a process SIGKILLed at any point of a save or a rotation always resumes from a
complete, finite checkpoint and then trains exactly as the run that was never killed.

The kill points and the trial runner are in ``tests/fault_injection.py``. One process, 10 forked
trials at points spread evenly over every filesystem step of six saves and four rotations (5 more
with ``checkpoint.async_mode=thread``): the same points on every machine, so a failure reproduces.
Then the same under ``torchrun --nproc-per-node=2 --max-restarts=1``: the non-main rank killed in the
middle of its save points, then the attempt torchrun restarts inspects what is on disk and resumes.
``python tests/fault_injection.py trials OUT 20 7`` draws 20 random points instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.fault_injection import RUN
from tests.helpers import ROOT, python, step_losses, torchrun_command

SCRIPT = ROOT / "tests" / "fault_injection.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
TRIALS = 10


@pytest.mark.slow
@pytest.mark.parametrize(
    ("async_mode", "n"),
    # Asynchronous saves: the kill lands while DCP's thread writes, or the commit renames, with the
    # loop training on. 5 trials here; `python tests/fault_injection.py trials OUT 20 7
    # checkpoint.async_mode=thread` runs 20 random ones (docs/checkpoints/async.md).
    [("none", TRIALS), ("thread", 5)],
)
def test_sigkill_at_random_points_of_saves_and_rotation_always_resumes_exactly(
    tmp_path: Path, async_mode: str, n: int
) -> None:
    out = tmp_path / "trials.json"
    proc = subprocess.run(
        python(str(SCRIPT), "trials", str(out), str(n), "spread", f"checkpoint.async_mode={async_mode}"),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    reference = report["reference"]["losses"]
    assert sorted(reference, key=int) == [str(s) for s in range(1, 7)]
    points = report["points"]
    assert points >= 30  # 6 saves, 4 rotations: many distinct places to die
    trials = report["trials"]
    assert len(trials) == n
    assert sum(t["killed"] for t in trials) == n  # every chosen point was reached
    for t in trials:
        assert "error" not in t, t
        # Every step_N on disk after the kill was whole (inspect_checkpoint passed on each) ...
        if t["resumed_from"] is not None:
            assert t["resumed_from"] in t["complete_before_resume"], t
            assert t["resumed_from"] == t["complete_before_resume"][-1], t  # ... and the newest was used
        # ... and the resumed run's losses are the clean run's, bitwise (CPU, fp32).
        assert t["losses"] == reference, t
    # The kills landed all over a save: before and after the rename, inside rotation's deletion.
    assert len({t["kill_at"] for t in trials}) >= n // 2
    assert any(t["leftovers_before_resume"] for t in trials)


def _torchrun(
    overrides: list[str], cwd: Path, env: dict, torchrun_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*torchrun_command(2, *torchrun_args), str(SCRIPT), *RUN, *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_sigkill_of_a_torchrun_worker_during_a_save_resumes_exactly(tmp_path: Path) -> None:
    count = tmp_path / "count"
    clean = tmp_path / "clean"
    env = {**ENV, "FAULT_KILL_AT": "0", "FAULT_RANK": "0", "FAULT_MARKER": str(tmp_path / "none")}
    out = _torchrun([f"run_dir={clean}"], tmp_path, {**env, "FAULT_COUNT_FILE": str(count)})
    assert out.returncode == 0, out.stderr[-3000:]
    reference = step_losses(clean)
    assert sorted(reference) == list(range(1, 7))
    points = {rank: int(Path(f"{count}.rank{rank}").read_text()) for rank in (0, 1)}
    assert min(points.values()) >= 10

    # Rank 1 (not the one that renames and rotates) in the middle of its points: rank 0's kills are the
    # one-process trials above.
    for trial, (rank, kill_at) in enumerate([(1, (points[1] + 1) // 2)]):
        marker, found = tmp_path / f"killed{trial}", tmp_path / f"found{trial}.json"
        run_dir = tmp_path / f"trial{trial}"
        env = {
            **ENV,
            "FAULT_KILL_AT": str(kill_at),
            "FAULT_RANK": str(rank),
            "FAULT_MARKER": str(marker),
            "FAULT_FOUND_FILE": str(found),
        }
        # A rank dies; torchrun stops the other one, the attempt fails, and torchrun starts a new one
        # (one launch: the kill, then the resume), whose rank 0 first inspects what the kill left.
        args = [f"run_dir={run_dir}", "checkpoint.resume=auto"]
        resumed = _torchrun(args, tmp_path, env, ("--max-restarts=1",))
        context = f"trial {trial}: rank {rank} killed at point {kill_at}\n" + resumed.stderr[-3000:]
        # The kill happened, failed the attempt, and torchrun restarted it (only a restarted attempt's
        # rank 0 finds the marker at its start and writes ``found``).
        assert marker.exists() and found.exists(), context
        outcome = json.loads(found.read_text())
        assert "error" not in outcome, context + str(outcome)  # every step_N left is whole
        assert resumed.returncode == 0, context
        assert step_losses(run_dir) == reference, context
