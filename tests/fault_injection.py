"""Fault injection for ``tests/test_faults.py``: SIGKILL a training process at a random point of a save
or a rotation, resume it, and compare with the run that was never killed.

The *points* are every filesystem step a save takes, counted while ``Checkpointer.save`` runs (and, for
``checkpoint.async_mode=thread``, in the threads that write and commit it while training goes on): DCP's
data writes and its index (``FileSystemWriter.write_data`` / ``finish``), the JSON files, every
``rename`` (tmp -> final, old aside, rotation) and every ``unlink``/``rmdir`` of a deletion (so a kill
can land in the middle of deleting a rotated checkpoint). ``install(kill_at)`` makes the process
SIGKILL itself just before point number ``kill_at``; ``kill_at=0`` only counts.

Two ways to run it:

- ``python tests/fault_injection.py trials OUT N SEED [OVERRIDE...]``: one process runs the clean reference, then N
  trials, each in a forked child (``OMP_NUM_THREADS=1``: no thread pool to break in a fork) -- a
  child killed at a point (SEED ``spread``: N points evenly spaced over all of them, as the tests
  run it; a number: N random points), then a child that resumes with ``checkpoint.resume=auto`` --
  and writes every trial's outcome to ``OUT`` (JSON). Forking saves the ~3 s of ``import torch`` per
  run, which is what makes 20+ trials cheap.
- as a torchrun worker script: ``FAULT_KILL_AT``/``FAULT_RANK``/``FAULT_MARKER`` select the point,
  the rank, and a file that makes the kill happen once (so a later launch, or a torchrun restart,
  runs clean and resumes); ``FAULT_COUNT_FILE`` records each rank's number of points;
  ``FAULT_FOUND_FILE``: rank 0 of the attempt torchrun restarts after the kill writes there the
  checkpoints it finds, each inspected whole, before it resumes (or the error that says which is not).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import sys
import threading
from pathlib import Path

RUN = [
    "device=cpu",
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "optim.warmup_steps=2",
    "checkpoint.every=1",
    "checkpoint.keep=2",
]

SAVE_THREADS = ("AsyncCheckpointExecutor", "checkpoint-commit")
"""Name prefixes of the threads an asynchronous save writes from (DCP's, then the Checkpointer's)."""

_state = {"count": 0, "kill_at": 0, "in_save": False, "installed": False}


def install(kill_at: int) -> None:
    """Count (and at ``kill_at``, SIGKILL before) each filesystem step taken inside a save."""
    _state["kill_at"] = kill_at
    _state["count"] = 0
    if _state.get("installed"):  # a forked child re-arms the hooks its parent installed
        return
    _state["installed"] = True
    from torch.distributed.checkpoint import FileSystemWriter

    import portatrain.checkpoint.checkpointer as checkpointer

    def point() -> None:
        # The main thread inside Checkpointer.save, or a thread of an asynchronous save (DCP's
        # writer, the commit): never the loop's own file operations while a save is in flight.
        here = threading.current_thread()
        saving = _state["in_save"] if here is threading.main_thread() else here.name.startswith(SAVE_THREADS)
        if not saving:
            return
        _state["count"] += 1
        if _state["count"] == _state["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name):
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            point()
            return original(*args, **kwargs)

        setattr(owner, name, hooked)

    for owner, name in [
        (os, "rename"),
        (os, "unlink"),
        (os, "rmdir"),
        (FileSystemWriter, "write_data"),
        (FileSystemWriter, "finish"),
        (checkpointer, "write_json"),
    ]:
        wrap(owner, name)

    save = checkpointer.Checkpointer.save

    def counted_save(self, *args, **kwargs):
        _state["in_save"] = True
        try:
            return save(self, *args, **kwargs)
        finally:
            _state["in_save"] = False

    checkpointer.Checkpointer.save = counted_save


_configs: dict[tuple[str, ...], object] = {}
"""Composed configs by overrides: composed once in the parent, each forked trial copies its own (Hydra's
compose takes about as long as the training run it configures)."""


def _config(overrides: list[str], run_dir: Path):
    from omegaconf import open_dict

    from tests.helpers import compose_config

    key = tuple(RUN + overrides)
    if key not in _configs:
        _configs[key] = compose_config(list(key))
    cfg = copy.deepcopy(_configs[key])
    with open_dict(cfg):
        cfg.run_dir = str(run_dir)
    return cfg


def _fit(run_dir: Path, overrides: list[str]) -> dict:
    from portatrain.trainer import Trainer
    from tests.helpers import step_losses

    trainer = Trainer(_config(overrides, run_dir))
    try:
        trainer.fit()
    finally:
        trainer.close()
    resumed = trainer.resume_from
    return {
        "losses": {str(k): v for k, v in step_losses(run_dir).items()},
        "resumed_from": None if resumed is None else resumed.name,
        "points": _state["count"],
    }


def _in_child(fn, out: Path) -> int:
    """Run ``fn()`` in a forked child that writes its result to ``out``; return its wait status."""
    out.unlink(missing_ok=True)  # a child that dies leaves no stale result behind
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller's code
        code = 0
        try:
            out.write_text(json.dumps(fn()))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
            out.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def kill_points(total: int, n: int, seed: str) -> list[int]:
    """The points the ``n`` trials die at: ``seed="spread"`` spaces them evenly over ``1..total`` (the
    first and last point included: the same points on every machine); a number draws them at random."""
    if seed == "spread":
        return [1 + round(i * (total - 1) / max(n - 1, 1)) for i in range(n)]
    rng = random.Random(int(seed))
    return [rng.randint(1, total) for _ in range(n)]


def trials(out: Path, n: int, seed: str, overrides: list[str] | None = None) -> None:
    work = out.parent / "fault-trials"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result_file = work / "result.json"

    # The clean run runs here, not in a child: every module training needs is then imported before
    # the first fork, so all trials run the same code (and pay for no import).
    install(0)
    overrides = overrides or []
    reference = _fit(work / "clean", overrides)
    _config([*overrides, "checkpoint.resume=auto"], work)  # composed here, before the first fork
    total = reference["points"]
    outcomes = []
    for trial, kill_at in enumerate(kill_points(total, n, seed)):
        run_dir = work / f"trial{trial}"

        def killed(run_dir=run_dir, kill_at=kill_at) -> dict:
            install(kill_at)
            return _fit(run_dir, overrides)

        status = _in_child(killed, result_file)
        was_killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        complete_before = _complete(run_dir)
        metrics = run_dir / "metrics.jsonl"
        logged = metrics.read_text().splitlines() if metrics.is_file() else []
        before = {
            str(json.loads(line)["step"]): json.loads(line)["loss"] for line in logged if '"loss"' in line
        }
        folder = run_dir / "checkpoints"
        leftovers = sorted(p.name for p in folder.glob("step_*") if "." in p.name) if folder.is_dir() else []

        def resume(run_dir=run_dir) -> dict:
            install(0)
            return _fit(run_dir, [*overrides, "checkpoint.resume=auto"])

        _in_child(resume, result_file)
        outcome = json.loads(result_file.read_text()) if result_file.is_file() else {"error": "resume died"}
        outcomes.append(
            {
                "trial": trial,
                "kill_at": kill_at,
                "killed": was_killed,
                "complete_before_resume": complete_before,
                "leftovers_before_resume": leftovers,
                "losses_before_resume": before,
                **outcome,
            }
        )
        shutil.rmtree(run_dir, ignore_errors=True)
    out.write_text(json.dumps({"reference": reference, "points": total, "trials": outcomes}, indent=1))


def _complete(run_dir: Path) -> list[str]:
    from portatrain.checkpoint import complete_checkpoints, inspect_checkpoint

    names = []
    for path in complete_checkpoints(run_dir / "checkpoints"):
        inspect_checkpoint(path)  # raises if a step_N is not whole
        names.append(path.name)
    return names


def torchrun_worker() -> None:
    """A torchrun worker: the CLI, with the kill hook on one rank (once, by a marker file)."""
    from portatrain.cli import main

    marker = Path(os.environ["FAULT_MARKER"])
    armed = int(os.environ.get("RANK", "0")) == int(os.environ["FAULT_RANK"]) and not marker.exists()
    kill_at = int(os.environ["FAULT_KILL_AT"]) if armed else 0
    if kill_at:
        # The marker is written when the kill happens, so the restarted workers run clean.
        def before_kill(signum=None, frame=None) -> None:
            marker.write_text(str(kill_at))

        original_kill = os.kill

        def kill(pid: int, sig: int) -> None:
            if sig == signal.SIGKILL and pid == os.getpid():
                before_kill()
            original_kill(pid, sig)

        os.kill = kill
    install(kill_at)
    found = os.environ.get("FAULT_FOUND_FILE")
    if found and marker.exists() and os.environ.get("RANK", "0") == "0" and not Path(found).exists():
        # The first worker of an attempt restarted after the kill, before it resumes: every step_N
        # the killed attempt left must be whole (the newest is the one to resume from).
        run_dir = Path([a for a in sys.argv if a.startswith("run_dir=")][-1].partition("=")[2])
        try:
            outcome = {"complete": _complete(run_dir)}
        except Exception as exc:  # noqa: BLE001 - reported to the test through the file
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        Path(found).write_text(json.dumps(outcome))
    count_file = os.environ.get("FAULT_COUNT_FILE")
    try:
        main()
    finally:
        if count_file:
            Path(f"{count_file}.rank{os.environ.get('RANK', '0')}").write_text(str(_state["count"]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if len(sys.argv) > 1 and sys.argv[1] == "trials":
        trials(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
    else:
        torchrun_worker()
