"""The sections of what trains: the device, the model, the data, the optimizer, fine-tuning, the loop,
kernel overrides and low-precision matmuls (re-exported by ``portatrain.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class DeviceConfig:
    type: str = "auto"
    """Accelerator to run on: ``auto`` (tpu -> neuron -> cuda -> cpu), ``cpu``, ``cuda``, ``tpu``, ``neuron``, ``mps``."""
    index: int | None = None
    """Requested device index; default is ``LOCAL_RANK`` under torchrun, else 0. Adapters whose
    runtime binds each process to its own device override it (TPU: every worker drives ``tpu:0``;
    Neuron: ``neuron:0`` when the process sees one core)."""
    memory_gib: float | None = None
    """Memory of one device in GiB (e.g. 95 for a TPU v5p chip, 24 for a Trainium2 logical
    NeuronCore), for the dry run's verdict on whether the estimate fits; None: no verdict."""


@dataclass
class ModelConfig:
    name: str = "llama3"
    """Model family: a key of the registry ``portatrain.models.SPECS`` (``llama3``, ...)."""
    flavor: str = "debug"
    """Named size within the family (Llama 3: ``debug``, ``1b``, ``3b``, ``8b``, ``70b``)."""
    vocab_size: int | None = None
    """Override the flavour's vocabulary size (the byte tokenizer needs 258)."""
    max_seq_len: int | None = None
    """Override the flavour's RoPE table length."""
    # Custom sizes: None keeps the flavour's value. A family maps each key onto its arguments
    # (``ModelSpec.config_overrides``); a key it does not support is a config error. The keys of one
    # family only (DeepSeek-V3's latent attention and group routing) are declared in its folder
    # (``ModelSpec.options``) and join this section's schema (``portatrain.models.ModelSchema``).
    dim: int | None = None
    """Hidden size."""
    n_layers: int | None = None
    """Transformer blocks."""
    n_heads: int | None = None
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int | None = None
    """SwiGLU hidden width (HF ``intermediate_size``)."""
    head_dim: int | None = None
    """Width of one attention head, for families where it is not ``dim / n_heads`` (Qwen 3)."""
    rope_theta: float | None = None
    """RoPE base period."""
    norm_eps: float | None = None
    """RMSNorm epsilon."""
    tie_embeddings: bool | None = None
    """Share the embedding matrix with the output projection."""
    n_experts: int | None = None
    """Mixture-of-experts families: routed experts per sparse block."""
    top_k: int | None = None
    """Mixture-of-experts families: experts each token is routed to."""
    moe_ffn_dim: int | None = None
    """Mixture-of-experts families: each expert's SwiGLU width."""
    moe_dispatch: str = "auto"
    """Mixture-of-experts families: ``dropless`` (every token reaches its experts; shapes vary with
    the routing), ``capacity`` (a fixed number of slots per expert, overflow dropped and counted;
    static shapes, no host sync) or ``auto``: ``capacity`` where the device's compiler wants static
    shapes (tpu, neuron, sim impersonating them), ``dropless`` elsewhere."""
    capacity_factor: float = 1.25
    """``capacity`` dispatch: slots per expert = ``capacity_factor * tokens * top_k / n_experts``."""
    init_from: str | None = None
    """Local Hugging Face Llama directory (``config.json`` + safetensors) to initialize the weights
    from; each rank reads only its slices. Ignored when resuming from a checkpoint."""
    init_std: float = 0.02
    """Standard deviation of the truncated-normal weight init."""


@dataclass
class MixEntry:
    dataset: str = MISSING
    """A ``data.dataset`` source (not a prepared corpus)."""
    weight: float = 1.0
    """Share of the mix, relative to the other entries' weights."""


