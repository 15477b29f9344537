"""Shared fixtures. The helpers themselves live in ``tests/helpers.py`` (re-exported here for the
tests that import them from ``tests.conftest``)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig

from tests import fork_server, shared_launch
from tests.helpers import ROOT, TINY, compose_config, fit, run_cli

__all__ = ["ROOT", "TINY", "compose_config", "run_cli", "tiny_cfg"]

# One compile cache for the whole session (inherited by every subprocess and torchrun worker): a
# graph compiled by one test is reused by the next, as inductor's shared /tmp cache did before
# compile.cache gave each run its own. Tests of the cache location clear it with monkeypatch.
os.environ.setdefault(
    "PORTATRAIN_COMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="portatrain-test-compile-cache-")
)
# Measured CPU peaks (portatrain.accelerators.cpu.measured_peak) go to a file of the session's, never
# into the user's ~/.cache: a figure measured while the suite loads the machine is no peak to keep.
os.environ.setdefault(
    "PORTATRAIN_PEAK_CACHE",
    os.path.join(tempfile.mkdtemp(prefix="portatrain-test-peaks-"), "peak_flops.json"),
)


def _start_fork_server() -> None:
    """Start this test process's fork server (tests/fork_server.py) and name its socket in the
    environment every process a test starts inherits: ``tests.helpers.python(...)`` runs are forks of
    it. A client waits while the server imports (a few seconds), then starts a real interpreter if it
    still finds none. The server ends with this process; its directory (socket, log) is removed."""
    if os.environ.get("PORTATRAIN_TEST_NO_FORK") == "1":
        return
    where = tempfile.mkdtemp(prefix="ptfork-")  # short: a socket's path has ~100 bytes at most
    path = os.path.join(where, "socket")
    log = open(os.path.join(where, "server.log"), "w")  # noqa: SIM115 -- the server's, for its lifetime
    _FORK_SERVER.append(
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "fork_server.py"), path],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.PIPE,  # closed when this process ends: the server then ends too
            start_new_session=True,  # a signal a test sends to its process group leaves it alone
            stdout=log,
            stderr=log,
        )
    )
    with open(os.path.join(where, "pid"), "w") as pid_file:  # clients wait while it is alive and importing
        pid_file.write(str(_FORK_SERVER[-1].pid))
    os.environ["PORTATRAIN_FORK_SERVER"] = path
    atexit.register(shutil.rmtree, where, ignore_errors=True)


_FORK_SERVER: list[subprocess.Popen] = []


def pytest_configure(config: pytest.Config) -> None:
    # Every process that runs tests gets one: an xdist worker, or pytest itself without xdist (an
    # xdist controller runs none).
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        _start_fork_server()


def _keep_absl_off_pytests_capture() -> None:
    """absl's log handler (absl comes with tensorboard and lm-eval's metrics) binds whatever
    ``sys.stderr`` is when absl is first imported, and its ``close`` closes that stream unless it is
    the *current* ``sys.stderr``. Hydra's logging set-up closes every handler ever made
    (``logging.config.dictConfig``), so an in-process ``portatrain`` under ``capsys`` closed pytest's
    own capture file and pytest died with "lost sys.stderr". Bind absl to ``sys.__stderr__`` first,
    which its ``close`` never closes (absl/logging/__init__.py, ``PythonHandler.close``)."""
    try:
        from absl import logging as absl_logging
    except ImportError:
        return
    absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__


_keep_absl_off_pytests_capture()


@pytest.fixture(autouse=True)
def _drop_log_handlers_on_closed_streams() -> Iterator[None]:
    """After each test, remove logging handlers left writing to a stream pytest has closed.

    Libraries add a ``StreamHandler`` on first use, bound to whatever ``sys.stderr`` is then:
    lm-eval's ``setup_logging`` does, once per process, during ``simple_evaluate``. Inside a test
    under ``capsys`` that is a capture stream closed at the test's teardown; the next test whose
    lm-eval call logs would write to a closed file ("--- Logging error ---" on stderr)."""
    yield
    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            stream = getattr(handler, "stream", None)
            if stream is not None and getattr(stream, "closed", False):
                logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _keep_the_import_time_environment(request: pytest.FixtureRequest) -> Iterator[None]:
    """Put back the variables read at import (``tests/fork_server.py``'s list) that a test changed in
    this process's environment and left so: every later process this worker starts inherits them, and
    the fork server refuses each (a real interpreter, ~6 CPU-s more each), for the rest of the session.
    The change is reported as a warning naming the test."""
    before = _import_time_environment()
    yield
    after = _import_time_environment()
    if after != before:
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        warnings.warn(f"{request.node.nodeid} left {', '.join(changed)} changed; put back", stacklevel=1)


def _import_time_environment() -> dict[str, str]:
    return {
        key: value
        for key, value in os.environ.items()
        if key.startswith(fork_server.IMPORT_TIME_ENV) and not key.startswith(fork_server.READ_LATER)
    }


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> DictConfig:
    return compose_config(TINY, run_dir=tmp_path / "run")


# Damaged checkpoints (tests/test_checkpoint_verify.py, tests/test_reliability.py) start from these.
@pytest.fixture(scope="module")
def three_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that saved steps 1, 2 and 3; tests damage copies of it."""
    run_dir = tmp_path_factory.mktemp("three") / "run"
    fit(["trainer.steps=3", "checkpoint.every=1", "checkpoint.keep=0"], run_dir)
    return run_dir


@pytest.fixture
def run_copy(three_steps: Path, tmp_path: Path) -> Path:
    shutil.copytree(three_steps, tmp_path / "run")
    return tmp_path / "run"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Rerun a failed slow test once (multi-process tests: torchrun/gloo start-up and teardown on a
    loaded 2-core machine now and then abort a worker). A real failure fails twice; every rerun is
    reported in pytest's summary ("N rerun")."""
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=1))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared torchrun launches the selected tests need (tests/shared_launch.py)."""
    if not session.config.option.collectonly:
        shared_launch.start(session)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shared_launch.finish(session, exitstatus)
