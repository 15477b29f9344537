"""Typed configuration for portatrain: the schema, and nothing else.

Every component owns one dataclass here; :func:`register_configs` puts them in Hydra's
ConfigStore as the schema of the YAML under ``conf/`` and ``recipes/``, so a misspelled key
is an error instead of a silent default. Each default lives here or in a ``conf/`` group file,
never both.

This module is a leaf: it imports nothing of portatrain, so every stage may import its dataclasses.
Checking a composed config as a whole is ``portatrain.validate``'s job (it asks each stage for its
problems); the allowed values of each option are defined by the stage that uses it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


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
    # (``ModelSpec.config_overrides``); a key it does not support is a config error.
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
    n_group: int | None = None
    """DeepSeek-V3: expert groups for group-limited routing."""
    topk_group: int | None = None
    """DeepSeek-V3: groups a token's experts may come from (at most ``n_group``)."""
    bias_update_rate: float | None = None
    """DeepSeek-V3: per-step change of each expert's selection bias toward even load (0 freezes it)."""
    kv_lora_rank: int | None = None
    """DeepSeek-V3: width of the key/value latent of latent attention."""
    qk_rope_head_dim: int | None = None
    """DeepSeek-V3: rotary query/key channels per head (even)."""
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
    logged as ``spike_skipped``."""


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
    """Ask torch for deterministic algorithms (slower)."""
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
class LaunchConfig:
    """The job's shape across hosts and the scheduler it is rendered for (``portatrain render|submit``).

    Outside torchrun, the parallel layout is validated against ``nodes * procs_per_node`` processes.
    """

    scheduler: str = "slurm"
    """``slurm`` (sbatch script: ``srun torchrun``), ``jobset`` (Kubernetes JobSet, TPU slices) or
    ``pytorchjob`` (Kubeflow PyTorchJob, GPU or Trainium nodes)."""
    nodes: int = 1
    """Hosts in the job."""
    procs_per_node: int = 1
    """Training processes per host, one per device: GPUs, logical NeuronCores (64 on a trn2.48xlarge)
    or TPU devices (one per chip, two per TPU7x chip)."""
    job_name: str | None = None
    """Scheduler job name; default ``portatrain-<recipe>``. Kubernetes appends a time stamp and a random
    suffix: every rendering gets a new, valid name."""
    rdzv_port: int = 29500
    """TCP port of torchrun's c10d rendezvous on the head node."""
    output: str | None = None
    """File ``render`` writes (default: stdout); ``submit`` writes ``<run_dir>/job.sbatch|job.yaml``."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run on every host before torchrun (``module load ...``, ``source venv/bin/activate``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the training processes."""
    partition: str | None = None
    """SLURM partition."""
    account: str | None = None
    """SLURM account."""
    time: str | None = None
    """SLURM time limit, e.g. ``24:00:00``."""
    image: str | None = None
    """Container image with portatrain installed (Kubernetes schedulers; required there)."""
    namespace: str = "default"
    """Kubernetes namespace."""
    tpu_accelerator: str = "tpu-v5p-slice"
    """GKE node selector ``cloud.google.com/gke-tpu-accelerator`` (jobset)."""
    tpu_topology: str = "2x2x2"
    """GKE node selector ``cloud.google.com/gke-tpu-topology`` (jobset)."""
    save_grace: int = 180
    """Seconds an interrupted job gets to save a checkpoint and stop: SLURM warns this long before the
    time limit (``--signal=B:USR1@...``), torchrun gives its workers this long after SIGTERM
    (``--shutdown-timeout``), Kubernetes' ``terminationGracePeriodSeconds`` is this + 30."""
    max_restarts: int = 3
    """Kubernetes: restarts of a failed job (JobSet ``maxRestarts``, PyTorchJob ``backoffLimit``), each
    resuming from the newest checkpoint."""
    volume_claim: str | None = None
    """Kubernetes (required): a ReadWriteMany PersistentVolumeClaim mounted on every pod; the run
    directory lives on it."""
    volume_mount: str = "/mnt/portatrain"
    """Where ``volume_claim`` is mounted; the run directory is ``<volume_mount>/runs/<recipe>/<job name>``."""
    cpu: str = "8"
    """Kubernetes: CPU request per pod (any request keeps the pod out of BestEffort, evicted first)."""
    memory: str = "32Gi"
    """Kubernetes: memory request per pod."""
    efa: int | None = None
    """EFA interfaces per pod (``vpc.amazonaws.com/efa``). Default: all 16 of a trn2.48xlarge for a
    multi-node Trainium job, none otherwise; a multi-node GPU job must set it (0: no EFA)."""


