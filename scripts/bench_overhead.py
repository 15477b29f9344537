"""Framework overhead: portatrain's Trainer against a bare, hand-written PyTorch loop.

Both sides train the same model (same class, same init), on the same batches (portatrain's
loader over the same documents and seed), with the same optimizer (AdamW, same parameter groups,
fused as the CPU adapter chooses), schedule (linear warm-up + cosine), gradient clipping and loss.
The bare loop is what one writes by hand: next batch, forward, loss, backward, clip, step. The
difference is portatrain's per-step work: the Trainer's hooks, host-side token and FLOP counts,
the compile monitor, the progress bar and, every ``trainer.log_every`` steps, a synchronize, an
all-reduce, memory statistics and a JSONL line.

Method, built for a noisy shared machine: one process, runners in lockstep. The Trainer's
``fit()`` runs unmodified; its ``on_step_end`` hook (the documented extension point) runs one step
of every other runner, alternating their order. So steps alternate T, A, B, T, B, A, ... and a
burst of load from another process hits all runners alike. A Trainer step is timed from the end of
the hook to the next hook (everything ``fit()`` does per step, logging included); a loop step from
its start to its end (data loading included). The first ``--warmup`` steps (compilation) are
dropped. Reported per runner: the median step time, tokens/s as mean real tokens per step over
that median (every runner sees the same batches in the same order), the ratio of tokens/s to the
baseline's, and the same ratio per chunk of ``--chunk`` consecutive steps as the spread. With both
modes, each run also carries the other mode's bare loop, so compiled vs eager is measured side by
side as well (the Trainer's through the eager bare loop both runs share).

    OMP_NUM_THREADS=1 python scripts/bench_overhead.py               # eager and compiled
    OMP_NUM_THREADS=1 python scripts/bench_overhead.py --modes eager --steps 40

``bench_hf.py`` reuses the helpers here.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, open_dict

from portatrain.cli import config_dir
from portatrain.config import register_configs
from portatrain.data.collate import with_attention_mask
from portatrain.data.documents import load_documents
from portatrain.data.loader import build_dataloader
from portatrain.data.tokenizer import build_tokenizer
from portatrain.models import ModelSchema, build_model
from portatrain.trainer import Trainer

BASE_OVERRIDES = [
    "recipe=debug",
    "device=cpu",
    "data.batch_size=8",
    "data.seq_len=256",
    "trainer.steps=100000",  # the LR schedule's length; fit() is stopped long before (see run_lockstep)
    "trainer.eval_every=0",
    "trainer.log_every=5",  # more often than the recipe's 10: the pessimistic case for portatrain
    "trainer.progress=false",
    "checkpoint.enabled=false",
]
TRAINER = "portatrain Trainer"

Step = tuple[float, int]  # (seconds, real tokens)


def compose(overrides: list[str], run_dir: Path) -> DictConfig:
    """The config exactly as ``portatrain`` composes it from the command line."""
    register_configs(ModelSchema)
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = hydra_compose("config", overrides=overrides)
    with open_dict(cfg):
        cfg.run_dir = str(run_dir)
    return cfg


# ---------------------------------------------------------------------------------------------
# The bare loop
# ---------------------------------------------------------------------------------------------
def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine to ``min_ratio`` (written out again on purpose: a bare loop)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LoopRunner:
    """A hand-written training loop around ``model``; ``forward(model, batch)`` returns logits."""

    def __init__(
        self,
        cfg: DictConfig,
        model: torch.nn.Module,
        forward: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    ) -> None:
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        documents, _ = load_documents(
            cfg.data.dataset,
            tokenizer,
            num_documents=cfg.data.num_documents,
            eval_fraction=cfg.data.eval_fraction,
            seed=cfg.trainer.seed,
        )
        self.batches = iter(
            build_dataloader(cfg.data, documents, pad_id=tokenizer.pad_id, seed=cfg.trainer.seed)
        )
        self.model, self.forward = model.train(), forward
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            fused=True,  # what portatrain's CPU adapter picks
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, o.warmup_steps, cfg.trainer.steps, o.min_lr_ratio)
        )
        self.grad_clip = o.grad_clip

    def step(self) -> int:
        batch = next(self.batches)
        labels = batch["labels"]
        num_tokens = int((labels != -100).sum())
        logits = self.forward(self.model, batch)
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        (loss / num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return num_tokens


def portatrain_model(cfg: DictConfig) -> torch.nn.Module:
    """portatrain's Llama for ``cfg``, initialized as the Trainer does (same seed, same init)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device="cpu")
    torch.manual_seed(cfg.trainer.seed)
    with torch.no_grad():
        model.init_weights(cfg.model.init_std)
    return model


def portatrain_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = with_attention_mask(batch)  # packed rows: the mask from document_ids, as the Trainer does
    return model(batch["input_ids"], positions=batch.get("positions"), attn_mask=batch.get("attn_mask"))


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """What the Trainer's ``compile.enabled=true`` does on CPU: inductor, each block in place."""
    for block in model.layers.values():
        block.compile(backend="inductor", fullgraph=True)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


