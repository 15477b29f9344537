"""Typed configuration for portatrain: the schema, and nothing else.

Every component owns one dataclass, in the section module of its kind (``training.py``: the device,
model, data, optimizer, fine-tuning, loop, kernels and quantization; ``run.py``: launch, parallel
layout, compile, checkpoints, fault tolerance, metrics, profiler, runtime audit; ``commands.py``:
export, eval, generate, prepare, bench, report), all re-exported here; :class:`Config` gathers them
and :func:`register_configs` puts it in Hydra's ConfigStore as the schema of the YAML under ``conf/``
and ``recipes/``, so a misspelled key is an error instead of a silent default. Each default lives
here or in a ``conf/`` group file, never both. A model family's own ``model.*`` keys live in its
folder (``ModelSpec.options``) and join the schema through :func:`register_configs`.

This package is a leaf: it imports nothing else of portatrain, so every stage may import its
dataclasses. Checking a composed config as a whole is ``portatrain.validate``'s job (it asks each
stage for its problems); the allowed values of each option are defined by the stage that uses it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from portatrain.config.commands import (
    BenchConfig,
    EvalConfig,
    ExportConfig,
    GenerateConfig,
    PrepareConfig,
    ReportConfig,
)
from portatrain.config.run import (
    CheckpointConfig,
    CompileConfig,
    FaultToleranceConfig,
    LaunchConfig,
    MetricsConfig,
    MovedLaunchConfig,
    ParallelConfig,
    ProfileConfig,
    RuntimeAuditConfig,
)
from portatrain.config.training import (
    DataConfig,
    DeviceConfig,
    DpoConfig,
    FinetuneConfig,
    KernelsConfig,
    LoraConfig,
    MixEntry,
    ModelConfig,
    MuonConfig,
    OptimConfig,
    QuantizeConfig,
    SpikeGuardConfig,
    TrainerConfig,
)


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


def register_configs(model_schema: type[ModelConfig] = ModelConfig) -> None:
    """Register the typed schema as ``base_config`` and the ``portatrain_run_id`` resolver.

    ``model_schema`` types the ``model`` section: ``portatrain.models.ModelSchema``, the shared keys of
    :class:`ModelConfig` and every family's own (each family's folder declares them; this leaf
    module cannot import the families). The plain :class:`ModelConfig` leaves the families' keys out.
    """
    if not OmegaConf.has_resolver("portatrain_run_id"):
        OmegaConf.register_new_resolver("portatrain_run_id", run_id)
    if not OmegaConf.has_resolver("portatrain_run_dir"):
        OmegaConf.register_new_resolver("portatrain_run_dir", default_run_dir)
    # A subclass merged into a node typed ModelConfig becomes its type (OmegaConf's structured merge):
    # its keys are then the only ones `model.<key>` may set.
    schema = OmegaConf.merge(OmegaConf.structured(Config), {"model": OmegaConf.structured(model_schema)})
    ConfigStore.instance().store(name="base_config", node=schema)


__all__ = [
    "BenchConfig",
    "CheckpointConfig",
    "CompileConfig",
    "Config",
    "DataConfig",
    "DeviceConfig",
    "DpoConfig",
    "EvalConfig",
    "ExportConfig",
    "FaultToleranceConfig",
    "FinetuneConfig",
    "GenerateConfig",
    "KernelsConfig",
    "LaunchConfig",
    "LoraConfig",
    "MetricsConfig",
    "MixEntry",
    "ModelConfig",
    "MovedLaunchConfig",
    "MuonConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrepareConfig",
    "ProfileConfig",
    "QuantizeConfig",
    "ReportConfig",
    "RuntimeAuditConfig",
    "SpikeGuardConfig",
    "TrainerConfig",
    "default_run_dir",
    "register_configs",
    "run_id",
]
