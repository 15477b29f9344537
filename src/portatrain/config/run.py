"""The sections of how a run goes: the job's launch, the parallel layout, compilation, checkpoints,
fault tolerance, and what watches the run (metrics, profiler, runtime audit); re-exported by
``portatrain.config``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import get_origin, get_type_hints


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
    """Seconds to wait for a quorum of replica groups (longer than a step), and to retry steps that do
    not commit (fewer than ``min_replicas`` groups left) before the group stops with one line."""


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
