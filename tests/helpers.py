"""Helpers shared by the test suite: configs composed as the CLI composes them, fresh-process runners
of the CLI (alone and under ``torchrun``), fitting a Trainer, reading ``metrics.jsonl``, and a CPU
adapter that counts host syncs.

``tests/conftest.py`` re-exports the config helpers, so ``from tests.conftest import TINY`` keeps
working; new tests import from here.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.cli import config_dir
from portatrain.config import register_configs
from portatrain.launch.moved_keys import apply_moved_keys
from portatrain.models import ModelSchema

ROOT = Path(__file__).resolve().parents[1]

# Small enough that a few steps take a fraction of a second on one core.
TINY = [
    "device=cpu",
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.steps=4",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "optim.warmup_steps=2",
]


# bf16 tolerances. bf16 keeps 8 significant bits, so rounding to nearest is off by at most
# u = 2**-8 = 3.9e-3 of the value. A bf16 forward rounds at every step of its deepest path: per
# sublayer (attention, feed-forward; two per block) and for the head, about four times -- the
# activation cast to bf16, the weight cast, the matmul's output (its accumulation is fp32 in oneDNN's
# and cuBLAS's bf16 GEMMs), one elementwise or normalization output. Each error reaches the logits
# with a gain of about one (the residual stream carries it; the normalizations rescale, they do not
# amplify). Roundings to nearest are zero-mean and, in practice, independent, so n of them add in
# quadrature -- a standard deviation of at most sqrt(n) * u, not the worst case n * u (Higham & Mary,
# "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019) -- and
# a tolerance of three of those, 3 * sqrt(n) * u, is the bound. The backward pass goes over every
# path twice more (input and weight gradients), so a gradient has 3n roundings; two bf16 runs
# compared with each other (a layout against one process) have both runs' roundings between them.
BF16_UNIT_ROUNDOFF = 2.0**-8
BF16_LAMBDA = 3.0
BF16 = ["trainer.dtype=bfloat16", "metrics.peak_tflops=1"]
"""A Trainer run in bf16. The stated peak spares each process measuring one: a 1024-square bf16 matmul
takes ~5 s on a CPU without AMX (the MFU these runs log is then meaningless; no test reads it)."""


def decoder_roundings(n_layers: int, *, backward: bool = False) -> int:
    """bf16 roundings on the deepest path of a decoder of ``n_layers`` blocks: 4 for each of its
    ``2 * n_layers`` sublayers and its head (``3x`` that for a gradient)."""
    return 4 * (2 * n_layers + 1) * (3 if backward else 1)


def bf16_tolerance(roundings: int) -> float:
    """The relative error ``roundings`` bf16 roundings stay within: ``3 * sqrt(roundings) * 2**-8``
    (two blocks: 5.2e-2 on the logits, 9.1e-2 on the gradient; see the comment above)."""
    return BF16_LAMBDA * math.sqrt(roundings) * BF16_UNIT_ROUNDOFF


def relative_error(got, want) -> float:
    """``||got - want|| / ||want||`` (Frobenius, over every element; tensors or lists of tensors)."""
    import torch

    got, want = ([got], [want]) if isinstance(got, torch.Tensor) else (got, want)
    diff = sum(float((g.float() - w.float()).square().sum()) for g, w in zip(got, want, strict=True))
    norm = sum(float(w.float().square().sum()) for w in want)
    return math.sqrt(diff / norm)


def compose_config(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    """The config ``portatrain OVERRIDES...`` would run with (``run_dir`` set when given)."""
    register_configs(ModelSchema)
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = compose("config", overrides=overrides)
    apply_moved_keys(cfg)  # as the CLI does: parallel.launch.X is launch.X
    if run_dir is not None:
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    return cfg


FORK_CLIENT = ROOT / "tests" / "fork_client.py"


def python(*args: str) -> list[str]:
    """The command line of ``python ARGS`` as a fork of this test process's fork server: a process
    like a new interpreter's, started without importing torch again (``tests/fork_server.py``)."""
    return [sys.executable, "-S", str(FORK_CLIENT), *args]


def torchrun_command(nproc: int, *torchrun_args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node=NPROC TORCHRUN_ARGS``, its agent and its workers forks of
    the fork server; append the worker's ``-m MODULE ARGS`` or ``SCRIPT ARGS``."""
    agent = python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *torchrun_args)
    return [*agent, "--no-python", *python()]