# ---------------------------------------------------------------------------------------------
# Lockstep measurement
# ---------------------------------------------------------------------------------------------
def run_lockstep(
    cfg: DictConfig, loops: dict[str, LoopRunner], *, steps: int, warmup: int, trainer_name: str = TRAINER
) -> dict[str, list[Step]]:
    """Run the Trainer for ``warmup + steps`` steps, one step of every loop after each of its own.

    Returns the measured steps of every runner (the Trainer's under ``trainer_name``).
    """
    times: dict[str, list[Step]] = {trainer_name: [], **{name: [] for name in loops}}
    names = list(loops)

    class Lockstep(Trainer):
        resumed = time.perf_counter()

        def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
            self.accelerator.synchronize()
            times[trainer_name].append((time.perf_counter() - self.resumed, metrics["tokens"]))
            for name in names if step % 2 else reversed(names):
                start = time.perf_counter()
                tokens = loops[name].step()
                self.accelerator.synchronize()
                times[name].append((time.perf_counter() - start, tokens))
            self.resumed = time.perf_counter()

    with open_dict(cfg):
        cfg.trainer.steps = warmup + steps
    trainer = Lockstep(cfg)
    if cfg.compile.enabled and not is_compiled(trainer.model):
        raise SystemExit("compile.enabled=true left the Trainer's model uncompiled; nothing to compare")
    start = time.perf_counter()
    trainer.fit()
    trainer.close()
    print(f"  {warmup + steps} lockstep steps in {time.perf_counter() - start:.0f} s", flush=True)
    return {name: steps_[warmup:] for name, steps_ in times.items()}


def rate(steps: list[Step]) -> float:
    """Real tokens per second: mean tokens per step over the median step time.

    Every runner sees the same batches in the same order, so the mean token count is common to all
    and the ratio of two rates is the inverse ratio of their median step times -- robust to bursts
    of load, and right even when real tokens per step vary (padded batches: fixed compute, varying
    tokens).
    """
    return statistics.fmean(tokens for _, tokens in steps) / statistics.median(
        seconds for seconds, _ in steps
    )


def print_table(title: str, times: dict[str, list[Step]], baseline: str, chunk: int) -> dict[str, float]:
    """Per runner: median step rate and time, rate ratio to ``baseline``, per-chunk ratios as the spread."""
    print(f"\n{title}")
    print(
        f"  {'runner':<40} {'tokens/s':>10} {'step ms (median)':>17} {'ratio':>7}"
        f"  ratio per {chunk}-step chunk"
    )
    base = rate(times[baseline])
    rates = {}
    for name, steps in times.items():
        rates[name] = rate(steps)
        step_ms = 1e3 * statistics.median(seconds for seconds, _ in steps)
        chunks = [
            rate(steps[i : i + chunk]) / rate(times[baseline][i : i + chunk])
            for i in range(0, len(steps), chunk)
        ]
        print(
            f"  {name:<40} {rates[name]:>10,.0f} {step_ms:>17.2f} {rates[name] / base:>7.3f}  "
            + " ".join(f"{x:.2f}" for x in chunks)
        )
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per runner")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped first (compilation)")
    parser.add_argument("--chunk", type=int, default=10, help="steps per chunk in the spread column")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model.flavor=debug")
    args = parser.parse_args()
    overrides = BASE_OVERRIDES + args.overrides
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; overrides: {overrides}")
    both = len(set(args.modes)) == 2
    rates: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            cfg = compose(overrides + [f"compile.enabled={mode == 'compiled'}"], Path(tmp) / mode)
            # With both modes, each phase also runs the other mode's bare loop: compiled vs eager is
            # then measured side by side too, not across phases that saw different machine load.
            loops = {
                f"bare loop, {m}": LoopRunner(
                    cfg,
                    compile_blocks(portatrain_model(cfg)) if m == "compiled" else portatrain_model(cfg),
                    portatrain_forward,
                )
                for m in ([mode, "eager" if mode == "compiled" else "compiled"] if both else [mode])
            }
            print(f"\n[{mode}] batch {cfg.data.batch_size} x {cfg.data.seq_len}, model {cfg.model.flavor}")
            times = run_lockstep(
                cfg, loops, steps=args.steps, warmup=args.warmup, trainer_name=f"{TRAINER}, {mode}"
            )
            rates[mode] = print_table(f"[{mode}] framework overhead", times, f"bare loop, {mode}", args.chunk)
    print("\nsummary (tokens/s ratios, each from one lockstep run):")
    for mode, r in rates.items():
        print(
            f"  {mode:<9} portatrain Trainer / bare loop = {r[f'{TRAINER}, {mode}'] / r[f'bare loop, {mode}']:.3f}"
        )
    if both:
        e, c = rates["eager"], rates["compiled"]
        print(
            "  compiled / eager, bare loop = "
            f"{c['bare loop, compiled'] / c['bare loop, eager']:.3f} (compiled run), "
            f"{e['bare loop, compiled'] / e['bare loop, eager']:.3f} (eager run)"
        )
        # The Trainer runs in one mode per run; chain through the eager bare loop both runs share.
        trainer = (c[f"{TRAINER}, compiled"] / c["bare loop, eager"]) / (
            e[f"{TRAINER}, eager"] / e["bare loop, eager"]
        )
        print(
            f"  compiled / eager, portatrain Trainer = {trainer:.3f} (via the eager bare loop in both runs)"
        )


if __name__ == "__main__":
    main()
