"""``portatrain report recipe=... device=...``: the six-level portability checklist, filled from evidence.

The checklist is reference article 001's (section 8): 1 device & API portability, 2 operator &
library coverage, 3 numerical correctness, 4 compilation & shape stability, 5 real workload
performance, 6 cost & operational maturity. Each item is ``pass``, ``fail`` or ``not measured``,
with the evidence and the command that produced it. Evidence comes from four measurements, each
one of portatrain's own commands run in this process:

* **static audit** (``portatrain audit``) of the code in use: the research code's ``Trainer``
  subclass and its non-portatrain bases (:func:`portatrain.audit.sources.trainer_sources`), the
  model family's folder, the modules of the enabled kernel overrides, and ``report.paths``;
* **runtime audit** (``audit.runtime=true``, :mod:`portatrain.audit.runtime`): a short training
  run of ``report.steps`` steps on the device -- host syncs, CPU fallbacks and mixed-device ops
  between logging steps, graph breaks, recompiles after warm-up, the batch shapes seen, the losses;
  with ``compile.enabled`` it warms up every shape first and warns instead of stopping on a recompile;
* **parity** (``portatrain parity``, :mod:`portatrain.parity`) against the fp32 CPU reference;
* **bench** (``portatrain bench``, :mod:`portatrain.bench`): cold start, steady state, MFU, cost.

Nothing passes without a measurement: where a measurement is missing (no counter on this device,
no target set, a command not run) the item is ``not measured`` and names the command that would
measure it. On the simulated device (``device=sim``, or the sim impersonating ``tpu``/``neuron``)
every item says so: its host-sync, fallback and shape counts are real measurements of the code,
while its timings are the host CPU's, so performance and cost are not measured there.

Output: ``<run_dir>/report.md`` and ``<run_dir>/report.json`` (schema :data:`SCHEMA`), and a copy
at ``report.out``; the Markdown is printed. Exit status 1 when an item fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
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

SCHEMA = "portatrain.report/1"
PASS, FAIL, NOT_MEASURED = "pass", "fail", "not measured"
STATUSES = (PASS, FAIL, NOT_MEASURED)
LEVELS: dict[int, str] = {
    1: "Device & API portability",
    2: "Operator & library coverage",
    3: "Numerical correctness",
    4: "Compilation & shape stability",
    5: "Real workload performance",
    6: "Cost & operational maturity",
    0: "Beyond the checklist: checkpoint safety",
}
"""Checklist level -> title (reference article 001, section 8); 0 is the static audit's own extra."""


def report_problems(report_cfg: ReportConfig) -> list[str]:
    """Every problem of the ``report`` section, each with its fix."""
    problems = []
    if report_cfg.steps < 2:
        problems.append(
            f"report.steps={report_cfg.steps} must be >= 2 (the runtime audit needs two logged windows)"
        )
    if report_cfg.bench_steps < 1 or report_cfg.bench_warmup_steps < 0:
        problems.append(
            f"report.bench_steps={report_cfg.bench_steps} must be >= 1 and report.bench_warmup_steps="
            f"{report_cfg.bench_warmup_steps} >= 0"
        )
    for key in ("max_cold_start_s", "min_tokens_per_s", "min_mfu", "max_cost_per_million_tokens"):
        value = getattr(report_cfg, key)
        if value is not None and value < 0:
            problems.append(f"report.{key}={value} must be >= 0 (or null: no verdict)")
    return problems


@dataclass
class Item:
    """One checklist line."""

    level: int
    id: str
    check: str
    """The question, in the checklist's words."""
    status: str
    evidence: str
    command: str
    """The command that produced the evidence -- or, for ``not measured``, the one that would."""
    simulated: bool = False
    """The report ran on the simulated device (said on the line itself too)."""


# -- the code in use ---------------------------------------------------------------------------------
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
        shown = _relative(path)
        if shown not in out:
            out.append(shown)
    return out


def _relative(path: Path) -> str:
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


# -- the runs ----------------------------------------------------------------------------------------
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
        "checkpoint": {"enabled": False, "resume": "none"},
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
        "dtype": str(result.dtype).removeprefix("torch."),
        "first_divergence": None if first is None else asdict(first),
        "losses": [[s.loss_reference, s.loss_target] for s in result.steps],
        "text": result.format(),
    }


