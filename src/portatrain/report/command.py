"""``portatrain report``: gather the evidence, fill the checklist, build the document, write and print it.

Output: ``<run_dir>/report.md`` and ``<run_dir>/report.json`` (schema :data:`SCHEMA`), and a copy
at ``report.out``; the Markdown is printed. Exit status 1 when an item fails.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from portatrain.config import Config, ReportConfig
from portatrain.errors import UserError
from portatrain.report.coverage import device_plan, findings_by_rule, op_coverage
from portatrain.report.evidence import (
    Evidence,
    bench_run,
    code_in_use,
    commands_for,
    parity_run,
    profile_runs,
    relative_to_cwd,
    runtime_run,
    static_audit,
)
from portatrain.report.render import render_markdown, write_report
from portatrain.report.verdicts import FAIL, checklist, level_verdicts

if TYPE_CHECKING:
    from portatrain.trainer import Trainer

SCHEMA = "portatrain.report/1"


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
    if runtime.get("simulated"):
        progress("report: runtime audit under each op-coverage profile")
    coverage = op_coverage(profile_runs(cfg, trainer_cls, run_dir, runtime))
    progress("report: parity against the fp32 CPU reference")
    parity = parity_run(cfg, trainer_cls, run_dir)
    progress(f"report: bench, {1 + cfg.report.bench_warmup_steps + cfg.report.bench_steps} steps")
    _forget_compiled_graphs()
    bench = bench_run(cfg, trainer_cls, run_dir / "bench")
    # The device ran was the sim (under its own name or an impersonated one): said on every line.
    simulated = bool(runtime.get("simulated")) or (cfg.device.type == "sim" and "error" in runtime)
    device = str(runtime.get("device") or cfg.device.type)
    evidence = Evidence(
        static, runtime, bench, parity, str(cfg.device.type), simulated, cfg.report, commands, coverage
    )
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
        "op_coverage": coverage,
        "findings_by_rule": findings_by_rule(static),
        "device_plan": device_plan(cfg),
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
        program = f"python {relative_to_cwd(argv0)}"  # a research script: `python my_train.py report ...`
    document = build_report(cfg, trainer_cls=trainer_cls, overrides=overrides, program=program)
    written = write_report(document, Path(cfg.run_dir), cfg.report.out)
    print(render_markdown(document))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 1 if any(i["status"] == FAIL for i in document["items"]) else 0