def _unset_copy(schema: type, name: str) -> type:
    """A dataclass with ``schema``'s keys, each unset (None; an open mapping empty): the old home of a
    moved section, where what a recipe or the command line set stands apart from what it did not."""
    hints = get_type_hints(schema)
    spec = [
        (f.name, hints[f.name], field(default_factory=dict))
        if get_origin(hints[f.name]) is dict
        else (f.name, hints[f.name] | None, None)
        for f in fields(schema)
    ]
    moved = make_dataclass(name, spec)
    moved.__module__ = __name__  # a pickled config names its schema classes by module
    return moved


MovedLaunchConfig = _unset_copy(LaunchConfig, "MovedLaunchConfig")
"""``parallel.launch``: the keys of :class:`LaunchConfig` where they were before they moved to ``launch``."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP replicate dimension)."""
    dp_shard: int = -1
    """FSDP shard dimension; -1 infers it from the world size."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel: row lengths must be multiples of it)."""
    ep: int = 1
    """Expert-parallel degree: a mixture of experts' experts are split over ``ep`` of the ``dp_shard``
    ranks (which must be a multiple of it), tokens reach them by all-to-all, and FSDP2 shards each
    rank's experts over the other ``dp_shard / ep`` (``portatrain.parallel.expert``)."""
    pp: int = 1
    """Pipeline-parallel degree: the model is split into stages along its blocks, on the outermost mesh
    dimension (``portatrain.parallel.pipeline``)."""
    pp_schedule: str = "1F1B"
    """A ``torch.distributed.pipelining`` schedule: ``GPipe``, ``1F1B``, ``Interleaved1F1B``,
    ``InterleavedZeroBubble`` or ``ZBVZeroBubble``."""
    pp_microbatches: int = 0
    """Micro-batches each step's batch (``data.batch_size`` rows) is split into; 0 means ``pp``."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank (interleaved and zero-bubble schedules; ``ZBVZeroBubble`` takes 2)."""
    pp_layers: list[int] | None = None
    """Blocks per stage, first stage first (``pp * pp_virtual_stages`` numbers summing to
    ``model.n_layers``); None splits them evenly, extra blocks going to the middle stages first."""
    cp: int = 1
    """Context-parallel degree: each row's positions are split over ``cp`` ranks, each holding one
    chunk from the head and one from the tail of the row (rows must be multiples of ``2 * cp``);
    keys and values are all-gathered for attention (``portatrain.parallel.context``)."""
    activation_checkpointing: str = "none"
    """``none``, ``full`` or ``selective``."""
    param_dtype: str | None = None
    """FSDP2 MixedPrecisionPolicy parameter dtype; default bf16 on accelerators, fp32 on CPU."""
    reduce_dtype: str = "float32"
    """FSDP2 gradient reduction dtype."""
    init_full_tensors: bool = True
    """Initialize each sharded parameter by drawing the full tensor on every rank and keeping the local
    shard: weights equal the 1-device run's for any layout, at the cost of one transient full
    parameter per rank (4.2 GB fp32 for Llama 70B's embedding). False draws local shards only."""
    launch: MovedLaunchConfig | None = field(
        default_factory=MovedLaunchConfig, metadata={"moved_to": "launch"}
    )
    """Deprecated: the old home of the top-level ``launch`` section. ``parallel.launch.X`` is applied as
    ``launch.X`` with a warning (``portatrain.launch.moved_keys``); it is removed in the next release."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """Apply ``torch.compile`` with the accelerator's compiler (what a graph spans: ``granularity``)."""
    granularity: str = "block"
    """``block``: one graph per transformer block (identical blocks share it; the embedding, head and
    loss stay eager); the cold start does not grow with depth; works with FSDP2, TP and every
    backend. ``model``: the whole model as one graph: 5–6% faster steps at the debug size on CPU, a
    first step that grows with depth. ``nested``: the whole model as one graph with each block
    compiled once and reused (``torch.compiler.nested_compile_region``): steps between ``block``'s and
    ``model``'s, a first step near ``block``'s; experimental in torch (``portatrain.compile``). ``model`` and ``nested``:
    one unsharded model only (no FSDP2, no TP)."""
    backend: str | None = None
    """Override the adapter's compile backend (``inductor`` on cpu/cuda, the vendor's on tpu/neuron);
    e.g. ``eager`` or ``aot_eager`` to debug dynamo without a code generator."""
    dynamic: bool | None = None
    """Dynamic shapes. Default: False where the adapter wants static shapes (tpu, neuron), else
    torch's default (static first, dynamic after a shape changes)."""
    warmup: bool = False
    """Compile every shape of ``data.loader.batch_shapes`` (one per bucket) before step 1, log the
    per-shape cold-start time, then arm the recompile guard."""
    on_recompile: str = "error"
    """After warm-up, an unexpected recompile ``error``s (stops before compiling, naming the shape and
    the failed guard) or ``warn``s (logs the same, compiles and continues)."""
    cache: bool = True
    """Keep compiled graphs for restarts of the run: inductor's FX graph and AOTAutograd caches, PyTorch's
    portable cache artifacts and the vendor compiler's cache, under ``cache_dir`` (``portatrain.compile``)."""
    cache_dir: str | None = None
    """Where the compile cache lives; default ``$PORTATRAIN_COMPILE_CACHE_DIR`` when set, else
    ``<run_dir>/compile_cache``. A shared path lets several runs (same torch version, model and
    shapes) reuse each other's compilations."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Save checkpoints (and on SIGTERM, save one at the next step boundary and stop)."""
    every: int = 0
    """Save every N steps (0: only at the end)."""
    keep: int = 3
    """Keep the last K complete checkpoints (0 keeps all)."""
    resume: str = "none"
    """``none`` (a new run; fails if the run dir already holds checkpoints), ``auto`` (the newest
    complete checkpoint in ``<run_dir>/checkpoints``, or step 0 if there is none) or the path of a
    ``step_N`` checkpoint directory."""
    final: bool = True
    """Save at the end of training."""
    restore_data: bool = True
    """On resume, continue the saved data order exactly. ``false`` starts a fresh data order
    (epoch 0), e.g. after changing ``data.batch_size * data-parallel ranks``."""
    async_mode: str = "none"
    """``none`` (the loop waits for the whole save), ``thread`` or ``process``: the loop waits only
    while the state is copied to host memory, and DCP writes the copy from a background thread (or
    from a process of its own); the checkpoint is renamed in when every rank has written it."""