# -- the checklist -----------------------------------------------------------------------------------
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

    def with_device(self, device: str) -> str:
        """The report command run on another device (where this one cannot measure something)."""
        report = self.commands.report
        if f"device={self.device}" in report:
            return report.replace(f"device={self.device}", f"device={device}")
        return f"{report} device={device}"


Verdict = tuple[str, str, str]
"""(status, evidence, command) of one item."""


def _static(level: int) -> Callable[[Evidence], Verdict]:
    """The static audit's findings at checklist ``level``: errors and warnings fail."""

    def judge(ev: Evidence) -> Verdict:
        found = [f for f in ev.static["findings"] if f["level"] == level]
        files = len(ev.static["files"])
        if not found:
            rules = sorted(
                r for r, v in ev.static["rules"].items() if v["level"] == level and not v["disabled"]
            )
            return PASS, f"0 findings in {files} file(s) for the rules {', '.join(rules)}", ev.commands.audit
        shown = "; ".join(f"{f['path']}:{f['line']} {f['rule']}: {f['message']}" for f in found[:3])
        more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
        counts = ", ".join(
            f"{sum(f['severity'] == s for f in found)} {s}" for s in ("error", "warning", "info")
        )
        serious = any(f["severity"] in ("error", "warning") for f in found)
        return (
            (FAIL if serious else PASS),
            f"{len(found)} finding(s) ({counts}): {shown}{more}",
            ev.commands.audit,
        )

    return judge


def _needs_run(judge: Callable[[Evidence], Verdict]) -> Callable[[Evidence], Verdict]:
    """A judge of the runtime-audit run: a run that failed on the device fails the item."""

    def wrapped(ev: Evidence) -> Verdict:
        if "error" in ev.runtime:
            return FAIL, f"the runtime-audit run failed: {ev.runtime['error']}", ev.commands.train
        return judge(ev)

    return wrapped


def _needs_bench(judge: Callable[[Evidence], Verdict]) -> Callable[[Evidence], Verdict]:
    def wrapped(ev: Evidence) -> Verdict:
        if "error" in ev.bench:
            return FAIL, f"the bench run failed: {ev.bench['error']}", ev.commands.bench
        if ev.simulated:  # sim timings are the host CPU's
            return (
                NOT_MEASURED,
                f"{SIM_TIMINGS} ({_bench_numbers(ev.bench)})",
                _on_hardware(ev.commands.bench),
            )
        return judge(ev)

    return wrapped


SIM_TIMINGS = "timings on the simulated device are the host CPU's, not the target's"


def _on_hardware(command: str) -> str:
    return command.replace("device=sim", "device=tpu|neuron")


def _counted(ev: Evidence, key: str, prefix: str) -> Verdict:
    """A sim counter summed over the run's windows: 0 passes, null is not measured."""
    runtime = ev.runtime
    if runtime[key] is None:
        return (
            NOT_MEASURED,
            f"{ev.device} has no such counter; the sim device counts them",
            ev.with_device("sim"),
        )
    kinds = {k: n for k, n in runtime["offences"].items() if k.startswith(prefix)}
    where = "; ".join(
        f"{k} x{n}, first at {runtime['first'].get(k, '?')}" for k, n in list(kinds.items())[:3]
    )
    per_window = ", ".join(str(w.get(f"audit_{key}", "?")) for w in runtime["per_window"])
    evidence = (
        f"{runtime[key]} in {runtime['steps']} steps, counted between logging steps (per window: {per_window})"
        + (f": {where}" if where else "")
    )
    return (PASS if runtime[key] == 0 else FAIL), evidence, ev.commands.train


@_needs_run
def _trains(ev: Evidence) -> Verdict:
    r = ev.runtime
    trainer = r.get("trainer", "the Trainer")
    evidence = f"{r['steps']} optimizer steps of {trainer} on {r['device']} ({r['dtype']}), losses {_floats(r['losses'])}"
    return PASS, evidence, ev.commands.train


@_needs_run
def _mixed_device(ev: Evidence) -> Verdict:
    return _counted(ev, "mixed_device", "mixed_device:")


