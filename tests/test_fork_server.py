"""The suite's fork server (tests/fork_server.py) serves the interpreter forms it claims and hands
every other one to a real interpreter. A served process is a child of the server; a refused one is
the client itself, ``exec``'d into ``python``, so its parent is this test process."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import python

pytestmark = pytest.mark.skipif(
    not os.environ.get("PORTATRAIN_FORK_SERVER") or os.environ.get("PORTATRAIN_TEST_NO_FORK") == "1",
    reason="the suite runs without its fork server (PORTATRAIN_TEST_NO_FORK=1)",
)

PARENT = "import os, sys; print(os.getppid(), sys.argv[1:], repr(sys.path[0]), __name__)"


def _run(*args: str, env: dict | None = None) -> tuple[bool, str]:
    """Whether the process was a fork (its parent is not this test process), and what it printed."""
    proc = subprocess.run(
        python(*args),
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    parent, rest = proc.stdout.split(" ", 1)
    return int(parent) != os.getpid(), rest.strip()


def _server_state() -> str:
    """Whether this process's server still runs, and the end of its log: why a run was not a fork."""
    where = Path(os.environ["PORTATRAIN_FORK_SERVER"]).parent
    pid = int((where / "pid").read_text())
    try:
        os.kill(pid, 0)
        alive = "alive"
    except OSError:
        alive = "gone"
    return f"server {pid} {alive}; its log ends:\n{(where / 'server.log').read_text()[-3000:]}"


def test_c_and_u_are_served_as_python_runs_them() -> None:
    assert _run("-c", PARENT, "a", "b") == (True, "['a', 'b'] '' __main__"), _server_state()
    assert _run("-u", "-c", PARENT) == (True, "[] '' __main__"), _server_state()


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (("-W", "ignore", "-c", PARENT), None),  # an interpreter option the server does not take
        (("-c", PARENT), {"OMP_NUM_THREADS": "2"}),  # read when the OpenMP runtime loads
        (("-c", PARENT), {"TORCH_LOGS": "dynamo"}),  # read when torch is imported
    ],
    ids=["option", "omp", "torch-env"],
)
def test_what_a_fork_cannot_be_runs_in_a_real_interpreter(args: tuple[str, ...], env: dict | None) -> None:
    forked, printed = _run(*args, env=env)
    assert not forked
    assert printed == "[] '' __main__"


def test_exit_status_and_a_signal_death_are_the_processes() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the server's: these are forks
    assert subprocess.run(python("-c", "raise SystemExit(3)"), env=env, capture_output=True).returncode == 3
    killed = subprocess.run(python("-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), env=env)
    assert killed.returncode == -9


def test_clients_killed_mid_request_leave_the_server_serving() -> None:
    """A test that kills a client (a timeout, a SIGKILL) at any point of its request -- before the
    server's reply, after it -- must not end the server: every later process would be a new
    interpreter for the rest of the session."""
    for delay in (0.0, 0.001, 0.005, 0.02, 0.1):
        client = subprocess.Popen(
            python("-c", "import time; time.sleep(60)"), env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        time.sleep(delay)
        client.kill()
        client.wait()
    assert _run("-c", PARENT)[0], _server_state()