def run_cli(
    args: list[str], *, cwd: Path, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m portatrain ARGS`` in a fresh process (a fork of the fork server)."""
    return subprocess.run(
        python("-m", "portatrain", *args),
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun(
    nproc: int, args: list[str], *, cwd: Path, timeout: float = 300, torchrun_args: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m portatrain ARGS`` under ``torchrun --standalone`` with ``nproc`` processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [*torchrun_command(nproc, *(torchrun_args or [])), "-m", "portatrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def make_trainer(overrides: list[str], run_dir: Path, trainer_cls: type | None = None, **kwargs):
    """A Trainer (or ``trainer_cls``) for ``TINY + overrides`` writing into ``run_dir``."""
    from portatrain.trainer import Trainer

    return (trainer_cls or Trainer)(compose_config(TINY + overrides, run_dir=run_dir), **kwargs)


def fit(overrides: list[str], run_dir: Path, trainer_cls: type | None = None, **kwargs):
    """Build a Trainer for ``TINY + overrides``, fit it, close it (also on failure) and return it."""
    trainer = make_trainer(overrides, run_dir, trainer_cls, **kwargs)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of ``<run_dir>/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_records(run_dir: Path) -> list[dict]:
    """The training-step records (those with a ``loss``)."""
    return [r for r in read_metrics(run_dir) if "loss" in r]


def losses(run_dir: Path) -> list[float]:
    """The logged training losses, in order."""
    return [r["loss"] for r in train_records(run_dir)]


def step_losses(run_dir: Path) -> dict[int, float]:
    """Loss of each step; a step logged twice (before and after a resume) keeps the last."""
    return {r["step"]: r["loss"] for r in train_records(run_dir)}


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test launches: one compute thread, this checkout first on the
    path, and no launcher variables inherited from a run around the test."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}
    for key in ("WORLD_SIZE", "PORTATRAIN_RUN_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def launch_runs(
    nproc: int,
    runs: dict[str, list[str]],
    tmp_path: Path,
    stop_at: dict[str, int] | None = None,
    **env: str,
) -> dict[str, Path]:
    """Train every run of ``runs`` (name -> overrides) in ONE torchrun launch of ``nproc`` processes
    (``tests/launch_runs.py``: the processes start and join the process group once for all of them),
    in order: a run may resume from an earlier one's checkpoint. A run's directory is ``tmp_path/NAME``,
    or ``tmp_path/DIR`` for an override ``run_dir=DIR`` (two runs may share one: a run, then its
    resume); ``stop_at``: name -> the step after which that run is asked to stop (it saves and ends);
    ``env``: extra environment variables. Returns each run's directory; the launch's stderr is
    ``tmp_path/stderr.txt``."""
    dirs, spec = {}, []
    for name, overrides in runs.items():
        given = [o.partition("=")[2] for o in overrides if o.startswith("run_dir=")]
        dirs[name] = tmp_path / (given[-1] if given else name)
        overrides = [o for o in overrides if not o.startswith("run_dir=")]
        spec.append(
            {"run_dir": str(dirs[name]), "overrides": overrides, "stop_at": (stop_at or {}).get(name)}
        )
    (tmp_path / "runs.json").write_text(json.dumps(spec))
    out = subprocess.run(
        [*torchrun_command(nproc), str(ROOT / "tests" / "launch_runs.py"), str(tmp_path / "runs.json")],
        cwd=tmp_path,
        env=launch_env(**env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    (tmp_path / "stderr.txt").write_text(out.stderr)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return dirs


def sigterm_portatrain_torchrun(args: list[str], cwd: Path, after: str = "step 2/") -> tuple[int, str]:
    """``portatrain torchrun`` on 2 local processes, SIGTERMed once its log shows ``after``: (exit
    status, log)."""
    log = cwd / "log.txt"
    with log.open("w") as sink:
        job = subprocess.Popen(
            python("-m", "portatrain", "torchrun", "--standalone", "--nproc-per-node=2", "--no-python")
            + python("-m", "portatrain", *args),
            cwd=cwd,
            env=launch_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 240
        while after not in log.read_text() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.5)
        job.send_signal(signal.SIGTERM)
        status = job.wait(timeout=120)
    return status, log.read_text()


class CountingCPU(CPUAccelerator):
    """The CPU adapter, counting ``synchronize()`` calls and memory-statistics reads."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.syncs = 0
        self.memory_reads = 0

    def synchronize(self) -> None:
        self.syncs += 1

    def memory_stats(self) -> dict[str, int]:
        self.memory_reads += 1
        return super().memory_stats()


def spawn(fn, args: tuple = (), nprocs: int = 2, timeout: float = 600) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` processes, as ``torch.multiprocessing.spawn`` would, but
    under ``torchrun`` with the processes forks of the fork server (``tests/spawn_entry.py``): ~1
    CPU-s a rank instead of a new interpreter's ~6. ``fn`` is a module-level function; ``args`` are
    JSON values. A rank that raises fails the test with torchrun's summary and the ranks' stderr."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    out = subprocess.run(
        [*torchrun_command(nprocs), "-m", "tests.spawn_entry", target, json.dumps(list(args))],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"{target} failed:\n{out.stdout[-3000:]}\n{out.stderr[-8000:]}"