@_needs_run
def _fallbacks(ev: Evidence) -> Verdict:
    runtime = ev.runtime
    if runtime["cpu_fallbacks"] is None and runtime["device_type"] == "cpu":
        return NOT_MEASURED, "the CPU is the host: nothing can fall back to it", ev.with_device("sim")
    if runtime["cpu_fallbacks"] is None:
        why = f"the {ev.device} adapter reports no CPU fallbacks (Accelerator.take_fallback_report)"
        return NOT_MEASURED, why, ev.with_device("sim")
    if ev.simulated and not runtime.get("unsupported_ops"):
        why = (
            "the sim device marks no operation unsupported (SIM_UNSUPPORTED_OPS is empty), so none can fall "
            "back; list the target's unsupported operations to count them"
        )
        return NOT_MEASURED, why, f"SIM_UNSUPPORTED_OPS=aten::op1,aten::op2 {ev.commands.report}"
    status, evidence, command = _counted(ev, "cpu_fallbacks", "fallback:")
    if ev.simulated:
        evidence += f" (ops marked unsupported: {', '.join(runtime['unsupported_ops'])})"
    return status, evidence, command


def _parity(ev: Evidence) -> Verdict:
    parity = ev.parity
    if "skipped" in parity:
        return NOT_MEASURED, f"parity not run: {parity['skipped']}", ev.commands.parity
    if "error" in parity:
        return FAIL, f"the parity run failed: {parity['error']}", ev.commands.parity
    first = parity["first_divergence"]
    losses = "; ".join(f"{ref:.6g} vs {tgt:.6g}" for ref, tgt in parity["losses"])
    verdict = (
        "every loss, module output and gradient within tolerance"
        if first is None
        else f"first divergence at step {first['step']}: {first['kind']} of {first['name']!r} off by {first['rel']:.2e}"
    )
    evidence = (
        f"{parity['steps']} steps, {parity['dtype']} vs fp32 CPU, relative tolerance {parity['tolerance']:g}: "
        f"{verdict} (losses cpu vs {ev.device}: {losses})"
    )
    return (PASS if parity["ok"] else FAIL), evidence, ev.commands.parity


@_needs_run
def _finite(ev: Evidence) -> Verdict:
    losses = ev.runtime["losses"]
    ok = bool(losses) and all(math.isfinite(x) for x in losses)
    evidence = (
        f"losses at the {len(losses)} logged steps of a {ev.runtime['steps']}-step run: {_floats(losses)} "
        "(a short run; long runs are guarded by trainer.on_nonfinite)"
    )
    return (PASS if ok else FAIL), evidence, ev.commands.train


@_needs_run
def _static_shapes(ev: Evidence) -> Verdict:
    seen, configured = ev.runtime["shapes_seen"], ev.runtime["shapes_configured"]
    stray = [s for s in seen if s not in configured]
    static_status, static_evidence, _ = _static(4)(ev)
    status = FAIL if stray or static_status == FAIL else PASS
    evidence = f"batch shapes seen {seen}, configured {configured}; static: {static_evidence}"
    return status, evidence, f"{ev.commands.train}; {ev.commands.audit}"


@_needs_run
def _graph_breaks(ev: Evidence) -> Verdict:
    r = ev.runtime
    if not r["compile"]:
        return NOT_MEASURED, COMPILE_OFF, _with(ev.commands.report, "compile.enabled=true")
    breaks = r["graph_breaks_whole_run"]
    reasons = f": {'; '.join(r['graph_break_reasons'][:3])}" if breaks else ""
    evidence = f"{breaks} graph break(s), {r['graphs_whole_run']} graph(s) compiled over the run{reasons}"
    return (PASS if breaks == 0 else FAIL), evidence, _with(ev.commands.train, "compile.enabled=true")


COMPILE_OFF = "compile.enabled=false in this config: nothing was compiled"


def _with(command: str, *overrides: str) -> str:
    """``command`` plus the ``overrides`` it does not already carry."""
    words = command.split()
    return " ".join([*words, *(o for o in overrides if o not in words)])


@_needs_run
def _recompiles(ev: Evidence) -> Verdict:
    r = ev.runtime
    if not r["compile"]:
        return NOT_MEASURED, COMPILE_OFF, _with(ev.commands.report, "compile.enabled=true")
    evidence = (
        f"{r['recompiles']} recompile(s), {r['graphs']} new graph(s) in {r['steps']} steps after compiling the "
        f"{len(r['shapes_configured'])} configured shape(s) first"
    )
    command = _with(
        ev.commands.train, "compile.enabled=true", "compile.warmup=true", "compile.on_recompile=warn"
    )
    return (PASS if r["recompiles"] == 0 else FAIL), evidence, command


