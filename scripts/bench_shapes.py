"""Static shapes, measured: how four ways of batching variable-length documents fare under a compiler
that builds one graph per input shape (``torch.compile(dynamic=False)``, as XLA and Neuron do).

    python scripts/bench_shapes.py            # about 5 minutes on 2 idle CPU cores

On one long-tailed corpus (document lengths log-normal, clipped to 16..2048 positions), the debug
Llama is trained for one epoch, compiled per block with inductor and ``dynamic=False``, with:

- ``naive``      pad each batch to its own longest document: a new shape, hence a new graph, for
                 almost every batch (the compilation storm). Built as ``collator=bucket`` with a
                 bucket at every length. Without warm-up, and cut off after ``--naive-budget-s``
                 seconds: the table then says how many of the epoch's shapes it reached and projects
                 the full epoch from the measured compile and step times;
- ``pad_to_max`` pad every batch to 2048: one graph, most of the work spent on padding;
- ``bucket``     pad to the smallest of ``--buckets`` that fits (length-grouped sampler): one graph
                 per bucket, all compiled by ``compile.warmup`` before step 1;
- ``packing``    concatenate documents into 2048-position rows with block-diagonal masks: one graph.

Every strategy runs in a fresh process with an empty inductor cache, so compile times are cold
starts. Reported per strategy: graphs compiled, padding waste over the whole epoch (% of processed
positions that are padding), total wall time of ``Trainer.fit`` including compilation, and
steady-state throughput in real (non-pad) tokens per second over the steps that compiled nothing.
The runs use the real pipeline (``Trainer``, ``build_dataloader``, ``compile_blocks``, warm-up);
only the corpus is generated here. Other work on the machine skews the times: run it on an idle one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ("naive", "pad_to_max", "bucket", "packing")


def make_corpus(path: Path, *, num_docs: int, max_len: int, seed: int) -> list[int]:
    """Write ``num_docs`` JSONL documents whose lengths in positions follow a clipped log-normal.

    The byte tokenizer adds BOS and EOS, and a document of T tokens occupies T - 1 positions, so a
    text of L - 1 bytes is L positions long.
    """
    rng = random.Random(seed)
    lengths = [min(max_len, max(16, round(rng.lognormvariate(math.log(160), 1.0)))) for _ in range(num_docs)]
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    with path.open("w") as f:
        for n in lengths:
            f.write(json.dumps({"text": "".join(rng.choices(alphabet, k=n - 1))}) + "\n")
    return lengths


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from portatrain.cli import config_dir
    from portatrain.config import register_configs
    from portatrain.models import ModelSchema

    register_configs(ModelSchema)
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        return hydra_compose("config", overrides=overrides)


def strategy_overrides(strategy: str, args: argparse.Namespace) -> list[str]:
    common = [
        "device=cpu",
        f"data.dataset={args.corpus}",
        "data.eval_fraction=0",
        f"data.batch_size={args.batch_size}",
        f"data.seq_len={args.max_len}",
        "data.overlong=truncate",
        f"model.max_seq_len={args.max_len}",
        "compile.enabled=true",
        "compile.dynamic=false",
        "trainer.eval_every=0",
        "trainer.log_every=1000000",
        "trainer.progress=false",
        "checkpoint.enabled=false",
        "metrics.jsonl=false",
        f"trainer.seed={args.seed}",
    ]
    if strategy == "naive":  # buckets are set after composing: one per length
        return [*common, "data.collator=bucket"]
    if strategy == "bucket":
        return [*common, "data.collator=bucket", f"data.buckets=[{args.buckets}]", "compile.warmup=true"]
    return [*common, f"data.collator={strategy}", "compile.warmup=true"]


def epoch_shapes(cfg) -> list[tuple[int, int, int]]:
    """``(batch, seq, real tokens)`` of every batch of one epoch, from the data stage alone."""
    from portatrain.data.documents import load_documents
    from portatrain.data.loader import build_dataloader
    from portatrain.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.data.tokenizer)
    train, _ = load_documents(
        cfg.data.dataset, tokenizer, num_documents=0, eval_fraction=0.0, seed=cfg.trainer.seed
    )
    loader = build_dataloader(cfg.data, train, pad_id=tokenizer.pad_id, seed=cfg.trainer.seed, infinite=False)
    return [(*b["labels"].shape, int((b["labels"] != -100).sum())) for b in loader]


def run_strategy(strategy: str, args: argparse.Namespace) -> dict:
    """One strategy in this process: train one epoch, return the measurements."""
    import torch
    from omegaconf import open_dict

    from portatrain.trainer import Trainer

    cfg = compose(strategy_overrides(strategy, args))
    with open_dict(cfg):
        cfg.run_dir = tempfile.mkdtemp(prefix=f"bench_shapes_{strategy}_")
        if strategy == "naive":
            cfg.data.buckets = list(range(1, args.max_len + 1))
            # Dynamo gives up after 8 graphs per function and runs it eagerly: let the storm happen.
            torch._dynamo.config.recompile_limit = 100_000
            torch._dynamo.config.accumulated_recompile_limit = 100_000
    shapes = epoch_shapes(cfg)
    with open_dict(cfg):
        cfg.trainer.steps = len(shapes)
    budget = args.naive_budget_s if strategy == "naive" else float("inf")

    class Stop(Exception):
        pass

    class BenchTrainer(Trainer):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.steps: list[dict] = []
            self.compiled_batches: list[list[dict]] = []
            self.warmup_records: list[dict] = []

        def warmup(self):
            self.warmup_records = super().warmup()
            return self.warmup_records

        def train_step(self, batches):
            step = timed_step(self, batches)
            self.steps.append(step)
            if step["compiled"]:
                self.compiled_batches.append(batches)
            return step.pop("metrics")

        def on_step_end(self, step, metrics):
            if time.perf_counter() - fit_start > budget:
                raise Stop

    trainer = BenchTrainer(cfg)
    fit_start = time.perf_counter()
    capped = False
    try:
        trainer.fit()
    except Stop:
        capped = True
    wall = time.perf_counter() - fit_start
    graphs = trainer.compile_monitor.graphs
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    steady = [s for s in trainer.steps if not s["compiled"]]
    if capped and len(steady) < args.replays:
        # The storm left too few steps that compiled nothing to time: run a few of the batches whose
        # graphs exist again (not counted in the wall time).
        for batches in trainer.compiled_batches[-args.replays :]:
            step = timed_step(trainer, batches)
            step.pop("metrics")
            steady.append(step)
    trainer.close()

    compiling = [s for s in trainer.steps if s["compiled"]]
    processed = sum(b * s for b, s, _ in shapes)
    real = sum(r for _, _, r in shapes)
    steady_s = max(sum(s["seconds"] for s in steady), 1e-9)
    result = {
        "strategy": strategy,
        "batches": len(shapes),
        "steps_run": len(trainer.steps),
        "capped": capped,
        "graphs": graphs,
        "distinct_shapes": len({(b, s) for b, s, _ in shapes}),
        "padding_waste": 1 - real / processed,
        "real_tokens": real,
        "wall_s": wall,
        "warmup_s": sum(r.get("train_s", 0) for r in trainer.warmup_records),
        "steady_steps": len(steady),
        "steady_tokens_per_s": sum(s["real"] for s in steady) / steady_s,
    }
    if capped:
        # The rest of the epoch: a step with a shape not met yet costs one cold compile (the mean
        # measured), any other step its positions at the steady rate (padding costs time too).
        # The first compile of a process also pays one-time start-up (imports, C++ headers): use the
        # marginal cost of the later ones where there are any.
        marginal = compiling[1:] or compiling
        compile_s = sum(s["seconds"] for s in marginal) / max(len(marginal), 1)
        positions_per_s = sum(s["positions"] for s in steady) / steady_s
        seen, rest = {s["shape"] for s in trainer.steps}, 0.0
        for b, sq, _ in shapes[len(trainer.steps) :]:
            rest += b * sq / positions_per_s if (b, sq) in seen else compile_s
            seen.add((b, sq))
        result["projected_wall_s"] = wall + rest
        result["projected_graphs"] = graphs + len(seen) - len({s["shape"] for s in trainer.steps})
        result["compile_s_per_shape"] = compile_s
        result["compile_s_from"] = "after the first" if len(compiling) > 1 else "the only one"
    return result


def timed_step(trainer, batches) -> dict:
    """Run ``Trainer.train_step``; return the step's shape, real tokens, positions, seconds, whether it
    compiled a graph, and its metrics."""
    from portatrain.compile import dynamo_graph_count
    from portatrain.trainer import Trainer

    graphs, start = dynamo_graph_count(), time.perf_counter()
    metrics = Trainer.train_step(trainer, batches)
    shape = tuple(batches[0]["input_ids"].shape)
    return {
        "shape": shape,
        "real": metrics["tokens"],
        "positions": sum(b["input_ids"].numel() for b in batches),
        "seconds": time.perf_counter() - start,
        "compiled": dynamo_graph_count() > graphs,
        "metrics": metrics,
    }


def print_table(results: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        f"debug Llama (inductor, per-block compile, dynamic=False), {args.docs} documents of "
        f"16..{args.max_len} positions (log-normal, median 160), batch size {args.batch_size}, "
        f"buckets [{args.buckets}], length-grouped sampler, one epoch, {os.cpu_count()} CPU cores "
        f"(load average {args.load_before:.1f} before, {os.getloadavg()[0]:.1f} after: other work skews the times)",
        "",
        "| strategy | batches | graphs compiled | padding waste | total wall time (incl. compile) "
        "| steady-state real tokens/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        graphs, wall = f"{r['graphs']}", f"{r['wall_s']:.0f} s"
        if r["capped"]:
            graphs += f" in {r['steps_run']} steps; {r['projected_graphs']} for the epoch"
            wall += (
                f" for {r['steps_run']} steps (cap); {r['projected_wall_s']:.0f} s projected for the epoch"
            )
        elif r["warmup_s"]:
            wall += f" ({r['warmup_s']:.0f} s of it warm-up)"
        lines.append(
            f"| {r['strategy']} | {r['batches']} | {graphs} | {100 * r['padding_waste']:.1f}% | {wall} "
            f"| {r['steady_tokens_per_s']:,.0f} |"
        )
    for r in results:
        if r["capped"]:
            lines.append(
                f"\n{r['strategy']} was stopped after {args.naive_budget_s:.0f} s (--naive-budget-s): a step that "
                f"compiles a new shape ({r['compile_s_from']}) took {r['compile_s_per_shape']:.1f} s on average; the projection adds "
                f"that for every shape of the epoch not reached and the other steps at the steady rate "
                f"({r['steady_steps']} steps timed)."
            )
    print("\n".join(lines))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=300, help="documents in the corpus")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument(
        "--max-len", type=int, default=2048, help="longest document, pad-to-max and packing row"
    )
    parser.add_argument("--buckets", default="128,256,512,1024,2048")
    parser.add_argument("--naive-budget-s", type=float, default=90.0, help="time cap of the naive run")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--replays", type=int, default=8, help="steady-state steps re-run after the cap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # one strategy, in a fresh process; prints one JSON line last
        print(json.dumps(run_strategy(args.worker, args)))
        return

    args.load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="bench_shapes_"))
    args.corpus = workdir / "corpus.jsonl"
    make_corpus(args.corpus, num_docs=args.docs, max_len=args.max_len, seed=args.seed)
    results = []
    for strategy in args.strategies.split(","):
        start = time.perf_counter()
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(workdir / f"inductor_{strategy}")}
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", strategy, "--corpus", str(args.corpus)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{strategy} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{strategy}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    shutil.rmtree(workdir, ignore_errors=True)  # the corpus and the inductor caches
    print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
