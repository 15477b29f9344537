"""Several training runs in one ``torchrun`` launch (its processes start and join the process group once).

``python -m torch.distributed.run --nproc-per-node=N tests/launch_runs.py RUNS.json``, where RUNS.json
is a list of ``{"name": ..., "run_dir": ..., "overrides": [...]}``: each run is composed as the CLI composes
it, trained by a Trainer, and closed; the process group stays up between runs (torn down at exit).
A run with ``"stop_at": N`` is asked to stop after step N (rank 0 asks, as a SIGTERM to one rank would):
it saves and ends there, and a later run of the launch may resume it.

Each run is isolated from the others as far as one process allows: its stderr (fd 2, so C++ and
torch's own writes too) goes to ``<run_dir>/stderr.txt``; Python's warnings registries start afresh
(a warning printed by an earlier run prints again); a run that raises writes its traceback to
``<run_dir>/error.txt`` and the launch goes on to the next run. Rank 0 appends one line per run to
``results.jsonl`` beside RUNS.json: ``{"name": ..., "failed": bool}`` (failed on any rank); the launch
exits 1 when a run failed.
``tests/shared_launch.py`` runs it (one launch per world size for the whole session) and
``tests.helpers.launch_runs`` (one launch of its own).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from portatrain.trainer import Trainer
from portatrain.validate import validate
from tests.helpers import compose_config


class StopAt(Trainer):
    """Rank 0 alone asks to stop after step ``stop_at``; the ranks agree on it, save, and end."""

    stop_at = 0

    def on_step_end(self, step: int, metrics: dict) -> None:
        super().on_step_end(step, metrics)
        if step == self.stop_at and self.dist.is_main:
            self.preemption.requested = True


@contextmanager
def stderr_to(path: Path):
    """fd 2 (not only ``sys.stderr``: torch's C++ warnings write to the descriptor) appended to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    sink = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(sink, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(sink)
        os.close(saved)


def forget_warnings() -> None:
    """Python's warnings print once per location per process; catch_warnings (around each run)
    invalidates their registries (CPython's Lib/warnings.py: its __enter__ calls _filters_mutated).
    DTensor keeps its own once-per-mesh set for its "sequential all_reduce" warning (torch's
    torch/distributed/tensor/_redistribute.py), keyed by the mesh's contents: an earlier run on the
    same mesh would hide it from a later run's stderr (tests/test_expert_parallel.py reads it)."""
    from torch.distributed.tensor import _redistribute

    getattr(_redistribute, "_warned_flatten_issues", set()).clear()


def train(run: dict) -> None:
    cfg = compose_config(run["overrides"], run_dir=run["run_dir"])
    validate(cfg)
    if cfg.finetune.method == "dpo":  # as the train command picks it (portatrain.commands.train)
        from portatrain.dpo_trainer import DPOTrainer

        trainer = DPOTrainer(cfg)
    elif run.get("stop_at"):
        trainer = StopAt(cfg)
        trainer.stop_at = run["stop_at"]
    else:
        trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()


def main(path: str) -> None:
    runs = json.loads(Path(path).read_text())
    results = Path(path).parent / "results.jsonl"
    rank = int(os.environ.get("RANK", "0"))
    any_failed = False
    for run in runs:  # the process group stays up between runs, torn down at exit (portatrain.train.runtime)
        run_dir = Path(run["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        failed = ""
        # A warning an earlier run printed prints again in this run's stderr, and the warning filters
        # a run sets end with it.
        with stderr_to(run_dir / "stderr.txt"), warnings.catch_warnings():
            forget_warnings()
            try:
                train(run)
            except Exception:
                failed = f"run {run.get('name', run_dir.name)}, rank {rank}:\n{traceback.format_exc()}"
                with (run_dir / "error.txt").open("a") as out:
                    out.write(failed)
        print(failed, end="", file=sys.stderr)  # the launch's own stderr: tests.helpers.launch_runs shows it
        # Every rank done with this run before the next starts, and all agree whether it failed (a run
        # that failed before joining the process group failed on every rank alike).
        flag = torch.tensor([int(bool(failed))])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        any_failed = any_failed or bool(flag)
        if rank == 0:
            with results.open("a") as out:
                out.write(json.dumps({"name": run.get("name", run_dir.name), "failed": bool(flag)}) + "\n")
    sys.exit(1 if any_failed else 0)


if __name__ == "__main__":
    main(sys.argv[1])