@dataclass
class DataConfig:
    dataset: str = "builtin"
    """``builtin`` (the bundled generated corpus); a corpus written by ``portatrain prepare`` (streamed
    from memory maps); or, read whole into memory, a local ``.jsonl``/``.json``/``.parquet``/``.arrow``/
    ``.txt`` file, a directory or glob of them, or ``hf:NAME?split=train`` (Hugging Face ``datasets``)."""
    tokenizer: str = "byte"
    """``byte`` (no download) or a Hugging Face tokenizer directory (``tokenizer.json`` + config)."""
    text_field: str = "text"
    """Record field holding the text (``data.format=text``)."""
    format: str = "text"
    """``text`` (pre-training), ``prompt_response`` (``prompt``/``response`` fields, loss on the
    response only) or ``chat`` (``messages``, rendered with the tokenizer's chat template)."""
    mix: list[MixEntry] = field(default_factory=list)
    """Several datasets mixed by weight (replaces ``dataset``), deterministic under ``trainer.seed``."""
    packing_attention: str = "document"
    """``collator=packing``: ``document`` (block-diagonal mask, positions restart per document) or
    ``causal`` (no mask, documents separated by EOS only: SDPA's fused causal path)."""
    prefetch: int = 2
    """Batches a prepared corpus's loader builds ahead on a background thread (0: none)."""
    seq_len: int = 256
    """Row length for ``packing`` and ``pad_to_max``."""
    batch_size: int = 8
    """Micro-batch size per rank (rows per step per rank, before gradient accumulation)."""
    collator: str = "packing"
    """``packing`` (documents packed into fixed rows, document-aware masks), ``bucket`` (pad to the
    smallest fitting bucket) or ``pad_to_max`` (pad every batch to ``seq_len``)."""
    buckets: list[int] = field(default_factory=lambda: [64, 128, 256])
    """Sequence-length buckets for ``collator=bucket``, ascending."""
    overlong: str = "split"
    """What to do with a document longer than the largest bucket/``seq_len``: ``truncate``, ``split``, ``error``."""
    last_batch: str = "drop"
    """Last partial batch: ``drop`` it or ``pad`` it with fully-masked rows to the static batch size."""
    sampler: str = "length_grouped"
    """``length_grouped`` (shuffled, grouped by length to cut padding), ``random`` or ``sequential``."""
    group_size_multiplier: int = 50
    """Length-grouped sampler: sort windows of ``batch_size * multiplier`` documents by length."""
    num_workers: int = 0
    """DataLoader worker processes (in-memory sources; a prepared corpus uses ``prefetch``)."""
    eval_fraction: float = 0.05
    """Fraction of documents held out for evaluation."""
    num_documents: int = 4000
    """Number of documents the built-in corpus generates."""


@dataclass
class MuonConfig:
    """``optim.name=muon``: Muon on the blocks' matrices, AdamW (``optim.lr``, ``betas``, ``eps``,
    ``weight_decay``) on the rest; the values follow ``torch.optim.Muon`` (see ``portatrain.optim.muon``)."""

    lr: float | None = None
    """Peak LR of the Muon matrices; default ``optim.lr`` (with ``adjust_lr=match_rms_adamw`` the
    update's RMS is AdamW's, so AdamW's LR carries over: Moonlight, https://arxiv.org/abs/2502.16982)."""
    weight_decay: float | None = None
    """Decoupled weight decay of the Muon matrices; default ``optim.weight_decay``."""
    momentum: float = 0.95
    """Momentum of the gradient average that is orthogonalized, in [0, 1)."""
    nesterov: bool = True
    """Orthogonalize Nesterov's look-ahead ``g + momentum * (buffer - g)`` instead of the buffer."""
    ns_steps: int = 5
    """Newton-Schulz iterations, 1 to 99."""
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    """The quintic's ``(a, b, c)``: Keller Jordan's, https://kellerjordan.github.io/posts/muon/."""
    ns_eps: float = 1e-7
    """Floor of the norm the update is divided by before Newton-Schulz."""
    ns_dtype: str = "bfloat16"
    """Precision of Newton-Schulz (and of the gather of sharded matrices): ``bfloat16`` as
    ``torch.optim.Muon`` (fast on GPUs), or ``float32`` (on a CPU without bf16 matmul units about 6x
    faster; layouts then agree with one process to fp32's rounding, not bf16's)."""
    adjust_lr: str = "match_rms_adamw"
    """LR scale per matrix of ``rows x cols``: ``match_rms_adamw`` (``0.2 * sqrt(max(rows, cols))``)
    or ``original`` (``sqrt(max(1, rows / cols))``, for a Muon-tuned ``lr`` such as 0.02)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """``adamw``, or ``muon`` (AdamW on embeddings, head, norms, biases and routers; see ``muon``)."""
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    """Linear warm-up from 0 to ``lr``."""
    decay: str = "cosine"
    """Decay after warm-up: ``cosine``, ``linear`` or ``constant``."""
    min_lr_ratio: float = 0.1
    """Floor of the decay as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    fused: bool | None = None
    """Use the fused AdamW kernel; default: the accelerator adapter decides."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon's settings (used when ``name=muon``)."""
    qk_clip: float | None = None
    """QK-clip's threshold tau (MuonClip, Kimi K2 report https://arxiv.org/abs/2507.20534, section 2.1:
    tau = 100 there): after each step, the query/key projections of every head whose largest attention
    logit of the step passed tau are scaled so that it is tau; null or 0: off. Any ``name``; see
    ``portatrain.models.common.qk_clip``."""


