"""One ``torchrun`` launch per world size for the whole test session, shared by every test module that
compares layouts against one process.

A launch costs ~18 CPU-s of start-up (torch import, rendezvous, gloo) and a tiny run ~1.3 CPU-s more,
so the suite's runs of one world size train in ONE launch of ``tests/launch_runs.py``, not one each.
A module declares its runs at import time and gets their directories from the fixture it names::

    layouts = shared_launch.declare("layouts", 2, {"tp2": [...], "fsdp2": [...]}, stop_at={"fsdp2": 2})

    def test_tp2(layouts):
        train_records(layouts["tp2"])

* Only groups a selected test uses (``item.fixturenames``) go in a launch, so ``pytest tests/test_mtp.py``
  trains test_mtp's runs alone; ``pytest_collection_finish`` (tests/conftest.py) plans the launches
  from ``session.items`` and starts them in the background while the other tests run. Launches run
  one after another, in order of world size, so a run may resume a smaller launch's checkpoint.
* A run's directory is ``ROOT/MODULE/NAME`` (or ``ROOT/MODULE/DIR`` for an override ``run_dir=DIR``: a
  run and its resume share one), ROOT the session's shared temp dir; an override may name another
  run's directory with :func:`module_path`. Runs keep their order within a group, groups their
  order of collection.
* Under xdist each worker computes the same plan from the same items; the first to take a launch's
  ``filelock.FileLock`` trains it and writes ``done.json``, the others find it done and read the same
  directories. A worker that dies mid-launch frees its lock and the next one trains the launch again.
* A launch's process group has one backend (the first run's device's: gloo on ``device=cpu``,
  gloo and simccl on ``device=sim``), so runs of another device, or of other environment variables,
  are a launch of their own.
* A run that raises fails the tests that read its directory with its traceback (``error.txt``); the
  other runs of the launch are unaffected. Each run's stderr is ``<run_dir>/stderr.txt``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import filelock
import pytest

from tests.helpers import ROOT, launch_env, python, torchrun_command

ROOT_TOKEN = "{shared_launch_root}"
"""Replaced in overrides by the session's shared directory (see :func:`module_path`)."""

START_UP_S, PER_RUN_S = 900, 120
"""A launch's time limit: start-up and teardown (as long as one launch had before they were shared:
a cold build of the sim device's extension takes minutes on a loaded machine), plus each run (2-4x
the unloaded time on a 2-core machine that runs two test workers beside it)."""


@dataclass
class Group:
    """The runs a module declared under one fixture name, in order."""

    module: str
    fixture: str
    nproc: int
    runs: dict[str, list[str]]
    stop_at: dict[str, int]
    env: dict[str, str]
    setup: str | None = None
    """``package.module:function``, called with the module's directory before the launch starts."""

    @property
    def device(self) -> str:
        given = [o.partition("=")[2] for run in self.runs.values() for o in run if o.startswith("device=")]
        return given[-1] if given else "cpu"

    def run_dirs(self, root: Path) -> dict[str, Path]:
        dirs = {}
        for name, overrides in self.runs.items():
            given = [o.partition("=")[2] for o in overrides if o.startswith("run_dir=")]
            dirs[name] = root / self.module / (given[-1] if given else name)
        return dirs


@dataclass
class Launch:
    """The groups of one world size, device and environment, trained in one ``torchrun``."""

    nproc: int
    device: str
    env: dict[str, str]
    groups: list[Group] = field(default_factory=list)

    def spec(self, root: Path) -> list[dict]:
        spec = []
        for group in self.groups:
            for name, run_dir in group.run_dirs(root).items():
                overrides = [
                    o.replace(ROOT_TOKEN, str(root)) for o in group.runs[name] if not o.startswith("run_dir=")
                ]
                stop_at = group.stop_at.get(name)
                qualified = f"{group.module}.{name}"
                spec.append(
                    {"name": qualified, "run_dir": str(run_dir), "overrides": overrides, "stop_at": stop_at}
                )
        return spec

    def directory(self, root: Path) -> Path:
        digest = hashlib.sha1(json.dumps([self.nproc, self.env, self.spec(root)]).encode()).hexdigest()
        return root / f"launch_{self.nproc}_{self.device}_{digest[:10]}"

    @property
    def time_limit(self) -> float:
        return START_UP_S + PER_RUN_S * sum(len(g.runs) for g in self.groups)


