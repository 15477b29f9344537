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
dynamo/inductor state, one set of compiled-code caches and a warm CPU cache between the runners, and
there per-block compilation looked even with HF while users saw it ~8% behind. A user runs one
process per try with nothing compiled before. So here each runner is its own fresh process with its
own empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``, ``compile.cache=false``), compiled; the
processes compile one at a time (first-step times reported), then step in lockstep *across*
processes -- the driver asks each for one step in turn, order rotated -- so a burst of load from
other jobs hits all alike (runners in sequence were useless here: the load average fell from 7 to
3 during one such run and moved the ratios by 2x). Runners:

- ``trainer``: the Trainer's own ``fit()`` loop (per-block compile, the default: the embedding,
  final norm, output head and loss eager; logging every 5 steps), each step timed up to its
  ``on_step_end``;
- ``trainer-model`` / ``trainer-nested``: the same with ``compile.granularity=model`` (the whole
  model one graph) / ``nested`` (one graph, each block a nested region compiled once);
- ``hf``: ``torch.compile(LlamaForCausalLM)`` (whole model) in the bare loop of ``bench_overhead.py``;
- ``ours-blocks`` / ``ours-whole``: portatrain's model in the same bare loop, compiled per block /
  whole (``model.compile()``): they separate the Trainer's own cost from the compile granularity's.

    OMP_NUM_THREADS=1 python scripts/bench_hf.py                     # processes (~10 min)
    OMP_NUM_THREADS=1 python scripts/bench_hf.py --steps 20 --runners trainer trainer-model
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
    Step,
    compile_blocks,
    compose,
    portatrain_model,
    print_table,
    rate,
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
    "trainer": "portatrain Trainer (fit), per block",
    "trainer-model": "portatrain Trainer (fit), whole model",
    "trainer-nested": "portatrain Trainer (fit), nested regions",
    "hf": "HF compiled (whole model), bare loop",
    "ours-blocks": "portatrain model, per-block, bare loop",
    "ours-whole": "portatrain model, whole, bare loop",
}


_MARK = "bench_hf_worker: "


def _reply(**values: float) -> None:
    print(_MARK + json.dumps(values), flush=True)  # marked: other output may share stdout


