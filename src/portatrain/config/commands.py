"""The sections of the commands beside training: export, eval, generate, prepare, bench and report
(re-exported by ``portatrain.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ExportConfig:
    """``portatrain export checkpoint=PATH|auto out=DIR``: a checkpoint -> a Hugging Face model directory."""

    checkpoint: str = "auto"
    """A ``step_N`` checkpoint directory, or ``auto``: the newest complete one under ``run_dir``."""
    out: str | None = None
    """Directory to write (must not exist yet): ``config.json``, safetensors shards and their index."""
    max_shard_size: str = "5GB"
    """Largest safetensors file, as ``5GB``, ``500MB``, ``2GiB`` or a number of bytes."""
    dtype: str = "float32"
    """Dtype of the exported weights: ``float32`` (as trained, lossless) or ``bfloat16``."""
    merge_lora: bool = False
    """A LoRA checkpoint: write the base with the adapters merged in (a plain model), instead of the
    base model plus its adapters in PEFT's format under ``out/adapter``."""


@dataclass
class EvalConfig:
    """``portatrain eval checkpoint=PATH|auto tasks=[...]``: lm-evaluation-harness tasks on a checkpoint
    (``portatrain.evaluation``). The task settings also serve ``trainer.eval_tasks``."""

    checkpoint: str = "auto"
    """A ``step_N`` checkpoint directory, a run directory (its newest), or ``auto``: the newest under ``run_dir``."""
    tasks: Any = field(default_factory=list)
    """lm-eval task, group or tag names: ``[a,b]``, ``a`` or ``'a,b'``."""
    include_path: list[str] = field(default_factory=list)
    """Folders of local task YAML files (their data a local jsonl: nothing is downloaded)."""
    limit: float | None = None
    """Documents per task: a count, or a fraction below 1; null: all."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; null: each task's own."""
    batch_size: int = 8
    """Requests per forward."""
    max_gen_toks: int = 256
    """Tokens a generation may add when its task sets no ``max_gen_toks``."""
    bootstrap_iters: int = 100000
    """Resamples for the standard errors of metrics without a closed form (0: none; training uses 0)."""
    out: str | None = None
    """Also write lm-eval's results as JSON to this file."""


@dataclass
class GenerateConfig:
    """``portatrain generate checkpoint=PATH|auto prompt=TEXT``: text from a checkpoint's model, greedy or
    sampled, with a static-shape KV cache (``portatrain.generate``)."""

    checkpoint: str = "auto"
    """A ``step_N`` checkpoint directory, a run directory (its newest), or ``auto``: the newest under ``run_dir``."""
    prompt: str = ""
    """The text to continue (encoded with the checkpoint's tokenizer, BOS first when it has one)."""
    max_new_tokens: int = 64
    """Tokens to generate at most (fewer when EOS comes first); prompt + these must fit ``max_seq_len``."""
    temperature: float = 0.0
    """0: greedy (the most likely token); above 0: sample from ``softmax(logits / temperature)``."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens only; 0: all."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to ``top_p`` (nucleus); 1: all."""
    seed: int = 0
    """Seed of the sampling generator: the same seed, checkpoint and device give the same text."""
    bucket: int = 256
    """The KV cache spans prompt + ``max_new_tokens`` positions rounded up to a multiple of this (at
    most ``max_seq_len``): every prompt in a bucket shares one compiled decode step."""


@dataclass
class PrepareConfig:
    """``portatrain prepare out=DIR``: tokenize ``data.dataset`` (or ``data.mix``) into memory-mapped shards."""

    out: str | None = None
    """Directory to write (new, or an interrupted prepare of the same settings, which resumes)."""
    workers: int = 0
    """Tokenizer processes; 0 uses every core."""
    shard_chars: int = 64_000_000
    """Characters of text per shard (about 16M tokens with a Llama 3 tokenizer)."""
    verify: bool = False
    """Re-read every shard and check its sha256 against the manifest afterwards."""


@dataclass
class BenchConfig:
    warmup_steps: int = 10
    """Steps after the first (cold-start) step that run but are not measured."""
    steps: int = 100
    """Steady-state steps measured after the warm-up."""
    price_per_hour: float | None = None
    """Hourly price (USD) of all the hardware the job runs on, for the cost per million tokens."""


@dataclass
class ReportConfig:
    """``portatrain report recipe=... device=...``: the six-level portability checklist, from evidence."""

    out: str | None = None
    """Also write the report here: ``FILE.md`` (JSON beside it), ``FILE.json`` or a directory."""
    paths: list[str] = field(default_factory=list)
    """Extra files or folders to audit statically (e.g. the CUDA-first script being ported)."""
    steps: int = 6
    """Optimizer steps of the runtime-audit run (logged twice: every ``steps // 2``)."""
    bench_warmup_steps: int = 2
    """Bench steps after the cold-start step that are not measured."""
    bench_steps: int = 4
    """Bench steps measured for steady state (raise it for a stable median)."""
    parity: bool = True
    """Run ``portatrain parity`` for numerical correctness when that command is available."""
    max_cold_start_s: float | None = 120.0
    """Cold start (to the end of step 1) that passes; None: no verdict."""
    min_tokens_per_s: float | None = None
    """Steady-state tokens/s (all devices) that passes, e.g. the SLA; None: no verdict."""
    min_mfu: float | None = None
    """Steady-state MFU (0-1) that passes; None: no verdict."""
    max_cost_per_million_tokens: float | None = None
    """USD per million tokens that passes (e.g. the NVIDIA baseline's); needs ``bench.price_per_hour``."""
