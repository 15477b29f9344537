"""What the first GPU machine must tell us, in one command: parity, throughput with and without FP8,
the memory plan against the measured peak, and the MoE block -- printed side by side.

    python scripts/device_check.py                      # one CUDA GPU (H200: ~6 min, estimated)
    python scripts/device_check.py --dry-run            # the same plumbing on the CPU, tiny sizes (seconds)
    python scripts/device_check.py --out runs/check     # keep the runs and device_check.json there

Each section runs one of the project's own stages, never a copy of it:

1. **parity** -- ``portatrain.parity.run_parity``: the debug recipe on the device (its default dtype,
   bf16 on a GPU) against fp32 on the CPU, 3 steps, judged against the derived tolerances;
2. **throughput** -- ``portatrain.bench.run_bench`` (the Trainer, one device): Llama 3 1B, and 8B when
   the memory plan says it fits, bf16 and compiled; tokens/s, MFU (against the bf16 peak) and the
   time to the end of step 1; then the same with ``quantize.linear=float8_rowwise`` and ``mxfp8``
   where the adapter declares the format (``Accelerator.low_precision_matmuls``: FP8 from sm89,
   MXFP8 on sm100), their ratio to bf16 beside them; a refused recipe prints its one-line refusal;
3. **memory** -- ``portatrain.plan.estimate_for_config`` (what ``dry_run=true`` prints) against each
   bench's measured peak (the allocator's high-water mark, reset before each run);
4. **MoE** -- ``scripts/bench_moe.py``'s ``measure`` on the device in bf16, at Qwen 3 30B-A3B's expert
   shape (128 experts, top-8, hidden 2048, expert width 768): the dropless grouped GEMM and the
   capacity dispatch against a dense SwiGLU of the same active FLOPs.

Budget on one H200, estimated (not yet run on one): parity ~20 s, each 1B bench ~1-1.5 min with its compilation (3 + 10 steps of
8 x 2048 tokens), the MoE block seconds; 8B (fp32 master weights and AdamW state: ~128 GB before any
activation) is skipped by the plan on a 141 GB device. ``--dry-run`` swaps in the debug model, a few
tiny steps, no compilation, the CPU (where FP8 runs emulated) and a small MoE block; it is what
``tests/test_device_check.py`` runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GIB = 1024**3
QUANTIZED = ("float8_rowwise", "mxfp8")
FIT_FRACTION = 0.9
"""A model is benched when the plan's estimate is at most this share of the device's memory: the
estimate leaves out fragmentation and workspaces (``portatrain.plan.fit_verdict`` says keep 10-20% free)."""

GPU: dict[str, Any] = {
    "device": "cuda",
    "parity": ["recipe=debug", "trainer.steps=3"],
    "models": {"llama3 1b": ["recipe=llama1b"], "llama3 8b": ["recipe=llama8b"]},
    # Llama 3's 128,256-token vocabulary at 8 x 2048 positions would hold ~20 GB of logits and their
    # gradients: the chunked loss never builds them (as scripts/gpu_llama1b.py).
    "bench": [
        "trainer.dtype=bfloat16",
        "compile.enabled=true",
        "trainer.loss=chunked",
        "bench.warmup_steps=3",
        "bench.steps=10",
    ],
    "moe": {"dim": 2048, "width": 768, "experts": 128, "top_k": 8, "tokens": 8192, "rounds": 5},
}
TINY_DATA = ["data.num_documents=64", "data.seq_len=64", "data.batch_size=2", "trainer.progress=false"]
DRY_RUN: dict[str, Any] = {
    "device": "cpu",
    "parity": ["recipe=debug", "trainer.steps=1", *TINY_DATA],
    "models": {"llama3 debug": ["model=llama3_debug", *TINY_DATA]},
    "bench": ["trainer.dtype=bfloat16", "bench.warmup_steps=0", "bench.steps=1", "metrics.peak_tflops=1"],
    "moe": {"dim": 64, "width": 24, "experts": 8, "top_k": 2, "tokens": 128, "rounds": 1},
}


def compose(overrides: list[str], run_dir: Path) -> Any:
    """The config ``portatrain OVERRIDES... run_dir=RUN_DIR`` runs with, validated as the CLI does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from portatrain.cli import config_dir
    from portatrain.config import register_configs
    from portatrain.models import ModelSchema
    from portatrain.validate import validate

    register_configs(ModelSchema)
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = hydra_compose("config", overrides=[*overrides, f"run_dir={run_dir}"])
    validate(cfg)
    return cfg