@dataclass
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021, https://arxiv.org/abs/2106.09685): ``W x + (alpha / rank) B A x``."""

    rank: int = 8
    """Rank ``r`` of each adapter (``A`` is ``[r, in]``, ``B`` is ``[out, r]``)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linear layers to adapt, by name pattern (``fnmatch``) on the module path, e.g. ``layers.0.self_attn.q_proj``:
    a pattern without a dot matches the last name (``q_proj``), one with dots the whole path
    (``layers.*.mlp.*``). A mixture of experts' routed experts are never matched by these names; its
    router (``mlp.gate``) and shared experts (``mlp.shared_experts.*``) only when named."""


@dataclass
class DpoConfig:
    """Direct preference optimization (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290)."""

    beta: float = 0.1
    """Strength of the KL penalty toward the reference model (the DPO temperature)."""
    lora: bool = False
    """Train LoRA adapters (``finetune.lora``) instead of every weight; the reference is then the base
    model with the adapters switched off."""


@dataclass
class FinetuneConfig:
    method: str = "full"
    """``full`` (every weight trains), ``lora`` (only low-rank adapters train; the base is frozen and
    has no optimizer state) or ``dpo`` (preference pairs, ``prompt``/``chosen``/``rejected`` records)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)


@dataclass
class SpikeGuardConfig:
    """The loss-spike guard (``portatrain.train.spike``): off with ``window=0``."""

    window: int = 0
    """Applied steps whose global loss the guard remembers; a step is judged once the window is full."""
    factor: float = 3.0
    """A step whose loss exceeds ``factor`` x the window's median is a spike."""
    action: str = "skip"
    """``skip``: the spike's step is not applied (no update, in lockstep on every rank), counted and
    logged as ``spike_skipped``. ``rewind``: the run goes back to its newest checkpoint and skips the
    batches from there to the spike (``spike_rewinds``; needs ``checkpoint.every``)."""


@dataclass
class TrainerConfig:
    steps: int = 300
    """Optimizer steps to train for."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    eval_every: int = 100
    """Evaluate every N steps (0 disables); also at the end."""
    eval_batches: int = 8
    log_every: int = 10
    seed: int = 1234
    deterministic: bool = False
    """Deterministic kernels (slower): two runs of one config on one device give bitwise-identical
    losses; where the device or the compiler cannot promise it, one warning line says so."""
    dtype: str = "auto"
    """Compute precision: ``auto`` (the accelerator's default: bf16 on accelerators, fp32 on CPU),
    ``float32`` or ``bfloat16``."""
    progress: bool = True
    """Show progress (rank 0 only): a live bar on a terminal, one log line per ``log_every`` steps
    when stderr is a file or pipe (SLURM output, CI)."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: ``stop`` (raise before anything non-finite is
    saved; exit 2) or ``skip_step`` (leave weights and optimizer state as they were, count and log it)."""
    spike_guard: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)
    """Skip steps whose loss spikes (see :class:`SpikeGuardConfig`)."""
    loss: str = "plain"
    """Next-token loss: ``plain`` (cross-entropy over the model's full logits, through the
    ``compute_loss`` hook) or ``chunked`` (``portatrain.losses``: the output projection and the loss
    taken ``loss_chunk_size`` positions at a time, never the full ``[B, S, vocab]`` logits; used only
    when ``compute_loss`` is not overridden)."""
    loss_chunk_size: int = 1024
    """Positions per chunk of ``trainer.loss=chunked`` (peak extra memory ~ 2 x chunk x vocab x 4 bytes)."""
    eval_tasks: Any = field(default_factory=list)
    """lm-evaluation-harness tasks run during training (``[a,b]``, ``a`` or ``'a,b'``; empty: none),
    with the ``eval`` section's settings; their metrics are logged as ``eval/<task>/<metric>``."""
    eval_tasks_every: int = 0
    """Run ``eval_tasks`` every N steps and at the end; 0: at ``trainer.eval_every``'s interval."""


@dataclass
class KernelsConfig:
    enabled: list[str] = field(default_factory=list)
    """Kernel overrides to apply, by name (opt-in)."""


@dataclass
class QuantizeConfig:
    """Low-precision matmuls through torchao (``portatrain.converters.quantize``): the chosen linear
    layers multiply in FP8 or MXFP8; weights, gradients, optimizer state and checkpoints keep their
    precision."""

    linear: str = "none"
    """``none``; ``float8_tensorwise`` (one scale per tensor; with FSDP2 the weights are all-gathered in
    FP8); ``float8_rowwise`` (a scale per row: closer to bf16); ``mxfp8`` (a scale per 32 elements)."""
    skip_last_blocks: int = 0
    """Keep the last N transformer blocks' linear layers in high precision (the output head always is)."""
    fsdp_float8_all_gather: bool = True
    """``float8_tensorwise`` with FSDP2: all-gather each weight cast to FP8 (half bf16's bytes), its
    scale computed for every weight in one all-reduce after each optimizer step."""
