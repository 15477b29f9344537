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

    OMP_NUM_THREADS=1 python scripts/bench_hf.py                 # eager and compiled
    OMP_NUM_THREADS=1 python scripts/bench_hf.py --modes eager --steps 40
"""

from __future__ import annotations

import argparse
import sys
import tempfile
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--steps", type=int, default=40, help="measured steps per runner")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped first (compilation)")
    parser.add_argument("--chunk", type=int, default=10, help="steps per chunk in the spread column")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    overrides = BASE_OVERRIDES + ["data.collator=pad_to_max"] + args.overrides
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
