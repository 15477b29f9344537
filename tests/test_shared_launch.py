"""``tests/shared_launch.py``: a run of the shared launch that raises fails only the tests that read it,
with its traceback, and the launch goes on to the next run; each run's stderr is its own."""

from __future__ import annotations

import pytest

from tests import shared_launch
from tests.helpers import TINY, train_records

runs = shared_launch.declare(
    "runs",
    2,
    {
        "refused": [*TINY, "parallel.tp=3"],  # validation refuses it on both ranks
        "after": [*TINY, "trainer.steps=1", "checkpoint.enabled=false"],
    },
)


@pytest.mark.slow
def test_a_run_that_raises_fails_its_readers_and_the_launch_goes_on(runs) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"(?s)run 'refused'.*Traceback.*parallel\.tp=3"):
        runs["refused"]  # noqa: B018 -- reading it is what fails
    assert [r["step"] for r in train_records(runs["after"])] == [1]
    assert (runs["after"] / "stderr.txt").is_file()
    assert not (runs["after"] / "error.txt").exists()
