"""portatrain against Hugging Face ``LlamaForCausalLM`` (SDPA attention), eager and compiled.

Three runners train in lockstep on the same machine, at the same dimensions and batch:

- ``portatrain Trainer``: the unmodified Trainer (``compile.enabled=true``: each block compiled);
- ``portatrain Llama, bare loop``: portatrain's model in the hand-written loop of
  ``bench_overhead.py`` (compiled per block like the Trainer);
- ``HF Llama, bare loop``: ``LlamaForCausalLM(attn_implementation="sdpa")`` built from
  ``portatrain.models.llama.hf.hf_config(args)``, loaded with the same weights (``to_hf``), in the
  same loop (compiled with ``torch.compile(model)``, the usual plain-loop choice).

Batches come from ``data.collator=pad_to_max`` (one document per row, no mask), so both models take
their plain causal-attention path; HF gets ``use_cache=False`` as any training loop passes.
Method and measurements as in ``bench_overhead.py`` (lockstep steps, medians); with both modes the
compiled run also carries the eager HF loop, the common reference for compiled / eager. Before
training, both models' losses on one random batch are printed: equal weights, so they must agree.

    OMP_NUM_THREADS=1 python scripts/bench_hf.py --method lockstep            # eager and compiled
    OMP_NUM_THREADS=1 python scripts/bench_hf.py --method lockstep --modes eager --steps 40

**What a user sees** (``--method processes``, the default): lockstep in one process shares one
dynamo/inductor state and one warm CPU cache between the runners, and there per-block compilation
looked even with HF. A user runs one process per try, with nothing compiled before. So each runner
here is its own fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a new
temporary directory, ``compile.cache=false``), compiled, timing ``--steps`` steps after
``--warmup``; runners take turns (order rotated per round) for ``--rounds`` rounds so load from other
processes spreads over all. Runners:

- ``portatrain bench``: ``portatrain.bench.run_bench`` -- the Trainer exactly as ``portatrain bench``
  runs it (per-block compile; the embedding, final norm, output head and loss eager);
- ``HF compiled``: ``torch.compile(LlamaForCausalLM)`` (whole model) in the bare loop;
- ``portatrain model, per-block, bare loop`` and ``portatrain model, whole, bare loop``: portatrain's
  model in the same bare loop compiled per block / whole (``model.compile()``), which separates the
  Trainer's own cost from the compile granularity's.

Reported per runner: median step time and tokens/s (real tokens per step over the median), the
first-step time (compilation), each round's ratio to HF and the load average.

    OMP_NUM_THREADS=1 python scripts/bench_hf.py                     # processes, 2 rounds
    OMP_NUM_THREADS=1 python scripts/bench_hf.py --rounds 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import (  # noqa: E402  (a sibling script, not a package)
    BASE_OVERRIDES,
    TRAINER,
    LoopRunner,
    compile_blocks,
    compose,
    portatrain_model,
    print_table,
    run_lockstep,
)

from portatrain.models.llama.hf import hf_config, to_hf  # noqa: E402

OURS = "portatrain Llama, bare loop"
HF = "HF Llama, bare loop"


def hf_model(ours: torch.nn.Module) -> torch.nn.Module:
    """``LlamaForCausalLM`` with ``ours``'s dimensions and weights, SDPA attention, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**hf_config(ours.args, torch_dtype="float32"))
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(to_hf(ours.state_dict()), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights did not map: missing {missing}, unexpected {unexpected}")
    return model


def ours_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["input_ids"])  # rows start at position 0; no mask: causal SDPA


def hf_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], use_cache=False).logits


def check_same_loss(loops: dict[str, LoopRunner], batch_size: int, seq_len: int, vocab_size: int) -> None:
    """Both models on one random batch before any step: the same weights must give the same loss.

    A random batch, not the loaders': every runner must start at the same real batch.
    """
    tokens = torch.randint(
        0, vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    losses = {}
    with torch.no_grad():
        for name, loop in loops.items():
            logits = loop.forward(loop.model, batch)
            losses[name] = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    print("  same batch, same weights: loss " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))


# ---------------------------------------------------------------------------------------------
# One process per runner: what a user sees
# ---------------------------------------------------------------------------------------------
PROCESS_RUNNERS = {
    "bench": "portatrain bench",
    "hf": "HF compiled (whole model), bare loop",
    "ours-blocks": "portatrain model, per-block, bare loop",
    "ours-whole": "portatrain model, whole, bare loop",
}


