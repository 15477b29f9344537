"""Pipeline parallelism on CPU: idle time against the theoretical bubble, activation memory of 1F1B
against GPipe, and the step time of pp=2 against one process at the same global batch.

    OMP_NUM_THREADS=1 python scripts/bench_pipeline.py [KEY=VALUE ...]

The script trains one process (pp=1) itself, then launches itself under ``torchrun`` on 2 processes
(pp=2) for every schedule and micro-batch count, and prints, side by side:

* per pipeline rank, the idle fraction of a step -- ``1 - busy / step``, where busy is the time spent
  in the stages' forward and backward computation (``PipelineStage.forward_one_chunk``,
  ``backward_one_chunk``, ``backward_weight_one_chunk``) and step the wall time of the schedule's step
  -- against the theoretical bubble ``(p - 1) / (m + p - 1)`` (``(p - 1) / (v m + p - 1)`` interleaved);
  idle includes the time the stages spend sending and receiving activations, which the formula leaves out;
* per pipeline rank, the peak bytes allocated during one step above what was held before it (activations
  and gradients; ``portatrain.models.memory.measured_peak_bytes``), 1F1B against GPipe;
* the step time (forward and backward of one global batch, no optimizer step) of pp=2 against pp=1.

Each figure is the median of ``STEPS`` steps after one warm-up step. The debug model is small: the
numbers show the schedules' shape on 2 CPU processes, not a speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from portatrain.cli import config_dir
from portatrain.config import register_configs
from portatrain.models.memory import measured_peak_bytes
from portatrain.parallel.pipeline import bubble_fraction

STEPS = 10
DEFAULTS = [
    "device=cpu",
    "data.num_documents=400",
    "data.seq_len=128",
    "data.batch_size=8",
    "model.n_layers=8",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "checkpoint.enabled=false",
]
RUNS = [  # (schedule, micro-batches, stages per rank)
    ("GPipe", 2, 1),
    ("GPipe", 8, 1),
    ("1F1B", 2, 1),
    ("1F1B", 4, 1),
    ("1F1B", 8, 1),
    ("Interleaved1F1B", 8, 2),
    ("ZBVZeroBubble", 8, 2),
]


def build_trainer(overrides: list[str], name: str):
    import portatrain.trainer
    from portatrain.trainer import Trainer

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = compose("config", overrides=overrides)
    with open_dict(cfg):  # a fresh directory per launch (main makes it), one per run
        cfg.run_dir = os.path.join(os.environ["BENCH_PIPELINE_DIR"], name)
    portatrain.trainer.destroy_distributed = lambda: None  # one process group for every run
    return Trainer(cfg)


def one_batch(trainer) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    batch = trainer._to_device(next(iter(trainer.train_loader)))
    return batch, (batch["labels"] != -100).sum().float()


def timed_steps(trainer, batch: dict, num_tokens: torch.Tensor, barrier=lambda: None) -> list[float]:
    times = []
    for _ in range(STEPS + 1):
        barrier()
        start = time.perf_counter()
        trainer.forward_backward(batch, num_tokens)
        times.append(time.perf_counter() - start)
        trainer.optimizer.zero_grad(set_to_none=True)
    return times[1:]


def pipeline_rank(schedule: str, microbatches: int, virtual: int) -> dict:
    """One schedule on this rank: median step time, idle fraction, peak bytes of one step."""
    import torch.distributed as dist

    overrides = [
        *DEFAULTS,
        "parallel.pp=2",
        f"parallel.pp_schedule={schedule}",
        f"parallel.pp_microbatches={microbatches}",
        f"parallel.pp_virtual_stages={virtual}",
        *sys.argv[2:],
    ]
    trainer = build_trainer(overrides, f"{schedule}_{microbatches}")
    try:
        pipeline = trainer.pipeline
        schedule_obj = pipeline.schedule
        stages = getattr(schedule_obj, "_stages", None) or [schedule_obj._stage]
        busy = [0.0]
        for stage in stages:  # time the computation of every forward and backward chunk
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                original = getattr(stage, method)

                def timed(*args, _original=original, **kwargs):
                    start = time.perf_counter()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        busy[0] += time.perf_counter() - start

                setattr(stage, method, timed)
        batch, num_tokens = one_batch(trainer)
        group = trainer.parallel_dims.pp_mesh.get_group()
        idle = []
        for _ in range(STEPS + 1):
            dist.barrier(group=group)
            busy[0] = 0.0
            start = time.perf_counter()
            trainer.forward_backward(batch, num_tokens)
            wall = time.perf_counter() - start
            idle.append((wall, 1 - busy[0] / wall))
            trainer.optimizer.zero_grad(set_to_none=True)
        idle = idle[1:]
        dist.barrier(group=group)
        peak = measured_peak_bytes(lambda: trainer.forward_backward(batch, num_tokens))
        trainer.optimizer.zero_grad(set_to_none=True)
        return {
            "step_s": statistics.median(w for w, _ in idle),
            "idle": statistics.median(i for _, i in idle),
            "peak_bytes": peak,
        }
    finally:
        trainer.close()


def child() -> None:
    """Under torchrun: every run of ``RUNS``; rank 0 prints each rank's figures as one JSON line."""
    import torch.distributed as dist

    results = []
    for schedule, m, v in RUNS:
        mine = pipeline_rank(schedule, m, v)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results.append({"schedule": schedule, "m": m, "v": v, "ranks": gathered})
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    os.environ["BENCH_PIPELINE_DIR"] = tempfile.mkdtemp(prefix="bench_pipeline_")  # the children inherit it
    trainer = build_trainer([*DEFAULTS, *sys.argv[1:]], "pp1")
    try:
        batch, num_tokens = one_batch(trainer)
        pp1 = statistics.median(timed_steps(trainer, batch, num_tokens))
    finally:
        trainer.close()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(
        [*cmd, str(Path(__file__).resolve()), "--child", *sys.argv[1:]],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULTS ")]
    if out.returncode or not lines:
        sys.exit(f"pp=2 runs failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    results = json.loads(lines[-1].removeprefix("RESULTS "))

    print(
        "pp=2 on 2 CPU processes, global batch 8 x 128 tokens, llama3 debug with 8 blocks, median of", STEPS
    )
    print(
        f"{'schedule':<18}{'m':>3}{'v':>3}{'bubble':>9}{'idle r0':>9}{'idle r1':>9}{'step s':>9}{'vs pp=1':>9}"
    )
    for r in results:
        bubble = bubble_fraction(r["schedule"], 2, r["m"], r["v"])
        idle = [rank["idle"] for rank in r["ranks"]]
        step = max(rank["step_s"] for rank in r["ranks"])
        print(
            f"{r['schedule']:<18}{r['m']:>3}{r['v']:>3}{bubble:>9.1%}{idle[0]:>9.1%}{idle[1]:>9.1%}"
            f"{step:>9.3f}{step / pp1:>9.2f}"
        )
    print(f"pp=1 (one process, same global batch): {pp1:.3f} s a step")
    print()
    print("peak bytes allocated in one step, above what was held before it (activations and gradients)")
    print(f"{'m':>3}{'rank':>6}{'GPipe MiB':>12}{'1F1B MiB':>12}{'1F1B/GPipe':>12}")
    by = {(r["schedule"], r["m"]): r["ranks"] for r in results}
    for m in (2, 8):
        for rank in range(2):
            gpipe, f1b = by[("GPipe", m)][rank]["peak_bytes"], by[("1F1B", m)][rank]["peak_bytes"]
            print(f"{m:>3}{rank:>6}{gpipe / 2**20:>12.2f}{f1b / 2**20:>12.2f}{f1b / gpipe:>12.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
    else:
        main()