_DECLARED: dict[tuple[str, str], Group] = {}
_PLAN = pytest.StashKey["Plan"]()


def declare(
    fixture: str,
    nproc: int,
    runs: dict[str, list[str]],
    *,
    stop_at: dict[str, int] | None = None,
    env: dict[str, str] | None = None,
    setup: Callable[[Path], None] | None = None,
):
    """Declare ``runs`` (name -> overrides, trained in this order) on ``nproc`` processes and return a
    module-scoped fixture named ``fixture`` (assign it to that name in the module) that waits for
    them: a mapping of name -> run directory. ``stop_at``: name -> the step after which that run is
    asked to stop (it saves and ends); ``env``: environment variables of the launch; ``setup``: a
    function of the module, called in a fresh process with the module's directory (``ROOT/MODULE``)
    before the launch starts, which makes what the runs read (a checkpoint to resume, a dataset)."""
    module = sys._getframe(1).f_globals["__name__"].rpartition(".")[2]
    taken = {n for (m, f), g in _DECLARED.items() if m == module and f != fixture for n in g.runs}
    if taken & runs.keys():
        raise ValueError(f"{module}: run names {sorted(taken & runs.keys())} declared twice")
    where = f"{setup.__module__}:{setup.__name__}" if setup else None
    group = Group(module, fixture, nproc, dict(runs), dict(stop_at or {}), dict(env or {}), where)
    _DECLARED[module, fixture] = group

    @pytest.fixture(scope="module", name=fixture)
    def wait_for_runs(request: pytest.FixtureRequest) -> RunDirs:
        return RunDirs(request.config, group)

    return wait_for_runs


def module_path(*parts: str) -> str:
    """``ROOT/MODULE/PARTS`` of the calling module, for overrides: a run's directory (a resume reads
    it; a run ``NAME`` is ``module_path(NAME)``) or what the group's ``setup`` made there."""
    module = sys._getframe(1).f_globals["__name__"].rpartition(".")[2]
    return "/".join([ROOT_TOKEN, module, *parts])


class RunDirs(Mapping[str, Path]):
    """Run name -> directory. Reading one waits for the launch (so a test may train its one-process
    reference first, while the launch trains); reading a run that failed fails the test with the
    run's traceback."""

    def __init__(self, config: pytest.Config, group: Group) -> None:
        self._config, self._group = config, group
        self._errors: dict[str, str] | None = None

    def __getitem__(self, name: str) -> Path:
        errors = self._wait()
        if name in errors:
            pytest.fail(f"run {name!r} of the shared launch {self.launch_dir} failed:\n{errors[name]}")
        return self._group.run_dirs(self._plan.root)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group.runs)

    def __len__(self) -> int:
        return len(self._group.runs)

    @property
    def _plan(self) -> Plan:
        plan = self._config.stash.get(_PLAN, None)
        assert plan is not None, (
            f"{self._group.module}: no shared launch was planned for {self._group.fixture}"
        )
        return plan

    @property
    def launch_dir(self) -> Path:
        return self._plan.launch_of(self._group).directory(self._plan.root)

    @property
    def planned(self) -> bool:
        """Whether this session's launches train the group (a selected test uses its fixture)."""
        plan = self._config.stash.get(_PLAN, None)
        return plan is not None and any(self._group in launch.groups for launch in plan.launches)

    @property
    def module_dir(self) -> Path:
        """``ROOT/MODULE``, once the group's ``setup`` has made what it makes there."""
        self._wait_for_setup()
        return self._plan.root / self._group.module

    @property
    def launch_stderr(self) -> str:
        """The launch's stderr outside its runs' (start-up, teardown, torchrun's own)."""
        self._wait()
        return (self.launch_dir / "stderr.txt").read_text()

    def _wait_for_setup(self) -> None:
        _poll(self.launch_dir / "setup.json", self._plan.time_limit(self._plan.launch_of(self._group)))
        error = self._plan.root / self._group.module / "setup_error.txt"
        if error.exists():
            pytest.fail(f"{self._group.setup} failed:\n{error.read_text()}")

    def _wait(self) -> dict[str, str]:
        if self._errors is None:
            self._errors = _wait(self._plan, self._group)
        return self._errors


