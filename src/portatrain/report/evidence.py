"""The evidence ``portatrain report`` judges, each piece measured by one of portatrain's own commands
run in this process, and the command lines that reproduce it.

* **static audit** (``portatrain audit``) of the code in use (:func:`code_in_use`): the research
  code's ``Trainer`` subclass and its non-portatrain bases
  (:func:`portatrain.audit.sources.trainer_sources`), the model family's folder, the modules of the
  enabled kernel overrides, and ``report.paths``;
* **runtime audit** (``audit.runtime=true``, :mod:`portatrain.audit.runtime`, :func:`runtime_run`):
  a short training run of ``report.steps`` steps on the device -- host syncs, CPU fallbacks and
  mixed-device ops between logging steps, graph breaks, recompiles after warm-up, the batch shapes
  seen, the losses; with ``compile.enabled`` it warms up every shape first and warns instead of
  stopping on a recompile;
* **op coverage** (:func:`profile_runs`): on the sim, the runtime-audit run once per op-coverage
  profile with that profile in force, so the operators outside it really fall back and are counted;
* **parity** (``portatrain parity``, :mod:`portatrain.parity`, :func:`parity_run`) against the fp32
  CPU reference;
* **bench** (``portatrain bench``, :mod:`portatrain.bench`, :func:`bench_run`): cold start, steady
  state, MFU, cost.

A run that fails on the device is evidence (``{"error": ...}``), not a crash of the report.
:class:`Evidence` bundles the four with the :class:`Commands` that produced them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from portatrain.audit import audit_paths, find_config, load_config
from portatrain.audit.formats import json_document
from portatrain.audit.runtime import dynamo_totals
from portatrain.audit.sources import trainer_sources
from portatrain.config import Config, ReportConfig
from portatrain.errors import UserError

if TYPE_CHECKING:
    from portatrain.trainer import Trainer

logger = logging.getLogger(__name__)


def code_in_use(cfg: Config, trainer_cls: type | None, extra_paths: list[str]) -> list[str]:
    """What the static audit scans: ``extra_paths``, the Trainer subclass's files, the model family's
    folder and the enabled kernel overrides' modules (relative to the working directory where below it)."""
    from portatrain.kernels import OVERRIDES
    from portatrain.models import get_spec

    paths: list[Path] = [Path(p) for p in extra_paths]
    paths += trainer_sources(trainer_cls)
    model_file = inspect.getsourcefile(get_spec(cfg.model.name).model_cls)
    if model_file:
        paths.append(Path(model_file).parent)
    for name in cfg.kernels.enabled:
        override = OVERRIDES.get(str(name))
        spec = importlib.util.find_spec(override.builder.split(":")[0]) if override else None
        if spec is not None and spec.origin:
            origin = Path(spec.origin)
            paths.append(origin.parent if origin.name == "__init__.py" else origin)
    out: list[str] = []
    for path in paths:
        shown = relative_to_cwd(path)
        if shown not in out:
            out.append(shown)
    return out


def relative_to_cwd(path: Path) -> str:
    """``path`` relative to the working directory where below it, else absolute (POSIX form)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def static_audit(paths: list[str]) -> dict[str, Any]:
    """``portatrain audit --format json PATHS`` as a dict (the project config found from the first path)."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise UserError(f"report.paths: no such file or directory: {', '.join(missing)}")
    found = find_config(paths[0]) if paths else None
    return json_document(audit_paths(paths, load_config(found) if found else None), "error")


def _derived(cfg: Config, run_dir: Path, updates: dict[str, Any]) -> Config:
    merged = OmegaConf.merge(cfg, {"run_dir": str(run_dir), **updates})
    return merged  # type: ignore[return-value]


