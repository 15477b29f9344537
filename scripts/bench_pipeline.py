"""Pipeline parallelism on CPU: idle time against the theoretical bubble, activation memory of 1F1B
against GPipe, and the step time of pp=2 against one process at the same global batch.

    OMP_NUM_THREADS=1 python scripts/bench_pipeline.py [--stage-ms=MS] [KEY=VALUE ...]

The script trains one process (pp=1) itself, then launches itself under ``torchrun`` on 2 processes
(pp=2) for every schedule and micro-batch count, and prints, side by side:

* per pipeline rank, the idle fraction of a step against the theoretical bubble ``(p - 1) / (m + p - 1)``
  (``(p - 1) / (v m + p - 1)`` interleaved). Each rank traces the time of every operation of its stages
  (``PipelineStage.forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``: start
  and end on its own clock); idle is ``1 - busy / step``, busy the sum of those intervals, step the wall
  time of the schedule's step (both ranks end it together, in the loss's all-reduce). The formula
  assumes equal stage times and free communication, which the debug model's millisecond stages on a
  shared CPU are far from; so for this table every operation also costs a fixed time per block of its
  stage -- ``MS`` milliseconds (default 20) for a forward, twice that for a full backward, ``MS`` each for
  a zero-bubble schedule's input and weight halves (the 1 : 2 forward : backward ratio of a transformer
  block) -- spent asleep: it dominates the sends and receives, and no other job on the machine can
  stretch it. The figures then measure the schedule itself: which operation waits for which, and what the
  point-to-point communication adds. ``--stage-ms=0`` measures the model's own compute instead;
* per pipeline rank, the peak bytes allocated during one step above what was held before it (activations
  and gradients; ``portatrain.profiling.measured_peak_bytes``), 1F1B against GPipe;
* the step time (forward and backward of one global batch, no optimizer step) of pp=2 against pp=1,
  with the model's own compute.

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
from portatrain.models import ModelSchema
from portatrain.parallel.pipeline import bubble_fraction
from portatrain.profiling import measured_peak_bytes

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
RUNS = [  # (schedule, micro-batches, stages per rank): memory and step time, the model's own compute
    ("GPipe", 2, 1),
    ("GPipe", 8, 1),
    ("1F1B", 2, 1),
    ("1F1B", 4, 1),
    ("1F1B", 8, 1),
    ("Interleaved1F1B", 8, 2),
    ("ZBVZeroBubble", 8, 2),
]
IDLE_RUNS = [  # idle fraction against the bubble, each operation at a fixed cost per block
    ("GPipe", 2, 1),
    ("GPipe", 4, 1),
    ("GPipe", 8, 1),
    ("1F1B", 2, 1),
    ("1F1B", 4, 1),
    ("1F1B", 8, 1),
    ("1F1B", 16, 1),
    ("Interleaved1F1B", 2, 2),
    ("Interleaved1F1B", 4, 2),
    ("Interleaved1F1B", 8, 2),
    ("ZBVZeroBubble", 8, 2),
]
IDLE_MODEL = ["data.seq_len=32", "data.batch_size=16"]
"""For the idle table: rows of 32 tokens, 16 a step (16 micro-batches of one row at most): the model's
own compute is a fraction of a millisecond a block, far below the fixed cost."""


def build_trainer(overrides: list[str], name: str):
    from portatrain.trainer import Trainer

    register_configs(ModelSchema)
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = compose("config", overrides=overrides)
    with open_dict(cfg):  # a fresh directory per launch (main makes it), one per run
        cfg.run_dir = os.path.join(os.environ["BENCH_PIPELINE_DIR"], name)
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


def trace_operations(stages: list, cost_s: float, spans: list[tuple[float, float]]) -> None:
    """Record every operation of ``stages`` as a (start, end) span on this rank's clock into ``spans``;
    with ``cost_s`` > 0 each one also sleeps ``cost_s`` per block of its stage (a forward once, a full
    backward twice, a zero-bubble schedule's input or weight half once)."""

    def units(method: str, args: tuple, kwargs: dict) -> int:
        if method != "backward_one_chunk":
            return 1
        # backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False)
        full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
        return 2 if full else 1

    for stage in stages:
        blocks = len(stage.submod.layers)
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            original = getattr(stage, method)

            def traced(*args, _original=original, _method=method, _blocks=blocks, **kwargs):
                start = time.perf_counter()
                try:
                    out = _original(*args, **kwargs)
                    if cost_s:
                        time.sleep(cost_s * _blocks * units(_method, args, kwargs))
                    return out
                finally:
                    spans.append((start, time.perf_counter()))

            setattr(stage, method, traced)


def pipeline_rank(schedule: str, microbatches: int, virtual: int, cost_ms: float, extra: list[str]) -> dict:
    """One schedule on this rank: median step time, idle fraction, peak bytes of one step."""
    import torch.distributed as dist

    overrides = [
        *DEFAULTS,
        *extra,
        "parallel.pp=2",
        f"parallel.pp_schedule={schedule}",
        f"parallel.pp_microbatches={microbatches}",
        f"parallel.pp_virtual_stages={virtual}",
        *USER_OVERRIDES,
    ]
    trainer = build_trainer(overrides, f"{schedule}_{microbatches}_{cost_ms}")
    try:
        pipeline = trainer.pipeline
        schedule_obj = pipeline.schedule
        spans: list[tuple[float, float]] = []
        trace_operations(
            getattr(schedule_obj, "_stages", None) or [schedule_obj._stage], cost_ms / 1e3, spans
        )
        batch, num_tokens = one_batch(trainer)
        group = trainer.parallel_dims.pp_mesh.get_group()
        steps = []
        for _ in range(STEPS + 1):
            dist.barrier(group=group)
            spans.clear()
            start = time.perf_counter()
            trainer.forward_backward(batch, num_tokens)
            wall = time.perf_counter() - start
            busy = sum(end - begin for begin, end in spans)
            steps.append((wall, 1 - busy / wall, len(spans)))
            trainer.optimizer.zero_grad(set_to_none=True)
        steps = steps[1:]
        result = {
            "step_s": statistics.median(w for w, _, _ in steps),
            "idle": statistics.median(i for _, i, _ in steps),
            "ops": steps[-1][2],
        }
        if not cost_ms:
            dist.barrier(group=group)
            result["peak_bytes"] = measured_peak_bytes(lambda: trainer.forward_backward(batch, num_tokens))
            trainer.optimizer.zero_grad(set_to_none=True)
        return result
    finally:
        trainer.close()


def child() -> None:
    """Under torchrun: every run of ``RUNS``; rank 0 prints each rank's figures as one JSON line."""
    import torch.distributed as dist

    results = []
    runs = [(*run, STAGE_MS, IDLE_MODEL) for run in IDLE_RUNS] if STAGE_MS else []
    runs += [(*run, 0.0, []) for run in RUNS]
    for schedule, m, v, cost_ms, extra in runs:
        mine = pipeline_rank(schedule, m, v, cost_ms, extra)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results.append({"schedule": schedule, "m": m, "v": v, "cost_ms": cost_ms, "ranks": gathered})
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    os.environ["BENCH_PIPELINE_DIR"] = tempfile.mkdtemp(prefix="bench_pipeline_")  # the children inherit it
    trainer = build_trainer([*DEFAULTS, *USER_OVERRIDES], "pp1")
    try:
        batch, num_tokens = one_batch(trainer)
        pp1 = statistics.median(timed_steps(trainer, batch, num_tokens))
    finally:
        trainer.close()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(
        [*cmd, str(Path(__file__).resolve()), "--child", f"--stage-ms={STAGE_MS}", *USER_OVERRIDES],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULTS ")]
    if out.returncode or not lines:
        sys.exit(f"pp=2 runs failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    results = json.loads(lines[-1].removeprefix("RESULTS "))
    traced = [r for r in results if r["cost_ms"]]
    own = [r for r in results if not r["cost_ms"]]

    if traced:
        print(
            f"idle fraction per rank against the bubble: pp=2 on 2 CPU processes, each operation {STAGE_MS:g} ms "
            f"a block asleep (forward; full backward twice), global batch 16 x 32 tokens, median of {STEPS}"
        )
        print(
            f"{'schedule':<18}{'m':>3}{'v':>3}{'bubble':>9}{'idle r0':>9}{'idle r1':>9}{'ops':>5}{'step s':>9}"
        )
        for r in traced:
            bubble = bubble_fraction(r["schedule"], 2, r["m"], r["v"])
            idle = [rank["idle"] for rank in r["ranks"]]
            step = max(rank["step_s"] for rank in r["ranks"])
            print(
                f"{r['schedule']:<18}{r['m']:>3}{r['v']:>3}{bubble:>9.1%}{idle[0]:>9.1%}{idle[1]:>9.1%}"
                f"{r['ranks'][0]['ops']:>5}{step:>9.3f}"
            )
        print()
    print(
        "the model's own compute: pp=2 on 2 CPU processes, global batch 8 x 128 tokens, llama3 debug with "
        f"8 blocks, median of {STEPS}"
    )
    print(
        f"{'schedule':<18}{'m':>3}{'v':>3}{'bubble':>9}{'idle r0':>9}{'idle r1':>9}{'step s':>9}{'vs pp=1':>9}"
    )
    for r in own:
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
    by = {(r["schedule"], r["m"]): r["ranks"] for r in own}
    for m in (2, 8):
        for rank in range(2):
            gpipe, f1b = by[("GPipe", m)][rank]["peak_bytes"], by[("1F1B", m)][rank]["peak_bytes"]
            print(f"{m:>3}{rank:>6}{gpipe / 2**20:>12.2f}{f1b / 2**20:>12.2f}{f1b / gpipe:>12.2f}")


def parse_args(argv: list[str]) -> tuple[bool, float, list[str]]:
    """``[--child] [--stage-ms=MS] [KEY=VALUE ...]``: torchrun's child or not, the fixed cost per block
    (milliseconds, 0 for none), and the config overrides."""
    is_child = bool(argv) and argv[0] == "--child"
    argv = argv[1:] if is_child else argv
    stage_ms = 20.0
    if argv and argv[0].startswith("--stage-ms="):
        stage_ms = float(argv[0].removeprefix("--stage-ms="))
        argv = argv[1:]
    return is_child, stage_ms, argv


if __name__ == "__main__":
    CHILD, STAGE_MS, USER_OVERRIDES = parse_args(sys.argv[1:])
    if CHILD:
        child()
    else:
        main()