def device_memory(accelerator: Any) -> int:
    """Bytes of memory of one device (the host's RAM for the CPU)."""
    if accelerator.device_type == "cuda":
        return int(torch.cuda.get_device_properties(accelerator.index).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_parity(sizes: dict[str, Any], out: Path) -> dict[str, Any]:
    from portatrain.parity import run_parity

    cfg = compose([f"device={sizes['device']}", *sizes["parity"]], out / "parity")
    report = run_parity(cfg)
    print(report.format(), flush=True)
    last = report.steps[-1]
    return {
        "ok": bool(report.ok),
        "dtype": str(report.dtype).removeprefix("torch."),
        "steps": len(report.steps),
        "loss_rel": last.loss_rel,
        "loss_tolerance": last.loss_tolerance,
    }


def bench(name: str, overrides: list[str], recipe: str, out: Path, accelerator: Any) -> dict[str, Any]:
    """One bench run (``portatrain bench``'s engine); a refusal (a ``UserError``) is its result."""
    from portatrain.bench import run_bench
    from portatrain.errors import UserError
    from portatrain.plan import estimate_for_config

    quantize = [] if recipe == "bf16" else [f"quantize.linear={recipe}"]
    run_dir = out / f"{name.replace(' ', '_')}_{recipe}"
    try:
        cfg = compose([*overrides, *quantize], run_dir)
        plan = int(estimate_for_config(cfg)["total"])
        import torch._dynamo

        torch._dynamo.reset()  # each run compiles its own graphs, from a clean slate
        accelerator.reset_peak_memory()
        r = run_bench(cfg)
    except UserError as exc:
        return {"model": name, "recipe": recipe, "refused": str(exc)}
    finally:
        gc.collect()
        if accelerator.device_type == "cuda":
            torch.cuda.empty_cache()
    return {
        "model": name,
        "recipe": recipe,
        "tokens_per_s": r["tokens_per_s"],
        "mfu": r["mfu"],
        "step_time_median_s": r["step_time_median_s"],
        "cold_start_s": r["cold_start_s"],
        "peak_bytes": r["memory_peak_bytes"],
        "plan_bytes": plan,
    }


def check_throughput(sizes: dict[str, Any], out: Path, accelerator: Any) -> list[dict[str, Any]]:
    from portatrain.plan import estimate_for_config

    rows = []
    memory = device_memory(accelerator)
    for name, model in sizes["models"].items():
        overrides = [f"device={sizes['device']}", *model, *sizes["bench"]]
        plan = int(estimate_for_config(compose(overrides, out / "plan"))["total"])
        if plan > FIT_FRACTION * memory:
            rows.append(
                {
                    "model": name,
                    "recipe": "bf16",
                    "refused": f"skipped: the plan needs {plan / GIB:.1f} GiB, more than {FIT_FRACTION:.0%} "
                    f"of the device's {memory / GIB:.0f} GiB",
                }
            )
            continue
        for recipe in ("bf16", *QUANTIZED):
            rows.append(bench(name, overrides, recipe, out, accelerator))
            print(_row(rows[-1], rows), flush=True)
    return rows


def check_moe(sizes: dict[str, Any], accelerator: Any) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_moe import measure

    dtype = torch.bfloat16 if accelerator.device_type != "cpu" else torch.float32
    shape = sizes["moe"]
    times = measure(
        shape["dim"],
        shape["width"],
        shape["experts"],
        shape["top_k"],
        shape["tokens"],
        shape["rounds"],
        hf=(),
        accelerator=accelerator,
        dtype=dtype,
    )
    # A GPU's time is the wall clock's (the host only queues work); one CPU thread's, the process's.
    pick = 1 if accelerator.device_type != "cpu" else 0
    return {
        **shape,
        "dtype": str(dtype).removeprefix("torch."),
        "clock": "wall" if pick else "cpu",
        "seconds": {name: t[pick] for name, t in times.items()},
    }


def _row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = f"  {row['model']:<13} {row['recipe']:<15}"
    if "refused" in row:
        return f"{head} {row['refused']}"
    base = next(
        (r for r in rows if r["model"] == row["model"] and r["recipe"] == "bf16" and "refused" not in r), None
    )
    ratio = row["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    mfu = f"{100 * row['mfu']:5.1f}%" if row["mfu"] is not None else "  n/a"
    peak = row["peak_bytes"]
    peak_text = f"{peak / GIB:8.2f}" if peak else "     n/a"
    vs_plan = f"{row['plan_bytes'] / peak:9.2f}" if peak else "      n/a"
    return (
        f"{head} {row['tokens_per_s']:11,.0f} {ratio:7.2f} {mfu} {peak_text} {row['plan_bytes'] / GIB:8.2f} "
        f"{vs_plan} {row['cold_start_s']:9.1f}"
    )


def report(results: dict[str, Any]) -> str:
    """Everything side by side, as printed at the end."""
    p = results["parity"]
    lines = [
        f"device_check on {results['device_name']} ({results['device']}), torch {results['torch']}, "
        f"torchao {results['torchao']}, {results['date']}, {results['elapsed_s']:.0f} s",
        f"parity: debug recipe, {p['dtype']} on {results['device']} vs fp32 on cpu, {p['steps']} step(s): "
        f"{'ok' if p['ok'] else 'FAILED'} (last loss {p['loss_rel']:.2e} of {p['loss_tolerance']:.2e} allowed)",
        "throughput and memory (one device; MFU against the bf16 peak; peak: allocator high-water mark; "
        "plan: dry_run's estimate)",
        f"  {'model':<13} {'recipe':<15} {'tokens/s':>11} {'vs bf16':>7} {'MFU':>6} {'peak GiB':>8} "
        f"{'plan GiB':>8} {'plan/peak':>9} {'cold s':>9}",
    ]
    lines += [_row(row, results["throughput"]) for row in results["throughput"]]
    m = results["moe"]
    s = m["seconds"]
    lines.append(
        f"MoE block ({m['experts']} experts, top-{m['top_k']}, dim {m['dim']}, expert width {m['width']}, "
        f"{m['tokens']} tokens, {m['dtype']}; forward + backward, median {m['clock']} time)"
    )
    for name in ("dense", "ours-dropless", "ours-capacity", "ours-matmuls"):
        lines.append(f"  {name:<14} {s[name] * 1e3:9.2f} ms   dense / this {s['dense'] / s[name]:5.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the plumbing on the CPU with tiny sizes")
    parser.add_argument(
        "--out", default=None, help="where the runs and device_check.json go (default: a temporary dir)"
    )
    args = parser.parse_args(argv)
    sizes = DRY_RUN if args.dry_run else GPU
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA GPU visible (torch.cuda.is_available() is False): run this on a CUDA machine, or "
            "pass --dry-run to check the plumbing on the CPU"
        )
    from portatrain.accelerators import resolve_accelerator

    out = Path(args.out or tempfile.mkdtemp(prefix="device_check_"))
    out.mkdir(parents=True, exist_ok=True)
    accelerator = resolve_accelerator(sizes["device"])
    start = time.perf_counter()
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = "not installed"
    results: dict[str, Any] = {
        "device": sizes["device"],
        "device_name": accelerator.device_name(),
        "torch": torch.__version__,
        "torchao": torchao_version,
        "date": time.strftime("%Y-%m-%d"),
        "dry_run": args.dry_run,
    }
    results["parity"] = check_parity(sizes, out)
    results["throughput"] = check_throughput(sizes, out, accelerator)
    results["moe"] = check_moe(sizes, accelerator)
    results["elapsed_s"] = time.perf_counter() - start
    (out / "device_check.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + report(results) + f"\n  wrote {out / 'device_check.json'}", flush=True)
    return results


if __name__ == "__main__":
    main()