def _bench_numbers(bench: dict[str, Any]) -> str:
    return (
        f"{bench['tokens_per_s']:,.0f} tokens/s, median step {1e3 * bench['step_time_median_s']:.1f} ms over "
        f"{bench['measured_steps']} steps, MFU {_percent(bench['mfu'])}, cold start {bench['cold_start_s']:.1f} s"
    )


@_needs_bench
def _throughput(ev: Evidence) -> Verdict:
    bench, cfg = ev.bench, ev.report_cfg
    targets = [
        (key, limit, value)
        for key, limit, value in (
            ("report.min_tokens_per_s", cfg.min_tokens_per_s, bench["tokens_per_s"]),
            ("report.min_mfu", cfg.min_mfu, bench["mfu"]),
        )
        if limit is not None and value is not None
    ]
    numbers = _bench_numbers(bench)
    if not targets:
        return NOT_MEASURED, f"{numbers}; no target set", f"{ev.commands.report} report.min_tokens_per_s=N"
    below = [f"{key}={limit}" for key, limit, value in targets if value < limit]
    verdict = (
        f"below {', '.join(below)}" if below else "meets " + ", ".join(f"{k}={t}" for k, t, _ in targets)
    )
    return (FAIL if below else PASS), f"{numbers}: {verdict}", ev.commands.bench


@_needs_bench
def _cold_start(ev: Evidence) -> Verdict:
    bench, limit = ev.bench, ev.report_cfg.max_cold_start_s
    cold = (
        f"cold start {bench['cold_start_s']:.1f} s to the end of step 1 (setup {bench['setup_s']:.1f} s + first "
        f"step {bench['first_step_s']:.1f} s), compile={'on' if bench['compile'] else 'off'}"
    )
    if limit is None:
        return NOT_MEASURED, f"{cold}; no limit set", f"{ev.commands.report} report.max_cold_start_s=S"
    ok = bench["cold_start_s"] <= limit
    return (
        (PASS if ok else FAIL),
        f"{cold}: {'within' if ok else 'over'} report.max_cold_start_s={limit}",
        ev.commands.bench,
    )


@_needs_run
def _host_syncs(ev: Evidence) -> Verdict:
    return _counted(ev, "host_syncs", "sync:")


@_needs_bench
def _cost(ev: Evidence) -> Verdict:
    bench, limit = ev.bench, ev.report_cfg.max_cost_per_million_tokens
    if bench["cost_per_million_tokens"] is None:
        command = f"{ev.commands.report} bench.price_per_hour=P report.max_cost_per_million_tokens=C"
        return NOT_MEASURED, "no bench.price_per_hour: the cost per token is unknown", command
    cost = f"${bench['cost_per_million_tokens']:.4g} per million tokens at ${bench['price_per_hour']}/h"
    if limit is None:
        return (
            NOT_MEASURED,
            f"{cost}; no baseline set",
            f"{ev.commands.report} report.max_cost_per_million_tokens=C",
        )
    ok = bench["cost_per_million_tokens"] <= limit
    return (PASS if ok else FAIL), f"{cost} vs the baseline's ${limit}", ev.commands.bench


def _spot(ev: Evidence) -> Verdict:
    evidence = "a property of the cloud account, not of the code (portatrain resumes preempted jobs: checkpoint.resume=auto)"
    return NOT_MEASURED, evidence, "the cloud provider's capacity tools"


def _debuggable(ev: Evidence) -> Verdict:
    evidence = (
        "not measurable by a run; the tools exist: audit.nonfinite=true names the first non-finite module, "
        "the sim device's counters give each host sync its stack"
    )
    return NOT_MEASURED, evidence, f"{ev.commands.train} audit.nonfinite=true"


