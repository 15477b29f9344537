"""The job's shape lives under the top-level ``launch`` section; its old spelling ``parallel.launch.*``
still works for one release, with one warning line (``portatrain.launch.moved_keys``).

Everything runs in this process (``tests.test_command_errors.run``); ``render`` writes the job to
stdout without running it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import TINY, compose_config
from tests.test_command_errors import one_line_error, run

SHAPE = ["parallel.dp_shard=4", "launch.nodes=2", "launch.procs_per_node=2"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # render's discarded run directory lands here
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if ": warning: " in line]


def test_launch_keys_shape_the_job_and_stay_out_of_its_training_command(capsys) -> None:
    status, err = run(["render", *TINY, *SHAPE, "+launch.env.NCCL_DEBUG=INFO"], capsys)
    job = capsys.readouterr().out
    assert status == 0 and err == "", err
    assert "#SBATCH --nodes=2\n" in job and "--nproc-per-node=2" in job and "export NCCL_DEBUG=INFO" in job
    assert "launch." not in job.split("-m portatrain")[1]  # the job shape is the scheduler's, not training's
    # The layout is validated against launch.nodes * launch.procs_per_node processes.
    status, err = run(
        ["render", *TINY, "parallel.dp_shard=3", "launch.nodes=2", "launch.procs_per_node=2"], capsys
    )
    assert status == 2 and "dp_replicate(1) * dp_shard(3) * tp(1) = 3 != world size 4" in err, err


def test_an_old_key_is_applied_as_the_new_one_with_one_warning(capsys) -> None:
    status, err = run(["render", *TINY, "parallel.dp_shard=2", "parallel.launch.nodes=2"], capsys)
    assert status == 0 and "#SBATCH --nodes=2\n" in capsys.readouterr().out, err
    assert err.splitlines() == [
        "portatrain render: warning: parallel.launch.nodes is deprecated: use launch.nodes "
        "(the old key is removed in the next release)"
    ]
    # Several old keys, `+` under the old open mapping, and a new key agreeing with its old spelling.
    old = ["parallel.launch.procs_per_node=4", "launch.procs_per_node=4", "+parallel.launch.env.A=1"]
    cfg = compose_config(old)
    assert (
        cfg.launch.procs_per_node == 4 and dict(cfg.launch.env) == {"A": "1"} and cfg.parallel.launch is None
    )
    status, err = run(["--cfg", "job", *TINY, *old], capsys)
    assert (
        status == 0
        and "launch:\n  scheduler: slurm\n  nodes: 1\n  procs_per_node: 4\n" in capsys.readouterr().out
    )
    assert _warnings(err) == [
        "portatrain train: warning: parallel.launch.procs_per_node, parallel.launch.env.A are deprecated: use "
        "launch.procs_per_node, launch.env.A (the old keys are removed in the next release)"
    ]


def test_an_old_key_in_a_recipe_warns_once_per_run(tmp_path: Path, capsys) -> None:
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "old_style.yaml").write_text(
        "# @package _global_\nrecipe: old_style\nparallel:\n  dp_shard: 2\n  launch:\n    nodes: 2\n"
    )
    search = f"hydra.searchpath=[file://{tmp_path}]"
    # A sweep composes once, then once per job: still one warning.
    status, err = run(["render", "-m", *TINY, search, "recipe=old_style", "trainer.steps=1,2"], capsys)
    assert status == 0 and capsys.readouterr().out.count("#SBATCH --nodes=2\n") == 2, err
    assert _warnings(err) == [
        "portatrain render: warning: parallel.launch.nodes is deprecated: use launch.nodes "
        "(the old key is removed in the next release)"
    ]


def test_both_spellings_set_differently_is_one_line(capsys) -> None:
    status, err = run(["render", *TINY, "parallel.launch.nodes=2", "launch.nodes=3"], capsys)
    assert status == 2
    assert one_line_error(err, "render") == (
        "portatrain render: error: parallel.launch.nodes=2 and launch.nodes=3 disagree: set only launch.nodes "
        "(the old key is removed in the next release)"
    )
    status, err = run(["render", *TINY, "+parallel.launch.env.A=1", "+launch.env.A=2"], capsys)
    assert status == 2 and "parallel.launch.env.A=1 and launch.env.A=2 disagree" in one_line_error(
        err, "render"
    )


def test_a_misspelled_launch_key_names_the_new_spelling(capsys) -> None:
    for typo in ("launch.nodez=2", "parallel.launch.nodez=2"):
        status, err = run(["render", *TINY, typo], capsys)
        assert status == 2 and one_line_error(err, "render").endswith("did you mean launch.nodes?"), err
    status, err = run(["render", *TINY, "+launch.nodez=2"], capsys)
    assert status == 2 and "only to an open mapping (launch.env)" in one_line_error(err, "render")


@pytest.mark.parametrize("command", ["render", "submit"])
def test_help_lists_the_launch_keys(command: str, capsys) -> None:
    status, _ = run([command, "--help"], capsys)
    text = capsys.readouterr().out
    assert status == 0 and "launch.* options [default]:" in text
    assert "  launch.nodes" in text and "  launch.procs_per_node" in text and "  launch.env" in text
    assert "parallel.launch" not in text