@dataclass
class Plan:
    root: Path
    launches: list[Launch]
    thread: threading.Thread | None = None
    process: subprocess.Popen | None = None

    def launch_of(self, group: Group) -> Launch:
        return next(launch for launch in self.launches if group in launch.groups)

    def time_limit(self, launch: Launch) -> float:
        """How long a test waits for ``launch``: the launches before it run first."""
        return sum(other.time_limit for other in self.launches[: self.launches.index(launch) + 1])


def start(session: pytest.Session) -> None:
    """Plan the launches the selected tests need and start training them in the background."""
    groups = []
    for item in session.items:
        module = getattr(item, "module", None)
        name = module.__name__.rpartition(".")[2] if module else ""
        for fixture in getattr(item, "fixturenames", ()):
            group = _DECLARED.get((name, fixture))
            if group is not None and group not in groups:
                groups.append(group)
    if not groups:
        return
    launches: dict[tuple, Launch] = {}
    for group in groups:
        key = (group.nproc, group.device, tuple(sorted(group.env.items())))
        launches.setdefault(key, Launch(group.nproc, group.device, group.env)).groups.append(group)
    factory = session.config._tmp_path_factory
    base = factory.getbasetemp()
    root = (base.parent if hasattr(session.config, "workerinput") else base) / "shared_launch"
    root.mkdir(exist_ok=True)
    plan = Plan(root, [launches[key] for key in sorted(launches)])
    plan.thread = threading.Thread(target=_train_all, args=(plan,), daemon=True, name="shared_launch")
    session.config.stash[_PLAN] = plan
    plan.thread.start()