def runtime_run(cfg: Config, trainer_cls: type[Trainer] | None, run_dir: Path) -> dict[str, Any]:
    """A short training run with ``audit.runtime=true``: the audit's summary, the losses, the batch
    shapes seen and the compile stage's counts (``{"error": ...}`` when the run failed)."""
    from portatrain.data.loader import batch_shapes
    from portatrain.trainer import Trainer

    steps = int(cfg.report.steps)
    updates: dict[str, Any] = {
        "trainer": {"steps": steps, "log_every": max(1, steps // 2), "eval_every": 0, "progress": False},
        # One save mid-run, as configured (checkpoint.async_mode): what the loop waits for.
        "checkpoint": {
            "enabled": True,
            "every": max(1, steps // 2),
            "keep": 1,
            "final": False,
            "resume": "none",
        },
        "audit": {"runtime": True, "nonfinite": False},
    }
    if cfg.compile.enabled:  # compile every shape first, then count what recompiles (and go on)
        updates["compile"] = {"warmup": True, "on_recompile": "warn"}
    run_cfg = _derived(cfg, run_dir, updates)
    shapes: set[tuple[int, ...]] = set()

    base = trainer_cls or Trainer

    class RuntimeAuditTrainer(base):  # type: ignore[misc, valid-type]
        def train_step(self, batches):  # noqa: ANN001, ANN202 - the hook's own signature
            shapes.update(tuple(b["input_ids"].shape) for b in batches)
            return super().train_step(batches)

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # an earlier report's: a new run each time
    dynamo_before = dynamo_totals()
    trainer = None
    try:
        trainer = RuntimeAuditTrainer(run_cfg)
        trainer.fit()
    except Exception as exc:  # a run that fails on the device is evidence, not a crash of the report
        logger.warning("runtime-audit run failed: %s: %s", type(exc).__name__, exc, exc_info=_is_bug(exc))
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    finally:
        if trainer is not None:
            trainer.close()
    breaks_after, _, graphs_after = dynamo_totals()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    blocked = [r["checkpoint_blocked_frac"] for r in records if "checkpoint_blocked_frac" in r]
    return {
        **trainer.runtime_audit.summary(),
        "graph_breaks_whole_run": sum((breaks_after - dynamo_before[0]).values()),
        "graph_break_reasons": sorted(
            {r.strip().splitlines()[0][:160] for r in (breaks_after - dynamo_before[0])}
        ),
        "graphs_whole_run": graphs_after - dynamo_before[2],
        "trainer": f"{base.__module__}.{base.__qualname__}",
        "compile": bool(run_cfg.compile.enabled),
        "losses": losses,
        "checkpoint_blocked_frac": blocked[-1] if blocked else None,
        "checkpoint_async_mode": str(run_cfg.checkpoint.async_mode),
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "shapes_seen": sorted([list(s) for s in shapes]),
        "shapes_configured": [list(s) for s in batch_shapes(run_cfg.data)],
        "unsupported_ops": _unsupported_ops(trainer.runtime_audit.simulated),
        "metrics": str(run_dir / "metrics.jsonl"),
    }


def _is_bug(exc: BaseException) -> bool:
    """Anything but a :class:`UserError` keeps its traceback in the log (the item still fails)."""
    return not isinstance(exc, UserError)


def _unsupported_ops(simulated: bool) -> dict[str, str] | None:
    """The ops the sim marks unsupported (None off the sim)."""
    from portatrain.accelerators.sim import counters

    return counters.unsupported_ops() if simulated else None


def profile_runs(
    cfg: Config, trainer_cls: type[Trainer] | None, run_dir: Path, runtime: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """On the sim, the runtime-audit run once per op-coverage profile, that profile in force (so the
    operators outside it really fall back and are counted); ``runtime``, the run already made, stands
    for the profile it ran under. ``{}`` off the sim or when that run failed."""
    if not runtime.get("simulated"):
        return {}
    from portatrain.accelerators.sim import counters, op_profiles

    previous = counters.active_profile()
    runs = {}
    try:
        for name, profile in op_profiles.load_all().items():
            if runtime.get("profile") == name:
                runs[name] = runtime
                continue
            counters.set_profile(profile)
            runs[name] = runtime_run(cfg, trainer_cls, run_dir / f"runtime-{name}")
    finally:
        counters.set_profile(previous)
    return runs


def bench_run(cfg: Config, trainer_cls: type[Trainer] | None, run_dir: Path) -> dict[str, Any]:
    """``portatrain bench`` with ``report.bench_*`` steps; its results, or ``{"error": ...}``."""
    from portatrain.bench import run_bench

    bench_cfg = _derived(
        cfg,
        run_dir,
        {
            "bench": {
                "warmup_steps": int(cfg.report.bench_warmup_steps),
                "steps": int(cfg.report.bench_steps),
            },
            "audit": {"runtime": False, "nonfinite": False},
            "trainer": {"progress": False},
        },
    )
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the bench's own summary goes to its log file
            results = run_bench(bench_cfg, trainer_cls=trainer_cls)
    except Exception as exc:
        logger.warning("bench run failed: %s: %s", type(exc).__name__, exc, exc_info=_is_bug(exc))
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    (run_dir / "bench.txt").write_text(printed.getvalue())
    results = {k: v for k, v in results.items() if k != "step_times_s"}
    results["json"] = str(run_dir / "bench.json")
    return results


def parity_run(cfg: Config, trainer_cls: type[Trainer] | None, run_dir: Path) -> dict[str, Any]:
    """``portatrain parity`` where that command exists: ``{"ok", "first_divergence", ...}``, or
    ``{"skipped": why}`` / ``{"error": ...}``."""
    if not cfg.report.parity:
        return {"skipped": "report.parity=false"}
    if importlib.util.find_spec("portatrain.parity") is None:
        return {"skipped": "this portatrain has no `portatrain parity` command"}
    from portatrain import parity

    if str(cfg.device.type) == "cpu" and str(cfg.trainer.dtype) in ("auto", "float32"):
        return {"skipped": "the device is the fp32 CPU reference itself: nothing to compare"}
    steps = min(3, int(cfg.report.steps))
    try:
        result = parity.run_parity(_derived(cfg, run_dir, {}), steps, trainer_cls=trainer_cls)
    except Exception as exc:
        logger.warning("parity run failed: %s: %s", type(exc).__name__, exc, exc_info=_is_bug(exc))
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    first = result.first_divergence
    return {
        "ok": bool(result.ok),
        "steps": len(result.steps),
        "tolerance": float(result.tolerance),
        "derivation": result.derivation,
        "update_tolerance": result.update_tolerance,
        "dtype": str(result.dtype).removeprefix("torch."),
        "first_divergence": None if first is None else asdict(first),
        "losses": [[s.loss_reference, s.loss_target] for s in result.steps],
        "fallbacks": result.fallbacks,
        "fallbacks_first": result.fallbacks_first,
        "profile": result.profile,
        "text": result.format(),
    }


@dataclass
class Commands:
    """The commands that produce each piece of evidence, as a user would type them."""

    audit: str
    train: str
    bench: str
    parity: str
    report: str


def commands_for(cfg: Config, overrides: list[str], static_paths: list[str], program: str) -> Commands:
    """Reproducible command lines: the user's overrides (the report's own keys and run_dir dropped)."""
    own = ("report.", "run_dir")
    keep = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith(own)]
    base = " ".join([f"recipe={cfg.recipe}", *[o for o in keep if not o.startswith("recipe=")]])
    steps = int(cfg.report.steps)
    return Commands(
        audit=f"portatrain audit --format json {' '.join(static_paths)}",
        train=f"{program} train {base} audit.runtime=true trainer.steps={steps} "
        f"trainer.log_every={max(1, steps // 2)} trainer.eval_every=0 checkpoint.enabled=false",
        bench=f"{program} bench {base} bench.warmup_steps={cfg.report.bench_warmup_steps} "
        f"bench.steps={cfg.report.bench_steps}",
        parity=f"{program} parity {base} trainer.steps={min(3, steps)}",
        report=f"{program} report {base}",
    )


@dataclass
class Evidence:
    """Everything measured, as the judges below read it."""

    static: dict[str, Any]
    """The static audit's ``portatrain.audit/1`` document."""
    runtime: dict[str, Any]
    """:func:`runtime_run`'s result (``{"error": ...}`` when the run failed)."""
    bench: dict[str, Any]
    parity: dict[str, Any]
    device: str
    """``device.type`` as asked (``sim``, ``cpu``, ``tpu``...)."""
    simulated: bool
    report_cfg: ReportConfig
    commands: Commands
    coverage: dict[str, dict[str, Any]] = field(default_factory=dict)
    """On the sim: profile -> the operators that fell back under it (:func:`~.coverage.op_coverage`)."""

    def with_device(self, device: str) -> str:
        """The report command run on another device (where this one cannot measure something)."""
        report = self.commands.report
        if f"device={self.device}" in report:
            return report.replace(f"device={self.device}", f"device={device}")
        return f"{report} device={device}"