@dataclass
class FaultToleranceConfig:
    """Fault tolerance without restarts (``portatrain.fault_tolerance``, on torchft): the replicate axis
    becomes ``group_size`` replica groups, each its own job; a failed group is replaced while the others
    keep training, and the replacement takes a healthy group's state."""

    enabled: bool = False
    """Run this job as replica group ``replica_id`` of ``group_size``: FSDP2 (``parallel.dp_shard``) inside
    the group, gradients averaged across the groups through torchft's Manager (a quorum each step, the
    optimizer stepped only when the step commits). ``parallel.dp_replicate`` must stay 1."""
    lighthouse: str | None = None
    """Address of torchft's lighthouse (``http://host:29510``, started by ``portatrain lighthouse``); None
    reads ``$TORCHFT_LIGHTHOUSE``."""
    replica_id: int = 0
    """This job's replica group, 0 .. ``group_size - 1``: it names the group and picks its slice of
    the global batch."""
    group_size: int = 1
    """Replica groups of the run (each reads ``1 / group_size`` of the global batch)."""
    min_replicas: int = 1
    """Replica groups a step needs to commit; fewer and the step is retried (1: one survivor trains on)."""
    timeout_s: float = 60.0
    """Seconds a cross-group collective, a commit vote or a state transfer may take before the step fails."""
    quorum_timeout_s: float = 120.0
    """Seconds to wait for a quorum of replica groups (longer than a step)."""


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
class MetricsConfig:
    jsonl: bool = True
    """Append every log record to ``<run_dir>/metrics.jsonl``."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to ``<run_dir>/tensorboard`` (needs the ``tensorboard`` package)."""
    wandb: bool = False
    """Also log to Weights & Biases (rank 0; needs the ``wandb`` package): offline, into
    ``<run_dir>/wandb`` for ``wandb sync`` later, unless ``WANDB_MODE=online``. The run's id is kept
    in ``<run_dir>/trackers.json``, so a resumed run continues the same W&B run."""
    mlflow: str | None = None
    """Also log to MLflow at this tracking URI (rank 0; needs the ``mlflow`` package):
    ``http://HOST:PORT`` for a tracking server, ``sqlite:///ABS/mlflow.db`` for a local store (MLflow
    3's file store, ``file://``, refuses new runs). A resumed run continues the same MLflow run."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one device for MFU, overriding the accelerator adapter's datasheet table
    (or, on CPU, its measured matmul peak). Set it for hardware the table does not know."""


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Record a ``torch.profiler`` trace of a window of steps into ``<run_dir>/profile/`` (every rank)."""
    start_step: int = 5
    """First profiled optimizer step (1-based); leave compilation and allocator warm-up before it."""
    steps: int = 3
    """Number of consecutive steps profiled."""
    record_shapes: bool = True
    """Record operator input shapes."""
    profile_memory: bool = False
    """Track tensor allocations (slower; shows the memory timeline)."""
    with_stack: bool = False
    """Record Python stacks of each op (much larger traces)."""


@dataclass
class BenchConfig:
    warmup_steps: int = 10
    """Steps after the first (cold-start) step that run but are not measured."""
    steps: int = 100
    """Steady-state steps measured after the warm-up."""
    price_per_hour: float | None = None
    """Hourly price (USD) of all the hardware the job runs on, for the cost per million tokens."""


@dataclass
class RuntimeAuditConfig:
    """The ``audit`` section: what a training run watches about itself (``portatrain.audit.runtime``).

    Named apart from ``portatrain.audit.AuditConfig``, the static scan's per-project file config.
    """

    runtime: bool = False
    """Write, with every logged step, the host syncs, CPU fallbacks and mixed-device ops of the steps
    since the previous log (the sim device's counters, or the vendor's fallback report through the
    accelerator adapter where one exists; null where none does) and the graph breaks and recompiles."""
    nonfinite: bool = False
    """Debugging mode: check every module's output (and each gradient) and stop at the first NaN/inf,
    naming the module, the tensor and the step. Syncs once per module; needs ``compile.enabled=false``."""


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


@dataclass
class Config:
    recipe: str = MISSING
    """Name of the recipe this config came from (set by the recipe file)."""
    run_dir: str | None = None
    """Where the resolved config, metrics and checkpoints go (written once per job, by rank 0).
    Default: Hydra's run directory, ``runs/<recipe>/<run id>``."""
    dry_run: bool = False
    """Build the model on meta, print parameter count and memory estimate, and exit."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Job shape and scheduler settings (``portatrain render|submit``; see :class:`LaunchConfig`)."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    audit: RuntimeAuditConfig = field(default_factory=RuntimeAuditConfig)
    report: ReportConfig = field(default_factory=ReportConfig)


def run_id() -> str:
    """A run name every rank of one job agrees on.

    ``PORTATRAIN_RUN_ID`` if set, else torchrun's rendezvous id (shared by all ranks and kept
    across elastic restarts, so ``checkpoint.resume=auto`` finds the same directory), else a
    timestamp for a single process. Never a per-rank ``${now:}``.
    """
    rid = os.environ.get("PORTATRAIN_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return rid
    if "RANK" in os.environ:  # distributed without a rendezvous id: one fixed name for all ranks
        return "job"
    return _STARTED_AT


_STARTED_AT = time.strftime("%Y%m%d-%H%M%S")


def default_run_dir(run_dir: str | None, recipe: str) -> str:
    """Hydra's run directory: ``run_dir`` when given (so Hydra creates no second folder), else
    ``runs/<recipe>/<run id>``."""
    return run_dir if run_dir else f"runs/{recipe}/{run_id()}"


def register_configs() -> None:
    """Register the typed schema as ``base_config`` and the ``portatrain_run_id`` resolver."""
    if not OmegaConf.has_resolver("portatrain_run_id"):
        OmegaConf.register_new_resolver("portatrain_run_id", run_id)
    if not OmegaConf.has_resolver("portatrain_run_dir"):
        OmegaConf.register_new_resolver("portatrain_run_dir", default_run_dir)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