def worker(name: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    """Run one runner in this (fresh) process; return its step times and tokens per step."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(overrides + ["compile.enabled=true", "compile.cache=false"], Path(tmp) / "run")
        if name == "bench":
            from omegaconf import open_dict

            from portatrain.bench import run_bench

            with open_dict(cfg):
                cfg.bench.steps, cfg.bench.warmup_steps = steps, warmup
            r = run_bench(cfg)
            return {
                "step_s": r["step_time_median_s"],
                "first_step_s": r["first_step_s"],
                "tokens_per_step": r["tokens_per_step"],
            }
        ours = portatrain_model(cfg)
        if name == "hf":
            model, forward = hf_model(ours), hf_forward
            model.compile()
        else:
            model, forward = ours, ours_forward
            compile_blocks(model) if name == "ours-blocks" else model.compile()
        loop = LoopRunner(cfg, model, forward)
        times, tokens = [], []
        for _ in range(warmup + 1 + steps):
            start = time.perf_counter()
            tokens.append(loop.step())
            times.append(time.perf_counter() - start)
        return {
            "step_s": statistics.median(times[warmup + 1 :]),
            "first_step_s": times[0],
            "tokens_per_step": statistics.fmean(tokens[warmup + 1 :]),
        }


def run_processes(args: argparse.Namespace, overrides: list[str]) -> None:
    names = list(PROCESS_RUNNERS)
    results: dict[str, list[dict]] = {n: [] for n in names}
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; overrides: {overrides}")
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", name, "--steps", str(args.steps),
                     "--warmup", str(args.warmup), *args.overrides],
                    env=env, capture_output=True, text=True,
                )  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["load"] = os.getloadavg()[0]
            results[name].append(r)
            print(
                f"  round {round_} {PROCESS_RUNNERS[name]:<42} step {r['step_s'] * 1e3:7.1f} ms, "
                f"first step {r['first_step_s']:6.1f} s, load {r['load']:.1f}",
                flush=True,
            )
    print(
        f"\n  {'runner':<42} {'tokens/s':>9} {'step ms':>8} {'first step s':>13}  tokens/s ratio to HF per round"
    )
    for name in names:
        rs = results[name]
        step = statistics.median(r["step_s"] for r in rs)
        ratios = [h["step_s"] / r["step_s"] for r, h in zip(rs, results["hf"])]
        print(
            f"  {PROCESS_RUNNERS[name]:<42} {rs[0]['tokens_per_step'] / step:>9,.0f} {step * 1e3:>8.1f} "
            f"{statistics.median(r['first_step_s'] for r in rs):>13.1f}  "
            + ", ".join(f"{x:.3f}" for x in ratios)
        )
    print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="processes", choices=["processes", "lockstep"])
    parser.add_argument("--rounds", type=int, default=2, help="processes: rounds over all runners")
    parser.add_argument("--worker", choices=list(PROCESS_RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--steps", type=int, default=40, help="measured steps per runner")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped first (compilation)")
    parser.add_argument("--chunk", type=int, default=10, help="steps per chunk in the spread column")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    overrides = BASE_OVERRIDES + ["data.collator=pad_to_max"] + args.overrides
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.warmup, overrides)))
        return
    if args.method == "processes":
        run_processes(args, overrides)
        return
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads; overrides: {overrides}"
    )
    both = len(set(args.modes)) == 2
    rates: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            compiled = mode == "compiled"
            cfg = compose(overrides + [f"compile.enabled={compiled}"], Path(tmp) / mode)
            ours = portatrain_model(cfg)
            hf = hf_model(ours)
            loops = {
                f"{OURS}, {mode}": LoopRunner(cfg, ours, ours_forward),
                f"{HF}, {mode}": LoopRunner(cfg, hf, hf_forward),
            }
            print(f"\n[{mode}] batch {cfg.data.batch_size} x {cfg.data.seq_len}, model {cfg.model.flavor}")
            check_same_loss(loops, cfg.data.batch_size, cfg.data.seq_len, ours.args.vocab_size)
            if compiled:
                compile_blocks(ours)
                hf.compile()  # whole model, in place: what a plain HF loop does
                if both:  # the eager HF loop again, as the common reference for compiled / eager
                    loops[f"{HF}, eager"] = LoopRunner(cfg, hf_model(portatrain_model(cfg)), hf_forward)
            times = run_lockstep(
                cfg, loops, steps=args.steps, warmup=args.warmup, trainer_name=f"{TRAINER}, {mode}"
            )
            rates[mode] = print_table(f"[{mode}] against Hugging Face", times, f"{HF}, {mode}", args.chunk)
    print("\nsummary (tokens/s ratios, each from one lockstep run):")
    for mode, r in rates.items():
        print(
            f"  {mode:<9} portatrain Trainer / HF = {r[f'{TRAINER}, {mode}'] / r[f'{HF}, {mode}']:.3f}, "
            f"portatrain Llama / HF (same loop) = {r[f'{OURS}, {mode}'] / r[f'{HF}, {mode}']:.3f}"
        )
    if both:
        # compiled / eager through the eager HF loop that both runs share.
        e, c = rates["eager"], rates["compiled"]
        for who in (TRAINER, OURS, HF):
            ratio = (c[f"{who}, compiled"] / c[f"{HF}, eager"]) / (e[f"{who}, eager"] / e[f"{HF}, eager"])
            print(f"  compiled / eager, {who} = {ratio:.3f}")


if __name__ == "__main__":
    main()