def worker(name: str, overrides: list[str]) -> None:
    """One runner in this fresh process, driven over stdin/stdout by :func:`run_processes`.

    On the first command it builds and compiles (timing step 1, compilation included), then runs one
    step per ``step`` command and replies with its time; ``quit`` ends it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        granularity = {"trainer-model": "model", "trainer-nested": "nested"}.get(name, "block")
        cfg = compose(
            overrides + ["compile.enabled=true", "compile.cache=false", f"compile.granularity={granularity}"],
            Path(tmp) / "run",
        )
        sys.stdin.readline()  # "start": the driver starts runners one at a time
        start = time.perf_counter()
        if name.startswith("trainer"):
            from omegaconf import open_dict

            from portatrain.trainer import Trainer

            class Driven(Trainer):
                resumed = start

                def on_step_end(self, step: int, metrics: dict) -> None:
                    self.accelerator.synchronize()
                    _reply(s=time.perf_counter() - self.resumed, tokens=metrics["tokens"])
                    if sys.stdin.readline().strip() != "step":
                        raise SystemExit(0)
                    self.resumed = time.perf_counter()

            with open_dict(cfg):
                cfg.trainer.steps = 10**6
            Driven(cfg).fit()  # the Trainer's own loop: logging, token counts, compile monitor
            return
        ours = portatrain_model(cfg)
        if name == "hf":
            model, forward = hf_model(ours), hf_forward
            model.compile()
        else:
            model, forward = ours, ours_forward
            compile_blocks(model) if name == "ours-blocks" else model.compile()
        loop = LoopRunner(cfg, model, forward)
        while True:
            tokens = loop.step()
            _reply(s=time.perf_counter() - start, tokens=tokens)
            if sys.stdin.readline().strip() != "step":
                return
            start = time.perf_counter()


def run_processes(args: argparse.Namespace, overrides: list[str]) -> None:
    """Every runner in ``--replicas`` fresh processes; steps in lockstep across all of them (one step
    of each in turn, order rotated), so load hits all alike.

    Replicas, because one process's speed carries a per-process offset that no amount of steps
    averages away (where its buffers land, which core it gets): two runs of one process per runner
    here gave the same runner 1.087x and 0.952x HF, each with steady per-chunk ratios. A runner's
    rate is the median over its replicas, shown with each replica's ratio. The first replica compiles
    with an empty inductor cache (its first step is the cold start a user sees); the others share
    that runner's cache, so they compile in seconds -- the compiled code, hence the steady state, is
    the same.
    """
    names = ["hf"] + [n for n in args.runners if n != "hf"]
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; overrides: {overrides}")
    with tempfile.TemporaryDirectory() as caches:
        procs = {}
        for name in names:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(caches) / name)}
            for replica in range(args.replicas):
                procs[name, replica] = subprocess.Popen(
                    [sys.executable, __file__, "--worker", name, *args.overrides],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                )  # fmt: skip

        def command(key: tuple[str, int], text: str) -> dict:
            proc = procs[key]
            proc.stdin.write(text + "\n")
            proc.stdin.flush()
            while True:
                line = proc.stdout.readline()
                if not line:
                    raise SystemExit(f"{key[0]} exited ({proc.wait()}); run it alone: --worker {key[0]}")
                if line.startswith(_MARK):
                    return json.loads(line[len(_MARK) :])

        first = {}
        for key in procs:  # one compilation at a time: first-step times do not compete
            first[key] = command(key, "start")["s"]
        for name in names:
            warm = [f"{first[name, r]:.1f}" for r in range(1, args.replicas)]
            print(
                f"  {PROCESS_RUNNERS[name]:<40} first step {first[name, 0]:6.1f} s (empty cache)"
                + (f"; replicas, warm cache: {' '.join(warm)} s" if warm else ""),
                flush=True,
            )
        keys = list(procs)
        times: dict[tuple[str, int], list[Step]] = {key: [] for key in keys}
        for step in range(args.warmup + args.steps):
            k = step % len(keys)
            for key in keys[k:] + keys[:k]:
                r = command(key, "step")
                if step >= args.warmup:
                    times[key].append((r["s"], int(r["tokens"])))
        for proc in procs.values():
            proc.stdin.write("quit\n")
            proc.stdin.close()
            proc.wait()
    rates = {name: statistics.median(rate(times[name, r]) for r in range(args.replicas)) for name in names}
    print(f"\ncompiled, {args.replicas} fresh process(es) per runner, lockstep, {args.steps} steps each")
    print(f"  {'runner':<14} {'tokens/s':>9} {'step ms':>8} {'ratio':>6}  ratio of each replica")
    for name in names:
        replicas = " ".join(f"{rate(times[name, r]) / rates['hf']:.3f}" for r in range(args.replicas))
        step_ms = 1e3 * statistics.median(s for r in range(args.replicas) for s, _ in times[name, r])
        print(
            f"  {name:<14} {rates[name]:>9,.0f} {step_ms:>8.2f} {rates[name] / rates['hf']:>6.3f}  {replicas}"
        )
    for name in names:
        print(f"  {name:<14} = {PROCESS_RUNNERS[name]}")
    pairs = [
        ("portatrain Trainer per block / HF", "trainer", "hf"),
        ("portatrain Trainer whole model / HF", "trainer-model", "hf"),
        ("portatrain Trainer nested / HF", "trainer-nested", "hf"),
        ("per-block / whole (same bare loop)", "ours-blocks", "ours-whole"),
    ]
    summary = [f"{label} = {rates[a] / rates[b]:.3f}" for label, a, b in pairs if a in rates and b in rates]
    print(
        "\n"
        + "; ".join(summary)
        + "; load average at the end "
        + " ".join(f"{x:.1f}" for x in os.getloadavg())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="processes", choices=["processes", "lockstep"])
    parser.add_argument("--worker", choices=list(PROCESS_RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument(
        "--runners",
        nargs="+",
        default=list(PROCESS_RUNNERS),
        choices=list(PROCESS_RUNNERS),
        help="with --method processes: which runners (hf is the baseline and always runs)",
    )
    parser.add_argument(
        "--replicas", type=int, default=3, help="with --method processes: processes per runner"
    )
    parser.add_argument("--steps", type=int, default=40, help="measured steps per runner")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped first (compilation)")
    parser.add_argument("--chunk", type=int, default=10, help="steps per chunk in the spread column")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    if args.replicas < 1:
        parser.error(f"--replicas {args.replicas}: give 1 or more processes per runner")
    overrides = BASE_OVERRIDES + ["data.collator=pad_to_max"] + args.overrides
    if args.worker:
        worker(args.worker, overrides)
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