CHECKS: tuple[tuple[int, str, str, Callable[[Evidence], Verdict]], ...] = (
    (1, "1.1", "No hard-coded CUDA device placement or CUDA-only API in the code in use", _static(1)),
    (1, "1.2", "Trains on the target device", _trains),
    (1, "1.3", "No operation mixes device and host tensors", _mixed_device),
    (2, "2.1", "Attention through SDPA; no CUDA-only kernel library or extension", _static(2)),
    (2, "2.2", "No operator falls back to the host CPU", _fallbacks),
    (3, "3.1", "Losses, module outputs and gradients match the fp32 CPU reference", _parity),
    (3, "3.2", "Loss stays finite", _finite),
    (4, "4.1", "Inputs statically padded or bucketed", _static_shapes),
    (4, "4.2", "torch.compile runs without graph breaks", _graph_breaks),
    (4, "4.3", "No recompiles after warm-up", _recompiles),
    (5, "5.1", "Steady-state throughput meets the target", _throughput),
    (5, "5.2", "Cold-start compilation latency acceptable", _cold_start),
    (5, "5.3", "No host round-trips in the training step's code (static)", _static(5)),
    (5, "5.4", "No host round-trips between logging steps (measured)", _host_syncs),
    (6, "6.1", "Cost per token beats the baseline", _cost),
    (6, "6.2", "Spot/preemptible capacity available", _spot),
    (6, "6.3", "On-call engineers can debug failures without the vendor", _debuggable),
    (0, "0.1", "Checkpoints and configs load without unpickling code", _static(0)),
)
"""(level, id, the question, its judge): the checklist, in order."""


def checklist(ev: Evidence) -> list[Item]:
    """Every checklist item, judged from the evidence. Pure: nothing is measured here."""
    items = []
    for level, id_, check, judge in CHECKS:
        status, evidence, command = judge(ev)
        items.append(Item(level, id_, check, status, evidence, command, ev.simulated))
    return items


def _floats(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


# -- rendering ---------------------------------------------------------------------------------------
def level_verdicts(items: list[Item]) -> dict[int, str]:
    """Per level: ``fail`` if any item fails, ``pass`` if every item passes, else ``not measured``."""
    out = {}
    for level in LEVELS:
        statuses = [i.status for i in items if i.level == level]
        out[level] = (
            FAIL
            if FAIL in statuses
            else PASS
            if statuses and all(s == PASS for s in statuses)
            else NOT_MEASURED
        )
    return out


def render_markdown(document: dict[str, Any]) -> str:
    """The report as Markdown: a header, one table per level, the evidence files."""
    simulated = document["simulated"]
    tag = " [simulated device]" if simulated else ""
    device = document["device"]
    lines = [
        f"# Portability report: {document['recipe']} on {device}{tag}",
        "",
        f"Checklist: reference article 001, section 8. Generated {document['generated']} by `{document['command']}`.",
    ]
    if simulated:
        lines += [
            "",
            f"**Simulated device** ({document['device_name']}): host syncs, fallbacks, mixed-device ops and shapes "
            "are measured on the code as it runs; timings are the host CPU's, so performance and cost are not "
            "measured here. Every line below says so.",
        ]
    counts = {s: sum(i["status"] == s for i in document["items"]) for s in STATUSES}
    lines += ["", f"**{counts[PASS]} pass, {counts[FAIL]} fail, {counts[NOT_MEASURED]} not measured.**", ""]
    verdicts = document["levels"]
    lines += ["| level | verdict |", "| --- | --- |"]
    for level, title in LEVELS.items():
        lines.append(f"| {level}. {title} | {verdicts[str(level)]}{tag} |")
    for level, title in LEVELS.items():
        rows = [i for i in document["items"] if i["level"] == level]
        lines += [
            "",
            f"## {level}. {title}",
            "",
            "| | check | status | evidence | command |",
            "| --- | --- | --- | --- | --- |",
        ]
        for item in rows:
            status = item["status"].upper() if item["status"] != NOT_MEASURED else "not measured"
            lines.append(
                f"| {item['id']} | {item['check']} | {status}{tag} | {_cell(item['evidence'])} | `{_cell(item['command'])}` |"
            )
    lines += ["", "## Evidence", ""]
    for name, where in document["evidence_files"].items():
        lines.append(f"- {name}: `{where}`{tag}")
    lines.append(
        f"- static audit: {len(document['static']['files'])} file(s): {', '.join(document['static']['paths'])}{tag}"
    )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# -- the command -------------------------------------------------------------------------------------
def write_report(document: dict[str, Any], run_dir: Path, out: str | None) -> list[Path]:
    """``report.md`` + ``report.json`` in ``run_dir`` and at ``out`` (``FILE.md``, ``FILE.json`` or a folder)."""
    markdown, text = render_markdown(document), json.dumps(document, indent=2) + "\n"
    targets = [(run_dir / "report.md", run_dir / "report.json")]
    if out:
        path = Path(out)
        if path.suffix in (".md", ".json"):
            targets.append((path.with_suffix(".md"), path.with_suffix(".json")))
        else:
            targets.append((path / "report.md", path / "report.json"))
    written = []
    for md_path, json_path in targets:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown)
        json_path.write_text(text)
        written += [md_path, json_path]
    return written