def finish(session: pytest.Session, exitstatus: int) -> None:
    """Wait for this worker's launch to end (another worker may be waiting for it); stop it when
    the session was interrupted."""
    plan = session.config.stash.get(_PLAN, None)
    if plan is None or plan.thread is None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED and plan.process is not None:
        _stop(plan.process)
    plan.thread.join(timeout=sum(launch.time_limit for launch in plan.launches))


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM first: torchrun's agent then stops its workers, which run in sessions of their own
    (a SIGKILL to the agent alone leaves them running)."""
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _train_all(plan: Plan) -> None:
    for launch in plan.launches:
        directory = launch.directory(plan.root)
        directory.mkdir(exist_ok=True)
        with filelock.FileLock(directory / "launch.lock"):
            if not (directory / "done.json").exists():
                _train(plan, launch, directory)


def _train(plan: Plan, launch: Launch, directory: Path) -> None:
    """One torchrun of ``tests/launch_runs.py``; ``done.json`` holds its exit status (or why none)."""
    outcome: dict = {"returncode": None}
    try:
        for partial in ("results.jsonl", "setup.json"):  # a worker that died mid-launch left them
            (directory / partial).unlink(missing_ok=True)
        (directory / "runs.json").write_text(json.dumps(launch.spec(plan.root)))
        _set_up(plan, launch, directory)
        cmd = torchrun_command(launch.nproc)  # agent and workers forks of the fork server
        with (directory / "stdout.txt").open("w") as out, (directory / "stderr.txt").open("w") as err:
            plan.process = subprocess.Popen(
                [*cmd, str(ROOT / "tests" / "launch_runs.py"), str(directory / "runs.json")],
                cwd=directory,
                env=launch_env(**launch.env),
                stdout=out,
                stderr=err,
            )
            try:
                outcome["returncode"] = plan.process.wait(timeout=launch.time_limit)
            except subprocess.TimeoutExpired:
                _stop(plan.process)
                outcome["error"] = f"stopped after its time limit of {launch.time_limit} s"
    except Exception as error:  # recorded for every waiting test, not lost in a background thread
        outcome["error"] = repr(error)
    finally:
        if not (directory / "setup.json").exists():  # no test waits for a setup that never ran
            (directory / "setup.json").write_text("[]")
        (directory / "done.json").write_text(json.dumps(outcome))


def _wait(plan: Plan, group: Group) -> dict[str, str]:
    """Poll for the group's launch to be done (and every launch before it: they run in order); the
    error of each of the group's runs that failed."""
    launch = plan.launch_of(group)
    directory = launch.directory(plan.root)
    names = {f"{group.module}.{name}" for name in group.runs}
    limit = plan.time_limit(launch)
    deadline = time.monotonic() + limit
    while True:  # until the group's runs are all done: the launch may train other modules' still
        done = (directory / "done.json").exists()
        failed = _results(directory)
        if done or names <= failed.keys():
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the shared launch {directory} had not trained {sorted(names)} after {limit} s")
        time.sleep(1)
    setup_error = plan.root / group.module / "setup_error.txt"
    if group.setup and setup_error.exists():
        return {name: f"{group.setup} failed:\n{setup_error.read_text()}" for name in group.runs}
    outcome = json.loads((directory / "done.json").read_text()) if done else {}
    errors = {}
    for name, run_dir in group.run_dirs(plan.root).items():
        qualified = f"{group.module}.{name}"
        if qualified not in failed:  # the launch ended before this run did
            tail = (directory / "stderr.txt").read_text()[-5000:]
            errors[name] = f"the launch ended before this run did ({outcome}); its stderr ends:\n{tail}"
        elif failed[qualified]:
            error = run_dir / "error.txt"
            errors[name] = (
                error.read_text() if error.exists() else (run_dir / "stderr.txt").read_text()[-5000:]
            )
    return errors


def _results(directory: Path) -> dict[str, bool]:
    """Qualified run name -> whether it failed, for the runs the launch has finished so far."""
    results = directory / "results.jsonl"
    # Whole lines only: the last piece is empty once the line being written has its newline.
    lines = results.read_text().split("\n")[:-1] if results.exists() else []
    return {r["name"]: r["failed"] for r in map(json.loads, lines)}


def _poll(marker: Path, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not marker.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the shared launch wrote no {marker} in {limit} s")
        time.sleep(1)


def _set_up(plan: Plan, launch: Launch, directory: Path) -> None:
    """Every group's ``setup``, in one fresh process (one import of torch for all of them); a setup
    that raises leaves ``setup_error.txt`` in its module's directory. ``setup.json`` marks them done."""
    setups = [
        {"setup": g.setup, "dir": str(plan.root / g.module)} for g in launch.groups if g.setup is not None
    ]
    if setups:
        (directory / "setups.json").write_text(json.dumps(setups))
        with (directory / "setup_stderr.txt").open("w") as err:
            subprocess.run(
                python("-m", "tests.shared_launch", str(directory / "setups.json")),
                cwd=directory,
                env=launch_env(),
                stdout=err,
                stderr=err,
                timeout=launch.time_limit,
            )
    (directory / "setup.json").write_text(json.dumps(setups))


def _run_setups(path: str) -> None:
    for entry in json.loads(Path(path).read_text()):
        directory = Path(entry["dir"])
        directory.mkdir(parents=True, exist_ok=True)
        module, _, function = entry["setup"].partition(":")
        try:
            getattr(importlib.import_module(module), function)(directory)
        except Exception:
            (directory / "setup_error.txt").write_text(traceback.format_exc())


if __name__ == "__main__":
    _run_setups(sys.argv[1])
