"""The checklist's verdicts: each item judged ``pass``, ``fail`` or ``not measured`` from the
:class:`~portatrain.report.evidence.Evidence`, with the evidence and the command that produced it.
Pure: nothing is measured here.

Six levels (:data:`LEVELS`): 1 device & API portability, 2 operator & library coverage, 3 numerical
correctness, 4 compilation & shape stability, 5 real workload performance, 6 cost & operational
maturity; and level 0, beyond the checklist: checkpoint safety (static) and the loop's wait on saves. Nothing passes without a
measurement: where one is missing (no counter on this device, no target set, a command not run)
the item is ``not measured`` and names the command that would measure it. On the simulated device
its host-sync, fallback and shape counts are real measurements of the code, while its timings are
the host CPU's, so performance and cost are ``not measured`` there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from portatrain.report.coverage import judged_profiles

if TYPE_CHECKING:
    from portatrain.report.evidence import Evidence

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
"""Checklist level -> title; 0 is the static audit's own extra."""


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
    if ev.coverage:
        return _profile_fallbacks(ev, ev.coverage)
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


def _profile_fallbacks(ev: Evidence, coverage: dict[str, dict[str, Any]]) -> Verdict:
    """The sim's op census judged against the op-coverage profile(s) of the target."""
    parts, failed = [], False
    names = judged_profiles(ev.runtime, coverage)
    for name in names:
        judged = coverage[name]
        if "error" in judged:
            failed = True
            parts.append(f"{name} profile: the run failed: {judged['error']}")
            continue
        fallbacks = judged["fallbacks"]
        if not fallbacks:
            parts.append(f"{name} profile: all {judged['operators']} operators run on the device")
            continue
        failed = True
        shown = "; ".join(
            f"{op} x{n}, first at {judged['first'][op]}" for op, n in list(fallbacks.items())[:3]
        )
        more = f"; and {len(fallbacks) - 3} more" if len(fallbacks) > 3 else ""
        parts.append(
            f"{name} profile: {len(fallbacks)} of {judged['operators']} operators fall back: {shown}{more}"
        )
    evidence = (
        f"{ev.runtime['steps']} steps with the op-coverage "
        f"{'profile' if len(names) == 1 else 'profiles'} {', '.join(names)} in force: " + " | ".join(parts)
    )
    return (FAIL if failed else PASS), evidence, f"SIM_OP_PROFILE={names[0]} {ev.commands.train}"


def _parity(ev: Evidence) -> Verdict:
    parity = ev.parity
    if "skipped" in parity:
        return NOT_MEASURED, f"parity not run: {parity['skipped']}", ev.commands.parity
    if "error" in parity:
        return FAIL, f"the parity run failed: {parity['error']}", ev.commands.parity
    first = parity["first_divergence"]
    losses = "; ".join(f"{ref:.6g} vs {tgt:.6g}" for ref, tgt in parity["losses"])
    verdict = (
        "step 1's module outputs and gradients, and every step's loss and optimizer update, within tolerance"
        if first is None
        else f"first divergence at step {first['step']}: {first['kind']} of {first['name']!r} off by "
        f"{first['rel']:.2e}" + (f" > {first['tolerance']:.2g}" if first.get("tolerance") is not None else "")
    )
    # Step 1 is compared module by module; later steps through losses and optimizer updates
    # (portatrain.parity's docstring: AdamW turns rounding into full-size weight differences).
    evidence = (
        f"{parity['steps']} steps, {parity['dtype']} vs fp32 CPU, step-1 relative tolerance "
        f"{parity['tolerance']:.2g} from the rounding of its reductions: {verdict} (losses cpu vs {ev.device}: {losses})"
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


CHECKPOINT_BLOCKED_MAX = 0.10
"""The share of wall time the loop may wait on checkpoints (saving every ``report.steps // 2`` steps)."""


@_needs_run
def _checkpoint_wait(ev: Evidence) -> Verdict:
    frac, mode = ev.runtime.get("checkpoint_blocked_frac"), ev.runtime.get("checkpoint_async_mode")
    if frac is None:
        return NOT_MEASURED, "the runtime run logged no checkpoint_blocked_frac", ev.commands.report
    evidence = (
        f"the loop waited on checkpoints {_percent(frac)} of its wall time (checkpoint.async_mode={mode}, "
        f"one save mid-run; at most {_percent(CHECKPOINT_BLOCKED_MAX)})"
    )
    if ev.simulated:  # a save's time on the sim is the host CPU's disk and memory, not the target's
        return NOT_MEASURED, f"{SIM_TIMINGS} ({evidence})", _on_hardware(ev.commands.report)
    if frac <= CHECKPOINT_BLOCKED_MAX:
        return PASS, evidence, ev.commands.report
    return FAIL, evidence, _with(ev.commands.report, "checkpoint.async_mode=thread")


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
    (0, "0.2", "The training loop waits on checkpoints for a small part of its time", _checkpoint_wait),
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