def _forget_compiled_graphs() -> None:
    """``torch._dynamo.reset()`` where dynamo was used: the next run compiles from scratch."""
    if "torch._dynamo" in sys.modules:
        import torch._dynamo

        torch._dynamo.reset()


def build_report(
    cfg: Config,
    *,
    trainer_cls: type[Trainer] | None = None,
    overrides: list[str] | None = None,
    program: str = "portatrain",
    progress: Callable[[str], None] = lambda message: print(message, file=sys.stderr),
) -> dict[str, Any]:
    """Gather the evidence (static audit, runtime audit, parity, bench) and fill the checklist."""
    problems = report_problems(cfg.report)
    if problems:
        raise UserError("invalid config:\n  - " + "\n  - ".join(problems))
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    paths = code_in_use(cfg, trainer_cls, [str(p) for p in cfg.report.paths])
    commands = commands_for(cfg, overrides or [], paths, program)
    progress(f"report: static audit of {len(paths)} path(s)")
    static = static_audit(paths)
    # Each run starts with dynamo's caches empty: otherwise the second run would reuse the first's
    # graphs (dynamo caches per code object), understating its cold start and hiding graph breaks.
    progress(f"report: runtime audit, {cfg.report.steps} steps on {cfg.device.type}")
    _forget_compiled_graphs()
    runtime = runtime_run(cfg, trainer_cls, run_dir / "runtime")
    progress("report: parity against the fp32 CPU reference")
    parity = parity_run(cfg, trainer_cls, run_dir)
    progress(f"report: bench, {1 + cfg.report.bench_warmup_steps + cfg.report.bench_steps} steps")
    _forget_compiled_graphs()
    bench = bench_run(cfg, trainer_cls, run_dir / "bench")
    # The device ran was the sim (under its own name or an impersonated one): said on every line.
    simulated = bool(runtime.get("simulated")) or (cfg.device.type == "sim" and "error" in runtime)
    device = str(runtime.get("device") or cfg.device.type)
    evidence = Evidence(static, runtime, bench, parity, str(cfg.device.type), simulated, cfg.report, commands)
    items = checklist(evidence)
    evidence_files = {"runtime audit": str(run_dir / "runtime" / "metrics.jsonl")}
    if "error" not in bench:
        evidence_files["bench"] = str(run_dir / "bench" / "bench.json")
    if "skipped" not in parity and "error" not in parity:
        evidence_files["parity"] = str(run_dir / "parity")
    return {
        "schema": SCHEMA,
        "recipe": cfg.recipe,
        "device": device,
        "device_name": bench.get("device_name", device),
        "simulated": simulated,
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": commands.report,
        "seconds": round(time.perf_counter() - started, 1),
        "levels": {str(k): v for k, v in level_verdicts(items).items()},
        "items": [asdict(i) for i in items],
        "commands": asdict(commands),
        "evidence_files": evidence_files,
        "static": static,
        "runtime": {k: v for k, v in runtime.items() if k != "first_stacks"},
        "parity": {k: v for k, v in parity.items() if k != "text"},
        "bench": bench,
    }


def report_command(cfg: Config, trainer_cls: type[Trainer] | None, overrides: list[str]) -> int:
    """``portatrain report``: build, write and print the report; the exit status (1: an item failed)."""
    program = "portatrain"
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.suffix == ".py" and argv0.name != "__main__.py":
        program = f"python {_relative(argv0)}"  # a research script: `python my_train.py report ...`
    document = build_report(cfg, trainer_cls=trainer_cls, overrides=overrides, program=program)
    written = write_report(document, Path(cfg.run_dir), cfg.report.out)
    print(render_markdown(document))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 1 if any(i["status"] == FAIL for i in document["items"]) else 0


__all__ = [
    "LEVELS",
    "SCHEMA",
    "STATUSES",
    "Item",
    "build_report",
    "checklist",
    "code_in_use",
    "render_markdown",
    "report_command",
    "report_problems",
    "write_report",
]
